"""The remote tier's circuit breaker: :class:`kvstrata.breaker.Breaker` (one breaker, shared
with the load-or-recompute decision's stalled tiers)."""

from kvstrata.breaker import Breaker

__all__ = ["Breaker"]
