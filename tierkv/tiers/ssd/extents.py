"""Free-space map of the SSD tier's page file: page extents, best fit, coalescing.

The page file is an array of 4 KiB pages ``[0, limit)``. Every stored
payload occupies one extent (a run of pages). :class:`ExtentMap` hands out
the smallest free extent that fits (so the file grows only when no hole fits:
the free space past the end of the file is one large extent) and merges an extent with its free
neighbours when it is returned. Both operations take O(log s) for s distinct
free-extent sizes.

Not thread-safe and needs no lock: recovery builds it at open, before the
writer thread starts; from then on the writer thread alone allocates and frees.
"""

from __future__ import annotations

import bisect
from typing import Iterable

__all__ = ["ExtentMap"]


class ExtentMap:
    """Free page extents of a file of ``limit`` pages.

    ``used`` lists the ``(start, npages)`` extents that are taken; they must
    not overlap (see :meth:`overlapping`). Used extents may reach past
    ``limit`` (a tier reopened with a smaller capacity): pages past the limit
    are never handed out again.
    """

    def __init__(self, limit: int, used: Iterable[tuple[int, int]] = ()) -> None:
        if limit < 0:
            raise ValueError(f"limit: expected >= 0 pages, got {limit}")
        self.limit = limit
        self._by_start: dict[int, int] = {}       # free start -> npages
        self._by_end: dict[int, int] = {}         # free end -> start
        self._starts: dict[int, set[int]] = {}    # npages -> free starts of that size
        self._sizes: list[int] = []               # sorted distinct npages of free extents
        self.free_pages = 0
        at = 0
        for start, npages in sorted(used):
            if at < start and at < limit:
                self._add(at, min(start, limit) - at)
            at = max(at, start + npages)
        if at < limit:
            self._add(at, limit - at)
        self._used_end = at  # pages past the limit stay in the file until reopened

    @staticmethod
    def overlapping(used: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The extents of ``used`` that overlap an earlier (lower-addressed) one."""
        bad: list[tuple[int, int]] = []
        end = 0
        for start, npages in sorted(used):
            if start < end:
                bad.append((start, npages))
            else:
                end = start + npages
        return bad

    # ------------------------------------------------------------------ queries

    @property
    def high_water(self) -> int:
        """One past the last page that is not free (the file never needs to be longer).
        Used extents given past the limit count until the map is rebuilt."""
        start = self._by_end.get(self.limit)
        return max(self.limit if start is None else start, self._used_end)

    def largest(self) -> int:
        """Pages in the largest free extent (0 if none)."""
        return self._sizes[-1] if self._sizes else 0

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, npages: int) -> int | None:
        """Take ``npages`` contiguous pages; return the first, or None if no extent fits."""
        if npages <= 0:
            raise ValueError(f"npages: expected > 0, got {npages}")
        i = bisect.bisect_left(self._sizes, npages)
        if i == len(self._sizes):
            return None
        size = self._sizes[i]
        start = next(iter(self._starts[size]))
        self._remove(start, size)
        if size > npages:
            self._add(start + npages, size - npages)
        return start

    def free(self, start: int, npages: int) -> None:
        """Return an extent; pages past ``limit`` are dropped. Merges with free neighbours."""
        end = min(start + npages, self.limit)
        if npages <= 0 or start >= end:
            return
        if start in self._by_start or self._by_end.get(end) is not None:
            raise ValueError(f"extent ({start}, {npages}) is already free")
        before = self._by_end.get(start)
        if before is not None:
            self._remove(before, start - before)
            start = before
        after = self._by_start.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        self._add(start, end - start)

    # ------------------------------------------------------------------ internals

    def _add(self, start: int, npages: int) -> None:
        self._by_start[start] = npages
        self._by_end[start + npages] = start
        starts = self._starts.get(npages)
        if starts is None:
            starts = self._starts[npages] = set()
            bisect.insort(self._sizes, npages)
        starts.add(start)
        self.free_pages += npages

    def _remove(self, start: int, npages: int) -> None:
        del self._by_start[start]
        del self._by_end[start + npages]
        starts = self._starts[npages]
        starts.discard(start)
        if not starts:
            del self._starts[npages]
            del self._sizes[bisect.bisect_left(self._sizes, npages)]
        self.free_pages -= npages
