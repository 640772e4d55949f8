"""Keys of fixed width -> slot, in flat arrays: the hash table of a :class:`CompactIndex`.

* ``keys``: one ``bytearray``, ``width`` bytes per slot (fixed by the first key
  placed); the slot is the entry;
* ``table``: open addressing with linear probing on ``hash(key)`` (cached in the
  caller's ``bytes`` objects), ``slot + 1`` per cell, at most half full;
  deletion shifts the following run back (no tombstones);
* keys of another width (a policy's tombstones) live in two small dicts.

Not thread-safe.
"""

from __future__ import annotations

from array import array
from typing import Sequence

__all__ = ["FlatKeys", "NIL"]

NIL = -1


class FlatKeys:
    """Key -> slot over slots handed out by the caller."""

    def __init__(self) -> None:
        self.width = 0
        self.keys = bytearray()
        self.table = array("i", bytes(4 * 16))
        self.count = 0                        # entries in the table
        self.odd: dict[bytes, int] = {}       # keys of another width -> slot
        self._odd_key: dict[int, bytes] = {}  # slot -> such a key

    def __len__(self) -> int:
        return self.count + len(self.odd)

    def grow(self, slots: int) -> None:
        """Room for ``slots`` slots' keys."""
        missing = slots * self.width - len(self.keys)
        if missing > 0:
            self.keys.extend(bytes(missing))

    def key_of(self, slot: int) -> bytes:
        odd = self._odd_key.get(slot)
        if odd is not None:
            return odd
        w = self.width
        return bytes(self.keys[slot * w:(slot + 1) * w])

    def fits(self, key: bytes) -> bool:
        """Does ``key`` go in the table (the first key placed sets the width)?"""
        if not self.width:
            self.width = len(key)
        return len(key) == self.width

    def find(self, key: bytes) -> int:
        """The key's slot, or :data:`NIL`."""
        if len(key) != self.width:
            return self.odd.get(key, NIL)
        table, keys, w = self.table, self.keys, self.width
        mask = len(table) - 1
        i = hash(key) & mask
        while True:
            cell = table[i]
            if not cell:
                return NIL
            at = (cell - 1) * w
            if keys[at:at + w] == key:
                return cell - 1
            i = (i + 1) & mask

    def insert(self, key: bytes, slot: int, slots: int) -> None:
        """Enter ``key`` at ``slot`` (``slots``: how many slots the caller has handed out room for)."""
        if not self.fits(key):
            self.odd[key] = slot
            self._odd_key[slot] = key
            return
        self.grow(slots)
        w = self.width
        self.keys[slot * w:slot * w + w] = key
        if 2 * (self.count + 1) > len(self.table):
            self._rehash(2 * len(self.table))
        table = self.table
        mask = len(table) - 1
        i = hash(key) & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = slot + 1
        self.count += 1

    def _rehash(self, size: int) -> None:
        old, w, keys = self.table, self.width, self.keys
        table = array("i", bytes(4 * size))
        mask = size - 1
        for cell in old:
            if cell:
                s = cell - 1
                i = hash(bytes(keys[s * w:s * w + w])) & mask
                while table[i]:
                    i = (i + 1) & mask
                table[i] = cell
        self.table = table

    def delete(self, key: bytes, slot: int) -> None:
        """Remove ``key`` (at ``slot``): backward-shift deletion."""
        if len(key) != self.width:
            del self.odd[key]
            del self._odd_key[slot]
            return
        table, keys, w = self.table, self.keys, self.width
        mask = len(table) - 1
        i = hash(key) & mask
        while table[i] != slot + 1:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            cell = table[j]
            if not cell:
                break
            s = cell - 1
            home = hash(bytes(keys[s * w:s * w + w])) & mask
            if (j - home) & mask >= (j - i) & mask:  # the entry at j may move back to i
                table[i] = cell
                i = j
        table[i] = 0
        self.count -= 1

    def fill(self, keys: Sequence[bytes]) -> None:
        """Enter distinct same-width ``keys`` in an empty table at slots 0..n-1, in bulk."""
        n = len(keys)
        self.width = len(keys[0])
        self.keys = bytearray(b"".join(keys))
        size = 16
        while size < 2 * n:
            size *= 2
        table = array("i", bytes(4 * size))
        mask = size - 1
        for cell, key in enumerate(keys, 1):
            i = hash(key) & mask
            while table[i]:
                i = (i + 1) & mask
            table[i] = cell
        self.table, self.count = table, n

    def nbytes(self) -> int:
        return len(self.keys) + self.table.itemsize * len(self.table)

    def check(self) -> None:
        assert sum(1 for c in self.table if c) == self.count, "table count is off"
