"""Exact LRU miss-ratio curves in one streaming pass over a trace.

An LRU cache of ``C`` blocks holds a block at its next access iff its *stack
distance* (distinct other blocks accessed since its previous access) is below
``C`` (Mattson et al., 1970), so one pass that computes every access's stack
distance gives the hit rate at every capacity at once.

Prefix rule (the definition used in every kvstrata output): a request's blocks
are looked up in prefix order and block ``j`` is served from cache only if
blocks ``0..j`` all are. With an LRU cache of ``C`` blocks that is "the
largest stack distance among blocks ``0..j`` is below ``C``", so the curve
is built from per-request running maxima of the distances. Every block of a
request is accessed (moved to most-recently used) whether it hit or not,
matching a cache that stores recomputed blocks.

:class:`CurvePass` takes requests in batches and keeps, besides the stack
(:mod:`kvstrata.bench.stackdist`), a histogram of these effective distances
(one counter per distance, at most one per distinct block), each block's
last access time (for the trace's reuse gaps, summarised by a
:class:`~kvstrata.bench.stats.Quantiles`) and nothing per access or request:
its memory follows the trace's distinct blocks. The curve is exact.
"""

from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvstrata.bench.stackdist import StackDistances
from kvstrata.bench.stats import Quantiles

if TYPE_CHECKING:
    import numpy as np

    from kvstrata.trace.reader import Request, Trace, TraceReader

__all__ = ["BATCH_ACCESSES", "CurvePass", "MissRatioCurve", "RequestBatch", "StackPass", "stack_distances",
           "build_mrc"]

BATCH_ACCESSES = 1 << 16
"""Accesses gathered before a batch is measured (vectorised work per batch)."""


def stack_distances(accesses: Sequence[int]) -> tuple[list[int], list[int]]:
    """Return ``(distance, previous)`` per access; both are -1 for a block's first access.

    ``distance[t]``: distinct other blocks accessed strictly between the
    previous access of the same block and ``t``. ``previous[t]``: that
    previous access's index. (Keeps a list per access: for small inputs.)
    """
    dense: dict[int, int] = {}
    ids = [dense.setdefault(b, len(dense)) for b in accesses]
    last: dict[int, int] = {}
    prev: list[int] = []
    for t, b in enumerate(ids):
        prev.append(last.get(b, -1))
        last[b] = t
    return StackDistances().feed(ids), prev


@dataclass
class MissRatioCurve:
    """Hit rate of an LRU cache of any capacity (in blocks) under the prefix rule.

    ``cumulative[c]``: accesses that hit in a cache of ``c`` blocks, for ``c`` from 0 to
    the saturation capacity (its last entry is the hits of an unbounded cache).
    """

    block_size: int
    accesses: int
    cumulative: "np.ndarray"

    @classmethod
    def from_histogram(cls, block_size: int, accesses: int, hist: "np.ndarray") -> "MissRatioCurve":
        """From ``hist[d]``: accesses whose effective distance is ``d``."""
        import numpy as np

        nz = np.flatnonzero(hist)
        top = int(nz[-1]) + 1 if nz.size else 0
        return cls(block_size, accesses, np.concatenate(([0], np.cumsum(hist[:top], dtype=np.int64))))

    def hits(self, capacity_blocks: int) -> int:
        cum = self.cumulative
        return int(cum[min(max(capacity_blocks, 0), len(cum) - 1)])

    def hit_rate(self, capacity_blocks: int) -> float:
        return self.hits(capacity_blocks) / self.accesses if self.accesses else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        """Hit rate of an unbounded cache."""
        return int(self.cumulative[-1]) / self.accesses if self.accesses else 0.0

    @property
    def saturation_blocks(self) -> int:
        """Smallest capacity that reaches the ideal hit rate."""
        return len(self.cumulative) - 1

    def capacity_for(self, hit_rate: float) -> int | None:
        """Smallest capacity (blocks) whose hit rate is at least ``hit_rate``; None if unreachable."""
        import numpy as np

        need = max(0, math.ceil(hit_rate * self.accesses - 1e-9))
        if need > self.cumulative[-1]:
            return None
        return int(np.searchsorted(self.cumulative, need, side="left"))

    def points(self, num: int = 160, extra: Sequence[int] = ()) -> list[tuple[int, float]]:
        """``(capacity_blocks, hit_rate)`` on a log grid up to saturation, plus ``extra`` capacities."""
        import numpy as np

        top = max(self.saturation_blocks, 1)
        grid = np.unique(np.geomspace(1, top, num=num).round().astype(np.int64))
        caps = sorted({0, *map(int, grid), top, *(int(c) for c in extra if c >= 0)})
        idx = np.minimum(np.asarray(caps, dtype=np.int64), len(self.cumulative) - 1)
        hits = self.cumulative[idx]
        return [(c, int(h) / self.accesses if self.accesses else 0.0) for c, h in zip(caps, hits)]


@dataclass
class StackPass:
    """Everything one pass over a trace's block accesses yields."""

    mrc: MissRatioCurve
    reuse_gaps: Quantiles = field(default_factory=Quantiles)   # the trace's own reuse gaps (s)
    distinct_blocks: int = 0
    seconds: float = 0.0                                       # time spent measuring
    peak_rss_bytes: int | None = None                          # of the process that measured, when it was a child

    def reuse_gaps_s(self) -> "np.ndarray":
        """Seconds between consecutive accesses of the same block (every sample: small traces only,
        see :class:`~kvstrata.bench.stats.Quantiles`)."""
        return self.reuse_gaps.samples()


class RequestBatch:
    """Requests gathered as flat arrays: block ids (each request's prompt blocks, then the
    blocks its output completed, if recorded), and per request its prompt length,
    hittable prefix, time and output blocks."""

    __slots__ = ("ids", "lens", "hittable", "times", "outs")

    def __init__(self) -> None:
        self.ids, self.lens, self.hittable, self.times = array("q"), array("q"), array("q"), array("d")
        self.outs = array("q")

    def add(self, r: "Request") -> None:
        self.ids.extend(r.blocks)
        self.ids.extend(r.output_blocks)
        self.lens.append(len(r.blocks))
        self.hittable.append(r.hittable)
        self.times.append(r.timestamp)
        self.outs.append(len(r.output_blocks))

    def __len__(self) -> int:
        return len(self.ids)

    def arrays(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The raw bytes of the five arrays (what a pipe carries)."""
        return (self.ids.tobytes(), self.lens.tobytes(), self.hittable.tobytes(), self.times.tobytes(),
                self.outs.tobytes())


class CurvePass:
    """The miss-ratio pass: feed :class:`RequestBatch` contents in arrival order, then :meth:`result`."""

    def __init__(self, block_size: int) -> None:
        import numpy as np

        self.block_size = block_size
        self.stack = StackDistances()
        self.hist = np.zeros(1024, dtype=np.int64)
        self.last_time = np.full(1024, np.nan)
        self.gaps = Quantiles()
        self.accesses = 0
        self.seconds = 0.0

    def add(self, batch: RequestBatch) -> None:
        self.add_arrays(*batch.arrays())

    def add_arrays(self, ids_b: bytes, lens_b: bytes, hit_b: bytes, times_b: bytes, outs_b: bytes) -> None:
        """One batch of whole requests (raw int64 x3 / float64 / int64 bytes, see :class:`RequestBatch`).
        A request's output blocks enter the cache (they are accessed) but are no lookups:
        never hits, not counted among the accesses."""
        import time

        import numpy as np

        t0 = time.perf_counter()
        ids = np.frombuffer(ids_b, dtype=np.int64)
        if ids.size:
            lens, hittable = np.frombuffer(lens_b, dtype=np.int64), np.frombuffer(hit_b, dtype=np.int64)
            spans = lens + np.frombuffer(outs_b, dtype=np.int64)
            times = np.repeat(np.frombuffer(times_b, dtype=np.float64), spans)
            dist = np.asarray(self.stack.feed(ids.tolist()), dtype=np.int64)
            self._count(_effective(dist, spans, hittable))  # output positions lie past the hittable prefix
            self._gaps(ids, times)
            self.accesses += int(lens.sum())
        self.seconds += time.perf_counter() - t0

    def _count(self, eff: "np.ndarray") -> None:
        import numpy as np

        eff = eff[eff >= 0]
        if not eff.size:
            return
        values, counts = np.unique(eff, return_counts=True)
        if values[-1] >= self.hist.size:
            self.hist = _grown(self.hist, int(values[-1]) + 1, 0)
        self.hist[values] += counts

    def _gaps(self, ids: "np.ndarray", times: "np.ndarray") -> None:
        """Reuse gaps of the batch: against the block's previous access in the batch, else its last one before."""
        import numpy as np

        top = int(ids.max()) + 1
        if top > self.last_time.size:
            self.last_time = _grown(self.last_time, top, np.nan)
        order = np.argsort(ids, kind="stable")
        s_ids, s_t = ids[order], times[order]
        first = np.empty(s_ids.size, dtype=bool)
        first[0] = True
        np.not_equal(s_ids[1:], s_ids[:-1], out=first[1:])
        prev = np.empty_like(s_t)
        prev[1:] = s_t[:-1]
        prev[first] = self.last_time[s_ids[first]]
        gaps = s_t - prev
        self.gaps.add(gaps[~np.isnan(gaps)])
        last = np.empty_like(first)
        last[-1] = True
        last[:-1] = first[1:]
        self.last_time[s_ids[last]] = s_t[last]

    def result(self) -> StackPass:
        mrc = MissRatioCurve.from_histogram(self.block_size, self.accesses, self.hist)
        return StackPass(mrc, self.gaps, self.stack.distinct, self.seconds)

    def retained_bytes(self) -> int:
        """Bytes of the per-block and per-distance arrays and the gap summary (for memory checks)."""
        return self.stack.retained_bytes() + self.hist.nbytes + self.last_time.nbytes + self.gaps.retained_bytes()


def _grown(arr: "np.ndarray", need: int, fill: float) -> "np.ndarray":
    """``arr`` extended to at least ``need`` entries (doubling), new entries ``fill``."""
    import numpy as np

    out = np.full(max(need, 2 * arr.size), fill, dtype=arr.dtype)
    out[:arr.size] = arr
    return out


def _effective(dist: "np.ndarray", lens: "np.ndarray", hittable: "np.ndarray") -> "np.ndarray":
    """Per-request running maxima of the distances (prefix rule); -1 where the access cannot hit."""
    import numpy as np

    n = dist.size
    never = int(dist.max()) + 1 if n else 0
    d = np.where(dist < 0, never, dist)
    starts = np.cumsum(lens) - lens
    pos_in_req = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
    d[pos_in_req >= np.repeat(hittable, lens)] = never
    width = never + 1
    offset = np.repeat(np.arange(lens.size, dtype=np.int64) * width, lens)  # segmented max in one accumulate
    eff = np.maximum.accumulate(d + offset) - offset
    eff[eff == never] = -1
    return eff


def build_mrc(trace: "Trace | TraceReader") -> StackPass:
    """One pass over ``trace`` in this process, batch by batch: exact curve, reuse gaps.

    A :class:`~kvstrata.trace.reader.TraceReader` is read as it goes (its block size is
    known once its first request is read)."""
    from kvstrata.trace.reader import Trace

    requests = iter(trace.requests if isinstance(trace, Trace) else trace)
    first = next(requests, None)
    cp = CurvePass(trace.block_size)
    batch = RequestBatch()
    for r in itertools.chain(() if first is None else (first,), requests):
        batch.add(r)
        if len(batch) >= BATCH_ACCESSES:
            cp.add(batch)
            batch = RequestBatch()
    cp.add(batch)
    return cp.result()
