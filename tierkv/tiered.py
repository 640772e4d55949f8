"""TieredKVCache: a paged GPU pool that spills to CPU DRAM and SSD and promotes hits back.

One walk of the prompt's hash chain looks every block up in the GPU pool, then
the CPU tier, then the SSD tier, and stops at the first block no tier holds.
Hits below the GPU get new GPU rows, are registered in the GPU map right away
and are copied in before :meth:`TieredAllocation.wait` returns.

Spilling: a zero-ref hashed block that the GPU pool evicts is copied to the CPU
tier before its row is reused, and (with ``spill.write_through``, the default)
queued for the SSD tier too, so the SSD tier is a persistent superset of what
was spilled. To keep that copy off the allocation path, the least recently
used ``spill.watermark`` fraction of the GPU pool (at least one block) is kept
already copied down: after every ``free`` and ``allocate`` the head of the
free queue is paged out in one batch, so an eviction usually finds its block
below already and costs nothing.

``payload=False`` runs the same policy on metadata only (no bytes, no LMDB):
the CPU and SSD tiers become LRU indexes with their capacities in blocks. The
trace replayer (``tierkv bench``) uses it.

Failures below the GPU tier (corrupt or unreadable SSD records, full queues,
pinned slots) are counted misses or dropped spills, never exceptions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import tierkv
from tierkv.block_pool import BlockManager
from tierkv.config import TierKVConfig
from tierkv.cpu_tier import SlotIndex
from tierkv.hashing import BlockHasher
from tierkv.metrics import TIERS, Lifecycle, TierKVCollector
from tierkv.transfer import copy_rows

__all__ = ["TieredKVCache", "TieredAllocation", "fingerprint"]

log = logging.getLogger(__name__)


def fingerprint(config: TierKVConfig, block_nbytes: int | None = None) -> str:
    """Everything that makes stored KV bytes incompatible, as one string."""
    m = config.model
    nbytes = config.block_nbytes() if block_nbytes is None else block_nbytes
    return (f"tierkv/v{tierkv.FORMAT_VERSION}|model={m.name}|layers={m.layers}|kv_heads={m.kv_heads}"
            f"|head_size={m.head_size}|kv_dtype={m.kv_dtype}|block_size={config.block_size}"
            f"|block_nbytes={nbytes}|hash={config.hash}")


@dataclass
class TieredAllocation:
    """A request's block table plus where its cached prefix came from.

    Call :meth:`wait` before attention reads ``block_ids``: promoted rows are
    copied asynchronously on CUDA (on CPU the copy is already done).
    """

    block_ids: list[int]
    num_cached_tokens: int
    hit_tokens: dict[str, int]
    hit_blocks: dict[str, int]
    _events: list[Any] = field(default_factory=list, repr=False)

    def wait(self) -> None:
        from tierkv.transfer import TransferEngine

        for ev in self._events:
            TransferEngine.wait_event(ev)
        self._events.clear()


def _zero() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


class TieredKVCache:
    """GPU pool + CPU tier + SSD tier behind one allocate/append/fork/free API.

    ``kv_pool``: the device pool as ``[num_gpu_blocks, block_nbytes]`` uint8
    (a view of real KV storage is fine); allocated from ``config`` when None.
    ``clock``: seconds for lifecycle metrics (the trace time in replays).
    ``on_drop(block_hash, tier)``: a block left the last tier that held it.
    ``namespace``: the hash-chain root and SSD fingerprint; derived from
    ``config`` (model, layout, block size, format version) when None.
    """

    def __init__(self, config: TierKVConfig, *, kv_pool: Any = None, payload: bool = True,
                 clock: Callable[[], float] | None = None, record_samples: bool = False,
                 on_drop: Callable[[bytes, str], None] | None = None, namespace: str | bytes | None = None) -> None:
        if kv_pool is not None and not payload:
            raise ValueError("kv_pool: a pool was given but payload=False moves no bytes")
        self.config = config
        self.payload = payload
        self.clock = clock or time.monotonic
        self.on_drop = on_drop
        self.block_size = config.block_size
        self.block_nbytes = int(kv_pool.shape[1]) if kv_pool is not None else config.block_nbytes()
        num_blocks = int(kv_pool.shape[0]) if kv_pool is not None else config.gpu.resolve_num_blocks(self.block_nbytes)
        self.namespace = namespace if namespace is not None else fingerprint(config, self.block_nbytes)
        self.hasher = BlockHasher(self.block_size, config.hash, namespace=self.namespace)
        self.manager = BlockManager(num_blocks, self.block_size, hasher=self.hasher, on_evict=self._on_gpu_evict)
        self.lifecycle = {t: Lifecycle(record_samples) for t in TIERS}
        self._counts: dict[str, dict[str, int]] = {k: _zero() for k in (
            "spills", "promotions", "evictions", "dropped_spills", "corrupt_blocks")}
        self._hits = {t: {"blocks": 0, "tokens": 0} for t in TIERS}
        self._queries = {"blocks": 0, "tokens": 0}
        self._spills_at_eviction = 0
        self._pending: dict[int, Any] = {}  # GPU row -> event of an unfinished promotion copy
        self._evicted_rows: list[tuple[int, bytes]] = []  # evicted during this call, not yet copied down
        self.cpu: Any = None
        self.ssd: Any = None
        self.transfer: Any = None
        self.cpu_index: SlotIndex | None = None
        self.ssd_index: SlotIndex | None = None
        self._open_tiers(kv_pool, num_blocks)
        below = self.cpu_index is not None or self.ssd is not None or self.ssd_index is not None
        self.watermark_blocks = max(1, int(config.spill.watermark * num_blocks)) if payload and below else 0
        self._metrics_server: Any = None
        if config.metrics.port is not None:
            self.start_metrics_server(config.metrics.port)

    # ------------------------------------------------------------------ setup

    def _open_tiers(self, kv_pool: Any, num_blocks: int) -> None:
        cfg, nbytes = self.config, self.block_nbytes
        cpu_slots = cfg.cpu.capacity // nbytes
        ssd_on = cfg.ssd.enabled and cfg.ssd.capacity >= nbytes
        if not self.payload:
            self.cpu_index = SlotIndex(cpu_slots) if cpu_slots else None
            self.ssd_index = SlotIndex(cfg.ssd.capacity // nbytes) if ssd_on else None
            return
        import torch

        from tierkv.cpu_tier import CPUTier
        from tierkv.transfer import TransferEngine

        if kv_pool is None:
            kv_pool = torch.zeros((num_blocks, nbytes), dtype=torch.uint8, device=cfg.gpu.resolve_device())
        self.kv_pool = kv_pool
        self.transfer = TransferEngine(kv_pool)
        if cpu_slots:
            self.cpu = CPUTier(cfg.cpu.capacity, nbytes, pin_memory=cfg.cpu.pin, on_evict=self._on_cpu_evict)
            self.cpu_index = self.cpu.index
        if ssd_on:
            from tierkv.ssd_tier import SSDTier

            path = cfg.ssd.resolved_path()
            assert path is not None
            if path.parent == Path.home() / ".cache":  # the default location: create ~/.cache
                path.parent.mkdir(parents=True, exist_ok=True)
            self.ssd = SSDTier(path, capacity_bytes=cfg.ssd.capacity,
                               fingerprint=self.namespace, compression=cfg.ssd.compression, level=cfg.ssd.level,
                               queue_capacity_bytes=cfg.ssd.queue_capacity, block_nbytes=nbytes)

    # --------------------------------------------------------------- requests

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None, *,
                 block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
                 cache_salt: str | bytes | None = None, lora_id: str | bytes | int | None = None) -> TieredAllocation:
        """Allocate a request's blocks, serving its cached prefix from any tier.

        Precomputed ``block_hashes`` are taken as full blocks; ``num_tokens``
        (optional with hashes) applies the last-token cap. Raises
        :class:`tierkv.OutOfBlocksError` with nothing changed when the GPU pool
        is too small.
        """
        now = self.clock()
        n = len(token_ids) if token_ids is not None else (
            num_tokens if num_tokens is not None else len(block_hashes or ()) * self.block_size)
        found: list[tuple[str, bytes, Any]] = []
        try:
            alloc = self.manager.allocate(request_id, token_ids, block_hashes=block_hashes, num_tokens=num_tokens,
                                          cache_salt=cache_salt, lora_id=lora_id,
                                          external_hit=lambda pos, h: self._lookup_below(h, found))
        except BaseException:
            self._unpin(found)
            raise
        self._spill_evicted()  # before any promotion overwrites a reused row
        events = self._promote(alloc.external, found, now)
        hashes = self.manager.requests[request_id].hashes
        self._note_gpu(alloc.block_ids, hashes, set(pos for pos, _, _ in alloc.external), alloc.num_gpu_hit_blocks, now)
        events.extend(ev for ev in (self._pending_event(r) for r in alloc.block_ids) if ev is not None)
        hit_blocks = {"gpu": alloc.num_gpu_hit_blocks, "cpu": 0, "ssd": 0}
        for tier, _, _ in found:
            hit_blocks[tier] += 1
        self._count_query(len(alloc.block_ids), n, hit_blocks)
        self._pageout()
        return TieredAllocation(alloc.block_ids, alloc.num_cached_tokens,
                                {t: b * self.block_size for t, b in hit_blocks.items()}, hit_blocks, events)

    def append(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens (BlockManager semantics); returns the COW copies ``(src, dst)`` to perform."""
        now = self.clock()
        before = len(self.manager.requests[request_id].hashes) if request_id in self.manager.requests else 0
        ops = self.manager.append(request_id, token_ids)
        self._spill_evicted()
        req = self.manager.requests[request_id]
        for i in range(before, len(req.hashes)):
            if req.blocks[i].block_hash == req.hashes[i]:
                self.lifecycle["gpu"].enter(req.hashes[i], now)
        return ops

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        self.manager.fork(parent_request_id, child_request_id)

    def free(self, request_id: str) -> None:
        """Release a request; its hashed blocks stay cached and the watermark is topped up."""
        self.manager.free(request_id)
        self._pageout()

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.block_ids(request_id)

    # ----------------------------------------------------------------- lookup

    def _lookup_below(self, h: bytes, found: list[tuple[str, bytes, Any]]) -> bool:
        """Does a lower tier hold ``h``? Pins CPU hits and reads SSD hits (verified) on the way."""
        if self.cpu_index is not None and h in self.cpu_index:
            self.cpu_index.pin(h)  # no spill caused by this allocation may evict it
            found.append(("cpu", h, None))
            return True
        if self.ssd_index is not None:
            if h not in self.ssd_index:
                return False
            self.ssd_index.pin(h)
            found.append(("ssd", h, None))
            return True
        if self.ssd is not None:
            data = self._ssd_read(h)
            if data is not None:
                found.append(("ssd", h, data))
                return True
        return False

    def _ssd_read(self, h: bytes) -> bytes | None:
        """A verified SSD block or None (the tier counts corrupt records and read errors itself)."""
        try:
            data = self.ssd.get(h)
        except Exception:  # the tier promises not to raise; never let it take the engine down
            log.exception("SSD tier: get failed; counted as a miss")
            self._counts["corrupt_blocks"]["ssd"] += 1
            return None
        if data is not None and len(data) != self.block_nbytes:
            self._counts["corrupt_blocks"]["ssd"] += 1
            return None
        return data

    def _unpin(self, found: list[tuple[str, bytes, Any]]) -> None:
        for tier, h, _ in found:
            index = self.cpu_index if tier == "cpu" else self.ssd_index
            if index is not None:
                index.unpin(h)

    # -------------------------------------------------------------- promotion

    def _promote(self, external: list[tuple[int, int, bytes]], found: list[tuple[str, bytes, Any]],
                 now: float) -> list[Any]:
        """Copy lower-tier hits into their new GPU rows; returns the copy events."""
        assert len(external) == len(found), "every external hit got a block"
        cpu_hits = [(row, h) for (_, row, _), (tier, h, _) in zip(external, found) if tier == "cpu"]
        ssd_hits = [(row, h, data) for (_, row, _), (tier, h, data) in zip(external, found) if tier == "ssd"]
        events: list[Any] = []
        for hits, promote in ((cpu_hits, self._promote_cpu), (ssd_hits, self._promote_ssd)):
            if not hits:
                continue
            ev = promote(hits)
            if ev is not None:
                events.append(ev)
                for hit in hits:
                    self._pending[hit[0]] = ev
        for tier, h, _ in found:
            self.lifecycle[tier].access(h, now)
            self._counts["promotions"][tier] += 1
        return events

    def _promote_cpu(self, hits: list[tuple[int, bytes]]) -> Any:
        exclusive = self.config.spill.promotion == "exclusive"
        if self.cpu is None:  # metadata only
            assert self.cpu_index is not None
            for _, h in hits:
                self.cpu_index.unpin(h)
                if exclusive:
                    self.cpu_index.pop(h)
            return None
        slots = [self.cpu.slot_of(h) for _, h in hits]
        event = self.transfer.write_rows([row for row, _ in hits], self._cpu_rows(slots))
        for _, h in hits:
            self.cpu.unpin(h)
            if exclusive:
                self.cpu.pop(h)
        return event

    def _cpu_rows(self, slots: list[int]) -> Any:
        """CPU-slab rows as a new host array (pinned on CUDA so the upload is asynchronous)."""
        if not self.transfer.cuda:
            import numpy as np

            out = np.empty((len(slots), self.block_nbytes), dtype=np.uint8)
            copy_rows(self.cpu.slab.numpy(), slots, out, range(len(slots)))
            return out
        import torch

        out = torch.empty((len(slots), self.block_nbytes), dtype=torch.uint8, pin_memory=True)
        torch.index_select(self.cpu.slab, 0, torch.tensor(slots, dtype=torch.int64), out=out)
        return out

    def _promote_ssd(self, hits: list[tuple[int, bytes, Any]]) -> Any:
        """SSD -> CPU staging -> GPU; the block also lands in the CPU tier (the SSD keeps its copy)."""
        keys = [h for _, h, _ in hits]
        if self.ssd_index is not None:  # metadata only
            for h in keys:
                self.ssd_index.unpin(h)
                if self.cpu_index is not None:
                    self._cpu_insert_meta(h)
        if not self.payload:
            return None
        import numpy as np

        data = np.empty((len(hits), self.block_nbytes), dtype=np.uint8)
        for i, (_, _, block) in enumerate(hits):
            data[i] = np.frombuffer(block, dtype=np.uint8)
        if self.cpu is not None:
            self._store_cpu(keys, data)
        return self.transfer.write_rows([row for row, _, _ in hits], data, "ssd->gpu")

    def _pending_event(self, row: int) -> Any:
        ev = self._pending.get(row)
        if ev is not None and self.transfer.is_done(ev):
            del self._pending[row]
            return None
        return ev

    # ------------------------------------------------------------------ spill

    def _pageout(self) -> None:
        """Copy the ``watermark`` least recently used free blocks down ahead of their eviction."""
        if not self.watermark_blocks:
            return
        rows: list[int] = []
        keys: list[bytes] = []
        for i, b in enumerate(self.manager.free_queue):
            if i >= self.watermark_blocks:
                break
            if b.block_hash is not None and not self._below(b.block_hash):
                rows.append(b.block_id)
                keys.append(b.block_hash)
        if keys:
            self._spill(keys, self.transfer.read_rows(rows))

    def _below(self, h: bytes) -> bool:
        if self.cpu_index is not None:
            return h in self.cpu_index
        return self.ssd is not None and h in self.ssd

    def _on_gpu_evict(self, block_id: int, h: bytes) -> None:
        self.lifecycle["gpu"].leave(h, self.clock())
        self._counts["evictions"]["gpu"] += 1
        self._pending.pop(block_id, None)
        if not self.payload:
            self._spill_meta(h)
        elif not self.watermark_blocks:
            self._drop(h, "gpu")
        elif not self._below(h):  # the page-out window missed it: copied in one batch before the row is written
            self._evicted_rows.append((block_id, h))

    def _spill_evicted(self) -> None:
        """Spill the rows evicted by the last allocate/append that the watermark had not copied yet.

        Their bytes are intact: the manager hands rows out, but nothing writes them
        before this returns (promotions are queued after it on the same stream).
        """
        if not self._evicted_rows:
            return
        rows, keys = zip(*self._evicted_rows)
        self._evicted_rows.clear()
        self._spills_at_eviction += len(keys)
        self._spill(list(keys), self.transfer.read_rows(list(rows)))

    def _spill(self, keys: list[bytes], data: Any) -> None:
        """Store host rows ``data`` of GPU-evicted blocks into the CPU tier (and SSD)."""
        stored = self._store_cpu(keys, data) if self.cpu is not None else [False] * len(keys)
        if self.ssd is not None and (self.config.spill.write_through or self.cpu is None):
            for i, k in enumerate(keys):
                stored[i] = self._store_ssd(k, data[i]) or stored[i]
        for k, ok in zip(keys, stored):
            if not ok:
                self._drop(k, "gpu")

    def _store_cpu(self, keys: list[bytes], data: Any) -> list[bool]:
        now = self.clock()
        stored = self.cpu.put_many(keys, data)
        for k, ok in zip(keys, stored):
            if ok:
                self._counts["spills"]["cpu"] += 1
                self.lifecycle["cpu"].enter(k, now)
            else:
                self._counts["dropped_spills"]["cpu"] += 1
        return stored

    def _store_ssd(self, key: bytes, data: Any) -> bool:
        try:
            ok = bool(self.ssd.put(key, data))
        except Exception:
            log.exception("SSD tier: put failed; the spill is dropped")
            ok = False
        if ok:
            self._counts["spills"]["ssd"] += 1
            self.lifecycle["ssd"].enter(key, self.clock())
        else:
            self._counts["dropped_spills"]["ssd"] += 1
        return ok

    def _on_cpu_evict(self, key: bytes, view: Any) -> None:
        """CPU tier eviction (payload): cascade to SSD unless write-through already queued it."""
        self.lifecycle["cpu"].leave(key, self.clock())
        self._counts["evictions"]["cpu"] += 1
        if self.ssd is None:
            self._drop(key, "cpu")
        elif not self.config.spill.write_through:
            if not self._store_ssd(key, view):
                self._drop(key, "cpu")

    def _drop(self, h: bytes, tier: str) -> None:
        if self.on_drop is not None and h not in self.manager.cached:
            self.on_drop(h, tier)

    # ------------------------------------------------------- metadata-only tiers

    def _spill_meta(self, h: bytes) -> None:
        placed = False
        if self.cpu_index is not None:
            self._cpu_insert_meta(h)
            placed = True
        if self.ssd_index is not None and (self.config.spill.write_through or self.cpu_index is None):
            self._ssd_insert_meta(h)
            placed = True
        if not placed:
            self._drop(h, "gpu")

    def _cpu_insert_meta(self, h: bytes) -> None:
        evicted = self._insert_meta("cpu", h)
        if evicted is None:
            return
        if self.ssd_index is not None and not self.config.spill.write_through:
            self._ssd_insert_meta(evicted)
        elif self.ssd_index is None or evicted not in self.ssd_index:
            self._drop(evicted, "cpu")

    def _ssd_insert_meta(self, h: bytes) -> None:
        evicted = self._insert_meta("ssd", h)
        if evicted is not None and (self.cpu_index is None or evicted not in self.cpu_index):
            self._drop(evicted, "ssd")

    def _insert_meta(self, tier: str, h: bytes) -> bytes | None:
        """Put ``h`` in a metadata-only tier; returns the key it evicted, if any."""
        idx = self.cpu_index if tier == "cpu" else self.ssd_index
        assert idx is not None
        if idx.touch(h):
            return None
        got = idx.try_allocate(h)
        if got is None:  # every slot pinned by this allocation's own hits
            self._counts["dropped_spills"][tier] += 1
            return None
        self._counts["spills"][tier] += 1
        now = self.clock()
        self.lifecycle[tier].enter(h, now)
        evicted = got[1]
        if evicted is not None:
            self._counts["evictions"][tier] += 1
            self.lifecycle[tier].leave(evicted, now)
        return evicted

    # -------------------------------------------------------------- accounting

    def _note_gpu(self, block_ids: list[int], hashes: list[bytes], external: set[int], gpu_hits: int,
                  now: float) -> None:
        lc = self.lifecycle["gpu"]
        blocks = self.manager.blocks
        for pos, h in enumerate(hashes):
            if pos < gpu_hits + len(external) and pos not in external:
                lc.access(h, now)
            elif blocks[block_ids[pos]].block_hash == h:
                lc.enter(h, now)

    def _count_query(self, num_blocks: int, num_tokens: int, hit_blocks: dict[str, int]) -> None:
        self._queries["blocks"] += num_blocks
        self._queries["tokens"] += num_tokens
        for t, b in hit_blocks.items():
            self._hits[t]["blocks"] += b
            self._hits[t]["tokens"] += b * self.block_size

    def stats(self) -> dict[str, Any]:
        """A snapshot of every counter (see the README's metrics table)."""
        occupancy = {"gpu": self.manager.num_cached_blocks,
                     "cpu": len(self.cpu_index) if self.cpu_index is not None else 0,
                     "ssd": len(self.ssd_index) if self.ssd_index is not None else 0}
        capacity = {"gpu": self.manager.num_blocks,
                    "cpu": self.cpu_index.num_slots if self.cpu_index is not None else 0,
                    "ssd": self.ssd_index.num_slots if self.ssd_index is not None else 0}
        out: dict[str, Any] = {
            "queries": dict(self._queries),
            "hits": {t: dict(v) for t, v in self._hits.items()},
            **{k: dict(v) for k, v in self._counts.items()},
            "spills_at_eviction": self._spills_at_eviction,
            "occupancy": occupancy,
            "capacity_blocks": capacity,
            "transfer": {d: dict(v) for d, v in self.transfer.moved.items()} if self.transfer else {},
            "lifecycle": {t: {"lifetime_s": lc.lifetime.samples, "idle_before_evict_s": lc.idle_before_evict.samples,
                              "reuse_gap_s": lc.reuse_gap.samples} for t, lc in self.lifecycle.items()},
        }
        if self.ssd is not None:
            ssd = self.ssd.stats()
            out["ssd"] = ssd
            occupancy["ssd"] = ssd["current_bytes"] // self.block_nbytes  # approximate: records are compressed
            capacity["ssd"] = self.config.ssd.capacity // self.block_nbytes
            out["corrupt_blocks"]["ssd"] += ssd["corrupt_deleted"] + ssd["read_errors"]
            out["dropped_spills"]["ssd"] += (ssd["dropped_write_error"]  # asynchronous; the rest
                                             + ssd["dropped_no_room"])    # counted at put
        if self.cpu is not None:
            out["cpu"] = self.cpu.stats()
        return out

    # -------------------------------------------------------------- lifecycle

    def start_metrics_server(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve Prometheus metrics for this cache on ``http://addr:port/metrics``."""
        from tierkv.metrics import start_metrics_server

        self._metrics_server = start_metrics_server(port, TierKVCollector(self.stats, self.lifecycle), addr)

    def flush(self) -> None:
        """Wait until every pending copy and SSD write has finished (SSD writes synced)."""
        if self.transfer is not None:
            self.transfer.synchronize()
        self._pending.clear()
        if self.ssd is not None:
            self.ssd.flush()

    def close(self) -> None:
        """Flush and release the tiers; the SSD tier's contents persist."""
        self.flush()
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self._metrics_server is not None:
            server = self._metrics_server
            self._metrics_server = None
            if hasattr(server, "shutdown"):
                server.shutdown()

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
