'''Scheduler half of the vLLM connector: vLLM's steps in the driver core's terms, never any I/O.

vLLM owns the GPU pool; this half tells the :class:`~kvstrata.core.driver.DriverCore`
what vLLM's scheduler did and sends the plans it gets back to the workers as
connector metadata, where they complete a step later. It never waits on disk or
device; for a remote server's answer, a step waits 2 ms at most. The step protocol is
the core's (the one ``kvstrata bench`` replays):

* ``get_num_new_matched_tokens``: the tiers' pure lookup after vLLM's GPU prefix
  (whole blocks, never the last prompt token). With a shared (remote) tier, what
  follows the local prefix is probed there and fetched into slab slots first
  (:class:`~kvstrata.connectors.kit.shared_lookups.SharedLookups`); until then the answer
  is None ("ask again"), so a shared block counts as a hit only once its bytes
  are local;
* ``update_state_after_alloc``: the request is admitted (GPU hits touched below,
  the lookup counted, the load planned with its sources pinned);
* ``build_connector_meta``: the planned loads and fetches go to the workers; the
  step's store offers: blocks vLLM evicted (the workers copy them before this
  step's forward rewrites them), newly computed full blocks, vLLM's least
  recently used free blocks (:class:`~kvstrata.connectors.vllm.pool.PoolView`);
* ``update_connector_output``: store plans every worker finished complete, then
  fetches, then finished loads (their hits counted); blocks the workers could not
  store or read, and those the persistent tier dropped on its own, are forgotten.

Lifetime rules: every slot a plan uses stays pinned in the policy until its
completion is reported (see :mod:`kvstrata.policy.manager`); a request whose load
was handed to the workers is not freed before that load finished
(``request_finished`` returns True). State is owned by vLLM's scheduler thread;
nothing here is shared with another thread.
'''

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.driver import DriverCore
from kvstrata.core.request import RequestState
from kvstrata.identity.groups import FULL, STATE
from kvstrata.identity.hashing import BlockHasher
from kvstrata.core.metrics import Lifecycle, LifecycleRecorder, lifecycle_sampling, policy_stats
from kvstrata.policy import TierPolicy
from kvstrata.policy.plans import LoadPlan
from kvstrata.policy.tiers import KNOWN, Tier, TierList, describe_tiers
from kvstrata.policy.seeding import StoreSeeding

from kvstrata.connectors.vllm.events import KVEvents, event_kinds, events_enabled
from kvstrata.connectors.vllm.mrv2 import not_overwritten, take_zeroing
from kvstrata.connectors.vllm.common import (
    KVStrataMetadata,
    KVStrataWorkerMetadata,
    block_nbytes_of,
    check_index_memory,
    engine_ranks,
    kv_groups,
    num_workers,
    policy_spec,
    retention_of,
    vllm_fingerprint,
)
from kvstrata.connectors.kit.transfer_costs import TransferTiming, attended, load_costs
from kvstrata.connectors.vllm.pool import PoolObserver, PoolView
from kvstrata.connectors.vllm.recording import SchedulerRecording
from kvstrata.connectors.kit.shared_lookups import SharedLookups, WorkerReports
from kvstrata.tiers.ssd.ranks import RankRecords, rank_records

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStrataScheduler", "PoolObserver"]

log = logging.getLogger(__name__)

_NULL = 0  # vLLM's null block: the padding of a window group's skipped blocks


class _Req(RequestState):
    """A vLLM request in the core's terms, plus what only this driver needs: the request,
    how many of its leading full blocks are accounted for (served from cache, or offered
    as computed), the last lookup's answer (first block, blocks below), the shared tier's
    probe and whether its lookup is over, and, for the recorder, its preemptions
    (``[preempted at, resumed at, tokens looked up]``)."""

    __slots__ = ("request", "handled", "matched", "probe", "shared_done", "preemptions")

    def __init__(self, request: "Request") -> None:
        super().__init__(request.request_id)
        self.request = request
        self.handled = 0
        self.matched: tuple[int, int] | None = None
        self.probe: tuple[int, int, Any] | None = None  # (first block probed, last, the future)
        self.shared_done = False
        self.preemptions: list[list[Any]] = []


def _cacheable(request: "Request") -> bool:
    return request.prompt_embeds is None if hasattr(request, "prompt_embeds") else True


def hit_sources(tiers: TierList) -> dict[str, CacheHitSource]:
    """vLLM's ``CacheHitSource`` of a hit from each of ``tiers`` (its declaration's
    ``hit_source``; a name this vLLM lacks: ``EXTERNAL_UNSPECIFIED``)."""
    unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED
    return {t.name: getattr(CacheHitSource, t.hit_source, unspecified) for t in tiers}


def _label(tiers: TierList, name: str) -> str:
    """How reports name tier ``name``: its declaration's label (the name when none is known)."""
    declared: Tier | None = tiers[name] if name in tiers else KNOWN.get(name)
    return (declared.label or name) if declared is not None else name


def _mm_hashes(request: "Request") -> list[tuple[str, int, int]] | None:
    feats = getattr(request, "mm_features", None) or ()
    out = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in feats]
    return out or None


class KVStrataScheduler:
    """The scheduler half (see the module docstring)."""

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
        assert spec.tiers is not None
        self._sources = hit_sources(spec.tiers)
        self.groups = kv_groups(kv_cache_config, self.block_size, retention_of(vllm_config))
        self._kinds = [group.kind for group in self.groups.groups]
        self._sparse = any(k != FULL for k in self._kinds)  # reads vLLM's block hashes
        self.costs = load_costs(cfg.load, spec, self.block_nbytes)
        self.core = DriverCore(self.policy, self.block_size, self.groups, self.costs)
        self._timing = TransferTiming(self.costs, self.block_size,
                                      first_of=lambda req_id: getattr(self.core.requests.get(req_id), "gpu_hits", 0),
                                      span_of=self._span,
                                      async_scheduling=bool(vllm_config.scheduler_config.async_scheduling))
        self.num_workers = num_workers(vllm_config)
        self._stores = WorkerReports(self.num_workers)
        self._pool = PoolView(record=self.policy.store is not None)  # the workers' hot set mirrors follow it
        self._manager: KVCacheManager | None = None
        self._ranks = engine_ranks(vllm_config)
        # the persistent tier's records from before this start, read per rank (the SSD tier's)
        self._records: RankRecords | None = rank_records(cfg, self.policy.store_tier, self.fingerprint, self._ranks)
        self._seeding: StoreSeeding | None = None
        self._store_evictions: list[bytes] = []
        if self._records is not None:
            self._seeding = StoreSeeding(self.policy, self._records.keys, self._records.recovering())
            self._store_evictions = self._seeding.start()
        self._reset_stores = False
        self._events = self._kv_events(vllm_config, spec, kv_cache_config)
        self._shared = SharedLookups(self.core, cfg, [r.tier_id(self.fingerprint) for r in self._ranks],
                                     self.block_nbytes, self.num_workers) if spec.shared else None
        self._metrics_server = self._start_metrics(cfg.metrics.port)
        gpu_blocks = max(1, int(kv_cache_config.num_blocks) - 1)  # vLLM keeps one as its null block
        self._recording = SchedulerRecording(cfg, vllm_config, gpu_blocks, spec, self.fingerprint, self.block_size,
                                             self.block_nbytes) if cfg.trace.enabled else None
        log.info("kvstrata scheduler: %s; block %d bytes; %s admission; %s", self.fingerprint.describe(),
                 self.block_nbytes, spec.admission, describe_tiers(spec.tiers, self.policy.occupancy()))

    def _kv_events(self, vllm_config: "VllmConfig", spec: Any, kv_cache_config: "KVCacheConfig") -> KVEvents | None:
        """The KV-event consumer when vLLM publishes KV-cache events (it then also announces
        what the persistent tier's records hold from before this start)."""
        if not events_enabled(vllm_config):
            return None
        from vllm.utils.hashing import get_hash_fn_by_name

        capacity = int(kv_cache_config.num_blocks) + sum(spec.capacity().values())
        events = KVEvents(self.policy, self.block_size, capacity,
                          get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo), self.hasher,
                          self._block_extra, event_kinds(kv_cache_config))
        if self._records is not None:
            events.announce_from(self._records.tags)
        log.info("kvstrata: KV-cache events for the tiers below the GPU (tags of up to %d blocks, "
                 "~%d MiB)", capacity, capacity * 400 >> 20)
        return events

    def take_events(self) -> list[Any]:
        """KV-cache events of the tiers below (vLLM's ``take_events`` hook, which it calls
        with every step's output: that step has ended)."""
        self._timing.ended()
        if self._events is None:
            return []
        return self._events.take(self._seeding is not None and self._seeding.pending)

    def _start_metrics(self, port: int | None) -> Any:
        if port is None:
            return None
        from kvstrata.core.metrics import KVStrataCollector, start_metrics_server

        return start_metrics_server(port, KVStrataCollector(self.stats, self.lifecycle), self.cfg.metrics.host)

    # ------------------------------------------------------------------ binding

    def bind_gpu_block_pool(self, pool: "BlockPool") -> None:
        """Observe vLLM's evictions (needed by ``on_evict`` admission and the shutdown mirror)."""
        self._pool.bind(pool)

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._manager = manager

    # ------------------------------------------------------------------ lookups

    def on_new_request(self, request: "Request") -> None:
        self.core.open(_Req(request))
        if self._recording is not None:
            self._recording.admitted(request.request_id)

    def _state(self, request: "Request") -> _Req:
        st = self.core.requests.get(request.request_id)
        if st is None:
            st = self.core.open(_Req(request))
        assert isinstance(st, _Req)
        return st

    def _span(self, plan: LoadPlan) -> int:
        """The block positions a load covers (with groups, fewer than its entries)."""
        st = self.core.loading(plan.req_id) or self.core.requests.get(plan.req_id)
        return len(st.sources) if st is not None and st.sources else len(plan)

    def _hashes(self, st: _Req, num_blocks: int) -> list[bytes]:
        if len(st.hashes) < num_blocks:
            req = st.request
            lora = req.lora_request.lora_name if req.lora_request is not None else None
            self.hasher.extend(st.hashes, req.all_token_ids[:num_blocks * self.block_size],
                               cache_salt=req.cache_salt, lora_id=lora, mm_hashes=_mm_hashes(req))
        return st.hashes

    def _block_extra(self, req: "Request", index: int) -> bytes:
        """What the key of block ``index`` of ``req`` hashed beside its parent and tokens (as
        :meth:`_hashes` hashes it), kept in its KV-event tag."""
        lora = req.lora_request.lora_name if req.lora_request is not None else None
        return self.hasher.block_extra(index, cache_salt=req.cache_salt, lora_id=lora, mm_hashes=_mm_hashes(req))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` held below (whole blocks, never the last
        prompt token); loaded asynchronously. Pure apart from caching the hash chain."""
        if not _cacheable(request):
            return 0, False
        st = self._state(request)
        if st.fetch is not None:  # its blocks are on their way from the shared tier: held, but not local yet
            return None, False  # type: ignore[return-value]  # vLLM asks again next step
        last = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        self._hashes(st, last)
        below = self.core.held_below(st, first, last)
        if self._shared is not None and first + below < last:
            if not self._shared.ready(st, first, first + below, last):
                return None, False  # type: ignore[return-value]  # vLLM asks again next step
            below = self.core.held_below(st, first, last)
        below = self.core.worth_loading(st, first, below)
        st.matched = (first, below)
        return (below * self.block_size, True) if below else (0, False)

    def may_load_async(self, request: "Request") -> bool:
        """vLLM 0.34's ``may_load_async``, called as the request enters a waiting queue: do the
        tiers below hold its first block? Hashes one block, looks up one key. (A request whose
        prefix vLLM's GPU cache holds too is a false positive: its load, if any, is shorter.)"""
        if not _cacheable(request) or request.num_tokens <= self.block_size:
            return False
        st = self._state(request)
        self._hashes(st, 1)
        return self.core.held_below(st, 0, 1) > 0

    # ------------------------------------------------------------------ loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self.core.requests.get(request.request_id)
        if not isinstance(st, _Req) or st.matched is None:  # resumed after its load: no new lookup
            return
        (first, hits), st.matched = st.matched, None
        external = num_external_tokens // self.block_size
        assert not external or hits == external, (hits, external)
        block_ids = blocks.get_block_ids()
        if self._recording is not None:
            self._recording.resumed(st, request.num_tokens)
        if self._events is not None:
            self._events.record(request, st.hashes, 0, first + external, self._group_key(st), len(self.groups))
        st.handled = max(st.handled, first + external)  # not computed now
        on_device = self._group_blocks(st, block_ids, 0, first)
        self._pool.resident.add([b for b, _ in on_device], [k for _, k in on_device])
        self._pool.resident.used([b for b, _ in on_device])
        self.core.admit(st, first, block_ids, external, request.num_tokens, resumed=request.num_preemptions > 0)

    def _group_key(self, st: _Req) -> Any:
        return st.group_key

    def _group_blocks(self, st: _Req, block_ids: Sequence[Sequence[int]], lo: int, hi: int,
                      offered: list[tuple[int, bytes]] | None = None) -> list[tuple[int, bytes]]:
        """``(device block, key)`` of blocks ``lo..hi`` of ``st`` that kvstrata follows on the
        device, in every KV-cache group: every block of a full-attention group; of a state
        group, the blocks vLLM cached as the state at their position (not scratch states); of
        a window group, those the tiers below keep (:meth:`DriverCore.stored`) and those vLLM
        caches (it keeps them where its own hits can end), not its null blocks.
        ``offered``: gets those of them the tiers below keep once computed; the rest are
        stored only if vLLM evicts them from its cache."""
        out = []
        key, stored, cached_as = st.group_key, self.core.stored, self._pool.cached_as
        kinds = self._kinds
        vhashes = st.request.block_hashes if self._sparse else ()
        for g, ids in enumerate(block_ids):
            kind = kinds[g]
            for i in range(lo, min(hi, len(ids))):
                if ids[i] == _NULL:
                    continue
                if kind == STATE:
                    keep = follow = i < len(vhashes) and cached_as(ids[i], g, vhashes[i])
                else:
                    keep = kind == FULL or stored(st, g, i)
                    follow = keep or (i < len(vhashes) and cached_as(ids[i], g, vhashes[i]))
                if not follow:
                    continue
                out.append((ids[i], key(g, i)))
                if offered is not None and keep:
                    offered.append(out[-1])
        return out

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        st = self.core.requests.get(request.request_id)
        tiers = Counter(st.sources if st is not None else ())
        sources: dict[CacheHitSource, int] = {}
        for t, n in tiers.items():
            if t in self._sources and n > 0:
                sources[self._sources[t]] = sources.get(self._sources[t], 0) + n * self.block_size
        return sources

    # ------------------------------------------------------------------ stores

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after an in-place weight
        update: every block below the GPU is stale (its fingerprint did not change). The
        policy forgets them all; the workers delete every record of their persistent tiers
        before the next step's forward (also those the policy no longer knew of); the
        replica moves to a new generation of the shared tier's namespace, where nothing
        written before is found (:mod:`kvstrata.tiers.remote.generation`).
        Refused (False, nothing changed) while a load or a fetch is planned or in flight."""
        busy = self.core.busy()
        if busy:
            log.warning("kvstrata: cannot reset the lower tiers while %d loads are in flight", busy)
            return False
        dropped = self.policy.occupancy()
        self.policy.clear()
        if self._seeding is not None:
            self._seeding.cancel()  # what they are verifying is stale too: the workers delete it all
        self._reset_stores = self.policy.store is not None  # the workers delete every record they hold
        if self._shared is not None:
            self._shared.reset()
        tiers = self.policy.spec.tiers
        assert tiers is not None
        log.info("kvstrata: reset: forgot %s", ", ".join(f"{n} {_label(tiers, t)} blocks" for t, n in dropped.items()))
        return True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStrataMetadata:
        if self._shared is not None:
            self._shared.new_step()
        if self._seeding is not None and self._seeding.pending:
            store = self.policy.store_tier
            leaving = frozenset(self._store_evictions).union(*(p.evictions.get(store, ()) for p in self.core.planned))
            self._store_evictions += self._seeding.poll(leaving)
        if self._recording is not None:
            for req_id in scheduler_output.preempted_req_ids or ():
                st = self.core.requests.get(req_id)
                if isinstance(st, _Req):
                    self._recording.preempted(st)
        meta = KVStrataMetadata(loads=self.core.take_planned(),
                                evictions={self.policy.store_tier: self._store_evictions} if self._store_evictions else {},
                                reset=self._reset_stores,
                                shared_generation=self._shared.generation if self._shared is not None else None)
        meta.cut = self._timing.step(scheduler_output.total_num_scheduled_tokens, meta.loads, attended(scheduler_output))
        self._store_evictions, self._reset_stores = [], False
        evicted = self._pool.take_changes(meta)
        meta.zero = take_zeroing(scheduler_output)
        evicted = not_overwritten(evicted, scheduler_output)
        computed = self._computed(scheduler_output)
        meta.early_stores, meta.stores = self.core.end_step(evicted, computed, self._pool.free_window)
        meta.resident = self._pool.resident.take_delta()
        if self._recording is not None:
            self._recording.measure(self.stats)
        if self._events is not None and self._records is not None:
            meta.tags = self._events.store_tags([*meta.loads, *meta.early_stores, *meta.stores])
        return meta

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
        st = self.core.requests.get(req_id)
        if not isinstance(st, _Req) or not _cacheable(st.request):
            return
        full = min(computed, st.request.num_tokens) // self.block_size
        if full <= st.handled:
            return
        assert self._manager is not None, "bind_kv_cache_manager was not called"
        hashes = self._hashes(st, full)
        new = self._group_blocks(st, self._manager.get_block_ids(req_id), st.handled, full, out)
        if self._events is not None:
            self._events.record(st.request, hashes, st.handled, full, self._group_key(st), len(self.groups))
        self._pool.resident.add([b for b, _ in new], [k for _, k in new])
        st.handled = full

    # ------------------------------------------------------------------ completion

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        meta = meta if isinstance(meta, KVStrataWorkerMetadata) else KVStrataWorkerMetadata()
        self._note_loads(meta)
        delivered = meta.loads_done
        done = self.core.complete(
            stores=[(plan_id, ()) for plan_id, _ in self._stores.add(meta.stored)], lost=meta.lost,
            fetches=self._shared.gathered(meta.fetched) if self._shared is not None else (),
            loads=[(r, delivered[r][0] if r in delivered else None) for r in output.finished_recving or ()])
        for plan in done.stores if self._events is not None else ():  # what a worker lost is not announced
            self._events.completed(plan)
        for plan, got in done.fetches:
            self._shared.fetched(plan, got)  # type: ignore[union-attr]
            self._timing.fetched(plan, got)
        for plan, got in done.fetches if self._events is not None else ():
            self._events.completed(plan, got)
        for st, plan, loaded in done.loads:
            self._loaded(st, plan, loaded)

    def _note_loads(self, meta: KVStrataWorkerMetadata) -> None:
        """What the workers say of running loads, before they complete: what they could not
        read, those given up with reads still out, and the reads' timings."""
        for req_id, lost in meta.load_lost.items():
            st = self.core.loading(req_id)
            if st is not None:
                st.load_lost.update(lost)
        for req_id in meta.stalled:  # given up with reads still out: no sample, the tier stalled
            st = self.core.loading(req_id)
            if st is not None and st.load is not None:
                self._timing.stalled(st.load)
        for req_id, (_, read, seconds) in meta.loads_done.items():
            if req_id not in meta.stalled:
                self._timing.reported(read, seconds)
        for req_id in meta.returned:
            self._timing.returned(req_id)

    def _loaded(self, st: RequestState, plan: LoadPlan, loaded: int) -> None:
        """A load completed with ``loaded`` positions of its hit in the device pool."""
        self._timing.loaded(plan)
        if self._events is not None:
            self._events.completed(plan, loaded)
        arrived = self.core.arrived(plan, loaded)
        self._pool.resident.add(plan.block_ids[:arrived], plan.keys[:arrived])
        if loaded < len(st.sources) and isinstance(st, _Req):  # vLLM recomputes them: offered as computed then
            st.handled = min(st.handled, st.gpu_hits + loaded)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing only while a load into the request's blocks is in flight."""
        self._timing.ended()  # with the step's output (or between steps: an abort)
        st, loading = self.core.finish(request.request_id)
        if self._recording is not None and isinstance(st, _Req):
            self._recording.finished(st, self._hashes, _cacheable(st.request))
        return loading, None

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        out = {**self.core.stats(), **policy_stats(self.policy), "transfer": {},
               "load": {**self.costs.estimates(), "decisions": self.costs.decisions}}
        if self._shared is not None:
            out[self.policy.shared_tier] = self._shared.stats()
        if self._events is not None:
            out["kv_events"] = dict(self._events.counts)
        return out

    def shutdown(self) -> None:
        if self._recording is not None:
            self._recording.close(self.stats)
            self._recording = None
        if self._shared is not None:
            self._shared.close()
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()
