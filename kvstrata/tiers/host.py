"""The CPU DRAM tier's bytes: a preallocated slab of fixed-size slots.

* :class:`HostSlab`: ``[num_slots, block_nbytes]`` uint8 (page-locked when CUDA
  is available), each slot tagged with the key whose bytes it holds. The
  executor writes and reads it at the slots the tier policy chose; the tag
  lets it refuse a slot that does not hold the expected block instead of
  copying wrong bytes. Page-locking: see :class:`HostSlab`.
* :class:`CPUTier`: a :class:`~kvstrata.policy.slot_index.SlotIndex` plus a
  slab, for use on its own (LRU eviction, pins, batched copies).

Not thread-safe: one owner thread, or the caller serialises access. (The
vLLM worker's loader thread and its main thread touch disjoint slots: the
policy pins every slot a plan uses until the plan completes.)
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvstrata.tiers.buffers import as_numpy
from kvstrata.errors import ConfigError
from kvstrata.policy.slot_index import PinnedError, SlotIndex, check_keys
from kvstrata.tiers.buffers import copy_rows

if TYPE_CHECKING:
    import torch

__all__ = ["HostSlab", "CPUTier", "PinnedError", "EvictCallback", "as_rows"]

log = logging.getLogger(__name__)

#: ``on_evict(key, slot_view)``: ``slot_view`` is a read-only uint8 numpy view of
#: the evicted block, valid only during the call (the slot is reused right after).
EvictCallback = Callable[[bytes, np.ndarray], None]


def as_rows(data: Any, n: int, block_nbytes: int, what: str, *, writable: bool = False) -> np.ndarray:
    """View ``data`` as a C-contiguous uint8 array ``[n, block_nbytes]`` without copying.

    Accepts CPU torch tensors and numpy arrays of any dtype (``bytes``-like
    objects for reading); raises ValueError naming ``what`` otherwise.
    """
    arr = as_numpy(data, what)
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: must be writable")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous")
    if arr.nbytes != n * block_nbytes:
        raise ValueError(f"{what}: expected {n} x {block_nbytes} = {n * block_nbytes} bytes, "
                         f"got {arr.nbytes}")
    return arr.reshape(-1).view(np.uint8).reshape(n, block_nbytes)


#: The slab is page-locked in registrations of at most this many bytes (a multiple of
#: _HUGE_PAGE: no registration ends inside a transparent huge page).
PIN_CHUNK_BYTES = 1 << 30
_HUGE_PAGE = 2 << 20
_REGISTER_FLAGS = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _PinRuntime:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's runtime bindings,
    on the device that was current when the slab was made."""

    def __init__(self, cudart: Any, device: int) -> None:
        self.cudart, self.device = cudart, device

    def register(self, ptr: int, size: int) -> int:
        """0, or the CUDA error code."""
        import torch

        with torch.cuda.device(self.device):
            return int(self.cudart.cudaHostRegister(ptr, size, _REGISTER_FLAGS))

    def unregister(self, ptr: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            self.cudart.cudaHostUnregister(ptr)

    def error_text(self, code: int) -> str:
        try:
            return f"{self.cudart.cudaGetErrorString(self.cudart.cudaError(code))} (error {code})"
        except Exception:
            return f"CUDA error {code}"


def _pin_runtime() -> tuple[_PinRuntime | None, str]:
    """The runtime to page-lock with and "", or None and the reason there is none."""
    import torch

    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        return _PinRuntime(torch.cuda.cudart(), torch.cuda.current_device()), ""
    except Exception as exc:
        return None, f"torch.cuda.cudart(): {type(exc).__name__}: {exc}"


class _HostMapping(mmap.mmap):
    """Anonymous page-aligned memory whose page-locked chunks are unregistered
    before it is unmapped (arrays and tensors made from it keep it alive)."""

    runtime: Any = None
    chunks: tuple[int, ...] = ()

    def __del__(self) -> None:
        if self.chunks:
            _unregister(self.runtime, self.chunks)
            self.chunks = ()


def _unregister(runtime: Any, chunks: Sequence[int]) -> None:
    for ptr in chunks:
        try:
            runtime.unregister(ptr)
        except Exception:  # CUDA already shut down: the process is going away
            pass


def _register(runtime: Any, base: int, nbytes: int) -> tuple[tuple[int, ...], str | None]:
    """Page-lock ``[base, base + nbytes)`` in chunks of PIN_CHUNK_BYTES, all or nothing:
    the registered chunk addresses and None, or () and why it failed. Runs on a
    thread of its own, so that a failure leaves no CUDA error pending on the
    caller's thread (the runtime keeps the last error per thread, and torch
    raises it at its next kernel launch)."""
    result: list[Any] = [(), "the registering thread did not finish"]

    def run() -> None:
        done: list[int] = []
        try:
            for offset in range(0, nbytes, PIN_CHUNK_BYTES):
                size = min(PIN_CHUNK_BYTES, nbytes - offset)
                code = runtime.register(base + offset, size)
                if code != 0:
                    _unregister(runtime, done)
                    result[:] = [(), f"cudaHostRegister of {size} bytes at offset {offset}: "
                                     f"{runtime.error_text(code)}"]
                    return
                done.append(base + offset)
            result[:] = [tuple(done), None]
        except Exception as exc:
            _unregister(runtime, done)
            result[:] = [(), f"{type(exc).__name__}: {exc}"]

    worker = threading.Thread(target=run, name="kvstrata-pin-slab", daemon=True)
    worker.start()
    worker.join()
    return result[0], result[1]


def _pageable(num_slots: int, block_nbytes: int) -> "torch.Tensor":
    """Anonymous memory with every page faulted in now: a store into the slab is a
    memcpy, not a page fault per 4 KiB (or a compaction per 2 MiB under torch's
    transparent huge pages) on the engine's critical path."""
    import torch

    nbytes = num_slots * block_nbytes
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(_faulted_in(np.frombuffer(mapping, dtype=np.uint8))).view(num_slots, block_nbytes)


def _faulted_in(array: np.ndarray) -> np.ndarray:
    array[::mmap.PAGESIZE] = 0  # one write per page: the kernel backs each one now
    return array


def _slab_memory(num_slots: int, block_nbytes: int, pin_memory: bool | None
                 ) -> tuple["torch.Tensor", "_HostMapping | None"]:
    """The slab tensor and, when it is page-locked, its mapping (see :class:`HostSlab`).

    Refused (ConfigError naming ``cpu.capacity``) when it is larger than the memory available
    less what other slabs starting on this machine have reserved: every byte of it is resident
    from the start (page-locked, or faulted in), so it would be killed for memory at start-up,
    or take the memory the engine and the page cache need. Its own reservation lasts until
    its memory is resident."""
    from kvstrata.system.machine import reserved_memory

    with reserved_memory(num_slots * block_nbytes, "cpu.capacity", "the DRAM tier's slab"):
        return _resident_slab(num_slots, block_nbytes, pin_memory)


def _resident_slab(num_slots: int, block_nbytes: int, pin_memory: bool | None
                   ) -> tuple["torch.Tensor", "_HostMapping | None"]:
    import torch

    if pin_memory is False or (pin_memory is None and not torch.cuda.is_available()):
        return _pageable(num_slots, block_nbytes), None
    nbytes = num_slots * block_nbytes
    runtime, reason = _pin_runtime()
    if runtime is None:
        _warn_pageable(nbytes, reason)
        return _pageable(num_slots, block_nbytes), None
    mapping = _HostMapping(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to lock and to map for the GPU
        except OSError:
            pass
    address = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=(-address) % _HUGE_PAGE)
    chunks, error = _register(runtime, array.ctypes.data, nbytes)
    if error is not None:
        _warn_pageable(nbytes, error)
        _faulted_in(array)
    else:
        mapping.runtime, mapping.chunks = runtime, chunks
    return torch.from_numpy(array).view(num_slots, block_nbytes), (mapping if error is None else None)


def _warn_pageable(nbytes: int, reason: str) -> None:
    log.warning("CPU tier: could not page-lock the %.1f GiB slab (%s). It stays in pageable memory: "
                "copies between it and the GPU will be ~10x slower", nbytes / 2**30, reason)


class HostSlab:
    """``num_slots`` blocks of ``block_nbytes`` in one preallocated uint8 tensor.

    Page-locking (``pin_memory``: None = when CUDA is available, True = asked
    for, False = never): the slab is anonymous page-aligned memory registered
    with ``cudaHostRegister`` (portable, mapped) in chunks of
    :data:`PIN_CHUNK_BYTES` (from a 2 MiB boundary, transparent huge pages
    advised), unregistered when the memory is freed. Chunks
    rather than ``torch.empty(pin_memory=True)``: torch's pinned allocator
    rounds a request up to a power of two (a 40 GiB slab would lock 64 GiB)
    and locks it in one call. The GPU addresses registered memory through
    the host pointer, so kernels and ``copy_(non_blocking=True)`` use the
    slab directly, and ``tensor.is_pinned()`` is true. If any chunk fails
    (CUDA missing while asked for, the locked-memory limit, out of memory)
    every chunk is released and the slab stays pageable; one warning says
    so, and :attr:`pinned` is False. Kernels cannot address a pageable slab
    (``gather_blocks`` refuses it as staging): its copies go through pinned
    staging rows instead.
    """

    def __init__(self, num_slots: int, block_nbytes: int, *, pin_memory: bool | None = None) -> None:
        _check_positive(num_slots, "num_slots")
        _check_positive(block_nbytes, "block_nbytes")
        self.block_nbytes = block_nbytes
        self.tensor, self._mapping = _slab_memory(num_slots, block_nbytes, pin_memory)
        self.pinned = self._mapping is not None
        self.array: np.ndarray = self.tensor.numpy()
        self.keys: list[bytes | None] = [None] * num_slots

    def close(self) -> None:
        """Unregister the page-locked memory now rather than when the last view of it is
        garbage-collected (the caller has let every copy into or out of it finish). The
        bytes stay readable as pageable memory. Idempotent."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None and mapping.chunks:
            _unregister(mapping.runtime, mapping.chunks)
            mapping.chunks = ()
        self.pinned = False

    def forget_all(self) -> None:
        """Untag every slot: none holds a block any more."""
        self.keys = [None] * len(self.keys)

    @property
    def num_slots(self) -> int:
        return len(self.keys)

    def holds(self, slot: int, key: bytes) -> bool:
        """Does ``slot`` hold the bytes of ``key``?"""
        return 0 <= slot < len(self.keys) and self.keys[slot] == key

    def write(self, slots: Sequence[int], keys: Sequence[bytes], rows: np.ndarray,
              src_rows: Sequence[int] | None = None) -> None:
        """Copy ``rows[src_rows[i]]`` (all rows in order when None) into ``slots[i]``, tagged ``keys[i]``."""
        if not slots:
            return
        copy_rows(rows, range(len(slots)) if src_rows is None else src_rows, self.array, slots)
        for slot, key in zip(slots, keys):
            self.keys[slot] = key

    def read(self, slots: Sequence[int], out: np.ndarray, dst_rows: Sequence[int]) -> None:
        """Copy ``slots[i]`` into ``out[dst_rows[i]]``."""
        copy_rows(self.array, slots, out, dst_rows)

    def forget(self, slot: int) -> None:
        self.keys[slot] = None

    def view(self, slot: int) -> np.ndarray:
        """Read-only numpy view of one slot's bytes (valid until the slot is rewritten)."""
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or \
                not 0 <= slot < len(self.keys):
            raise IndexError(f"slot: expected 0..{len(self.keys) - 1}, got {slot!r}")
        row = self.array[slot]
        row.flags.writeable = False
        return row


class CPUTier:
    """A fixed-capacity block store in one preallocated slab, LRU-evicted, with pins.

    ``capacity_bytes // block_nbytes`` slots exist and never more blocks are
    held. When a new block needs a slot and none is free, the least recently
    used unpinned block is evicted: ``on_evict(key, slot_view)`` is called
    first (``slot_view`` is a read-only numpy view of the old bytes, valid only
    during the callback), then the slot is overwritten. An exception raised by
    ``on_evict`` is logged and counted, never propagated.

    Views returned by :meth:`get` and :meth:`view` alias the slab: they stay
    valid while the key is resident, i.e. until a ``put``/``put_many`` evicts it
    or ``pop`` removes it; pin the key to keep a view valid across those calls.
    Not thread-safe.
    """

    def __init__(self, capacity_bytes: int, block_nbytes: int, *,
                 pin_memory: bool | None = None, on_evict: EvictCallback | None = None) -> None:
        _check_positive(block_nbytes, "block_nbytes")
        _check_positive(capacity_bytes, "capacity_bytes", allow_zero=True)
        if capacity_bytes < block_nbytes:
            raise ConfigError(f"capacity_bytes: {capacity_bytes} is below one block "
                              f"({block_nbytes} bytes)")
        if on_evict is not None and not callable(on_evict):
            raise ConfigError(f"on_evict: expected a callable, got {type(on_evict).__name__}")
        self.block_nbytes = block_nbytes
        self.index = SlotIndex(capacity_bytes // block_nbytes)
        self.on_evict = on_evict
        self._slab = HostSlab(self.index.num_slots, block_nbytes, pin_memory=pin_memory)
        self.pinned = self._slab.pinned
        self.slab: torch.Tensor = self._slab.tensor
        self._counts = dict(puts=0, hits=0, misses=0, evictions=0, dropped_all_pinned=0,
                            evict_callback_errors=0)

    # ------------------------------------------------------------------ queries

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    @property
    def capacity_bytes(self) -> int:
        """Usable capacity: ``num_slots * block_nbytes``."""
        return self.index.num_slots * self.block_nbytes

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def slot_of(self, key: bytes) -> int | None:
        """The slot (row of :attr:`slab`) holding ``key``, or None; no recency change."""
        return self.index.lookup(key)

    def view(self, slot: int) -> np.ndarray:
        """Read-only numpy view of one slot's bytes (see the class docstring for its lifetime)."""
        return self._slab.view(slot)

    def stats(self) -> dict[str, int]:
        """Counters plus current occupancy."""
        return dict(self._counts, blocks=len(self.index), slots=self.num_slots,
                    pinned_blocks=self.index.num_pinned, capacity_bytes=self.capacity_bytes)

    # ------------------------------------------------------------------ single blocks

    def get(self, key: bytes) -> np.ndarray | None:
        """Read-only view of ``key``'s block, or None; marks it most recently used."""
        slot = self.index.lookup(key)
        if slot is None:
            self._counts["misses"] += 1
            return None
        self.index.touch(key)
        self._counts["hits"] += 1
        return self.view(slot)

    def put(self, key: bytes, data: Any) -> bool:
        """Copy one block in (``block_nbytes`` bytes: tensor, array or bytes-like).

        Returns False, storing nothing, when every slot is pinned. A key already
        present is overwritten in place, unless it is pinned (then it is only
        touched: its bytes are in use, and equal keys mean equal content).
        """
        return self.put_many([key], as_rows(data, 1, self.block_nbytes, "data"))[0]

    def pop(self, key: bytes) -> bool:
        """Drop ``key`` without calling ``on_evict``; False if absent. PinnedError if pinned."""
        return self.index.pop(key) is not None

    def pin(self, key: bytes) -> int:
        """Pin ``key`` against eviction and return its slot; KeyError if absent."""
        return self.index.pin(key)

    def unpin(self, key: bytes) -> None:
        """Release one pin taken with :meth:`pin`."""
        self.index.unpin(key)

    # ------------------------------------------------------------------ batches

    def put_many(self, keys: Sequence[bytes], data: Any) -> list[bool]:
        """Store ``len(keys)`` blocks from ``data`` (``[n, block_nbytes]`` bytes) in one copy.

        Returns one flag per key: False where the block was not stored because
        every slot was pinned, or because the batch holds more blocks than the
        tier (its later blocks never displace its earlier ones). When a key
        repeats, its last row wins. Evictions call ``on_evict`` before any byte
        of the batch is copied.
        """
        rows = as_rows(data, len(keys), self.block_nbytes, "data")
        check_keys(keys, "keys")
        last = {k: i for i, k in enumerate(keys)}
        todo, src = self._unpinned_rows(last, len(keys))
        slots, evicted = self.index.allocate_many(todo)
        self._evicted(evicted)
        dropped = _dropped(todo, slots)
        if dropped:
            src = [row for row, slot in zip(src, slots) if slot is not None]
            todo = [key for key, slot in zip(todo, slots) if slot is not None]
            slots = [slot for slot in slots if slot is not None]
            self._counts["dropped_all_pinned"] += len(dropped)
        self._slab.write(slots, todo, rows, src)
        self._counts["puts"] += len(src)
        return [k not in dropped for k in keys] if dropped else [True] * len(keys)

    def _unpinned_rows(self, last: dict[bytes, int], n: int) -> tuple[list[bytes], Sequence[int]]:
        """The keys of a batch to place (pinned ones are in use by a transfer: their
        bytes are kept) and the row of ``data`` that each one stores."""
        pinned = self.index.pinned_among(last)
        if not pinned and len(last) == n:
            return list(last), range(n)
        todo = [k for k in last if k not in pinned]
        return todo, list(map(last.__getitem__, todo))

    def get_many(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        """Copy the blocks of ``keys`` into rows of ``out`` (``[n, block_nbytes]``, writable).

        Hits are copied with one gather and marked most recently used; rows of
        misses are left untouched. Returns one hit flag per key.
        """
        dst = as_rows(out, len(keys), self.block_nbytes, "out", writable=True)
        slots = self.index.lookup_many(keys)
        if None in slots:
            hit = [s is not None for s in slots]
            self._slab.read([s for s in slots if s is not None], dst,
                            [i for i, s in enumerate(slots) if s is not None])
        else:
            hit = [True] * len(keys)
            self._slab.read(slots, dst, range(len(keys)))
        self.index.touch_many(keys)
        nhit = sum(hit)
        self._counts["hits"] += nhit
        self._counts["misses"] += len(keys) - nhit
        return hit

    def _evicted(self, evicted: list[tuple[bytes, int]]) -> None:
        """Count evictions and hand each old block to ``on_evict``, least recently used first."""
        self._counts["evictions"] += len(evicted)
        if self.on_evict is None:
            return
        for key, slot in evicted:
            try:
                self.on_evict(key, self.view(slot))
            except Exception:
                if self._counts["evict_callback_errors"] == 0:
                    log.exception("CPU tier: on_evict raised; the evicted block is dropped")
                self._counts["evict_callback_errors"] += 1


def _dropped(keys: Sequence[bytes], slots: Sequence[int | None]) -> set[bytes]:
    """The keys that got no slot."""
    if None not in slots:
        return set()
    return {k for k, slot in zip(keys, slots) if slot is None}


def _check_positive(value: object, what: str, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigError(f"{what}: expected a {'non-negative' if allow_zero else 'positive'} "
                          f"integer, got {value!r}")
