"""The remote tier's own counters as Prometheus families, from ``RemoteTier.stats()``:
``kvstrata:remote_operations{outcome}``, ``kvstrata:remote_bytes{direction}``,
``kvstrata:remote_breaker_open`` and ``kvstrata:remote_server_memory_bytes`` (the kind
registers :func:`families` as its ``metrics``)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["OUTCOMES", "DIRECTIONS", "families"]

#: ``RemoteTier.stats()`` counters exported as ``kvstrata:remote_operations{outcome}``.
OUTCOMES = ("hits", "misses", "corrupt", "timeouts", "errors", "refused", "written", "present", "replaced",
            "put_failures", "dropped_full", "dropped_breaker")
#: ``kvstrata:remote_bytes{direction}``: ``RemoteTier.stats()``'s ``bytes_<direction>``.
DIRECTIONS = ("read", "written")


def families(stats: Mapping[str, Any]) -> Iterator[Any]:
    """The remote tier's counters, its circuit breaker's state and its server's memory."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    ops = CounterMetricFamily("kvstrata:remote_operations", "Remote tier reads and writes by outcome",
                              labels=["outcome"])
    for outcome in OUTCOMES:
        if outcome in stats:
            ops.add_metric([outcome], stats[outcome])
    yield ops
    moved = CounterMetricFamily("kvstrata:remote_bytes", "Bytes read from and written to the remote tier",
                                labels=["direction"])
    for direction in DIRECTIONS:
        moved.add_metric([direction], stats.get(f"bytes_{direction}", 0))
    yield moved
    breaker = GaugeMetricFamily("kvstrata:remote_breaker_open", "1 while the circuit breaker keeps the "
                                "remote tier off (reads miss, writes drop)", labels=[])
    breaker.add_metric([], 0 if stats.get("breaker", "closed") == "closed" else 1)
    yield breaker
    server = stats.get("server") or {}
    mem = GaugeMetricFamily("kvstrata:remote_server_memory_bytes", "The remote server's used memory and "
                            "maxmemory (INFO, read every 10 s)", labels=["kind"])
    for kind, key in (("used", "used_memory"), ("max", "maxmemory")):
        if isinstance(server.get(key), int):
            mem.add_metric([kind], server[key])
    yield mem
