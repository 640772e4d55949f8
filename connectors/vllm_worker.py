"""Worker half of the vLLM connector: it owns the bytes.

* the CPU tier's slab, ``[slots, block_nbytes]`` uint8, addressed by the slots
  the scheduler half chose (the scheduler's :class:`SlotIndex` is the only
  index; the worker remembers which key each slot holds, to refuse a stale
  slot instead of loading wrong bytes);
* the SSD tier, opened here (in the worker process, never across ``fork()``);
* copies between vLLM's KV tensors and tierkv blocks (:class:`KVLayout`).

Loads run on one background thread, first in first out, so a block promoted
from SSD into a slot by one load is in place before a later load reads that
slot. Stores run in ``wait_for_save`` of the step that computed the blocks.
A block that cannot be loaded (slot overwritten, SSD miss, bad record) is
reported through ``get_block_ids_with_load_errors`` (with it every later
block of that request) and vLLM recomputes it when
``kv_load_failure_policy`` is ``"recompute"``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from tierkv.config import TierKVConfig
from tierkv.ssd_tier import SSDTier
from tierkv.transfer import copy_rows

from tierkv.connectors.kv_layout import KVLayout
from tierkv.connectors.vllm_common import (
    LoadSpec,
    StoreSpec,
    TierKVMetadata,
    TierKVWorkerMetadata,
    block_nbytes_of,
    layout_fingerprint,
    worker_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TierKVWorker", "open_ssd_tier", "shared_ssd_tier"]

log = logging.getLogger(__name__)

# SSD tiers opened by a worker of this process, by path: the scheduler half in
# the same process reads its key list from here (LMDB allows one handle per process).
_SHARED: dict[str, SSDTier] = {}

# get_finished waits at most this long for an in-flight load (an idle engine
# otherwise spins through empty steps, competing with the load for the GIL).
_POLL_S = 0.002


def _ssd_path(cfg: TierKVConfig) -> str:
    path = cfg.ssd.resolved_path()
    assert path is not None
    return os.path.realpath(path)


def shared_ssd_tier(cfg: TierKVConfig) -> SSDTier | None:
    return _SHARED.get(_ssd_path(cfg))


def open_ssd_tier(cfg: TierKVConfig, fingerprint: str, block_nbytes: int, *, shared: bool = True) -> SSDTier:
    path = _ssd_path(cfg)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tier = SSDTier(path, capacity_bytes=cfg.ssd.capacity, fingerprint=fingerprint,
                   compression=cfg.ssd.compression, level=cfg.ssd.level,
                   queue_capacity_bytes=cfg.ssd.queue_capacity, block_nbytes=block_nbytes)
    if shared:
        _SHARED[path] = tier
    return tier


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (single process without a TP group)
        return 0


def _index(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class TierKVWorker:
    def __init__(self, cfg: TierKVConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        self.cfg = cfg
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.block_nbytes = block_nbytes_of(kv_cache_config)
        self.num_slots = cfg.cpu.capacity // self.block_nbytes
        self.fingerprint = worker_fingerprint(layout_fingerprint(vllm_config), _tp_rank())
        self.layout: KVLayout | None = None
        self.slab: torch.Tensor | None = None
        self.ssd: SSDTier | None = None
        self._slot_keys: list[bytes | None] = [None] * self.num_slots
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._inflight: dict[str, tuple[LoadSpec, Future[int]]] = {}
        self._errors: set[int] = set()
        self._lost: set[bytes] = set()
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = KVLayout(kv_caches, self.num_blocks)
        if self.layout.block_nbytes != self.block_nbytes:
            raise ValueError(f"kv_caches: tensors hold {self.layout.block_nbytes} bytes per block, "
                             f"kv_cache_config says {self.block_nbytes}")
        if self.num_slots:
            pin = self.cfg.cpu.pin if self.cfg.cpu.pin is not None else torch.cuda.is_available()
            self.slab = torch.empty((self.num_slots, self.block_nbytes), dtype=torch.uint8, pin_memory=pin)
        if self.cfg.ssd.enabled:
            self.ssd = open_ssd_tier(self.cfg, self.fingerprint, self.block_nbytes)
        atexit.register(self.shutdown)
        log.info("tierkv worker: %d layer segments (%s copies), %d B/block, %d CPU slots, SSD %s",
                 len(self.layout.segments), "fused" if self.layout.fused else "per-segment",
                 self.block_nbytes, self.num_slots, self.ssd.path if self.ssd else "off")

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, meta: TierKVMetadata) -> None:
        self._spill(meta.spills)
        for spec in meta.loads:
            self._inflight[spec.req_id] = (spec, self._pool.submit(self._load, spec))

    def _spill(self, spills: list[tuple[int, bytes]]) -> None:
        """Copy evicted slots to SSD before the slots are reused."""
        for slot, key in spills:
            if self._slot_keys[slot] == key and self.ssd is not None and self.slab is not None:
                if not self.ssd.put(key, self.slab[slot]):
                    self._lose(key)
            else:
                self._lose(key)
            self._slot_keys[slot] = None

    def _load(self, spec: LoadSpec) -> int:
        """Fill the request's blocks; returns how many leading blocks were loaded."""
        assert self.layout is not None
        n = len(spec.block_ids)
        rows = torch.empty((n, self.block_nbytes), dtype=torch.uint8)
        ok = set(self._rows_from_cpu(spec, rows)) | set(self._rows_from_ssd(spec, rows))
        good = 0
        while good < n and good in ok:
            good += 1
        if good:
            dev_rows = rows[:good].to(self.layout.device, non_blocking=True)
            self.layout.scatter(_index(spec.block_ids[:good], self.layout.device), dev_rows)
        return good

    def _rows_from_cpu(self, spec: LoadSpec, rows: torch.Tensor) -> list[int]:
        idx: list[int] = []
        for i, slot in enumerate(spec.cpu_slots):
            if slot < 0:
                continue
            if self._slot_keys[slot] == spec.keys[i]:
                idx.append(i)
            else:  # the slot was overwritten or never filled
                self._lose(spec.keys[i])
        if not idx:
            return []
        assert self.slab is not None
        # row memcpys on this loader thread: torch's intra-op threads would fight the forward pass
        copy_rows(self.slab.numpy(), [spec.cpu_slots[i] for i in idx], rows.numpy(), idx)
        return idx

    def _rows_from_ssd(self, spec: LoadSpec, rows: torch.Tensor) -> list[int]:
        idx = [i for i, slot in enumerate(spec.cpu_slots) if slot < 0]
        if not idx:
            return []
        out = rows.numpy()
        hits = (self.ssd.get_into([spec.keys[i] for i in idx], [out[i] for i in idx])
                if self.ssd is not None else [False] * len(idx))  # read from disk into the rows
        ok: list[int] = []
        for i, hit in zip(idx, hits):
            dst = spec.promote_slots[i]
            if not hit:
                self._lose(spec.keys[i])
                if dst >= 0:
                    self._slot_keys[dst] = None
                continue
            ok.append(i)
            if dst >= 0 and self.slab is not None:
                self.slab.numpy()[dst] = out[i]
                self._slot_keys[dst] = spec.keys[i]
        return ok

    def _lose(self, key: bytes) -> None:
        with self._lock:
            self._lost.add(key)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._inflight:  # a short GIL-free wait instead of letting the engine spin on empty steps
            wait([fut for _, fut in self._inflight.values()], timeout=_POLL_S, return_when=FIRST_COMPLETED)
        done = {rid for rid, (_, fut) in self._inflight.items() if fut.done()}
        for rid in done:
            spec, fut = self._inflight.pop(rid)
            try:
                good = fut.result()
            except Exception:
                log.exception("tierkv: load for request %s failed; vLLM recomputes it", rid)
                good = 0
            if good < len(spec.block_ids):
                self._errors.update(spec.block_ids[good:])
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_connector_worker_meta(self) -> TierKVWorkerMetadata | None:
        with self._lock:
            if not self._lost:
                return None
            lost, self._lost = self._lost, set()
        return TierKVWorkerMetadata(lost)

    # ------------------------------------------------------------------ stores

    def wait_for_save(self, meta: TierKVMetadata) -> None:
        stores = meta.stores
        if not len(stores):
            return
        assert self.layout is not None
        rows = torch.empty((len(stores), self.block_nbytes), dtype=torch.uint8, device=self.layout.device)
        self.layout.gather(_index(stores.block_ids, self.layout.device), rows)
        rows = rows.cpu()
        self._to_slab(stores, rows)
        self._to_ssd(stores, rows)

    def _to_slab(self, stores: StoreSpec, rows: torch.Tensor) -> None:
        idx = [i for i, slot in enumerate(stores.cpu_slots) if slot >= 0]
        if not idx or self.slab is None:
            return
        slots = [stores.cpu_slots[i] for i in idx]
        copy_rows(rows.numpy(), idx, self.slab.numpy(), slots)
        for i, slot in zip(idx, slots):
            self._slot_keys[slot] = stores.keys[i]

    def _to_ssd(self, stores: StoreSpec, rows: torch.Tensor) -> None:
        for i, to_ssd in enumerate(stores.to_ssd):
            if to_ssd and (self.ssd is None or not self.ssd.put(stores.keys[i], rows[i])):
                self._lose(stores.keys[i])

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self.ssd is not None:
            _SHARED.pop(_ssd_path(self.cfg), None)
            self.ssd.close()

    def stats(self) -> dict[str, Any]:
        return {"cpu_slots": self.num_slots, "ssd": self.ssd.stats() if self.ssd else None}
