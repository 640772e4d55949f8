"""The CPU DRAM tier: a preallocated slab of fixed-size slots with LRU eviction and pins.

Two layers, so that a process can do the bookkeeping without owning the bytes:

* :class:`SlotIndex` (pure Python, no torch): key -> slot, LRU order, pin
  counts, a fixed number of slots. A vLLM scheduler process or the trace
  simulator uses it alone as a metadata-only tier.
* :class:`CPUTier`: a :class:`SlotIndex` plus the slab, a ``uint8`` torch
  tensor ``[num_slots, block_nbytes]`` (page-locked when CUDA is available),
  with block copies in and out. A worker process can also copy into or out of
  explicit slots through :attr:`CPUTier.slab` and :meth:`CPUTier.slot_of`.

Keys are ``bytes`` (block hashes). Neither class is thread-safe: one owner
thread, or the caller serialises access.

Pin rule: a pinned entry is never evicted, popped or overwritten by another
key; pin an entry for as long as a copy into or out of its slot is in flight.
Pinning counts as use: when the last pin is released the entry becomes the
most recently used.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Iterator, Sequence

import numpy as np

from tierkv.errors import ConfigError
from tierkv.transfer import copy_rows

if TYPE_CHECKING:
    import torch

__all__ = ["SlotIndex", "CPUTier", "PinnedError", "EvictCallback"]

log = logging.getLogger(__name__)

#: ``on_evict(key, slot_view)``: ``slot_view`` is a read-only uint8 numpy view of
#: the evicted block, valid only during the call (the slot is reused right after).
EvictCallback = Callable[[bytes, np.ndarray], None]


class PinnedError(RuntimeError):
    """The operation needs a slot that is pinned (every slot pinned, or popping a pinned key)."""


def _check_key(key: object, what: str = "key") -> bytes:
    if not isinstance(key, bytes):
        raise ValueError(f"{what}: expected bytes (a block hash), got {type(key).__name__}")
    return key


def _check_keys(keys: Collection[object], what: str = "keys") -> None:
    """:func:`_check_key` for every key, with one C-level pass when all are plain ``bytes``."""
    if not set(map(type, keys)) <= {bytes}:
        for key in keys:
            _check_key(key, what)


class SlotIndex:
    """Key -> slot mapping with LRU order and pin counts over ``num_slots`` slots.

    Unpinned entries live in an ordered dict (front = least recently used) so
    that eviction is O(1) even when many entries are pinned; pinned entries are
    kept aside with their counts until released. Iteration yields keys in
    eviction order: unpinned entries least recently used first, then pinned
    entries in the order they were pinned.
    """

    __slots__ = ("num_slots", "_slot", "_lru", "_pins", "_free")

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots: expected a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot: dict[bytes, int] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._lru)
        yield from list(self._pins)

    @property
    def num_free(self) -> int:
        """Slots holding no entry."""
        return len(self._free)

    def lookup(self, key: bytes) -> int | None:
        """The slot of ``key``, or None; does not change recency."""
        return self._slot.get(_check_key(key))

    def lookup_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """:meth:`lookup` for each key: slots (None where absent); no recency change."""
        _check_keys(keys)
        return list(map(self._slot.get, keys))

    def pinned_among(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` that hold at least one pin."""
        return self._pins.keys() & keys if self._pins else set()

    def pin_count(self, key: bytes) -> int:
        """How many pins ``key`` holds (0 when unpinned or absent)."""
        return self._pins.get(key, 0)

    # ------------------------------------------------------------------ updates

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used; False if absent. Pinned keys become MRU on unpin."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        return key in self._pins

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`touch` each key in turn (absent keys are skipped)."""
        lru = self._lru
        move = lru.move_to_end
        for key in keys:
            if key in lru:
                move(key)

    def allocate(self, key: bytes) -> tuple[int, bytes | None]:
        """Give ``key`` a slot, evicting the least recently used unpinned entry if full.

        Returns ``(slot, evicted_key)``; ``evicted_key`` is None when a free slot
        was used or ``key`` was already present (then its own slot is returned
        and it becomes most recently used). The evicted entry is gone from the
        index, but its bytes stay in the slot until the caller overwrites them.
        Raises :class:`PinnedError` when every slot is pinned.
        """
        got = self.try_allocate(key)
        if got is None:
            raise PinnedError(f"all {self.num_slots} slots are pinned; cannot place a new block")
        return got

    def try_allocate(self, key: bytes) -> tuple[int, bytes | None] | None:
        """Like :meth:`allocate`, but returns None when every slot is pinned."""
        slot = self._slot.get(_check_key(key))
        if slot is not None:
            self.touch(key)
            return slot, None
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            evicted, _ = self._lru.popitem(last=False)
            slot = self._slot.pop(evicted)
        else:
            return None
        self._slot[key] = slot
        self._lru[key] = None
        return slot, evicted

    def allocate_many(self, keys: Sequence[bytes]
                      ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`try_allocate` each key in turn, except that no key given a slot by
        this call is evicted to place a later one.

        Returns ``(slots, evicted)``: ``slots[i]`` is the slot of ``keys[i]``, or
        None when every other slot is pinned or taken by an earlier key of the
        batch; ``evicted`` lists the evicted entries as ``(key, slot)``, least
        recently used first (their bytes are still in those slots).
        """
        _check_keys(keys)
        if len(keys) == len(set(keys)) and self._slot.keys().isdisjoint(keys):
            return self._allocate_new(keys)
        return self._allocate_each(keys)

    def _allocate_new(self, keys: Sequence[bytes]
                      ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` for distinct keys that are all absent."""
        nfree = min(len(keys), len(self._free))
        slots: list[int | None] = self._free[len(self._free) - nfree:][::-1]  # pop() order
        del self._free[len(self._free) - nfree:]
        victims = list(islice(self._lru, min(len(keys) - nfree, len(self._lru))))
        lru = self._lru
        for key in victims:
            del lru[key]
        freed = list(map(self._slot.pop, victims))
        slots += freed
        placed = keys[:len(slots)]
        self._slot.update(zip(placed, slots))
        for key in placed:
            lru[key] = None
        slots += [None] * (len(keys) - len(slots))
        return slots, list(zip(victims, freed))

    def _allocate_each(self, keys: Sequence[bytes]
                       ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` one key at a time (repeated or present keys)."""
        slots: list[int | None] = []
        evicted: list[tuple[bytes, int]] = []
        placed: set[bytes] = set()  # keys of this call in the LRU list, all behind the others
        for key in keys:
            slot = self._slot.get(key)
            if slot is not None:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    placed.add(key)
                slots.append(slot)
                continue
            if self._free:
                slot = self._free.pop()
            elif len(self._lru) > len(placed):
                victim, _ = self._lru.popitem(last=False)
                slot = self._slot.pop(victim)
                evicted.append((victim, slot))
            else:
                slots.append(None)
                continue
            self._slot[key] = slot
            self._lru[key] = None
            placed.add(key)
            slots.append(slot)
        return slots, evicted

    def pop(self, key: bytes) -> int | None:
        """Remove ``key`` and free its slot; return the slot or None if absent.

        Raises :class:`PinnedError` if ``key`` is pinned.
        """
        slot = self._slot.get(_check_key(key))
        if slot is None:
            return None
        if key in self._pins:
            raise PinnedError(f"key {key.hex()[:16]}... is pinned; unpin it before popping")
        del self._slot[key]
        del self._lru[key]
        self._free.append(slot)
        return slot

    def pin(self, key: bytes) -> int:
        """Add one pin to ``key`` and return its slot; KeyError if absent."""
        slot = self._slot.get(_check_key(key))
        if slot is None:
            raise KeyError(key)
        count = self._pins.get(key, 0)
        if count == 0:
            del self._lru[key]
        self._pins[key] = count + 1
        return slot

    def unpin(self, key: bytes) -> None:
        """Release one pin; the entry becomes most recently used when the last pin goes."""
        count = self._pins.get(_check_key(key), 0)
        if count == 0:
            raise RuntimeError(f"unpin of key {key.hex()[:16]}... that holds no pin")
        if count == 1:
            del self._pins[key]
            self._lru[key] = None
        else:
            self._pins[key] = count - 1

    def check(self) -> None:
        """Assert the accounting invariants (for tests and debugging)."""
        assert len(self._slot) + len(self._free) == self.num_slots, (
            f"entries {len(self._slot)} + free {len(self._free)} != slots {self.num_slots}")
        assert len(self._lru) + len(self._pins) == len(self._slot), (
            f"unpinned {len(self._lru)} + pinned {len(self._pins)} != entries {len(self._slot)}")
        assert set(self._lru).isdisjoint(self._pins), "a key is both pinned and in the LRU list"
        used = set(self._slot.values())
        assert len(used) == len(self._slot) and used.isdisjoint(self._free), "a slot is shared"


# ---------------------------------------------------------------------- byte views

def _as_rows(data: Any, n: int, block_nbytes: int, what: str, *, writable: bool = False) -> np.ndarray:
    """View ``data`` as a C-contiguous uint8 array ``[n, block_nbytes]`` without copying.

    Accepts CPU torch tensors and numpy arrays of any dtype (``bytes``-like
    objects for reading); raises ValueError naming ``what`` otherwise.
    """
    arr = _as_numpy(data, what)
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: must be writable")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous")
    if arr.nbytes != n * block_nbytes:
        raise ValueError(f"{what}: expected {n} x {block_nbytes} = {n * block_nbytes} bytes, "
                         f"got {arr.nbytes}")
    return arr.reshape(-1).view(np.uint8).reshape(n, block_nbytes)


def _as_numpy(data: Any, what: str) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if type(data).__module__.startswith("torch"):
        if data.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor, got one on {data.device}")
        if not data.is_contiguous():
            raise ValueError(f"{what}: must be contiguous")
        return data.detach().reshape(-1).view(_torch().uint8).numpy()
    raise ValueError(f"{what}: expected a torch tensor, numpy array or bytes, "
                     f"got {type(data).__name__}")


def _torch() -> Any:
    import torch
    return torch


def _pin_wanted(pin_memory: bool | None) -> bool:
    torch = _torch()
    cuda = torch.cuda.is_available()
    if pin_memory and not cuda:
        log.info("pin_memory=True but CUDA is not available; the CPU slab is not pinned")
    return cuda and pin_memory is not False


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
        torch = _torch()
        self.block_nbytes = block_nbytes
        self.index = SlotIndex(capacity_bytes // block_nbytes)
        self.on_evict = on_evict
        self.pinned = _pin_wanted(pin_memory)
        self.slab: torch.Tensor = torch.empty((self.index.num_slots, block_nbytes),
                                              dtype=torch.uint8, pin_memory=self.pinned)
        self._np = self.slab.numpy()
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
        row = self._np[slot]
        row.flags.writeable = False
        return row

    def stats(self) -> dict[str, int]:
        """Counters plus current occupancy."""
        return dict(self._counts, blocks=len(self.index), slots=self.num_slots,
                    pinned_blocks=len(self.index._pins), capacity_bytes=self.capacity_bytes)

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
        return self.put_many([key], _as_rows(data, 1, self.block_nbytes, "data"))[0]

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
        rows = _as_rows(data, len(keys), self.block_nbytes, "data")
        _check_keys(keys, "keys")
        last = {k: i for i, k in enumerate(keys)}
        todo, src = self._unpinned_rows(last, len(keys))
        slots, evicted = self.index.allocate_many(todo)
        self._evicted(evicted)
        dropped = _dropped(todo, slots)
        if dropped:
            src = [row for row, slot in zip(src, slots) if slot is not None]
            slots = [slot for slot in slots if slot is not None]
            self._counts["dropped_all_pinned"] += len(dropped)
        copy_rows(rows, src, self._np, slots)
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
        dst = _as_rows(out, len(keys), self.block_nbytes, "out", writable=True)
        slots = self.index.lookup_many(keys)
        if None in slots:
            hit = [s is not None for s in slots]
            copy_rows(self._np, [s for s in slots if s is not None], dst,
                      [i for i, s in enumerate(slots) if s is not None])
        else:
            hit = [True] * len(keys)
            copy_rows(self._np, slots, dst, range(len(keys)))
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
