"""A :class:`~kvstrata.policy.slot_index.SlotIndex` in flat arrays: ~45 bytes per 32-byte key.

The SSD tier's index in the tier policy holds every block the tier holds, tens
of millions on a large disk; a dict and an ordered dict of ``bytes`` objects
cost ~250 bytes per key. Here the slot is the entry:

* the keys: a :class:`~kvstrata.policy.flat_keys.FlatKeys` table, ``width``
  bytes per slot in one ``bytearray`` and an open-addressing table of slots
  (keys of another length, the policy's tombstones, always pinned, aside);
* ``_prev`` / ``_next``: ``array('i')`` links of the LRU list of unpinned
  entries (slot numbers; ``-1`` ends the list);
* pinned entries (a few: those open plans use) leave the LRU list and are
  counted in a dict.

Memory grows with occupancy, not capacity (arrays double as slots are handed
out). Same contract, order and errors as :class:`SlotIndex` (the tier policy's
state-machine tests run against both). Not thread-safe.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator, Sequence

from kvstrata.errors import ConfigError
from kvstrata.policy.flat_keys import NIL as _NIL, FlatKeys
from kvstrata.policy.slot_index import PinnedError, SlotCounts, check_key, check_keys

__all__ = ["CompactIndex"]


class CompactIndex(SlotCounts):
    """Key -> slot with LRU order and pin counts over ``num_slots`` slots, in flat arrays."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots: expected a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._k = FlatKeys()
        self._prev = array("i")
        self._next = array("i")
        self._head = self._tail = _NIL        # LRU list: head = least recently used
        self._lru_len = 0
        self._pins: dict[bytes, int] = {}     # pinned key -> count (insertion order = pin order)
        self._free = array("i")               # freed slots; pop() reuses the most recently freed
        self._unused = 0

    # ------------------------------------------------------------------ storage

    def _insert(self, key: bytes, slot: int) -> None:
        """Enter ``key`` at ``slot``, making room in the per-slot arrays (doubling)."""
        have = len(self._prev)
        if slot >= have:
            new = min(self.num_slots, max(slot + 1, 2 * have, 64))
            self._prev.extend([_NIL] * (new - have))
            self._next.extend([_NIL] * (new - have))
        self._k.insert(key, slot, len(self._prev))

    # ------------------------------------------------------------------ LRU list

    def _link_tail(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        prev[slot], nxt[slot] = self._tail, _NIL
        if self._tail == _NIL:
            self._head = slot
        else:
            nxt[self._tail] = slot
        self._tail = slot
        self._lru_len += 1

    def _unlink(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        p, n = prev[slot], nxt[slot]
        if p == _NIL:
            self._head = n
        else:
            nxt[p] = n
        if n == _NIL:
            self._tail = p
        else:
            prev[n] = p
        self._lru_len -= 1

    def _lru_slots(self, n: int | None = None) -> Iterator[int]:
        slot, nxt, left = self._head, self._next, self._lru_len if n is None else n
        while slot != _NIL and left > 0:
            yield slot
            slot = nxt[slot]
            left -= 1

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: object) -> bool:
        k = self._k
        w = k.width
        if not isinstance(key, bytes) or len(key) != w:
            return key in k.odd
        table, keys = k.table, k.keys
        mask = len(table) - 1
        i = hash(key) & mask
        while True:  # FlatKeys.find, inlined: the policy's lookups call this for every prompt block
            cell = table[i]
            if not cell:
                return False
            at = (cell - 1) * w
            if keys[at:at + w] == key:
                return True
            i = (i + 1) & mask

    def __len__(self) -> int:
        return len(self._k)

    def __iter__(self) -> Iterator[bytes]:
        yield from [self._k.key_of(s) for s in self._lru_slots()]
        yield from list(self._pins)

    def lookup(self, key: bytes) -> int | None:
        slot = self._k.find(check_key(key))
        return None if slot == _NIL else slot

    def lookup_many(self, keys: Sequence[bytes]) -> list[int | None]:
        check_keys(keys)
        return [self.lookup(k) for k in keys]

    def lru_keys(self, n: int | None = None) -> list[bytes]:
        return [self._k.key_of(s) for s in self._lru_slots(n)]

    def nbytes(self) -> int:
        """Bytes held by the arrays (the per-key cost; the few pinned keys aside)."""
        return (self._k.nbytes() + self._prev.itemsize * (len(self._prev) + len(self._next))
                + self._free.itemsize * len(self._free))

    # ------------------------------------------------------------------ updates

    def touch(self, key: bytes) -> bool:
        slot = self._k.find(key)
        if slot == _NIL:
            return False
        if key not in self._pins:
            self._unlink(slot)
            self._link_tail(slot)
        return True

    def touch_many(self, keys: Iterable[bytes]) -> None:
        pins = self._pins
        for key in keys:
            slot = self._k.find(key)
            if slot != _NIL and key not in pins:
                self._unlink(slot)
                self._link_tail(slot)

    def _evict_lru(self) -> tuple[bytes, int]:
        slot = self._head
        key = self._k.key_of(slot)
        self._unlink(slot)
        self._k.delete(key, slot)
        return key, slot

    def allocate(self, key: bytes) -> tuple[int, bytes | None]:
        got = self.try_allocate(key)
        if got is None:
            raise PinnedError(f"all {self.num_slots} slots are pinned; cannot place a new block")
        return got

    def try_allocate(self, key: bytes) -> tuple[int, bytes | None] | None:
        slot = self._k.find(check_key(key))
        if slot != _NIL:
            self.touch(key)
            return slot, None
        evicted = None
        free = self._take_free()
        if free is None:
            if self._head == _NIL:
                return None
            evicted, free = self._evict_lru()
        self._insert(key, free)
        self._link_tail(free)
        return free, evicted

    def allocate_many(self, keys: Sequence[bytes], *, pin: bool = False
                      ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        check_keys(keys)
        if self._can_fill(keys, pin):
            return self._fill(keys), []
        slots: list[int | None] = []
        evicted: list[tuple[bytes, int]] = []
        placed = 0  # keys of this call at the LRU list's end, never evicted for a later one
        ours: set[int] = set()
        for key in keys:
            slot = self._k.find(key)
            if slot != _NIL:
                if key not in self._pins:
                    self._unlink(slot)
                    self._link_tail(slot)
                    if slot not in ours:
                        ours.add(slot)
                        placed += 1
                slots.append(slot)
                continue
            slot = self._take_free()
            if slot is None:
                if self._lru_len <= placed:
                    slots.append(None)
                    continue
                victim, slot = self._evict_lru()
                evicted.append((victim, slot))
            self._insert(key, slot)
            self._link_tail(slot)
            ours.add(slot)
            placed += 1
            slots.append(slot)
        if pin:
            self.pin_many([k for k, s in zip(keys, slots) if s is not None])
        return slots, evicted

    def _can_fill(self, keys: Sequence[bytes], pin: bool) -> bool:
        """Is this the first placement of distinct same-length keys that fit (a start-up seed)?"""
        return (not pin and not len(self) and self._unused == 0 and 0 < len(keys) <= self.num_slots
                and len({len(k) for k in keys}) == 1 and len(set(keys)) == len(keys))

    def _fill(self, keys: Sequence[bytes]) -> list[int | None]:
        """Place ``keys`` in an empty index in slots 0..n-1, least recently used first, in
        bulk (the per-slot arrays built whole, one probe loop for the table)."""
        n = len(keys)
        self._k.fill(keys)
        self._prev = array("i", range(-1, n - 1))
        self._next = array("i", range(1, n + 1))
        self._next[n - 1] = _NIL
        self._head, self._tail, self._lru_len, self._unused = 0, n - 1, n, n
        return list(range(n))

    def allocate_absent(self, keys: Sequence[bytes], *, pin: bool = False
                        ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` for distinct absent keys: free slots first, then the least
        recently used entries in order; with ``pin`` every placed key is pinned."""
        slots: list[int | None] = []
        evicted: list[tuple[bytes, int]] = []
        victims = self._lru_len  # entries older than this call (new ones go behind them)
        for key in keys:
            slot = self._take_free()
            if slot is None:
                if not victims:
                    break
                victims -= 1
                victim, slot = self._evict_lru()
                evicted.append((victim, slot))
            self._insert(key, slot)
            if pin:
                self._pins[key] = 1
            else:
                self._link_tail(slot)
            slots.append(slot)
        slots += [None] * (len(keys) - len(slots))
        return slots, evicted

    def pop(self, key: bytes) -> int | None:
        slot = self._k.find(check_key(key))
        if slot == _NIL:
            return None
        if key in self._pins:
            raise PinnedError(f"key {key.hex()[:16]}... is pinned; unpin it before popping")
        self._unlink(slot)
        self._k.delete(key, slot)
        self._free.append(slot)
        return slot

    def rename(self, key: bytes, new_key: bytes) -> None:
        if self._k.find(new_key) != _NIL:
            raise ValueError("new_key: already present")
        slot = self._k.find(key)
        if slot == _NIL:
            raise KeyError(key)
        pinned = key in self._pins
        if not pinned:
            self._unlink(slot)
        self._k.delete(key, slot)
        self._insert(new_key, slot)
        if pinned:
            self._pins[new_key] = self._pins.pop(key)
        else:
            self._link_tail(slot)

    def pin(self, key: bytes) -> int:
        slot = self._k.find(check_key(key))
        if slot == _NIL:
            raise KeyError(key)
        count = self._pins.get(key, 0)
        if count == 0:
            self._unlink(slot)
        self._pins[key] = count + 1
        return slot

    def pin_many(self, keys: Sequence[bytes]) -> list[int]:
        out = []
        pins = self._pins
        for key in keys:
            slot = self._k.find(key)
            if slot == _NIL:
                raise KeyError(key)
            count = pins.get(key, 0)
            if not count:
                self._unlink(slot)
            pins[key] = count + 1
            out.append(slot)
        return out

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.unpin(key)

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise RuntimeError(f"unpin of key {key.hex()[:16]}... that holds no pin")
        if count == 1:
            del self._pins[key]
            self._link_tail(self._k.find(key))
        else:
            self._pins[key] = count - 1

    def check(self) -> None:
        """Assert the accounting invariants (for tests and debugging)."""
        entries = len(self)
        assert entries + self.num_free == self.num_slots, (
            f"entries {entries} + free {self.num_free} != slots {self.num_slots}")
        assert self._lru_len + len(self._pins) == entries, (
            f"unpinned {self._lru_len} + pinned {len(self._pins)} != entries {entries}")
        lru = list(self._lru_slots())
        assert len(lru) == self._lru_len, "the LRU list's length is off"
        self._k.check()
        keys = [self._k.key_of(s) for s in lru]
        assert set(keys).isdisjoint(self._pins), "a key is both pinned and in the LRU list"
        assert all(self._k.find(k) == s for k, s in zip(keys, lru)), "an LRU entry is not found by its key"
        used = set(lru) | {self._k.find(k) for k in self._pins}
        assert len(used) == entries and used.isdisjoint(self._free), "a slot is shared"
        assert all(s < self._unused for s in used | set(self._free)), "a slot beyond the handed-out range"

