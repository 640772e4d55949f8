"""Belady's offline optimum: the most block hits any cache of a given size could have had.

The yardstick of ``kvstrata bench --compare``: for a cache of ``capacity`` blocks
that sees the trace's block accesses in order and knows the future, evicting
(or not admitting) the block whose next use is furthest away maximises hits
(Belady's MIN, with bypass). No policy of that capacity does better, whatever
its eviction and admission, and prefix hits (what kvstrata counts) are a subset
of block hits, so every row of the comparison is at most this.

Exact, and two passes over the accesses: one that links each access to the
next use of its block (a forward pass: each access patches the previous one of
the same block), one that replays them with a heap of cached blocks by next
use (stale heap entries are skipped). Memory: one int per access.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Iterable, Sequence

__all__ = ["next_uses", "belady_hits"]

_NEVER = 1 << 62


def next_uses(accesses: Sequence[int]) -> array:
    """For each access, the index of the next access of the same block (``_NEVER``: none)."""
    nxt = array("q", [_NEVER]) * len(accesses)
    last: dict[int, int] = {}
    for i, block in enumerate(accesses):
        j = last.get(block)
        if j is not None:
            nxt[j] = i
        last[block] = i
    return nxt


def belady_hits(accesses: Sequence[int], capacities: Iterable[int]) -> dict[int, int]:
    """Hits of Belady's MIN with bypass over ``accesses`` (block ids), per capacity in blocks."""
    nxt = next_uses(accesses)
    return {c: _min_hits(accesses, nxt, c) for c in capacities}


def _min_hits(accesses: Sequence[int], nxt: array, capacity: int) -> int:
    if capacity <= 0:
        return 0
    cached: dict[int, int] = {}       # block -> the index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries are skipped
    hits = 0
    for i, block in enumerate(accesses):
        n = nxt[i]
        if block in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:  # the cached block used furthest in the future
                neg, victim = heap[0]
                if cached.get(victim) == -neg:
                    break
                heapq.heappop(heap)
            if -neg <= n:  # the new block is used later than all of them (or never): bypass
                continue
            heapq.heappop(heap)
            del cached[victim]
        if n == _NEVER:
            cached.pop(block, None)  # never used again: it need not hold a slot
            continue
        cached[block] = n
        heapq.heappush(heap, (-n, block))
    return hits
