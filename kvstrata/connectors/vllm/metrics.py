"""kvstrata's series in vLLM's own ``/metrics``, through vLLM 0.32's connector-stats hooks.

Who owns what, per process:

* each worker process (one per tensor-parallel rank and pipeline stage): the
  connector's worker half answers ``get_kv_connector_stats()``, which vLLM's
  model runner calls after every step that ran the connector. A
  :class:`CounterDeltas` in the connector instance turns
  ``KVStrataWorker.counters()`` (monotonic since start) into this interval's
  increments: blocks stored and loaded per tier, failures, dropped stores,
  corrupt blocks, copy bytes and seconds per direction. vLLM's
  ``KVOutputAggregator`` sums the ranks' stats with :meth:`KVStrataStats.aggregate`.
* the engine-core process: the scheduler half answers the same hook once per
  step (after ``update_connector_output``) from ``KVStrataScheduler.stats()``:
  lookups, hits per tier, and the occupancy gauge. vLLM aggregates it into the
  workers' stats and ships :meth:`KVStrataStats.to_dict` to the frontend inside
  its ``SchedulerStats`` (msgpack: plain dicts with string keys only).
* the frontend (API server or ``LLM``) process: vLLM rebuilds the payload with
  ``build_kv_connector_stats`` for its periodic log line, and calls
  ``build_prom_metrics`` once per Prometheus stat logger, whose
  :class:`KVStrataPromMetrics` registers the ``kvstrata:`` series and moves them
  in :meth:`KVStrataPromMetrics.observe` for each payload.

A tier is named as its declaration names it (``tier="cpu"``, ``"ssd"``, ``"remote"``,
a plug-in tier's own name): the series of the built-in tiers exist from the start, those
of every tier kind registered when the stat logger is built too, and a tier the frontend
process does not know (a kind registered only in the engine's processes) gets its series
with its first value.

Counters are summed over workers: a block stored by two tensor-parallel ranks
(each its own shard) counts twice, as do its bytes and the copy seconds.
Gauges come from the scheduler only; a later value replaces an earlier one.
Nothing is sent when nothing changed (:meth:`KVStrataStats.is_empty`), so an
idle engine sends no stats. A worker's counters that move after its last step
(a background write finishing) are reported with its next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from prometheus_client import REGISTRY, Counter, Gauge

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvstrata.connectors.vllm.events import EVENT_COUNTS
from kvstrata.tiers.remote.metrics import DIRECTIONS as SHARED_DIRECTIONS, OUTCOMES as SHARED_OUTCOMES
from kvstrata.policy.tiers import GPU, LOWER, PERSISTENT, SHARED
from kvstrata.dataplane.transfer import DIRECTIONS
from kvstrata.tiers.kinds import kinds

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["SERIES", "WORKER_SERIES", "CounterDeltas", "Series", "KVStrataPromMetrics", "KVStrataStats",
           "scheduler_sample", "worker_sample"]

log = logging.getLogger(__name__)

PREFIX = "kvstrata:"
# the built-in tiers each family names; a registered kind of the family's roles adds its own
HIT_TIERS = (*LOWER, *SHARED)  # the tiers below the GPU a hit is counted in
ADMITTING = (*PERSISTENT, *SHARED)  # the tiers with an admission of their own
LOCAL, KEYED, ANY = ("slab", "store"), ("store",), ("slab", "store", "shared")  # roles (kvstrata.tiers.kinds)
_COUNTERS, _GAUGES = "counters", "gauges"
NO_LABEL = ""  # the label key of a series without a tier/direction label

Sample = dict[tuple[str, str], float]  # (series, label value) -> value


@dataclass(frozen=True)
class Series:
    """One exported family: ``kvstrata:<name>``, with an extra ``label`` (``tier`` or
    ``direction``) taking ``values``, or none. ``roles``: a ``tier`` family's, whose
    registered tier kinds (:func:`kvstrata.tiers.kinds.kinds`) it names too."""

    name: str
    doc: str
    label: str | None = None
    values: tuple[str, ...] = (NO_LABEL,)
    gauge: bool = False
    roles: tuple[str, ...] = ()

    def labels(self) -> tuple[str, ...]:
        """``values``, then the names of the tier kinds of ``roles`` registered now."""
        if not self.roles:
            return self.values
        more = tuple(n for n, k in kinds().items() if k.role in self.roles and n not in self.values)
        return (*self.values, *more)


SERIES: tuple[Series, ...] = (
    # scheduler side (engine-core process)
    Series("prefix_cache_queries", "Prompt tokens of requests looked up by kvstrata (vLLM's GPU hits included; "
           "requests resumed after a preemption are counted apart, as vLLM counts its own)"),
    Series("prefix_cache_queries_blocks", "Prompt blocks of requests looked up by kvstrata"),
    Series("prefix_cache_hits", "Prompt tokens loaded from a tier below the GPU", "tier", HIT_TIERS, roles=ANY),
    Series("prefix_cache_hits_blocks", "Prompt blocks loaded from a tier below the GPU", "tier", HIT_TIERS,
           roles=ANY),
    Series("prefix_cache_preempted_queries", "Tokens of requests looked up again after a preemption"),
    Series("prefix_cache_preempted_hits", "Tokens of requests resumed after a preemption loaded from a tier below "
           "the GPU", "tier", HIT_TIERS, roles=ANY),
    Series("occupancy_blocks", "Blocks held per tier", "tier", LOWER, gauge=True, roles=LOCAL),
    Series("admissions_rejected", "Blocks offered to a tier that its second_hit admission did not take (seen "
           "once within its window)", "tier", ADMITTING, roles=("store", "shared")),
    Series("kv_events", "KV-cache events sent for the tiers below the GPU, per kind (announced: the SSD "
           "tier's blocks after a restart; untagged: blocks that could not be described)", "kind", EVENT_COUNTS),
    # worker side (summed over workers)
    Series("blocks_stored", "Blocks written into a tier (per worker shard)", "tier", LOWER, roles=LOCAL),
    Series("blocks_loaded", "Blocks read from a tier into the GPU pool (per worker shard)", "tier", LOWER,
           roles=LOCAL),
    Series("transfer_bytes", "Bytes copied between the GPU pool and host memory (d2h: stores, h2d: loads)",
           "direction", DIRECTIONS),
    Series("transfer_seconds", "Seconds spent copying between the GPU pool and host memory (d2h: stores, "
           "h2d: loads), summed over workers", "direction", DIRECTIONS),
    Series("storage_read_bytes", "Bytes read from the SSD tier into host memory for loads (per worker shard; "
           "the host-to-device copy after it is in transfer_bytes)"),
    Series("storage_read_seconds", "Seconds spent reading loads' blocks from the SSD tier into host memory, "
           "summed over workers"),
    Series("load_failures", "Blocks a tier could not deliver (recomputed by vLLM)", "tier", LOWER, roles=LOCAL),
    Series("load_blocks_cut", "SSD blocks of loads past their deadline that were not read (recomputed by vLLM; "
           "the tier keeps them; per worker shard)"),
    Series("store_failures", "Blocks a tier refused to store", "tier", PERSISTENT, roles=KEYED),
    Series("spill_failures", "Blocks that could not be moved from the CPU tier down to the SSD tier"),
    Series("stores_dropped", "Stores dropped before reaching a tier (full write queue, pinned slots)"),
    Series("corrupt_blocks", "Blocks that failed verification and were deleted (counted as misses)",
           "tier", PERSISTENT),
    Series("remote_operations", "Remote tier reads and writes by outcome (per worker shard)", "outcome",
           SHARED_OUTCOMES),
    Series("remote_bytes", "Bytes read from and written to the remote tier (per worker shard)", "direction",
           SHARED_DIRECTIONS),
)
_BY_NAME = {s.name: s for s in SERIES}

# KVStrataWorker.counters() name -> (series, label value), for the built-in tiers
WORKER_SERIES: dict[str, tuple[str, str]] = {
    **{f"blocks_{what}_{t}": (f"blocks_{what}", t) for what in ("stored", "loaded") for t in LOWER},
    "bytes_d2h": ("transfer_bytes", "d2h"),
    "bytes_h2d": ("transfer_bytes", "h2d"),
    "seconds_d2h": ("transfer_seconds", "d2h"),
    "seconds_h2d": ("transfer_seconds", "h2d"),
    "bytes_ssd_read": ("storage_read_bytes", NO_LABEL),
    "seconds_ssd_read": ("storage_read_seconds", NO_LABEL),
    "blocks_cut_ssd": ("load_blocks_cut", NO_LABEL),
    **{f"load_failures_{t}": ("load_failures", t) for t in LOWER},
    **{f"store_failures_{t}": ("store_failures", t) for t in PERSISTENT},
    "spill_failures": ("spill_failures", NO_LABEL),
    "stores_dropped": ("stores_dropped", NO_LABEL),
    "corrupt_blocks": ("corrupt_blocks", PERSISTENT[0]),
    **{f"remote_{o}": ("remote_operations", o) for o in SHARED_OUTCOMES},
    **{f"remote_bytes_{d}": ("remote_bytes", d) for d in SHARED_DIRECTIONS},
}
#: the families of a worker's per-tier counters (``<family>_<tier>``, any tier the family names)
PER_TIER = ("blocks_stored", "blocks_loaded", "load_failures", "store_failures")


def scheduler_sample(stats: Mapping[str, Any]) -> tuple[Sample, Sample]:
    """``(counters, gauges)`` of a ``KVStrataScheduler.stats()`` snapshot (counters monotonic)."""
    queries, hits, occupancy = stats["queries"], stats["hits"], stats["occupancy"]
    counters: Sample = {("prefix_cache_queries", NO_LABEL): queries["tokens"],
                        ("prefix_cache_queries_blocks", NO_LABEL): queries["blocks"]}
    preempted = stats["preempted"]
    counters["prefix_cache_preempted_queries", NO_LABEL] = preempted["queries"]["tokens"]
    for tier, hit in hits.items():  # the deployment's tiers (the remote tier's only with one)
        if tier != GPU:
            counters["prefix_cache_hits", tier] = hit["tokens"]
            counters["prefix_cache_hits_blocks", tier] = hit["blocks"]
            counters["prefix_cache_preempted_hits", tier] = preempted["hits"][tier]["tokens"]
    admitting = _BY_NAME["admissions_rejected"].labels()
    for tier, value in stats.get("admissions_rejected", {}).items():
        if tier in admitting:
            counters["admissions_rejected", tier] = value
    for kind, value in stats.get("kv_events", {}).items():
        counters["kv_events", kind] = value
    gauges: Sample = {("occupancy_blocks", tier): n for tier, n in occupancy.items() if tier != GPU}
    return counters, gauges


def worker_sample(counters: Mapping[str, float]) -> Sample:
    """The series of a ``KVStrataWorker.counters()`` snapshot: the built-in tiers' and other
    counters (:data:`WORKER_SERIES`), and ``<family>_<tier>`` of a :data:`PER_TIER` family
    for another tier the worker runs (a plug-in kind's); unknown names are skipped."""
    out: Sample = {}
    for name, value in counters.items():
        series = WORKER_SERIES.get(name) or _per_tier(name)
        if series is not None:
            out[series] = value
    return out


def _per_tier(name: str) -> tuple[str, str] | None:
    """``(family, tier)`` of a counter ``<family>_<tier>`` of a :data:`PER_TIER` family."""
    for family in PER_TIER:
        tier = name.removeprefix(family + "_")
        if tier and tier != name:
            return family, tier
    return None


@dataclass
class KVStrataStats(KVConnectorStats):
    """One interval's increments (counters) and latest values (gauges).

    ``data`` is ``{"counters": {series: {label: value}}, "gauges": {...}}``, with
    ``""`` as the label of a series without one: plain dicts, as vLLM ships it
    between processes. :meth:`aggregate` adds into ``self`` and returns it (as
    vLLM's aggregators expect); :meth:`from_payload` copies what it is given.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def from_payload(cls, data: Mapping[str, Any] | None) -> "KVStrataStats":
        if not data:
            return cls()
        return cls({kind: {name: dict(per_label) for name, per_label in data.get(kind, {}).items()}
                    for kind in (_COUNTERS, _GAUGES)})

    @classmethod
    def of(cls, counters: Sample | None = None, gauges: Sample | None = None) -> "KVStrataStats":
        stats = cls()
        for kind, sample in ((_COUNTERS, counters), (_GAUGES, gauges)):
            for (name, label), value in (sample or {}).items():
                stats.data[kind].setdefault(name, {})[label] = value
        return stats

    def reset(self) -> None:
        self.data = {_COUNTERS: {}, _GAUGES: {}}

    @property
    def counters(self) -> dict[str, dict[str, float]]:
        return self.data[_COUNTERS]

    @property
    def gauges(self) -> dict[str, dict[str, float]]:
        return self.data[_GAUGES]

    def is_empty(self) -> bool:
        return not self.counters and not self.gauges

    def aggregate(self, other: KVConnectorStats) -> "KVStrataStats":
        if other.is_empty():
            return self
        assert isinstance(other, KVStrataStats), f"cannot aggregate {type(other).__name__} into KVStrataStats"
        for name, per_label in other.counters.items():
            mine = self.counters.setdefault(name, {})
            for label, value in per_label.items():
                mine[label] = mine.get(label, 0) + value
        for name, per_label in other.gauges.items():
            self.gauges.setdefault(name, {}).update(per_label)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat ``{series[_label]: value}`` for vLLM's periodic log line."""
        out: dict[str, int | float] = {}
        for kind in (_COUNTERS, _GAUGES):
            for name, per_label in self.data[kind].items():
                for label, value in per_label.items():
                    out[f"{name}_{label}" if label else name] = round(value, 6) if isinstance(value, float) else value
        return out


class CounterDeltas:
    """Per-interval increments of monotonic counters, and the gauges that changed.

    Kept in the connector instance (one per process half); not thread-safe: vLLM
    calls the stats hook from one thread. A counter lower than at the last call
    restarted from zero: its whole value is the increment.
    """

    def __init__(self) -> None:
        self._counters: Sample = {}
        self._gauges: Sample = {}

    def take(self, counters: Sample, gauges: Sample | None = None) -> KVStrataStats | None:
        """The stats since the last call, or None when nothing changed."""
        last = self._counters
        moved: Sample = {}
        for key, value in counters.items():
            before = last.get(key, 0)
            if value != before:
                moved[key] = value - before if value > before else value
        self._counters = dict(counters)
        changed: Sample = {}
        for key, value in (gauges or {}).items():
            if self._gauges.get(key) != value:
                changed[key] = value
                self._gauges[key] = value
        return KVStrataStats.of(moved, changed) if moved or changed else None


def _unregister(names: set[str]) -> None:
    """Drop collectors of these names from the default registry: vLLM unregisters only its
    own (``vllm:``) series before a new stat logger registers them again."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in names:
            REGISTRY.unregister(collector)


class KVStrataPromMetrics(KVConnectorPromMetrics):
    """The ``kvstrata:`` families, labelled like vLLM's (``model_name``, ``engine``) plus
    ``tier`` or ``direction``; every child exists (at 0) from the start. Built in the
    frontend process by :meth:`KVStrataConnector.build_prom_metrics`."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if self._counter_cls is Counter and self._gauge_cls is Gauge:
            _unregister({PREFIX + s.name for s in SERIES})
        self._children: dict[tuple[int, str, str], Any] = {}
        self._unknown: set[str] = set()
        self._families: dict[str, Any] = {}
        self._engines = per_engine_labelvalues
        for series in SERIES:
            self._families[series.name] = self._family(series)
            for engine_idx in per_engine_labelvalues:
                for value in series.labels():
                    self._add_child(engine_idx, series, value)

    def _add_child(self, engine_idx: int, series: Series, value: str) -> Any:
        engine_labels = self._engines[engine_idx]
        labels = [*engine_labels, value] if series.label else list(engine_labels)
        self._children[engine_idx, series.name, value] = self._families[series.name].labels(*labels)
        return self._children[engine_idx, series.name, value]

    def _family(self, series: Series) -> Any:
        labelnames = [*self._labelnames, series.label] if series.label else list(self._labelnames)
        if series.gauge:
            return self._gauge_cls(name=PREFIX + series.name, documentation=series.doc, labelnames=labelnames,
                                   multiprocess_mode="mostrecent")
        return self._counter_cls(name=PREFIX + series.name, documentation=series.doc, labelnames=labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for kind in (_COUNTERS, _GAUGES):
            for name, per_label in transfer_stats_data.get(kind, {}).items():
                for label, value in per_label.items():
                    child = self._children.get((engine_idx, name, label))
                    if child is None:
                        child = self._new_tier(engine_idx, name, label)
                    if child is None:
                        self._warn_unknown(f"{name}{{{label}}}")
                    elif kind == _GAUGES:
                        child.set(value)
                    elif value > 0:
                        child.inc(value)

    def _new_tier(self, engine_idx: int, name: str, tier: str) -> Any:
        """The child of a tier family for a tier this process has no kind of (None: the
        family names no tier, or the engine is not this logger's)."""
        series = _BY_NAME.get(name)
        if series is None or not series.roles or not tier or engine_idx not in self._engines:
            return None
        return self._add_child(engine_idx, series, tier)

    def _warn_unknown(self, key: str) -> None:
        if key not in self._unknown:
            self._unknown.add(key)
            log.warning("kvstrata: no Prometheus series for the connector stat %s; not exported", key)

