"""Cache metrics: plain counters on the hot path, rendered for Prometheus at scrape time.

The hot path only increments ints in dicts and appends to bucket counts; the
:class:`KVStrataCollector` turns a snapshot of them into Prometheus families when
someone scrapes. Names follow vLLM's vocabulary (``prefix_cache_queries``,
``prefix_cache_hits``, ``kv_block_lifetime_seconds``, ...) under the ``kvstrata:``
prefix, with a ``tier`` label (``gpu``, ``cpu``, ``ssd``).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Callable, Iterator

from kvstrata.errors import ConfigError
from kvstrata.policy.events import TIERS
from kvstrata.policy.tiers import GPU
from kvstrata.tiers.kinds import kinds

__all__ = ["TIERS", "Histogram", "Lifecycle", "LifecycleRecorder", "KVStrataCollector", "lifecycle_sampling",
           "policy_stats", "start_metrics_server"]


# seconds: from a millisecond to a day
LIFECYCLE_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


class Histogram:
    """Fixed upper bounds (plus +Inf), cumulative counts rendered at scrape time.

    With ``keep_samples`` the hot path only appends the raw value and the bucket
    counts are derived from the samples when rendered (replays want exact
    percentiles and should not pay twice); otherwise it bumps one bucket.
    ``weight``: what one observation counts for (a sample of one in ``weight``).
    """

    __slots__ = ("bounds", "counts", "sum", "count", "samples", "weight")

    def __init__(self, bounds: tuple[float, ...] = LIFECYCLE_BUCKETS, keep_samples: bool = False,
                 weight: int = 1) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self.samples: list[float] | None = [] if keep_samples else None
        self.weight = weight

    def observe(self, value: float) -> None:
        if self.samples is not None:
            self.samples.append(value)
            return
        w = self.weight
        self.counts[bisect.bisect_left(self.bounds, value)] += w
        self.sum += value * w
        self.count += w

    def buckets(self) -> list[tuple[str, int]]:
        counts = self.counts
        if self.samples is not None:
            counts = [0] * (len(self.bounds) + 1)
            for v in self.samples:
                counts[bisect.bisect_left(self.bounds, v)] += self.weight
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), counts):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        return out

    def total(self) -> float:
        return sum(self.samples) * self.weight if self.samples is not None else self.sum


# Blocks a Lifecycle follows at most, about: past it, a uniform sample (~170 bytes each).
LIFECYCLE_TRACKED = 1 << 18


def lifecycle_sampling(capacity_blocks: int, tracked: int = LIFECYCLE_TRACKED) -> int:
    """The ``sample_every`` of a tier holding ``capacity_blocks``: the smallest power of two
    that keeps the blocks followed at or below ``tracked``."""
    every = 1
    while capacity_blocks > tracked * every:
        every *= 2
    return every


class Lifecycle:
    """Per-tier block lifecycle (the seed's kv_block_* metrics).

    lifetime = eviction time - time the block entered the tier;
    idle_before_evict = eviction time - last access;
    reuse_gap = time between consecutive accesses (entering counts as one).

    ``sample_every`` (a power of two): follow one block in that many, chosen by the
    key's hash, each of its observations counting that many times; memory is then
    about the tier's capacity / ``sample_every`` entries (see :func:`lifecycle_sampling`).
    """

    __slots__ = ("lifetime", "idle_before_evict", "reuse_gap", "_born", "_last", "sample_every", "_mask")

    def __init__(self, keep_samples: bool = False, sample_every: int = 1) -> None:
        if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1 or \
                sample_every & (sample_every - 1):
            raise ValueError(f"sample_every: expected a power of two, got {sample_every!r}")
        self.sample_every = sample_every
        self._mask = sample_every - 1
        self.lifetime = Histogram(keep_samples=keep_samples, weight=sample_every)
        self.idle_before_evict = Histogram(keep_samples=keep_samples, weight=sample_every)
        self.reuse_gap = Histogram(keep_samples=keep_samples, weight=sample_every)
        self._born: dict[bytes, float] = {}
        self._last: dict[bytes, float] = {}

    def follows(self, key: bytes) -> bool:
        """Whether ``key`` is one of the blocks this lifecycle follows (every one when not
        sampling). Accesses and leaves of the others find nothing and cost nothing."""
        return not self._mask or not hash(key) & self._mask

    def enter(self, key: bytes, now: float) -> None:
        if self.follows(key):
            self._born[key] = now
            self._last[key] = now

    def enter_new(self, key: bytes, now: float) -> None:
        """:meth:`enter` unless ``key`` is already in the tier."""
        if key not in self._born and self.follows(key):
            self._born[key] = now
            self._last[key] = now

    def access(self, key: bytes, now: float) -> None:
        last = self._last.get(key)
        if last is not None:
            self.reuse_gap.observe(now - last)
            self._last[key] = now

    def leave(self, key: bytes, now: float) -> None:
        born = self._born.pop(key, None)
        if born is not None:
            self.lifetime.observe(now - born)
            self.idle_before_evict.observe(now - self._last.pop(key))

    def access_many(self, keys: Any, now: float) -> None:
        for key in keys:
            self.access(key, now)

    def enter_many(self, keys: Any, now: float) -> None:
        born, last, mask = self._born, self._last, self._mask
        for key in keys:
            if not mask or not hash(key) & mask:
                born[key] = now
                last[key] = now

    def leave_many(self, keys: Any, now: float) -> None:
        """:meth:`leave` for each key (the hot path of replays: inlined)."""
        born_pop, last_pop = self._born.pop, self._last.pop
        life, idle = self.lifetime, self.idle_before_evict
        if life.samples is None or idle.samples is None:
            life_obs, idle_obs = life.observe, idle.observe
            for key in keys:
                born = born_pop(key, None)
                if born is not None:
                    life_obs(now - born)
                    idle_obs(now - last_pop(key))
            return
        life_add, idle_add = life.samples.append, idle.samples.append
        for key in keys:
            born = born_pop(key, None)
            if born is not None:
                life_add(now - born)
                idle_add(now - last_pop(key))

    def samples(self) -> dict[str, list[float] | None]:
        return {"lifetime_s": self.lifetime.samples, "idle_before_evict_s": self.idle_before_evict.samples,
                "reuse_gap_s": self.reuse_gap.samples}


class LifecycleRecorder:
    """A tier-policy observer feeding one :class:`Lifecycle` per lower tier: a block enters
    a tier when stored there, is accessed when a load reads it, leaves when evicted or lost."""

    __slots__ = ("lifecycles",)

    def __init__(self, lifecycles: dict[str, Any]) -> None:
        self.lifecycles = lifecycles  # tier -> Lifecycle, or anything with its *_many methods

    def __call__(self, kind: str, tier: str, keys: Any, now: float) -> None:
        lc = self.lifecycles.get(tier)
        if lc is None:  # a tier followed by no lifecycle (the shared remote tier)
            return
        if kind == "stored":
            lc.enter_many(keys, now)
        elif kind == "hit":
            lc.access_many(keys, now)
        elif kind in ("evicted", "lost"):
            lc.leave_many(keys, now)


def policy_stats(policy: Any, *, gpu_evictions: int = 0, gpu_cached: int = 0, gpu_blocks: int = 0) -> dict[str, Any]:
    """The per-tier counters of a stats snapshot, from a tier policy's event counts: the
    same in the library, the vLLM connector and the bench replay. The ``gpu`` entries
    are the driver's (its pool's evictions, cached blocks and size)."""
    counts = policy.counts.snapshot()
    zero = dict.fromkeys(TIERS, 0)
    return {
        "spills": {**zero, **counts["stored"]},
        "promotions": {**zero, **counts["hit"]},
        "evictions": {**zero, **counts["evicted"], GPU: gpu_evictions},
        "dropped_spills": {**zero, **counts["dropped"]},
        "corrupt_blocks": {**zero, **counts["lost"]},
        "admissions_rejected": {**zero, **counts["rejected"]},
        "tier_policies": {t.name: {"eviction": t.eviction, "admission": t.admission}
                          for t in getattr(policy.spec, "tiers", ())},
        "occupancy": {GPU: gpu_cached, **policy.occupancy()},
        "capacity_blocks": {GPU: gpu_blocks, **policy.capacity()},
    }


def _policy_metrics(s: dict[str, Any]) -> Iterator[Any]:
    """Evictions and rejected admissions per tier, labelled with the tier's policy."""
    from prometheus_client.core import CounterMetricFamily

    policies = s.get("tier_policies", {})
    for name, doc, which in (
            ("evictions", "Blocks evicted from a tier, by the tier's eviction order (the GPU pool's: its "
             "engine's)", "eviction"),
            ("admissions_rejected", "Blocks offered to a tier that its second_hit admission did not take",
             "admission")):
        fam = CounterMetricFamily(f"kvstrata:{name}", doc, labels=["tier", which])
        for tier, v in s[name].items():
            fam.add_metric([tier, str(policies.get(tier, {}).get(which) or "")], v)
        yield fam


def _load_decisions(decisions: dict[str, dict[str, int]]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily("kvstrata:load_decisions", "Blocks of hits below the GPU loaded or left to be "
                              "computed (load.policy: measured), per tier", labels=["tier", "decision"])
    for tier, counts in decisions.items():
        for decision, v in counts.items():
            fam.add_metric([tier, decision], v)
    return fam


class KVStrataCollector:
    """Prometheus collector that renders ``snapshot()`` (a TieredKVCache.stats() dict)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], lifecycles: dict[str, Lifecycle]) -> None:
        self._snapshot = snapshot
        self._lifecycles = lifecycles

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        s = self._snapshot()

        def per_tier(name: str, doc: str, values: dict[str, int], cls: Any = CounterMetricFamily) -> Any:
            fam = cls(f"kvstrata:{name}", doc, labels=["tier"])
            for tier, v in values.items():
                fam.add_metric([tier], v)
            return fam

        q = CounterMetricFamily("kvstrata:prefix_cache_queries", "Prompt tokens looked up", labels=[])
        q.add_metric([], s["queries"]["tokens"])
        yield q
        qb = CounterMetricFamily("kvstrata:prefix_cache_queries_blocks", "Prompt blocks looked up", labels=[])
        qb.add_metric([], s["queries"]["blocks"])
        yield qb
        yield per_tier("prefix_cache_hits", "Prompt tokens served from a tier",
                       {t: h["tokens"] for t, h in s["hits"].items()})
        yield per_tier("prefix_cache_hits_blocks", "Prompt blocks served from a tier",
                       {t: h["blocks"] for t, h in s["hits"].items()})
        yield per_tier("spills", "Blocks copied down into a tier", s["spills"])
        yield per_tier("promotions", "Blocks promoted from a tier into the GPU pool", s["promotions"])
        yield from _policy_metrics(s)
        yield per_tier("dropped_spills", "Spills dropped (full queue, pinned slots, I/O error)", s["dropped_spills"])
        yield per_tier("corrupt_blocks", "Blocks a tier lost: failed verification, I/O error or a refused write "
                       "(counted as misses)", s["corrupt_blocks"])
        yield per_tier("occupancy_blocks", "Blocks held per tier", s["occupancy"], GaugeMetricFamily)
        yield per_tier("capacity_blocks", "Block capacity per tier", s["capacity_blocks"], GaugeMetricFamily)
        moved = CounterMetricFamily("kvstrata:transfer_bytes", "Bytes moved between tiers", labels=["direction"])
        secs = CounterMetricFamily("kvstrata:transfer_seconds", "Seconds spent moving bytes", labels=["direction"])
        for direction, v in s["transfer"].items():
            moved.add_metric([direction], v["bytes"])
            secs.add_metric([direction], v["seconds"])
        yield moved
        yield secs
        if s.get("load"):
            yield _load_decisions(s["load"]["decisions"])
        for name, kind in kinds().items():  # a kind's own families (the remote tier's operations)
            if kind.metrics is not None and s.get(name):
                yield from kind.metrics(s[name])
        if s.get("kv_events"):
            ev = CounterMetricFamily("kvstrata:kv_events", "KV-cache events for routers, per kind (announced: "
                                     "stored events of the SSD tier's blocks after a restart; untagged: blocks "
                                     "that could not be described)", labels=["kind"])
            for kind, v in s["kv_events"].items():
                ev.add_metric([kind], v)
            yield ev
        for metric in ("lifetime", "idle_before_evict", "reuse_gap"):
            fam = HistogramMetricFamily(f"kvstrata:kv_block_{metric}_seconds",
                                        f"Block {metric.replace('_', ' ')} per tier", labels=["tier"])
            for tier, lc in self._lifecycles.items():
                h: Histogram = getattr(lc, metric)
                fam.add_metric([tier], h.buckets(), sum_value=h.total())
            yield fam


_servers_lock = threading.Lock()


def start_metrics_server(port: int, collector: KVStrataCollector, addr: str = "0.0.0.0") -> Any:
    """Serve ``collector`` (plus nothing else) on ``http://addr:port/metrics``; returns the HTTP server
    (``server.shutdown()`` stops it; ``server.server_port`` is the bound port when ``port`` is 0)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        with _servers_lock:
            server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # in use, not permitted, no such address
        raise ConfigError(f"metrics.port: cannot serve metrics on {addr}:{port}: "
                          f"{exc.strerror or exc}") from None
    return server
