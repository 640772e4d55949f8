"""Scheduler half of the vLLM connector: drives the tier policy, never any I/O.

vLLM owns the GPU pool; this half tells the :class:`~kvstrata.policy.TierPolicy`
what vLLM's scheduler did and sends the plans it gets back to the workers as
connector metadata. It never waits on disk or device. The step protocol is
the one ``kvstrata bench`` replays:

* ``get_num_new_matched_tokens``: the policy's pure lookup after vLLM's GPU
  prefix (whole blocks, never the last prompt token). With a remote tier, what
  follows the local prefix is probed there (``EXISTS``, on a thread, never
  waited for: the answer is None, "ask again", until it is in) and what the
  server holds is fetched into CPU slots (a fetch plan, run by the workers);
  only then is the request answered, so a remote block counts as a hit only
  once its bytes are local;
* ``update_state_after_alloc``: the GPU-hit prefix is touched below; the load
  is planned (its sources pinned) and the request waits for it;
* ``build_connector_meta``: blocks vLLM evicted in this step are offered as
  ``evicted`` (the workers copy them before this step's forward rewrites
  them), newly computed full blocks as ``computed``, vLLM's least recently
  used free blocks as ``pageout``;
* ``update_connector_output``: store plans every worker finished complete,
  then finished loads; blocks the workers could not store or read, and
  those the SSD tier dropped on its own, are forgotten.

vLLM's evictions are observed through the block pool's metrics hook (a
collector that forwards to vLLM's own, if any): ``on_block_evicted`` sees a
block while it still carries its hash. A prefix-cache reset is not an
eviction: those blocks are not stored (the reset may follow a weight update).

Lifetime rules: every slot a plan uses stays pinned in the policy until its
completion is reported (see :mod:`kvstrata.policy.manager`); a request whose
load was handed to the workers is not freed before that load finished
(``request_finished`` returns True). State is owned by vLLM's scheduler
thread; nothing here is shared with another thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.config import KVStrataConfig
from kvstrata.core.hits import served_from
from kvstrata.hashing import BlockHasher
from kvstrata.metrics import Lifecycle, LifecycleRecorder, lifecycle_sampling, policy_stats
from kvstrata.policy import COMPUTED, EVICTED, PAGEOUT, FetchPlan, LoadPlan, StorePlan, TierPolicy
from kvstrata.policy.seeding import SSDSeeding
from kvstrata.trace.recorder import RecordedRequest

from kvstrata.connectors.vllm_events import KVEvents, events_enabled
from kvstrata.connectors.vllm_common import (
    ResidentMap,
    KVStrataMetadata,
    KVStrataWorkerMetadata,
    block_nbytes_of,
    check_index_memory,
    engine_ranks,
    num_workers,
    policy_spec,
    vllm_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstrata.trace.recorder import TraceRecorder

__all__ = ["KVStrataScheduler", "PoolObserver"]

log = logging.getLogger(__name__)

MEASURE_S = 5.0  # how often the recorder's copy of the measured counters is refreshed
_SOURCES = {"cpu": CacheHitSource.HOST, "ssd": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class _Req:
    """Per-request state: the request, its hash chain so far, how many of its leading full
    blocks are accounted for (served from cache, or offered as computed), and, for the
    recorder, its preemptions (``[preempted at, resumed at, tokens looked up]``)."""

    __slots__ = ("request", "hashes", "handled", "preemptions")

    def __init__(self, request: "Request") -> None:
        self.request = request
        self.hashes: list[bytes] = []
        self.handled = 0
        self.preemptions: list[list[Any]] = []


class _Lookups:
    """Prefix lookups and the blocks each source served. Kept twice, as vLLM keeps its own
    prefix-cache counts: once for new requests (the hit rate) and once for requests looked
    up again after a preemption (their prompt was counted when they first ran)."""

    __slots__ = ("blocks", "tokens", "hits")

    def __init__(self) -> None:
        self.blocks = self.tokens = 0
        self.hits = {"gpu": 0, "cpu": 0, "ssd": 0}

    def stats(self, block_size: int) -> dict[str, Any]:
        return {"queries": {"blocks": self.blocks, "tokens": self.tokens},
                "hits": {t: {"blocks": b, "tokens": b * block_size} for t, b in self.hits.items()}}


def _cacheable(request: "Request") -> bool:
    return request.prompt_embeds is None if hasattr(request, "prompt_embeds") else True


def _mm_hashes(request: "Request") -> list[tuple[str, int, int]] | None:
    feats = getattr(request, "mm_features", None) or ()
    out = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in feats]
    return out or None


class PoolObserver:
    """vLLM block pool's metrics collector hook: records which blocks lose their hash
    (evicted) or are handed out again, then forwards to vLLM's own collector."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.evicted: list[int] = []     # block ids that were hashed when popped, in order
        self.reassigned: list[int] = []  # block ids handed out again
        self.cleared = False             # the prefix cache was reset

    @property
    def sample_rate(self) -> float:
        return self.inner.sample_rate if self.inner is not None else 0.01

    def on_block_evicted(self, block: Any) -> None:
        if block.block_hash is not None:
            self.evicted.append(block.block_id)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def on_block_allocated(self, block: Any) -> None:
        self.reassigned.append(block.block_id)
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def reset(self) -> None:
        self.cleared = True
        self.evicted.clear()  # a reset is not an eviction; blocks handed out stay listed (the fence)
        if self.inner is not None:
            self.inner.reset()

    def drain_events(self) -> list[Any]:
        return self.inner.drain_events() if self.inner is not None else []

    def __getattr__(self, name: str) -> Any:
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


class KVStrataScheduler:
    def __init__(self, cfg: KVStrataConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        self.cfg = cfg
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fingerprint = vllm_fingerprint(cfg, vllm_config, kv_cache_config)
        self.hasher = BlockHasher(self.block_size, cfg.hash, self.fingerprint.namespace())
        self.block_nbytes = block_nbytes_of(kv_cache_config)
        spec = policy_spec(cfg, kv_cache_config)
        self.lifecycle = {t: Lifecycle(sample_every=lifecycle_sampling(n)) for t, n in spec.capacity().items()}
        check_index_memory(spec, self.block_nbytes)
        self.policy = TierPolicy(spec, observers=[LifecycleRecorder(self.lifecycle)])
        self.num_workers = num_workers(vllm_config)
        self._reqs: dict[str, _Req] = {}
        self._matched: dict[str, tuple[int, int]] = {}     # req -> (first block, blocks below) of the last answer
        self._sources: dict[str, dict[CacheHitSource, int]] = {}
        self._loads: list[LoadPlan] = []                    # planned, for the next metadata
        self._inflight: dict[str, LoadPlan] = {}            # handed to the workers, not finished
        self._load_lost: dict[str, set[tuple[str, bytes]]] = {}
        self._stores: dict[int, StorePlan] = {}             # handed to the workers, not finished
        self._store_done: Counter = Counter()
        self._resident = ResidentMap(record=self.policy.ssd is not None)  # the workers' hot set mirrors follow it
        self._observer: PoolObserver | None = None
        self._pool: BlockPool | None = None
        self._manager: KVCacheManager | None = None
        self._lookups, self._preempted = _Lookups(), _Lookups()
        self._ranks = engine_ranks(vllm_config)
        self._seeding: SSDSeeding | None = None
        self._ssd_evictions: list[bytes] = []
        if self.policy.ssd is not None:
            from kvstrata.connectors.vllm_worker import read_ssd_keys, recovering_ssd_tiers

            self._seeding = SSDSeeding(self.policy, lambda: read_ssd_keys(cfg, self.fingerprint, self._ranks),
                                       recovering_ssd_tiers(cfg, self._ranks))
            self._ssd_evictions = self._seeding.start()
        self._reset_ssd = False
        self._events = self._kv_events(vllm_config, spec, kv_cache_config)
        self._remote = RemoteLookups(self, cfg) if self.policy.spec.remote else None
        self._metrics_server = self._start_metrics(cfg.metrics.port)
        self._recorder = self._start_recorder(cfg, vllm_config, kv_cache_config, spec)
        self._measured_at = 0.0
        log.info("kvstrata scheduler: %s; block %d bytes; %s admission; %d CPU slots, %d SSD blocks (%d held)",
                 self.fingerprint.describe(), self.block_nbytes, self.policy.spec.admission,
                 self.policy.spec.cpu_slots, self.policy.spec.ssd_slots, self.policy.occupancy()["ssd"])

    def _kv_events(self, vllm_config: "VllmConfig", spec: Any, kv_cache_config: "KVCacheConfig") -> KVEvents | None:
        """The KV-event consumer when vLLM publishes KV-cache events (it then also announces
        what the SSD tier holds from before this start)."""
        if not events_enabled(vllm_config):
            return None
        from vllm.utils.hashing import get_hash_fn_by_name

        capacity = int(kv_cache_config.num_blocks) + spec.cpu_slots + spec.ssd_slots
        events = KVEvents(self.policy, self.block_size, capacity,
                          get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
        if self.policy.ssd is not None:
            from kvstrata.connectors.vllm_worker import read_ssd_tags

            events.announce_from(lambda: read_ssd_tags(self.cfg, self.fingerprint, self._ranks[0]))
        log.info("kvstrata: KV-cache events for the tiers below the GPU (tags of up to %d blocks, "
                 "~%d MiB)", capacity, capacity * 400 >> 20)
        return events

    def _start_recorder(self, cfg: KVStrataConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                        spec: Any) -> "TraceRecorder | None":
        """The request recorder when ``trace.path`` is set (see :mod:`kvstrata.trace.recorder`)."""
        if not cfg.trace.enabled:
            return None
        import vllm

        from kvstrata.bench.deployment import recorded_deployment
        from kvstrata.trace.recorder import TraceRecorder

        gpu_blocks = max(1, int(kv_cache_config.num_blocks) - 1)  # vLLM keeps one as its null block
        deployment = recorded_deployment(
            cfg, block_size=self.block_size, block_nbytes=self.block_nbytes, gpu_blocks=gpu_blocks,
            capacity_blocks={"gpu": gpu_blocks, **spec.capacity()},
            engine={"name": "vllm", "version": vllm.__version__, "model": self.fingerprint.model,
                    "tp_size": self.fingerprint.tp_size, "kv_layout": self.fingerprint.kv_layout})
        return TraceRecorder(cfg.trace, block_size=self.block_size, deployment=deployment)

    def _record_finished(self, st: _Req) -> None:
        """Hand a finished request to the recorder: its prompt's full blocks and those its
        output completed (whose KV was computed: all tokens but the last)."""
        assert self._recorder is not None
        req = st.request
        if req.num_computed_tokens == 0 and req.num_output_tokens == 0:  # aborted before it ran
            self._recorder.finished(req.request_id, None)
            return
        prompt = req.num_prompt_tokens
        computed = max(prompt, req.num_tokens - 1) // self.block_size if _cacheable(req) else 0
        hashes = self._hashes(st, computed) if computed else []
        full = min(prompt // self.block_size, len(hashes))
        self._recorder.finished(req.request_id, RecordedRequest(
            arrival=float(req.arrival_time), finish=time.time(), input_length=prompt,
            output_length=req.num_output_tokens, keys=hashes[:full], output_keys=hashes[full:computed],
            preemptions=[(p, r, n) for p, r, n in st.preemptions if r is not None]))

    def _measure(self, final: bool = False) -> None:
        """The recorder's view of what the plugin measured, every few seconds and at the end."""
        now = time.monotonic()
        if self._recorder is None or (not final and now - self._measured_at < MEASURE_S):
            return
        self._measured_at = now
        stats = self.stats()
        kept = ("queries", "hits", "preempted", "spills", "promotions", "evictions", "dropped_spills",
                "corrupt_blocks", "capacity_blocks")
        self._recorder.measured({k: stats[k] for k in kept}
                                | {"block_size": self.block_size, "block_nbytes": self.block_nbytes})

    def take_events(self) -> list[Any]:
        """KV-cache events of the tiers below (vLLM's ``take_events`` hook)."""
        if self._events is None:
            return []
        return self._events.take(self._seeding is not None and self._seeding.pending)

    def _start_metrics(self, port: int | None) -> Any:
        if port is None:
            return None
        from kvstrata.metrics import KVStrataCollector, start_metrics_server

        return start_metrics_server(port, KVStrataCollector(self.stats, self.lifecycle), self.cfg.metrics.host)

    # ------------------------------------------------------------------ binding

    def bind_gpu_block_pool(self, pool: "BlockPool") -> None:
        """Observe vLLM's evictions (needed by ``on_evict`` admission and the shutdown mirror)."""
        self._pool = pool
        if not isinstance(pool.metrics_collector, PoolObserver):
            pool.metrics_collector = PoolObserver(pool.metrics_collector)
        self._observer = pool.metrics_collector

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._manager = manager

    # ------------------------------------------------------------------ lookups

    def on_new_request(self, request: "Request") -> None:
        self._reqs[request.request_id] = _Req(request)
        if self._recorder is not None:
            self._recorder.admitted(request.request_id)

    def _state(self, request: "Request") -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def _hashes(self, st: _Req, num_blocks: int) -> list[bytes]:
        if len(st.hashes) < num_blocks:
            req = st.request
            lora = req.lora_request.lora_name if req.lora_request is not None else None
            self.hasher.extend(st.hashes, req.all_token_ids[:num_blocks * self.block_size],
                               cache_salt=req.cache_salt, lora_id=lora, mm_hashes=_mm_hashes(req))
        return st.hashes

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` held below (whole blocks, never the last
        prompt token); loaded asynchronously. Pure apart from caching the hash chain."""
        if not _cacheable(request):
            return 0, False
        st = self._state(request)
        last = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        hashes = self._hashes(st, last)
        below = self.policy.lookup(hashes[first:last])
        if self._remote is not None and first + len(below) < last:
            if not self._remote.ready(request.request_id, hashes, first, first + len(below), last):
                return None, False  # type: ignore[return-value]  # vLLM asks again next step
            below = self.policy.lookup(hashes[first:last])
        self._matched[request.request_id] = (first, len(below))
        return (len(below) * self.block_size, True) if below else (0, False)

    # ------------------------------------------------------------------ loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        req_id = request.request_id
        matched = self._matched.pop(req_id, None)
        if matched is None or req_id not in self._reqs:  # resumed after its load: no new lookup
            return
        first, hits = matched
        block_ids = blocks.get_block_ids()[0]
        st = self._reqs[req_id]
        if st.preemptions and st.preemptions[-1][1] is None:  # resumed: looked up again
            st.preemptions[-1][1:] = [time.time(), request.num_tokens]
        keys = st.hashes
        self._resident.add(block_ids[:first], keys[:first])
        if self._events is not None:
            self._events.record(request, keys, 0, first + num_external_tokens // self.block_size)
        st.handled = max(st.handled, first + num_external_tokens // self.block_size)  # not computed now
        self.policy.touch(keys[:first])
        self._resident.used(block_ids[:first])
        self._count_query(request, first)
        if num_external_tokens == 0:
            return
        assert hits * self.block_size == num_external_tokens, (hits, num_external_tokens)
        plan = self.policy.prepare_load(req_id, keys[first:first + hits], block_ids[first:first + hits])
        self._loads.append(plan)
        fetched = self._remote.take_fetched(req_id) if self._remote is not None else set()
        tiers = Counter(served_from(plan.tiers(), plan.keys, fetched))
        self._sources[req_id] = {_SOURCES[t]: n * self.block_size for t, n in tiers.items() if t in _SOURCES and n > 0}

    def _lookups_for(self, request: "Request") -> _Lookups:
        return self._preempted if request.num_preemptions > 0 else self._lookups

    def _count_query(self, request: "Request", gpu_hits: int) -> None:
        lookups = self._lookups_for(request)
        lookups.blocks += -(-request.num_tokens // self.block_size)
        lookups.tokens += request.num_tokens
        lookups.hits["gpu"] += gpu_hits

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._sources.pop(request.request_id, {})

    # ------------------------------------------------------------------ stores

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after an in-place weight
        update: every block below the GPU is stale (its fingerprint did not change). The
        policy forgets them all; the workers delete every record of their SSD tiers
        before the next step's forward (also those the policy no longer knew of). Refused (False, nothing changed) while a load is planned or in flight."""
        fetching = len(self._remote.fetching) if self._remote is not None else 0
        if self._loads or self._inflight or fetching:
            log.warning("kvstrata: cannot reset the lower tiers while %d loads are in flight",
                        len(self._loads) + len(self._inflight) + fetching)
            return False
        dropped = self.policy.occupancy()
        self.policy.clear()
        if self._seeding is not None:
            self._seeding.cancel()  # what they are verifying is stale too: the workers delete it all
        self._reset_ssd = self.policy.ssd is not None  # the workers delete every record they hold
        log.info("kvstrata: reset: forgot %d CPU and %d SSD blocks", dropped["cpu"], dropped["ssd"])
        return True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStrataMetadata:
        if self._seeding is not None and self._seeding.pending:
            leaving = frozenset(self._ssd_evictions).union(*(plan.ssd_evictions for plan in self._loads))
            self._ssd_evictions += self._seeding.poll(leaving)
        if self._recorder is not None:
            for req_id in scheduler_output.preempted_req_ids or ():
                if req_id in self._reqs:
                    self._reqs[req_id].preemptions.append([time.time(), None, 0])
        meta = KVStrataMetadata(loads=self._loads, ssd_evictions=self._ssd_evictions, reset=self._reset_ssd)
        self._loads, self._ssd_evictions, self._reset_ssd = [], [], False
        for plan in meta.loads:
            if isinstance(plan, LoadPlan):
                self._inflight[plan.req_id] = plan
        evicted = self._take_pool_changes(meta)
        policy = self.policy
        if evicted and policy.admits(EVICTED):
            self._offer(evicted, EVICTED, meta.early_stores)
        computed = self._computed(scheduler_output)
        if computed and policy.admits(COMPUTED):
            self._offer(computed, COMPUTED, meta.stores)
        if policy.pageout_blocks:
            window = self._free_window(policy.pageout_blocks)
            if window:
                self._offer(window, PAGEOUT, meta.stores)
        meta.resident = self._resident.take_delta()
        self._measure()
        if self._events is not None and self.policy.ssd is not None:
            meta.tags = self._events.ssd_tags([*meta.loads, *meta.early_stores, *meta.stores])
        return meta

    def _offer(self, blocks: list[tuple[int, bytes]], reason: str, plans: list[StorePlan]) -> None:
        """Plan storing ``blocks``; a plan with work goes to the workers (into ``plans``),
        an empty one is complete at once."""
        plan = self.policy.prepare_store([b for b, _ in blocks], [k for _, k in blocks], reason)
        if plan.empty:
            self.policy.complete_store(plan)
        else:
            self._stores[plan.plan_id] = plan
            plans.append(plan)

    def _take_pool_changes(self, meta: KVStrataMetadata) -> list[tuple[int, bytes]]:
        """Blocks vLLM evicted since the last step (with our keys); updates the resident map
        and tells the workers which blocks were handed out again (``meta.reused``)."""
        obs = self._observer
        if obs is None:
            return []
        meta.reused = list(obs.reassigned)
        if obs.cleared:
            obs.cleared = False
            self._resident.clear()
        resident = self._resident.blocks
        evicted = [(b, resident[b]) for b in obs.evicted if b in resident]
        for block_id in obs.reassigned:
            self._resident.drop(block_id)
        obs.evicted, obs.reassigned = [], []
        return evicted

    def _computed(self, scheduler_output: "SchedulerOutput") -> list[tuple[int, bytes]]:
        """Full blocks that this step computes (or loaded blocks now counted as computed)."""
        out: list[tuple[int, bytes]] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._full_blocks(new.req_id, new.num_computed_tokens + scheduled[new.req_id], out)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self._full_blocks(req_id, computed + scheduled[req_id], out)
        return out

    def _full_blocks(self, req_id: str, computed: int, out: list[tuple[int, bytes]]) -> None:
        st = self._reqs.get(req_id)
        if st is None or not _cacheable(st.request):
            return
        full = min(computed, st.request.num_tokens) // self.block_size
        if full <= st.handled:
            return
        assert self._manager is not None, "bind_kv_cache_manager was not called"
        block_ids = self._manager.get_block_ids(req_id)[0]
        hashes = self._hashes(st, full)
        new = list(zip(block_ids[st.handled:full], hashes[st.handled:full]))
        if self._events is not None:
            self._events.record(st.request, hashes, st.handled, full)
        out.extend(new)
        self._resident.add([b for b, _ in new], [k for _, k in new])
        st.handled = full

    def _free_window(self, n: int) -> list[tuple[int, bytes]]:
        """The hashed blocks among the ``n`` vLLM evicts next (the head of its free queue)."""
        if self._pool is None:
            return []
        queue = self._pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        out = []
        for _ in range(n):
            if block is None or block is tail:
                break
            key = self._resident.blocks.get(block.block_id) if block.block_hash is not None else None
            if key is not None:
                out.append((block.block_id, key))
            block = block.next_free_block
        return out

    # ------------------------------------------------------------------ completion

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVStrataWorkerMetadata):
            self._store_done.update(meta.stored)
            done: list[StorePlan] = []
            for plan_id in [p for p, n in self._store_done.items() if n >= self.num_workers]:
                del self._store_done[plan_id]
                plan = self._stores.pop(plan_id, None)
                if plan is not None:
                    self.policy.complete_store(plan)
                    done.append(plan)
            self.policy.forget_pairs(meta.lost)
            for plan in done if self._events is not None else ():  # what a worker lost is not announced
                self._events.completed(plan)
            if self._remote is not None:
                self._remote.reported(meta.fetched)
            for req_id, lost in meta.load_lost.items():
                self._load_lost.setdefault(req_id, set()).update(lost)
        for req_id in output.finished_recving or ():
            plan = self._inflight.pop(req_id, None)
            if plan is not None:
                self._finish_load(plan, self._load_lost.pop(req_id, set()))

    def _finish_load(self, plan: LoadPlan, lost: set[tuple[str, bytes]]) -> None:
        """The workers finished a load: loaded blocks are resident; from the first block that
        failed on, vLLM recomputes, and those blocks are offered as computed then."""
        loaded = plan.loaded(lost)
        self.policy.complete_load(plan, lost, loaded)
        if self._events is not None:
            self._events.completed(plan, loaded)
        st = self._reqs.get(plan.req_id)
        hits = (self._lookups_for(st.request) if st is not None else self._lookups).hits
        for tier in plan.tiers()[:loaded]:
            hits[tier] += 1
        self._resident.add(plan.block_ids[:loaded], plan.keys[:loaded])
        if st is not None and loaded < len(plan):
            st.handled = min(st.handled, st.hashes.index(plan.keys[0]) + loaded)

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing only while a load into the request's blocks is in flight."""
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        if self._recorder is not None and st is not None:
            self._record_finished(st)
        self._matched.pop(req_id, None)
        self._sources.pop(req_id, None)
        if self._remote is not None:
            self._remote.finished(req_id)
        pending = [p for p in self._loads if p.req_id == req_id and isinstance(p, LoadPlan)]
        if pending:  # not handed to the workers yet: cancel it
            self._loads = [p for p in self._loads if p.req_id != req_id or not isinstance(p, LoadPlan)]
            for plan in pending:
                self.policy.complete_load(plan, loaded=0)
            return False, None
        return req_id in self._inflight, None

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        out = {
            **self._lookups.stats(self.block_size),
            "preempted": self._preempted.stats(self.block_size),
            **policy_stats(self.policy),
            "transfer": {},
        }
        if self._remote is not None:
            out["remote"] = self._remote.stats()
        if self._events is not None:
            out["kv_events"] = dict(self._events.counts)
        return out

    def shutdown(self) -> None:
        if self._recorder is not None:
            self._measure(final=True)
            self._recorder.close()
            self._recorder = None
        if self._remote is not None:
            self._remote.close()
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class RemoteLookups:
    """The scheduler's side of the remote tier: per request, a probe of what follows the
    local prefix (on the remote tier's probe thread), then a fetch plan for what the server
    holds, handed to the workers in the scheduler's plan list. :meth:`ready` is False until
    both are over; the scheduler never waits. A request gets one remote lookup: resumed
    or asked again later, it is answered from the tiers below as they are by then."""

    def __init__(self, owner: KVStrataScheduler, cfg: KVStrataConfig) -> None:
        from kvstrata.tiers.remote import RemoteTier

        self.owner = owner
        self.tier = RemoteTier.from_config(cfg.remote, [r.tier_id(owner.fingerprint) for r in owner._ranks],
                                           owner.block_nbytes, writer=False)
        self._probes: dict[str, tuple[int, Any]] = {}   # req -> (first probed block, future)
        self.fetching: dict[int, FetchPlan] = {}        # plan id -> plan, planned or with the workers
        self._reports: dict[int, list[int]] = {}        # plan id -> blocks each worker fetched
        self._fetched: dict[str, set[bytes]] = {}       # req -> keys fetched for it (hit sources)
        self._done: set[str] = set()
        self.blocks_fetched = 0

    def ready(self, req_id: str, hashes: list[bytes], first: int, start: int, last: int) -> bool:
        """May the request be answered now? ``hashes[first:start]`` are held below, the
        rest up to ``last`` are not."""
        if req_id in self._done:
            return True
        if any(p.req_id == req_id for p in self.fetching.values()):
            return False
        probe = self._probes.get(req_id)
        if probe is None:
            self._probes[req_id] = (start, self.tier.probe_async(hashes[start:last]))
            return False
        begin, future = probe
        if not future.done():
            return False
        del self._probes[req_id]
        self._done.add(req_id)
        try:
            held = int(future.result())
        except Exception:  # the probe thread never raises for the server; a bug must not stop the engine
            log.exception("kvstrata: a remote probe failed")
            held = 0
        held = begin + held - start if start >= begin else 0  # the local prefix may have grown meanwhile
        if held <= 0:
            return True
        policy = self.owner.policy
        policy.touch(hashes[first:start])  # the fetch's placements must not evict the local prefix
        plan = policy.prepare_fetch(hashes[start:start + held], req_id)
        if not len(plan):
            policy.complete_fetch(plan, 0)
            return True
        self._done.discard(req_id)
        self.fetching[plan.plan_id] = plan
        self.owner._loads.append(plan)  # in preparation order with the loads
        return False

    def reported(self, fetched: dict[int, list[int]]) -> None:
        """Workers' fetch results; a plan completes once every worker ran it (the blocks
        every rank fetched are held)."""
        for plan_id, counts in fetched.items():
            self._reports.setdefault(plan_id, []).extend(counts)
        for plan_id in [p for p, c in self._reports.items() if len(c) >= self.owner.num_workers]:
            got = min(self._reports.pop(plan_id))
            plan = self.fetching.pop(plan_id, None)
            if plan is None:
                continue
            self.owner.policy.complete_fetch(plan, got)
            if self.owner._events is not None:
                self.owner._events.completed(plan, got)
            self.blocks_fetched += got
            if plan.req_id in self.owner._reqs:
                self._done.add(plan.req_id)
                self._fetched[plan.req_id] = set(plan.keys[:got])

    def take_fetched(self, req_id: str) -> set[bytes]:
        """The keys fetched for ``req_id`` (its load's hit sources, :func:`served_from`)."""
        return self._fetched.pop(req_id, set())

    def finished(self, req_id: str) -> None:
        self._probes.pop(req_id, None)
        self._done.discard(req_id)
        self._fetched.pop(req_id, None)
        planned = [p for p in self.owner._loads if isinstance(p, FetchPlan) and p.req_id == req_id]
        if planned:  # not handed to the workers yet: cancelled
            self.owner._loads = [p for p in self.owner._loads if p not in planned]
            for plan in planned:
                self.fetching.pop(plan.plan_id, None)
                self.owner.policy.complete_fetch(plan, 0)

    def stats(self) -> dict[str, Any]:
        return {"blocks_fetched": self.blocks_fetched, **self.tier.stats()}

    def close(self) -> None:
        self.tier.close()
