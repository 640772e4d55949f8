"""Worker half of the vLLM connector: it owns the bytes and runs the plans.

* an :class:`~tierkv.executor.Executor` over vLLM's KV tensors
  (:class:`LayoutRows`, through :class:`~tierkv.connectors.kv_layout.KVLayout`),
  the CPU slab (:class:`~tierkv.tiers.host.HostSlab`, whose slots the
  scheduler half's policy chose; each slot is tagged with its key, so a stale
  slot is refused rather than loaded) and the worker's own SSD tier, opened
  here (in the worker process, never across ``fork()``), in ``rank-<r>`` under
  ``ssd.path`` (:class:`~tierkv.connectors.vllm_common.Rank`: a tier directory
  has one owner, and each tensor-parallel shard and pipeline stage holds
  other bytes of the same blocks);
* a mirror of the hashed GPU blocks (from each step's
  :class:`~tierkv.connectors.vllm_common.ResidentDelta`), so that
  :meth:`TierKVWorker.shutdown` can store the hot set the SSD tier lacks.

Per step, plans run in the order the policy prepared them: ``handle_preemptions``
(which vLLM calls before the forward, unlike ``start_load_kv``, which it calls
after the forward when no load is synchronous) applies SSD deletions, the
loads' spills and evictions, and stores the blocks vLLM evicted in this step,
whose bytes the forward is about to rewrite; ``start_load_kv`` queues the
loads' copies on one loader thread (first in, first out: a load may read a
slot an earlier load of the step promotes into); ``wait_for_save`` runs the
stores of computed and paged-out blocks. A block that cannot be loaded is
reported through ``get_block_ids_with_load_errors`` (with every later block
of that request) and vLLM recomputes it when ``kv_load_failure_policy`` is
``"recompute"``. Threads: vLLM's worker thread owns everything here except
the executor calls the loader thread makes (see :mod:`tierkv.executor`);
``_lock`` guards the reports collected for the scheduler half.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch

from tierkv.config import TierKVConfig
from tierkv.executor import Executor, LoadResult, host_rows
from tierkv.policy import SHUTDOWN, LoadPlan, StorePlan
from tierkv.policy.manager import select_for_shutdown
from tierkv.tiers.host import HostSlab
from tierkv.errors import ConfigError
from tierkv.identity import Fingerprint
from tierkv.tiers.ssd import SSDTier
from tierkv.tiers.ssd.tier import read_keys

from tierkv.connectors.kv_layout import KVLayout
from tierkv.connectors.vllm_common import (
    Rank,
    ResidentDelta,
    TierKVMetadata,
    TierKVWorkerMetadata,
    block_nbytes_of,
    engine_ranks,
    policy_spec,
    ssd_root,
    vllm_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TierKVWorker", "LayoutRows", "open_ssd_tier", "read_ssd_keys"]

log = logging.getLogger(__name__)

# SSD tiers opened by a worker of this process, by path: the scheduler half in
# the same process reads its key list from here (LMDB allows one handle per process).
_SHARED: dict[str, SSDTier] = {}

# get_finished waits at most this long for an in-flight load (an idle engine
# otherwise spins through empty steps, competing with the load for the GIL).
_POLL_S = 0.002


def open_ssd_tier(cfg: TierKVConfig, fingerprint: Fingerprint, rank: Rank, block_nbytes: int) -> SSDTier:
    """The SSD tier of one worker, in its own directory under ``ssd.path``."""
    root = ssd_root(cfg)
    if rank.index == 0 and (root / "data.mdb").exists():
        log.warning("tierkv: %s holds an SSD tier of the layout before per-rank directories; "
                    "it is no longer read (each worker uses %s/rank-<r>): delete its files to "
                    "free the space", root, root)
    path = rank.ssd_dir(root)
    tier = SSDTier(path, capacity_bytes=cfg.ssd.capacity, fingerprint=rank.tier_id(fingerprint),
                   compression=cfg.ssd.compression, level=cfg.ssd.level,
                   queue_capacity_bytes=cfg.ssd.queue_capacity, block_nbytes=block_nbytes)
    _SHARED[str(path)] = tier
    return tier


def read_ssd_keys(cfg: TierKVConfig, fingerprint: Fingerprint, ranks: Sequence[Rank]
                  ) -> tuple[list[bytes], list[bytes]]:
    """The blocks on SSD at start-up: ``(whole, partial)``. ``whole``: keys every rank's
    tier holds, least recently used first (by rank 0); ``partial``: keys only some hold
    (a crash between the ranks' writes), to delete. Read once, from the tiers the
    workers own: in this process through the worker's tier, otherwise beside it
    (read-only, in a child process). A tier that cannot be read yields none (misses
    only) and deletes nothing."""
    root = ssd_root(cfg)

    def keys_of(rank: Rank) -> list[bytes]:
        path = rank.ssd_dir(root)
        tier = _SHARED.get(str(path))
        return list(tier.keys()) if tier is not None else read_keys(path, rank.tier_id(fingerprint))

    try:
        with ThreadPoolExecutor(min(len(ranks), 8), thread_name_prefix="tierkv-keys") as pool:
            per_rank = list(pool.map(keys_of, ranks))  # the ranks' reader processes at once
    except (OSError, ConfigError) as exc:  # a broken tier costs hits, never the engine
        log.warning("tierkv: cannot read the SSD tiers under %s (%s); starting with none of "
                    "their blocks", root, exc)
        return [], []
    common = set(per_rank[0]).intersection(*per_rank[1:])
    whole = [k for k in per_rank[0] if k in common]
    partial = list(dict.fromkeys(k for keys in per_rank for k in keys if k not in common))
    return whole, partial


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


class LayoutRows:
    """:class:`~tierkv.executor.DeviceRows` over vLLM's KV tensors (row copies on CPU)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_nbytes = layout.block_nbytes

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.layout.device)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        rows = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8, device=self.layout.device)
        self.layout.gather(self._index(block_ids), rows)
        return rows.cpu().numpy()

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        src = torch.from_numpy(np.ascontiguousarray(rows)).to(self.layout.device, non_blocking=True)
        self.layout.scatter(self._index(block_ids), src)
        return None

    def staging(self, n: int) -> np.ndarray:
        return host_rows(n, self.block_nbytes, pinned=torch.device(self.layout.device).type == "cuda")


class TierKVWorker:
    def __init__(self, cfg: TierKVConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.block_nbytes = block_nbytes_of(kv_cache_config)
        self.spec = policy_spec(cfg, kv_cache_config)
        self.executor: Executor | None = None
        self._mirror: OrderedDict[int, bytes] = OrderedDict()  # hashed GPU blocks, least recently used first
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._inflight: dict[str, tuple[LoadPlan, Future[LoadResult]]] = {}
        self._errors: set[int] = set()
        self._report = TierKVWorkerMetadata()
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVLayout(kv_caches, self.num_blocks)
        if layout.block_nbytes != self.block_nbytes:
            raise ValueError(f"kv_caches: tensors hold {layout.block_nbytes} bytes per block, "
                             f"kv_cache_config says {self.block_nbytes}")
        slab = None
        if self.spec.cpu_slots:
            pin = self.cfg.cpu.pin if self.cfg.cpu.pin is not None else torch.cuda.is_available()
            slab = HostSlab(self.spec.cpu_slots, self.block_nbytes, pin_memory=pin)
        ssd = None
        if self.spec.ssd_slots:
            fp = vllm_fingerprint(self.cfg, self.vllm_config, self.kv_cache_config)
            ssd = open_ssd_tier(self.cfg, fp, _this_rank(self.vllm_config), self.block_nbytes)
        self.executor = Executor(LayoutRows(layout), slab, ssd)
        atexit.register(self.shutdown)
        log.info("tierkv worker: %d layer segments (%s copies), %d B/block, %d CPU slots, SSD %s",
                 len(layout.segments), "fused" if layout.fused else "per-segment",
                 self.block_nbytes, self.spec.cpu_slots, ssd.path if ssd else "off")

    @property
    def ssd(self) -> SSDTier | None:
        return self.executor.ssd if self.executor is not None else None

    # ------------------------------------------------------------------ loads

    def before_forward(self, meta: TierKVMetadata) -> None:
        """Store the blocks vLLM evicted in this step before the forward rewrites them
        (and before any load of this step is queued)."""
        ex = self.executor
        assert ex is not None, "register_kv_caches was not called"
        self._mirror_apply(meta.resident)
        if meta.reset and ex.ssd is not None:
            ex.evict([], list(ex.ssd.keys()))
        if meta.ssd_evictions:
            ex.evict([], meta.ssd_evictions)
        for plan in meta.loads:  # plans prepared before the stores: their evictions go first
            self._lose(ex.evict(plan.spills, plan.ssd_evictions))
        self._run_stores(meta.early_stores)
        meta.prepared = True

    def start_load_kv(self, meta: TierKVMetadata) -> None:
        ex = self.executor
        assert ex is not None, "register_kv_caches was not called"
        if not meta.prepared:  # an engine that does not call handle_preemptions
            self.before_forward(meta)
        for plan in meta.loads:  # the copies, in order on one thread (a load may read a slot an earlier one fills)
            self._inflight[plan.req_id] = (plan, self._loader.submit(ex.load, plan, evict=False))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._inflight:  # a short GIL-free wait instead of letting the engine spin on empty steps
            wait([fut for _, fut in self._inflight.values()], timeout=_POLL_S, return_when=FIRST_COMPLETED)
        done = {rid for rid, (_, fut) in self._inflight.items() if fut.done()}
        for rid in done:
            plan, fut = self._inflight.pop(rid)
            try:
                result = fut.result()
            except Exception:
                log.exception("tierkv: load for request %s failed; vLLM recomputes it", rid)
                result = LoadResult(0, [(t, k) for t, k in zip(plan.tiers(), plan.keys) if t])
            if result.loaded < len(plan):
                self._errors.update(plan.block_ids[result.loaded:])
            if result.lost:
                with self._lock:
                    self._report.load_lost.setdefault(rid, set()).update(result.lost)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_connector_worker_meta(self) -> TierKVWorkerMetadata | None:
        if self.executor is not None:
            self._lose(self.executor.take_lost())
        with self._lock:
            report, self._report = self._report, TierKVWorkerMetadata()
        return report if (report.stored or report.lost or report.load_lost) else None

    # ------------------------------------------------------------------ stores

    def wait_for_save(self, meta: TierKVMetadata) -> None:
        self._run_stores(meta.stores)

    def _run_stores(self, plans: list[StorePlan]) -> None:
        ex = self.executor
        assert ex is not None
        for plan in plans:
            self._lose(ex.store(plan))
            with self._lock:
                self._report.stored[plan.plan_id] += 1

    def _lose(self, lost: list[tuple[str, bytes]]) -> None:
        if lost:
            with self._lock:
                self._report.lost.update(lost)

    # ------------------------------------------------------------------ hot set

    def _mirror_apply(self, delta: ResidentDelta) -> None:
        if delta and self.spec.ssd_slots:
            delta.apply(self._mirror)

    def _mirror_mru(self) -> Iterator[tuple[int, bytes]]:
        return reversed(self._mirror.items())

    def persist_hot_set(self) -> int:
        """Store the hashed GPU blocks the SSD tier lacks, most recently used first, as many
        as the tier holds (the policy's shutdown rule); returns how many were stored."""
        ex, ssd = self.executor, self.ssd
        if ex is None or ssd is None or not self._mirror:
            return 0
        chosen, held = select_for_shutdown(self._mirror_mru(), ssd.__contains__, self.spec.ssd_slots)
        plan = StorePlan(0, SHUTDOWN, ssd_touches=held)
        for block_id, key in chosen:
            plan.add(block_id, key, -1, True)
        lost = ex.store(plan)
        return len(plan) - len(lost)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loader.shutdown(wait=True)
        try:
            stored = self.persist_hot_set()
            if stored:
                log.info("tierkv worker: stored %d GPU-resident blocks to the SSD tier at shutdown", stored)
        except Exception:
            log.exception("tierkv worker: storing the hot set at shutdown failed")
        ssd = self.ssd
        if ssd is not None:
            _SHARED.pop(str(ssd.path), None)
            ssd.close()

    def stats(self) -> dict[str, Any]:
        return {"cpu_slots": self.spec.cpu_slots, "executor": self.executor.stats() if self.executor else None,
                "ssd": self.ssd.stats() if self.ssd else None}

