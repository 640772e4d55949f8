"""Free-space map of the SSD tier's page file: page extents, best fit, coalescing.

The page file is an array of 4 KiB pages ``[0, limit)``. Every stored
payload occupies one extent (a run of pages). :class:`ExtentMap` hands out
the smallest free extent that fits (so the file grows only when no hole fits:
the free space past the end of the file is one large extent) and merges an extent with its free
neighbours when it is returned. Both operations take O(log s) for s distinct
free-extent sizes. A map is built in bulk, with numpy, from the used extents
(recovery) or from the free extents a clean close saved
(:mod:`~kvstrata.tiers.ssd.snapshot`).

Not thread-safe and needs no lock: recovery builds it at open, before the
writer thread starts; from then on the writer thread alone allocates and frees.
"""

from __future__ import annotations

import bisect
from typing import Iterable

import numpy as np

__all__ = ["ExtentMap"]


class ExtentMap:
    """Free page extents of a file of ``limit`` pages.

    ``used`` lists the ``(start, npages)`` extents that are taken; they must
    not overlap (see :meth:`overlapping`). Used extents may reach past
    ``limit`` (a tier reopened with a smaller capacity): pages past the limit
    are never handed out again.
    """

    def __init__(self, limit: int, used: Iterable[tuple[int, int]] = ()) -> None:
        pairs = sorted(used)
        self._set_used(limit, np.array([p for p, _ in pairs], dtype=np.int64),
                       np.array([n for _, n in pairs], dtype=np.int64))

    @classmethod
    def from_used(cls, limit: int, starts: np.ndarray, npages: np.ndarray) -> "ExtentMap":
        """:class:`ExtentMap` of the used extents ``(starts[i], npages[i])`` (arrays in any
        order), built in bulk."""
        starts, npages = np.asarray(starts, np.int64), np.asarray(npages, np.int64)
        order = np.argsort(starts, kind="stable")
        self = cls.__new__(cls)
        self._set_used(limit, starts[order], npages[order])
        return self

    @classmethod
    def from_free(cls, limit: int, starts: np.ndarray, npages: np.ndarray,
                  used_end: int) -> "ExtentMap":
        """The map whose free extents are exactly ``(starts[i], npages[i])`` (disjoint, none
        adjacent to another, inside ``limit``: as :meth:`free_extents` gives them), with
        used pages reaching up to ``used_end``."""
        self = cls.__new__(cls)
        self._load(limit, np.asarray(starts, np.int64), np.asarray(npages, np.int64), used_end)
        return self

    def free_extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Every free extent: first pages (ascending) and lengths, as ``int64`` arrays."""
        n = len(self._by_start)
        starts = np.fromiter(self._by_start.keys(), np.int64, n)
        npages = np.fromiter(self._by_start.values(), np.int64, n)
        order = np.argsort(starts)
        return starts[order], npages[order]

    def _set_used(self, limit: int, starts: np.ndarray, npages: np.ndarray) -> None:
        """Free every page of ``[0, limit)`` outside the used extents (sorted by start)."""
        keep = npages > 0
        starts, npages = starts[keep], npages[keep]
        ends = np.maximum.accumulate(starts + npages) if len(starts) else starts
        gap_starts = np.concatenate(([0], ends)).astype(np.int64)
        gap_ends = np.minimum(np.concatenate((starts, [max(limit, 0)])), limit).astype(np.int64)
        gaps = gap_starts < gap_ends
        used_end = int(ends[-1]) if len(ends) else 0  # pages past the limit stay until reopened
        self._load(limit, gap_starts[gaps], gap_ends[gaps] - gap_starts[gaps], used_end)

    def _load(self, limit: int, starts: np.ndarray, npages: np.ndarray, used_end: int) -> None:
        if limit < 0:
            raise ValueError(f"limit: expected >= 0 pages, got {limit}")
        self.limit = limit
        first, size = starts.tolist(), npages.tolist()
        self._by_start: dict[int, int] = dict(zip(first, size))           # free start -> npages
        self._by_end: dict[int, int] = dict(zip((starts + npages).tolist(), first))  # end -> start
        self._starts: dict[int, set[int]] = {}    # npages -> free starts of that size
        if len(first):
            order = np.argsort(npages, kind="stable")
            by_size = npages[order]
            cuts = np.flatnonzero(np.diff(by_size)) + 1
            sizes = by_size[np.concatenate(([0], cuts))].tolist()
            groups = np.split(starts[order], cuts)
            self._starts = {n: set(group.tolist()) for n, group in zip(sizes, groups)}
        self._sizes: list[int] = sorted(self._starts)  # sorted distinct npages of free extents
        self.free_pages = int(npages.sum())
        self._used_end = used_end

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
        end = self.limit if start is None else start
        return max(end, self._used_end) if self._used_end > self.limit else end

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
