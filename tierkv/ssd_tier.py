"""Transitional alias of :mod:`tierkv.tiers.ssd`, kept until every importer has moved there."""
from tierkv.tiers.ssd import SSDTier, record_footprint  # noqa: F401
