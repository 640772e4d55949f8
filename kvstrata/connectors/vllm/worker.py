"""Worker half of the vLLM connector: it owns the bytes and runs the plans.

* a :class:`~kvstrata.dataplane.copier.Copier` over vLLM's KV tensors (:class:`LayoutRows`,
  through :class:`~kvstrata.connectors.kit.kv_layout.KVLayout`; on CUDA kvstrata's
  gather/scatter kernels on streams of its own, on the CPU backend row
  memcpys that run when submitted), the CPU slab
  (:class:`~kvstrata.tiers.host.HostSlab`, whose slots the scheduler half's
  policy chose; each slot is tagged with its key, so a stale slot is refused
  rather than loaded) and the worker's own SSD tier, opened here (in the
  worker process, never across ``fork()``), in ``rank-<r>`` under
  ``ssd.path`` (:class:`~kvstrata.connectors.vllm.common.Rank`: a tier
  directory has one owner, and each tensor-parallel shard and pipeline stage
  holds other bytes of the same blocks);
* a mirror of the hashed GPU blocks (from each step's
  :class:`~kvstrata.connectors.vllm.common.ResidentDelta`), so that
  :meth:`KVStrataWorker.shutdown` can store the hot set the SSD tier lacks.

Per step, plans are queued in the order the policy prepared them, and nothing
here waits for a copy: ``handle_preemptions`` (which vLLM calls before the
forward) queues SSD deletions, the loads' spills and evictions and the
stores of blocks vLLM evicted in this step (gathered before the forward
rewrites them: the compute stream waits for gathers out of every block vLLM
handed out again, ``KVStrataMetadata.reused``), and records where the compute
stream stands; ``start_load_kv`` queues the loads after that point;
``wait_for_save`` records the end of the forward and queues the stores of
computed and paged-out blocks after it. ``get_finished`` and
``build_connector_worker_meta`` poll: finished loads go to vLLM, finished
stores and lost blocks to the scheduler half, whose policy keeps every slot a
plan uses pinned until then (see :mod:`kvstrata.dataplane.copier` for the ordering rules).
A block that cannot be loaded is reported through
``get_block_ids_with_load_errors`` (with every later block of that request)
and vLLM recomputes it when ``kv_load_failure_policy`` is ``"recompute"``;
with several KV-cache groups the request's load fails whole
(``failed_recving``), as block ids do not name a group.
Threads: vLLM's worker thread owns everything here; the copier's I/O thread
runs the SSD work.
"""

from __future__ import annotations

import atexit
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator

import torch

from kvstrata.config.schema import KVStrataConfig
from kvstrata.dataplane.copier import Copier, Finished
from kvstrata.core.deployment import executor_over, open_backends
from kvstrata.dataplane.executor import Executor
from kvstrata.policy import SHUTDOWN, FetchPlan, LoadPlan, StorePlan
from kvstrata.policy.hot_set import select_for_shutdown
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.tiers.remote.metrics import DIRECTIONS as SHARED_DIRECTIONS, OUTCOMES as SHARED_OUTCOMES
from kvstrata.system.streams import Event, streams_for
from kvstrata.policy.tiers import LOWER, PERSISTENT

from kvstrata.connectors.kit.kv_layout import KVLayout, LayoutRows
from kvstrata.identity.ranks import Rank
from kvstrata.connectors.vllm.common import (
    ResidentDelta,
    KVStrataMetadata,
    KVStrataWorkerMetadata,
    block_nbytes_of,
    engine_ranks,
    kv_groups,
    policy_spec,
    vllm_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KVStrataWorker"]

log = logging.getLogger(__name__)

# get_finished waits at most this long for the SSD reads of an in-flight load (an
# idle engine otherwise spins through empty steps, competing with them for the GIL).
_POLL_S = 0.002

# What KVStrataWorker.counters() reports (all monotonic since start), and for each local tier of
# another kind its TIER_COUNTERS (KEYED_COUNTERS too for a key-addressed one) suffixed with its name.
TIER_COUNTERS = ("blocks_loaded", "blocks_stored", "load_failures")
KEYED_COUNTERS = ("store_failures",)
WORKER_COUNTERS = ("blocks_loaded_cpu", "blocks_loaded_ssd", "blocks_stored_cpu", "blocks_stored_ssd",
                   "load_failures_cpu", "load_failures_ssd", "store_failures_ssd", "spill_failures",
                   "stores_dropped", "corrupt_blocks", "bytes_d2h", "bytes_h2d", "seconds_d2h", "seconds_h2d",
                   "bytes_ssd_read", "seconds_ssd_read", "blocks_cut_ssd",
                   *(f"remote_{o}" for o in SHARED_OUTCOMES), *(f"remote_bytes_{d}" for d in SHARED_DIRECTIONS))


def _this_rank(vllm_config: "VllmConfig") -> Rank:
    """This worker's place (tensor-parallel rank and pipeline stage from vLLM's groups;
    rank 0 of each when they are not initialised, as in a single process)."""
    first = engine_ranks(vllm_config)[0]
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp, pp = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # not initialised (a single process without parallel groups)
        tp, pp = 0, 0
    return Rank(tp, pp, first.dp, first.tp_size, first.pp_size)


# KVCacheLayout names (vllm/v1/kv_cache_layout.py): KVLayout reads every one from the strides.
SUPPORTED_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def _backends(vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor]) -> str:
    """The attention backends of these layers, by name, as vLLM's forward context has them."""
    names: set[str] = set()
    try:
        context = vllm_config.compilation_config.static_forward_context
        for layer in kv_caches:
            backend = getattr(context.get(layer), "attn_backend", None)
            if backend is not None:
                names.add(backend.get_name())
    except Exception:  # a config without layers (tests that build one by hand)
        pass
    return "/".join(sorted(names)) if names else "this engine"


def _drop_kernel_tables() -> None:
    """Forget the CUDA copy kernels' cached device tables (pointers into the KV tensors)."""
    import sys

    module = sys.modules.get("kvstrata.kernels.cuda_block_ops")
    if module is not None:
        module.drop_tables()


class KVStrataWorker:
    def __init__(self, cfg: KVStrataConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.block_nbytes = block_nbytes_of(kv_cache_config)
        self.spec = policy_spec(cfg, kv_cache_config)
        self.executor: Executor | None = None
        self.copier: Copier | None = None
        self._mirror: OrderedDict[int, bytes] = OrderedDict()  # hashed GPU blocks, least recently used first
        self._inflight: dict[str, LoadPlan] = {}
        self._finished: set[str] = set()
        self._before_forward: Event | None = None  # the compute stream once this step's blocks were fenced
        self._errors: set[int] = set()
        self._failed: set[str] = set()  # with groups: requests whose load failed (vLLM recomputes them)
        self._grouped = not kv_groups(kv_cache_config, int(vllm_config.cache_config.block_size)).plain
        self._report = KVStrataWorkerMetadata()
        self._closed = False
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self.fingerprint: Fingerprint | None = None
        self._reset_tiers = False  # set when re-registered tensors are of another kind
        self._generation: bytes | None = None  # the shared tier's generation, as last told by the scheduler

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors. Called once at start-up; called again (new tensors after
        vLLM discarded its KV cache), the tiers keep their blocks when the fingerprint still
        matches, and are reset (logged) when it does not."""
        fingerprint = vllm_fingerprint(self.cfg, self.vllm_config, self.kv_cache_config)
        first = self.executor is None
        if not first:
            self.unregister_kv_caches()
            if fingerprint != self.fingerprint:
                log.warning("kvstrata worker: the new KV tensors are of another kind (%s, before: %s): the CPU "
                            "and SSD tiers are reset", fingerprint.describe(), self.fingerprint.describe())
                self._reset_tiers = True
        self.fingerprint = fingerprint
        self._kv_caches = dict(kv_caches)
        self._attach()
        if first:
            atexit.register(self.shutdown)

    def _attach(self) -> None:
        """Views, row tables and streams over the registered tensors (again after a wake-up)."""
        layout = self._layout_of(self._kv_caches)
        rows = LayoutRows(layout)
        if self.executor is None:
            # a shared tier takes its scheduler half's namespace generation (meta.shared_generation)
            options = {tier.name: {"own_generation": False} for tier in self.spec.tiers.shared}
            backends = open_backends(self.cfg, self.spec, self.fingerprint, self.block_nbytes,
                                     rank=_this_rank(self.vllm_config), options=options)
            self.executor = executor_over(rows, backends)
        self.executor.device = rows
        self.copier = Copier(self.executor, rows, streams_for(layout.device),  # staging as the SSD tier queues
                             staging_bytes=self.cfg.ssd.queue_capacity)
        if self._reset_tiers:
            self._reset_tiers = False
            self.copier.discard_all()
            if self.executor.slab is not None:
                self.executor.slab.forget_all()
        log.info("kvstrata worker: %d runs per block (%s copies), layout %s, %d B/block, %d CPU slots, %s",
                 len(layout.segments), "fused" if layout.fused else "per-run", self.fingerprint.kv_layout or "?",
                 self.block_nbytes, self.spec.slab_slots, self._describe_stores())

    def _describe_stores(self) -> str:
        """``<label> <directory>`` of each key-addressed tier (``SSD /data/rank-0``), for the log."""
        assert self.executor is not None and self.spec.tiers is not None
        described = [f"{self.spec.tiers[name].label or name} {getattr(backend, 'path', 'on')}"
                     for name, backend in self.executor.stores.items()]
        return ", ".join(described) or "no store tier"

    def _layout_of(self, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        """The tensors as whole blocks; one line naming the layer, the layout and the
        backend when kvstrata cannot move their bytes exactly."""
        layout_name = self.fingerprint.kv_layout or "unresolved"
        try:
            layout = KVLayout(kv_caches, self.num_blocks)
        except ValueError as exc:
            raise ConfigError(f"kvstrata: cannot move the KV cache of {_backends(self.vllm_config, kv_caches)} "
                              f"in layout {layout_name}: {exc} (kvstrata moves per-layer attention caches in "
                              f"every layout vLLM resolves: {', '.join(SUPPORTED_LAYOUTS)})") from None
        if layout.block_nbytes != self.block_nbytes:
            raise ConfigError(f"kvstrata: kv_caches ({_backends(self.vllm_config, kv_caches)}, layout {layout_name}) "
                              f"hold {layout.block_nbytes} bytes per block, kv_cache_config says "
                              f"{self.block_nbytes}")
        return layout

    # ------------------------------------------------------------------ sleep mode (vLLM >= 0.33)

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV memory (sleep, discard): every copy in flight runs
        to its end and is collected, then every view, row table, stream and cached kernel
        table over the tensors is dropped. The tiers below keep their blocks. The GPU
        blocks' contents are gone after a sleep, so the hot-set mirror is cleared: a
        shutdown must not store them. Idempotent."""
        if self.copier is None:
            return
        self._collect(self.copier.drain())
        if self.executor is not None:
            self._lose(self.executor.take_lost())
            self.executor.device = None
        self.copier.close()
        self.copier = None
        self._before_forward = None
        self._mirror.clear()
        _drop_kernel_tables()

    def restore_kv_caches(self) -> None:
        """After a wake-up: the same tensors again (vLLM maps their memory back at the same
        addresses); views, row tables and streams are rebuilt. Idempotent."""
        if self.copier is None and self._kv_caches is not None and not self._closed:
            self._attach()

    @property
    def store(self) -> Any:
        """The persistent tier's backend: the last key-addressed one (the SSD tier; None: none)."""
        return self.executor.persistent if self.executor is not None else None

    def _persistent(self) -> tuple[str, Any] | None:
        """The persistent tier (the last key-addressed one) and its backend, None when none."""
        stores = self.executor.stores if self.executor is not None else {}
        name = next(reversed(stores), None)
        return (name, stores[name]) if name is not None else None

    # ------------------------------------------------------------------ loads

    def _copier(self) -> Copier:
        assert self.copier is not None, "no KV tensors registered (register_kv_caches, or asleep)"
        return self.copier

    def before_forward(self, meta: KVStrataMetadata) -> None:
        """Queue the SSD deletions, the loads' evictions and the stores of the blocks vLLM
        evicted in this step, then fence the blocks it handed out again: this step's
        forward (and its loads) rewrite them only after the gathers out of them ran.
        Then zero the blocks vLLM asked to zero (``meta.zero``), on the compute stream."""
        copier = self._copier()
        self._mirror_apply(meta.resident)
        if meta.tags and self.executor is not None:
            self.executor.add_tags(meta.tags)
        if meta.reset:
            copier.discard_all()
        if meta.shared_generation != self._generation:  # after the puts queued before, ahead of this step's fetches
            self._generation = meta.shared_generation
            copier.use_shared_generation(meta.shared_generation)
        if meta.evictions:
            copier.evict([], meta.evictions)
        for plan in meta.loads:  # plans prepared before the stores: their evictions go first
            if isinstance(plan, FetchPlan):
                copier.fetch(plan)  # into CPU slots now; loads of them come in a later step
            else:
                copier.evict(plan.spills, plan.evictions)
        self._queue_stores(meta.early_stores)
        copier.fence(meta.reused if meta.reused is not None else copier.reading())
        if meta.zero:  # vLLM's zeroing, on the compute stream after the fence above
            copier.rows.zero(meta.zero)
        self._before_forward = copier.streams.current().record()
        meta.prepared = True

    def start_load_kv(self, meta: KVStrataMetadata) -> None:
        copier = self._copier()
        if not meta.prepared:  # an engine that does not call handle_preemptions
            self.before_forward(meta)
        for plan in meta.loads:  # after the fence, not after this step's forward
            if isinstance(plan, LoadPlan):
                copier.load(plan, self._before_forward)
                self._inflight[plan.req_id] = plan
        for req_id in meta.cut:
            copier.cut(req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if (self._inflight or self._fetching()) and self.copier is not None:
            self.copier.wait_io(_POLL_S)
        self._poll()
        done, self._finished = self._finished, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """With KV-cache groups: requests whose load did not arrive whole since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def build_connector_worker_meta(self) -> KVStrataWorkerMetadata | None:
        self._poll()
        if self.executor is not None:
            self._lose(self.executor.take_lost())
        report, self._report = self._report, KVStrataWorkerMetadata()
        return report if (report.stored or report.lost or report.load_lost or report.fetched
                          or report.loads_done or report.returned) else None

    def _fetching(self) -> bool:
        return self.copier is not None and self.copier.fetching

    def _poll(self) -> None:
        """Collect what the copier finished: loads for vLLM, stores and losses for the
        scheduler half. Never waits for a copy."""
        if self.copier is None:
            return
        self._collect(self.copier.poll())

    def _collect(self, done: Finished) -> None:
        for plan_id in done.stored:
            self._report.stored[plan_id] += 1
        for plan_id, got in done.fetched.items():
            self._report.fetched.setdefault(plan_id, []).append(got)
        self._lose(done.lost)
        for req_id, result in done.loads.items():
            plan = self._inflight.pop(req_id)
            if result.loaded < len(plan) and self._grouped:
                self._failed.add(req_id)
            elif result.loaded < len(plan):
                self._errors.update(plan.block_ids[result.loaded:])
            if result.lost:
                self._report.load_lost.setdefault(req_id, set()).update(result.lost)
            self._report.loads_done[req_id] = (result.loaded, result.read, result.seconds)
            if result.stalled:
                self._report.stalled.add(req_id)
            self._finished.add(req_id)
        self._report.returned.update(done.returned)

    # ------------------------------------------------------------------ stores

    def wait_for_save(self, meta: KVStrataMetadata) -> None:
        """Queue this step's stores after its forward; returns without waiting for them."""
        self._queue_stores(meta.stores)

    def _queue_stores(self, plans: list[StorePlan]) -> None:
        if not plans:
            return
        copier = self._copier()
        after = copier.streams.current().record()  # the blocks' KV is written once the compute stream gets here
        for plan in plans:
            copier.store(plan, after)

    def _lose(self, lost: list[tuple[str, bytes]]) -> None:
        if lost:
            self._report.lost.update(lost)

    # ------------------------------------------------------------------ hot set

    def _mirror_apply(self, delta: ResidentDelta) -> None:
        if delta and self.spec.store_slots:
            delta.apply(self._mirror)

    def _mirror_mru(self) -> Iterator[tuple[int, bytes]]:
        return reversed(self._mirror.items())

    def persist_hot_set(self) -> int:
        """Store the hashed GPU blocks the persistent tier (the SSD tier) lacks, most recently
        used first, as many as the tier holds (the policy's shutdown rule); returns how many
        were stored."""
        ex, persistent = self.executor, self._persistent()
        if ex is None or persistent is None or not self._mirror:
            return 0
        tier, backend = persistent
        holds = getattr(backend, "__contains__", None) or set(backend.keys()).__contains__
        chosen, held = select_for_shutdown(self._mirror_mru(), holds, self.spec.store_slots)
        plan = StorePlan(0, SHUTDOWN, touches={tier: list(held)} if held else {})
        for block_id, key in chosen:
            plan.add(block_id, key, -1, (tier,))
        lost = ex.store(plan)
        return len(plan) - len(lost)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.copier is not None:
            self.copier.drain()  # shutdown may wait; stores in flight finish first
            self.copier.close()
        try:
            persistent, stored = self._persistent(), self.persist_hot_set()
            if stored and persistent is not None:
                log.info("kvstrata worker: stored %d GPU-resident blocks to the %s tier at shutdown", stored,
                         persistent[0])
        except Exception:
            log.exception("kvstrata worker: storing the hot set at shutdown failed")
        for backend in (self.executor.stores.values() if self.executor is not None else ()):
            backend.close()
        for backend in (self.executor.shared.values() if self.executor is not None else ()):
            backend.close()
        if self.executor is not None and self.executor.slab is not None:
            self.executor.slab.close()  # every copy out of it ran (drained above)

    def counters(self) -> dict[str, float]:
        """Monotonic counters since start (for vLLM's connector stats): blocks moved per
        tier and direction, failures, dropped stores, corrupt SSD records, the shared tier's
        operations, and bytes and seconds of the device copies per direction (``d2h``: stores,
        ``h2d``: loads)."""
        out: dict[str, float] = dict.fromkeys((*WORKER_COUNTERS, *self._tier_counters()), 0)
        if self.executor is not None:
            for name, value in self.executor.stats().items():
                if name in out:
                    out[name] = value
        # corrupt_blocks counts the built-in persistent tier's (the label WORKER_SERIES gives it)
        persistent = self.executor.stores.get(PERSISTENT[0]) if self.executor is not None else None
        if persistent is not None:
            out["corrupt_blocks"] = persistent.counts().get("corrupt_deleted", 0)
        shared = self.executor.first_shared if self.executor is not None else None
        if shared is not None:
            st = shared.stats()
            for outcome in SHARED_OUTCOMES:
                out[f"remote_{outcome}"] = st.get(outcome, 0)
            for direction in SHARED_DIRECTIONS:
                out[f"remote_bytes_{direction}"] = st.get(f"bytes_{direction}", 0)
        return out

    def _tier_counters(self) -> tuple[str, ...]:
        """The per-tier counters of this worker's local tiers of kinds other than the built-in
        ones (``blocks_loaded_<tier>``...)."""
        ex = self.executor
        if ex is None:
            return ()
        out: list[str] = []
        for tier in (ex.slab_tier, *ex.stores):
            if tier and tier not in LOWER:
                out += [f"{c}_{tier}" for c in (*TIER_COUNTERS, *(KEYED_COUNTERS if tier in ex.stores else ()))]
        return tuple(out)

    def stats(self) -> dict[str, Any]:
        """The slab's size, the executor's counters and each key-addressed and shared tier's own
        (under its name)."""
        ex = self.executor
        out: dict[str, Any] = {"cpu_slots": self.spec.slab_slots, "executor": ex.stats() if ex else None}
        for tier, backend in (*ex.stores.items(), *ex.shared.items()) if ex is not None else ():
            if callable(getattr(backend, "stats", None)):
                out[tier] = backend.stats()
        return out

