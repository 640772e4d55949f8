"""Exact LRU stack distances of a stream of block ids, in memory proportional to distinct blocks.

The stack distance of an access is the number of distinct other blocks
accessed since the previous access of the same block (Mattson et al., 1970).
Each block's latest access holds a *slot*; slots are numbered in access
order, and the distance of a block whose latest access is in slot ``p`` is
the number of occupied slots after ``p``. Occupied slots are marked in a
byte array counted three levels deep (per 2^10, 2^16 and 2^22 slots), so
one count reads at most 1,023 bytes (C speed) and a few dozen counters
whatever the trace's size.

Slots only ever grow at the top; when they run out, the occupied ones (one
per distinct block seen) are renumbered 0.. in order (:meth:`_compact`), and
the array doubles when more than half of it stays occupied. Memory: 9 to
21 bytes per distinct block (a 4-byte slot per block, a 4-byte owner and a
mark byte per slot, two to four slots per block, arrays grown by doubling),
nothing per access; time: amortised O(1) per access plus the counting above.
Block ids and slots are 32-bit: ids below 2^31, up to 2^30 distinct blocks.
"""

from __future__ import annotations

from array import array
from typing import Iterable

__all__ = ["StackDistances"]

_L1, _L2, _L3 = 10, 16, 22    # counter levels: slots per counter = 2^level
_FAN = 6                      # counters of one level per counter of the next (2^(16-10), 2^(22-16))
_MIN_SLOTS = 1 << 16
_MAX_ID = (1 << 31) - 1


class StackDistances:
    """Feed block ids (dense non-negative ints) in access order; get each access's stack distance.

    ``min_slots``: slots to start with (compactions begin once they are used up)."""

    __slots__ = ("slot_of", "owner", "marks", "c1", "c2", "c3", "top", "cap", "live")

    def __init__(self, min_slots: int = _MIN_SLOTS) -> None:
        if min_slots < 2:
            raise ValueError(f"min_slots: expected at least 2, got {min_slots}")
        self.slot_of = array("i")              # block -> slot of its latest access, -1 if never accessed
        self.top = self.live = 0               # next free slot; occupied slots (= distinct blocks seen)
        self.cap = 0
        self.owner = array("i")
        self.marks = bytearray()
        self.c1: list[int] = []
        self.c2: list[int] = []
        self.c3: list[int] = []
        self._resize(min_slots)

    @property
    def distinct(self) -> int:
        """Distinct blocks seen."""
        return self.live

    def feed(self, ids: Iterable[int]) -> list[int]:
        """Stack distance of each access (-1 for a block's first access), in order."""
        ids = ids if isinstance(ids, list) else list(ids)
        if ids:
            if min(ids) < 0:
                raise ValueError(f"block ids must be non-negative, got {min(ids)}")
            self._cover(max(ids))
        slot_of, owner, marks = self.slot_of, self.owner, self.marks
        c1, c2, c3 = self.c1, self.c2, self.c3
        count, t, cap, live = marks.count, self.top, self.cap, self.live
        out: list[int] = []
        put = out.append
        for b in ids:
            p = slot_of[b]
            if p >= 0:
                e1, e2, e3 = (p >> _L1) + 1, (p >> _L2) + 1, (p >> _L3) + 1
                put(count(1, p + 1, e1 << _L1) + sum(c1[e1:e2 << _FAN]) + sum(c2[e2:e3 << _FAN]) + sum(c3[e3:]))
                marks[p] = 0
                c1[e1 - 1] -= 1
                c2[e2 - 1] -= 1
                c3[e3 - 1] -= 1
            else:
                put(-1)
                live += 1
            if t == cap:
                self.top = t
                self._compact()
                slot_of, owner, marks = self.slot_of, self.owner, self.marks
                c1, c2, c3 = self.c1, self.c2, self.c3
                count, t, cap = marks.count, self.top, self.cap
            marks[t] = 1
            c1[t >> _L1] += 1
            c2[t >> _L2] += 1
            c3[t >> _L3] += 1
            slot_of[b] = t
            owner[t] = b
            t += 1
        self.top, self.live = t, live
        return out

    def _cover(self, block: int) -> None:
        """Make room in ``slot_of`` for ids up to ``block``."""
        n = len(self.slot_of)
        if block >= n:
            if block > _MAX_ID:
                raise ValueError(f"block ids must be below 2^31, got {block}")
            grow = min(max(block + 1, 2 * n, 1024), _MAX_ID + 1) - n
            self.slot_of.extend(array("i", [-1]) * grow)

    def _compact(self) -> None:
        """Renumber the occupied slots 0..live-1 in order; double the slots if over half stay occupied."""
        import numpy as np

        marks = np.frombuffer(self.marks, dtype=np.uint8)
        owner = np.frombuffer(self.owner, dtype=np.int32)
        blocks = owner[np.flatnonzero(marks[:self.top])]
        live = blocks.size
        owner[:live] = blocks
        np.frombuffer(self.slot_of, dtype=np.int32)[blocks] = np.arange(live, dtype=np.int32)
        marks[:] = 0
        marks[:live] = 1
        del marks, owner
        self.top = live
        if 2 * live > self.cap:
            if 2 * self.cap > _MAX_ID + 1:
                raise ValueError("more than 2^30 distinct blocks: beyond this structure's 32-bit slots")
            self._resize(2 * self.cap)
        self._recount()

    def _resize(self, cap: int) -> None:
        self.marks.extend(bytes(cap - self.cap))
        self.owner.extend(array("i", [0]) * (cap - self.cap))
        self.cap = cap
        self._recount()

    def _recount(self) -> None:
        """Counters of slots 0..top-1 all occupied (the state right after a compaction)."""
        self.c1 = _level_counts(self.top, self.cap, _L1)
        self.c2 = _level_counts(self.top, self.cap, _L2)
        self.c3 = _level_counts(self.top, self.cap, _L3)

    def retained_bytes(self) -> int:
        """Bytes held by the structure's arrays (they grow with distinct blocks, not accesses)."""
        lists = 8 * (len(self.c1) + len(self.c2) + len(self.c3))
        return len(self.marks) + self.owner.itemsize * len(self.owner) + \
            self.slot_of.itemsize * len(self.slot_of) + lists


def _level_counts(occupied: int, cap: int, level: int) -> list[int]:
    size = 1 << level
    n = -(-cap // size)
    full, rest = divmod(occupied, size)
    out = [size] * full + ([rest] if rest else [])
    return out + [0] * (n - len(out))
