"""Scheduler half of the vLLM connector: the index, never any I/O.

It knows which block hashes live in the CPU tier (a :class:`SlotIndex`, slot
bookkeeping without bytes) and on SSD (a set, read once from the tier at
start-up and then kept up to date from its own decisions and the keys the
workers report lost). Every answer comes from memory.

Lifetime rules:

* a CPU slot read or filled by a load is pinned from ``update_state_after_alloc``
  until the worker reports the request in ``finished_recving``; a pinned slot
  is never handed to another block;
* a request whose load was handed to the worker is not freed before that load
  finished (``request_finished`` returns True and vLLM frees its blocks on
  ``finished_recving``);
* stores copy out of vLLM blocks in ``wait_for_save`` of the step that computed
  them, and the worker runs steps in order, so a freed block can never be
  overwritten before its store finished: no delay is needed for stores.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.config import TierKVConfig
from tierkv.cpu_tier import SlotIndex
from tierkv.hashing import BlockHasher

from tierkv.connectors.vllm_common import (
    LoadSpec,
    StoreSpec,
    TierKVMetadata,
    TierKVWorkerMetadata,
    block_nbytes_of,
    layout_fingerprint,
    namespace_of,
    worker_fingerprint,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TierKVScheduler"]

log = logging.getLogger(__name__)


class _Req:
    """Per-request state: the request object, its hash chain so far, and how
    many of its leading blocks are already known to be in a tier."""

    __slots__ = ("request", "hashes", "handled")

    def __init__(self, request: "Request") -> None:
        self.request = request
        self.hashes: list[bytes] = []
        self.handled = 0


def _cacheable(request: "Request") -> bool:
    return request.prompt_embeds is None if hasattr(request, "prompt_embeds") else True


def _mm_hashes(request: "Request") -> list[tuple[str, int, int]] | None:
    feats = getattr(request, "mm_features", None) or ()
    out = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in feats]
    return out or None


class TierKVScheduler:
    def __init__(self, cfg: TierKVConfig, vllm_config: "VllmConfig",
                 kv_cache_config: "KVCacheConfig") -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        fingerprint = layout_fingerprint(vllm_config)
        self.hasher = BlockHasher(self.block_size, cfg.hash, namespace_of(fingerprint))
        self.block_nbytes = block_nbytes_of(kv_cache_config)
        num_slots = cfg.cpu.capacity // self.block_nbytes
        self.cpu: SlotIndex | None = SlotIndex(num_slots) if num_slots else None
        self.ssd_enabled = cfg.ssd.enabled
        self.write_through = cfg.spill.write_through
        self.ssd_keys: set[bytes] = (_read_ssd_keys(cfg, worker_fingerprint(fingerprint, 0),
                                                    self.block_nbytes)
                                     if self.ssd_enabled else set())
        self._reqs: dict[str, _Req] = {}
        self._matched: dict[str, tuple[int, int]] = {}     # req -> (first block, blocks) of the last answer
        self._sources: dict[str, dict[CacheHitSource, int]] = {}
        self._loads: list[LoadSpec] = []                    # for the next metadata
        self._spills: list[tuple[int, bytes]] = []
        self._pins: dict[str, list[bytes]] = {}             # req -> keys pinned until its load finished
        self._doomed: set[bytes] = set()                    # lost keys still pinned
        self._manager: KVCacheManager | None = None
        self._stores = StoreSpec()                          # being planned for this step
        self._store_pos: dict[bytes, int] = {}              # key -> its entry in self._stores
        log.info("tierkv scheduler: block %d bytes, %d CPU slots, %d blocks on SSD",
                 self.block_nbytes, num_slots, len(self.ssd_keys))

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._manager = manager

    # ------------------------------------------------------------------ lookups

    def on_new_request(self, request: "Request") -> None:
        self._reqs[request.request_id] = _Req(request)

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

    def _present(self, key: bytes) -> bool:
        return (self.cpu is not None and key in self.cpu) or key in self.ssd_keys

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the tiers hold (whole blocks,
        never the last prompt token); loaded asynchronously. Side-effect free
        apart from caching the request's hash chain."""
        if not _cacheable(request):
            return 0, False
        st = self._state(request)
        last = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        hashes = self._hashes(st, last)
        hits = 0
        for key in hashes[first:last]:
            if not self._present(key):
                break
            hits += 1
        self._matched[request.request_id] = (first, hits)
        return (hits * self.block_size, True) if hits else (0, False)

    # ------------------------------------------------------------------ loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        req_id = request.request_id
        first, hits = self._matched.pop(req_id)
        assert hits * self.block_size == num_external_tokens, (hits, num_external_tokens)
        block_ids = blocks.get_block_ids()[0][first:first + hits]
        keys = self._reqs[req_id].hashes[first:first + hits]
        # Pin the CPU hits first so that placing the SSD hits cannot evict them.
        cpu_slots = [self._pin_if_cached(key) for key in keys]
        promote: list[int] = []
        for key, src in zip(keys, cpu_slots):
            dst = -1 if src >= 0 else self._place(key)
            if dst >= 0:
                self.cpu.pin(key)  # type: ignore[union-attr]
            promote.append(dst)
        pinned = [key for key, src, dst in zip(keys, cpu_slots, promote) if src >= 0 or dst >= 0]
        spec = LoadSpec(req_id, list(block_ids), list(keys), cpu_slots, promote)
        on_cpu = sum(slot >= 0 for slot in cpu_slots)
        self._loads.append(spec)
        self._pins[req_id] = pinned
        bs = self.block_size
        self._sources[req_id] = {k: v for k, v in ((CacheHitSource.HOST, on_cpu * bs),
                                                   (CacheHitSource.DISK, (hits - on_cpu) * bs)) if v}

    def _pin_if_cached(self, key: bytes) -> int:
        if self.cpu is None or key not in self.cpu:
            return -1
        return self.cpu.pin(key)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._sources.pop(request.request_id, {})

    def _place(self, key: bytes) -> int:
        """A CPU slot for ``key`` (-1 if there is no CPU tier or every slot is pinned).
        The block it evicts is spilled to SSD first unless SSD already has it."""
        if self.cpu is None:
            return -1
        got = self.cpu.try_allocate(key)
        if got is None:
            return -1
        slot, evicted = got
        if evicted is None:
            return slot
        pos = self._store_pos.pop(evicted, None)
        if pos is not None:  # planned in this step, never written to the slot: send it to SSD only
            self._stores.cpu_slots[pos] = -1
            if self.ssd_enabled and evicted not in self.ssd_keys:
                self._stores.to_ssd[pos] = True
                self.ssd_keys.add(evicted)
        elif self.ssd_enabled and evicted not in self.ssd_keys:
            self._spills.append((slot, evicted))
            self.ssd_keys.add(evicted)
        return slot

    # ------------------------------------------------------------------ stores

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TierKVMetadata:
        stores = self._stores = StoreSpec()
        self._store_pos = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_stores(new.req_id, new.num_computed_tokens + scheduled[new.req_id], stores)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self._plan_stores(req_id, computed + scheduled[req_id], stores)
        meta = TierKVMetadata(loads=self._loads, spills=self._spills, stores=stores)
        self._loads, self._spills = [], []
        self._stores, self._store_pos = StoreSpec(), {}
        return meta

    def _plan_stores(self, req_id: str, computed: int, stores: StoreSpec) -> None:
        """Queue the blocks of ``req_id`` that are full once this step ran."""
        st = self._reqs.get(req_id)
        if st is None or not _cacheable(st.request):
            return
        full = min(computed, st.request.num_tokens) // self.block_size
        if full <= st.handled:
            return
        assert self._manager is not None, "bind_kv_cache_manager was not called"
        block_ids = self._manager.get_block_ids(req_id)[0]
        hashes = self._hashes(st, full)
        for i in range(st.handled, full):
            self._plan_store(block_ids[i], hashes[i], stores)
        st.handled = full

    def _plan_store(self, block_id: int, key: bytes, stores: StoreSpec) -> None:
        if self.cpu is not None and self.cpu.touch(key):
            return
        slot = self._place(key)
        to_ssd = self.ssd_enabled and key not in self.ssd_keys and (self.write_through or slot < 0)
        if slot < 0 and not to_ssd:
            return
        if to_ssd:
            self.ssd_keys.add(key)
        if slot >= 0:
            self._store_pos[key] = len(stores)
        stores.add(block_id, key, slot, to_ssd)

    # ------------------------------------------------------------------ completion

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        for req_id in output.finished_recving or ():
            self._unpin(req_id)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, TierKVWorkerMetadata):
            for key in meta.lost_keys:
                self._forget(key)

    def _unpin(self, req_id: str) -> None:
        for key in self._pins.pop(req_id, ()):
            self.cpu.unpin(key)  # type: ignore[union-attr]
            if key in self._doomed and self.cpu.pin_count(key) == 0:  # type: ignore[union-attr]
                self._doomed.discard(key)
                self.cpu.pop(key)  # type: ignore[union-attr]

    def _forget(self, key: bytes) -> None:
        self.ssd_keys.discard(key)
        if self.cpu is None or key not in self.cpu:
            return
        if self.cpu.pin_count(key):
            self._doomed.add(key)
        else:
            self.cpu.pop(key)

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing only while a load into the request's blocks is in flight."""
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._sources.pop(req_id, None)
        pending = [s for s in self._loads if s.req_id == req_id]
        if pending:  # not handed to the worker yet: drop it
            self._loads = [s for s in self._loads if s.req_id != req_id]
            self._unpin(req_id)
            return False, None
        return req_id in self._pins, None


def _read_ssd_keys(cfg: TierKVConfig, fingerprint: str, block_nbytes: int) -> set[bytes]:
    """The keys on SSD at start-up, read once. In this process the worker's tier
    is shared (LMDB forbids a second handle); otherwise the tier is opened
    briefly. A tier that cannot be read yields an empty set (misses only)."""
    from tierkv.connectors.vllm_worker import open_ssd_tier, shared_ssd_tier

    tier = shared_ssd_tier(cfg)
    if tier is not None:
        return set(tier.keys())
    try:
        tier = open_ssd_tier(cfg, fingerprint, block_nbytes, shared=False)
    except Exception as exc:  # a broken tier costs hits, never the engine
        log.warning("tierkv: cannot read the SSD tier at %s (%s); starting with none of its blocks",
                    cfg.ssd.path, exc)
        return set()
    try:
        return set(tier.keys())
    finally:
        tier.close()
