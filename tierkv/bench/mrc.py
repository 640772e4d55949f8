"""Exact LRU miss-ratio curves in one pass over a trace.

An LRU cache of ``C`` blocks holds a block at its next access iff its *stack
distance* (distinct other blocks accessed since its previous access) is below
``C`` (Mattson et al., 1970), so one pass that computes every access's stack
distance gives the hit rate at every capacity at once.

Prefix rule (the definition used in every tierkv output): a request's blocks
are looked up in prefix order and block ``j`` is served from cache only if
blocks ``0..j`` all are. With an LRU cache of ``C`` blocks that is "the
largest stack distance among blocks ``0..j`` is below ``C``", so the curve
is built from per-request running maxima of the distances. Every block of a
request is accessed (moved to most-recently used) whether it hit or not,
matching a cache that stores recomputed blocks.

Stack distances are counted over a bit array of "latest access" marks split
into 1024-entry chunks with per-chunk counts (sqrt decomposition, the same
counting a Fenwick tree does, but with C-speed counting inside a chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

    from tierkv.bench.traces import Trace

__all__ = ["MissRatioCurve", "StackPass", "stack_distances", "build_mrc"]

_CHUNK = 1024


def stack_distances(accesses: Sequence[int]) -> tuple[list[int], list[int]]:
    """Return ``(distance, previous)`` per access; both are -1 for a block's first access.

    ``distance[t]``: distinct other blocks accessed strictly between the
    previous access of the same block and ``t``. ``previous[t]``: that
    previous access's index.
    """
    n = len(accesses)
    marks = bytearray(n)
    counts = [0] * (n // _CHUNK + 1)
    last: dict[int, int] = {}
    get = last.get
    dist = [-1] * n
    prev = [-1] * n
    for t in range(n):
        b = accesses[t]
        p = get(b)
        if p is not None:
            q = p // _CHUNK + 1
            dist[t] = sum(counts[q:]) + marks[p + 1:q * _CHUNK].count(1)
            prev[t] = p
            marks[p] = 0
            counts[q - 1] -= 1
        marks[t] = 1
        counts[t // _CHUNK] += 1
        last[b] = t
    return dist, prev


@dataclass
class MissRatioCurve:
    """Hit rate of an LRU cache of any capacity (in blocks) under the prefix rule."""

    block_size: int
    accesses: int
    distances: "np.ndarray"   # sorted effective distances of the accesses that hit in an unbounded cache

    def hits(self, capacity_blocks: int) -> int:
        import numpy as np

        return int(np.searchsorted(self.distances, capacity_blocks, side="left"))

    def hit_rate(self, capacity_blocks: int) -> float:
        return self.hits(capacity_blocks) / self.accesses if self.accesses else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        """Hit rate of an unbounded cache."""
        return len(self.distances) / self.accesses if self.accesses else 0.0

    @property
    def saturation_blocks(self) -> int:
        """Smallest capacity that reaches the ideal hit rate."""
        return int(self.distances[-1]) + 1 if len(self.distances) else 0

    def capacity_for(self, hit_rate: float) -> int | None:
        """Smallest capacity (blocks) whose hit rate is at least ``hit_rate``; None if unreachable."""
        need = max(0, math.ceil(hit_rate * self.accesses - 1e-9))
        if need == 0:
            return 0
        if need > len(self.distances):
            return None
        return int(self.distances[need - 1]) + 1

    def points(self, num: int = 160, extra: Sequence[int] = ()) -> list[tuple[int, float]]:
        """``(capacity_blocks, hit_rate)`` on a log grid up to saturation, plus ``extra`` capacities."""
        import numpy as np

        top = max(self.saturation_blocks, 1)
        grid = np.unique(np.geomspace(1, top, num=num).round().astype(np.int64))
        caps = sorted({0, *map(int, grid), top, *(int(c) for c in extra if c >= 0)})
        hits = np.searchsorted(self.distances, np.asarray(caps, dtype=np.int64), side="left")
        return [(c, int(h) / self.accesses if self.accesses else 0.0) for c, h in zip(caps, hits)]


@dataclass
class StackPass:
    """Everything one pass over a trace's block accesses yields."""

    mrc: MissRatioCurve
    previous: "np.ndarray"        # index of the previous access of the same block, -1 if none
    access_time: "np.ndarray"     # arrival time (s) of the request making each access
    request_of: "np.ndarray"      # request index of each access

    def reuse_gaps_s(self) -> "np.ndarray":
        """Seconds between consecutive accesses of the same block (the trace's own reuse gaps)."""
        seen = self.previous >= 0
        return self.access_time[seen] - self.access_time[self.previous[seen]]


def build_mrc(trace: "Trace") -> StackPass:
    """One pass over ``trace``: stack distances, prefix-rule MRC, previous-access links."""
    import numpy as np

    reqs = trace.requests
    flat = [b for r in reqs for b in r.blocks]
    n = len(flat)
    dist_l, prev_l = stack_distances(flat)
    lens = np.fromiter((len(r.blocks) for r in reqs), dtype=np.int64, count=len(reqs))
    dist = np.asarray(dist_l, dtype=np.int64)
    never = np.int64(n + 1)                  # larger than any real distance
    dist[dist < 0] = never
    starts = np.cumsum(lens) - lens
    pos_in_req = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
    hittable = np.repeat(np.fromiter((r.hittable for r in reqs), dtype=np.int64, count=len(reqs)), lens)
    dist[pos_in_req >= hittable] = never
    request_of = np.repeat(np.arange(len(reqs), dtype=np.int64), lens)
    offset = request_of * (n + 2)            # segmented running max in one accumulate
    eff = np.maximum.accumulate(dist + offset) - offset
    eff = np.sort(eff[eff < never])
    times = np.repeat(np.fromiter((r.timestamp for r in reqs), dtype=np.float64, count=len(reqs)), lens)
    mrc = MissRatioCurve(trace.block_size, n, eff)
    return StackPass(mrc, np.asarray(prev_l, dtype=np.int64), times, request_of)
