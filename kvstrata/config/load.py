"""``load.*``: load or recompute a hit below the GPU (:mod:`kvstrata.core.costs`).

Every error is a :class:`~kvstrata.errors.ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvstrata.errors import ConfigError
from kvstrata.system.values import check_keys, integer, one_of, parse_size, short_repr

__all__ = ["LoadConfig", "LOAD_POLICIES"]

LOAD_POLICIES = ("measured", "always")


@dataclass(frozen=True)
class LoadConfig:
    """Load or recompute (:mod:`kvstrata.core.costs`). ``policy``: ``always`` loads every hit
    below the GPU; ``measured`` loads only the blocks whose load is measured to beat
    computing them (by ``margin``, a fraction), ``always`` until ``warmup`` samples of a
    tier exist. ``<tier>_bandwidth`` (bytes per second, as a size: ``2GiB``) fixes what a
    tier's load costs, and ``<tier>_latency`` (seconds, 0 by default) what each load of it
    pays once on top; ``prefill_rate`` fixes the compute rate. ``deadline``: under
    ``measured``, a load running this many times its estimate, or longer than computing its
    blocks, reads no more (0: never cut). ``attention_rate`` fixes the part of the compute that
    grows with the context: token pairs attended per second (a token computed after ``c``
    others attends ``c``); absent, with ``prefill_rate`` given, attention is free."""

    policy: str = "measured"
    margin: float = 0.1
    warmup: int = 1
    deadline: float = 2.0
    cpu_bandwidth: int | None = None
    ssd_bandwidth: int | None = None
    remote_bandwidth: int | None = None
    cpu_latency: float | None = None
    ssd_latency: float | None = None
    remote_latency: float | None = None
    prefill_rate: float | None = None
    attention_rate: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "load") -> "LoadConfig":
        keys = ("policy", "margin", "warmup", "deadline", "cpu_bandwidth", "ssd_bandwidth", "remote_bandwidth",
                "cpu_latency", "ssd_latency", "remote_latency", "prefill_rate", "attention_rate")
        check_keys(d, keys, p)
        policy = one_of(d.get("policy", cls.policy), f"{p}.policy", LOAD_POLICIES)
        margin = d.get("margin", cls.margin)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 100:
            raise ConfigError(f"{p}.margin: expected a fraction of 0 or more (0.1: a load must be 10% cheaper "
                              f"than computing), got {short_repr(margin)}")
        warmup = integer(d.get("warmup", cls.warmup), f"{p}.warmup", minimum=1, maximum=1 << 20)
        deadline = d.get("deadline", cls.deadline)
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not (
                deadline == 0 or 1 <= deadline <= 1000):
            raise ConfigError(f"{p}.deadline: expected 0 (never cut a load) or a factor from 1 to 1000 of a load's "
                              f"estimate, got {short_repr(deadline)}")
        bandwidth = {}
        for tier in ("cpu", "ssd", "remote"):
            key = f"{tier}_bandwidth"
            raw = d.get(key)
            if raw is not None:
                bandwidth[key] = parse_size(raw, f"{p}.{key}")
                if bandwidth[key] <= 0:
                    raise ConfigError(f"{p}.{key}: expected bytes per second above 0 (as a size: 2GiB), "
                                      f"got {short_repr(raw)}")
        latency = {}
        for tier in ("cpu", "ssd", "remote"):
            key = f"{tier}_latency"
            raw = d.get(key)
            if raw is None:
                continue
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw <= 60:
                raise ConfigError(f"{p}.{key}: expected seconds from 0 to 60 that each load of the tier pays once, "
                                  f"got {short_repr(raw)}")
            if f"{tier}_bandwidth" not in bandwidth:
                raise ConfigError(f"{p}.{key}: given without {p}.{tier}_bandwidth (the tier's figure it is part of)")
            latency[key] = float(raw)
        rate = _rate(d, "prefill_rate", p, "tokens per second")
        attention = _rate(d, "attention_rate", p, "token pairs attended per second")
        if attention is not None and rate is None:
            raise ConfigError(f"{p}.attention_rate: given without {p}.prefill_rate (the compute rate it is part of)")
        return cls(policy=policy, margin=float(margin), warmup=warmup, deadline=float(deadline), **bandwidth,
                   **latency, prefill_rate=rate, attention_rate=attention)


def _rate(d: Mapping[str, Any], key: str, p: str, unit: str) -> float | None:
    """``d[key]``: a finite rate above 0, or None when absent."""
    rate = d.get(key)
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not 0 < rate < float("inf")):
        raise ConfigError(f"{p}.{key}: expected {unit} above 0, got {short_repr(rate)}")
    return None if rate is None else float(rate)
