"""Percentile summaries of time samples, in bounded memory.

:class:`Quantiles` counts each distinct sample value while there are at most
``exact_limit`` of them (:data:`EXACT_VALUES` by default, 1 MiB): its
percentiles are then exact, numpy's linear interpolation between order
statistics, however many samples there are (trace times are usually whole
milliseconds, so durations repeat). Past the limit it folds the counts into
a log-bucket sketch (the mapping of DDSketch, Masson et al., VLDB 2019):
bucket ``i`` counts the samples in ``(g^(i-1), g^i]`` with
``g = (1 + a) / (1 - a)`` and reports them as ``2 g^i / (g + 1)``, so every
order statistic it reports is within relative error ``a``
(:data:`RELATIVE_ERROR`, 0.1%) of the true one; zeros are counted exactly.
A percentile interpolates between two such estimates, so it too is within
``a`` of the exact interpolated value. Memory past the limit: one counter
per bucket between the smallest and the largest positive sample, about
``ln(max / min) / (2a)`` counters (9,200 for samples from 1 ms to a day).
Sketched samples must be non-negative (they are durations).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

__all__ = ["EXACT_VALUES", "PERCENTILES", "RELATIVE_ERROR", "Quantiles", "summarize"]

PERCENTILES = (50, 90, 99)
EXACT_VALUES = 1 << 16
"""Distinct sample values counted exactly before a :class:`Quantiles` becomes a sketch."""
RELATIVE_ERROR = 1e-3
"""Largest relative error of a sketched percentile."""


class Quantiles:
    """Samples of a quantity: exact up to ``exact_limit`` distinct values, a bounded sketch after."""

    __slots__ = ("exact_limit", "alpha", "count", "_values", "_weights", "_zeros", "_counts", "_offset",
                 "_log_gamma")

    def __init__(self, exact_limit: int | None = None, alpha: float = RELATIVE_ERROR) -> None:
        import numpy as np

        if not 0 < alpha < 1:
            raise ValueError(f"alpha: expected a fraction in (0, 1), got {alpha}")
        self.exact_limit = EXACT_VALUES if exact_limit is None else exact_limit
        self.alpha = alpha
        self.count = 0
        self._values: Any = np.empty(0)                  # exact: sorted distinct values; None once sketched
        self._weights: Any = np.empty(0, dtype=np.int64)  # exact: how many samples have each value
        self._zeros = 0
        self._counts: Any = None                         # sketch: counts of buckets _offset, _offset + 1, ...
        self._offset = 0
        self._log_gamma = math.log((1 + alpha) / (1 - alpha))

    # ------------------------------------------------------------------ adding

    def add(self, values: Iterable[float] | Any) -> None:
        """Add samples (a numpy array or any iterable of floats)."""
        import numpy as np

        arr = np.asarray(values if not isinstance(values, (list, tuple)) else np.array(values, dtype=np.float64),
                         dtype=np.float64).ravel()
        if not arr.size:
            return
        if np.isnan(arr).any():
            raise ValueError("Quantiles: a sample is NaN")
        self.count += arr.size
        if self._values is None:
            self._bucket(arr, None)
            return
        v, w = np.unique(arr, return_counts=True)
        self._merge_exact(v, w)

    def merge(self, other: "Quantiles") -> None:
        """Add every sample ``other`` holds (its sketch's buckets when it is one)."""
        if other._values is not None:
            self.count += other.count
            if self._values is None:
                self._bucket(other._values, other._weights)
            else:
                self._merge_exact(other._values, other._weights)
            return
        if self._values is not None:
            self._to_sketch()
        self.count += other.count
        self._zeros += other._zeros
        if other._counts is not None:
            self._add_counts(other._offset, other._counts)

    @property
    def exact(self) -> bool:
        """Whether the percentiles are exact (every distinct value still counted)."""
        return self._values is not None

    def _merge_exact(self, v: Any, w: Any) -> None:
        import numpy as np

        if self._values.size:
            allv, allw = np.concatenate((self._values, v)), np.concatenate((self._weights, w))
            order = np.argsort(allv, kind="stable")
            allv, allw = allv[order], allw[order]
            starts = np.flatnonzero(np.concatenate(([True], allv[1:] != allv[:-1])))
            v, w = allv[starts], np.add.reduceat(allw, starts)
        self._values, self._weights = v, w
        if v.size > self.exact_limit:
            self._to_sketch()

    def _to_sketch(self) -> None:
        values, weights = self._values, self._weights
        self._values = self._weights = None
        self._bucket(values, weights)

    def _bucket(self, values: Any, weights: Any) -> None:
        import numpy as np

        if (values < 0).any():
            raise ValueError("Quantiles: samples must be non-negative to be sketched")
        pos = values > 0
        w = np.ones(values.size, dtype=np.int64) if weights is None else weights
        self._zeros += int(w[~pos].sum())
        if not pos.any():
            return
        idx = np.ceil(np.log(values[pos]) / self._log_gamma).astype(np.int64)
        lo = int(idx.min())
        self._add_counts(lo, np.bincount(idx - lo, weights=w[pos]).astype(np.int64))

    def _add_counts(self, lo: int, counts: Any) -> None:
        import numpy as np

        if self._counts is None:
            self._counts, self._offset = counts.astype(np.int64), lo
            return
        start, end = min(lo, self._offset), max(lo + counts.size, self._offset + self._counts.size)
        if (start, end) != (self._offset, self._offset + self._counts.size):
            grown = np.zeros(end - start, dtype=np.int64)
            grown[self._offset - start:self._offset - start + self._counts.size] = self._counts
            self._counts, self._offset = grown, start
        self._counts[lo - start:lo - start + counts.size] += counts

    # ------------------------------------------------------------------ reading

    def samples(self) -> Any:
        """Every sample, sorted (a float array); ValueError once sketched."""
        import numpy as np

        if self._values is None:
            raise ValueError(f"Quantiles: more than {self.exact_limit:,} distinct values: only percentiles are kept")
        return np.repeat(self._values, self._weights)

    def quantiles(self, fractions: Any) -> Any:
        """Values at ``fractions`` (0..1), numpy's linear interpolation; exact, or within ``alpha`` once sketched."""
        import numpy as np

        q = np.asarray(fractions, dtype=np.float64)
        if not self.count:
            return np.full(q.shape, np.nan)
        h = (self.count - 1) * q
        lo = np.floor(h).astype(np.int64)
        hi = np.minimum(lo + 1, self.count - 1)
        a, b, t = self._order_stat(lo), self._order_stat(hi), h - lo
        diff = b - a
        return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)   # numpy's lerp, both halves

    def _order_stat(self, ranks: Any) -> Any:
        """The ``ranks``-th smallest samples (0-based): exact, or the sketch's estimates."""
        import numpy as np

        if self._values is not None:
            return self._values[np.searchsorted(np.cumsum(self._weights), ranks, side="right")]
        out = np.zeros(ranks.shape, dtype=np.float64)
        pos = ranks >= self._zeros
        if self._counts is None or not pos.any():
            return out
        cum = np.cumsum(self._counts)
        bucket = np.searchsorted(cum, ranks[pos] - self._zeros, side="right") + self._offset
        gamma = math.exp(self._log_gamma)
        out[pos] = 2.0 * np.exp(bucket * self._log_gamma) / (gamma + 1.0)
        return out

    def summary(self) -> dict[str, float | int | bool | None]:
        """``{"count", "p50", "p90", "p99", "exact"}``; the percentiles None when there are no samples."""
        out: dict[str, float | int | bool | None] = {"count": int(self.count), "exact": self.exact}
        if not self.count:
            out.update({f"p{p}": None for p in PERCENTILES})
            return out
        values = self.quantiles([p / 100 for p in PERCENTILES])
        out.update({f"p{p}": round(float(v), 6) for p, v in zip(PERCENTILES, values)})
        return out

    def retained_bytes(self) -> int:
        """Bytes of values and counters held (for memory checks)."""
        if self._values is not None:
            return int(self._values.nbytes + self._weights.nbytes)
        return 0 if self._counts is None else int(self._counts.nbytes)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[float]:
        """The samples, sorted (ValueError once sketched)."""
        return iter(self.samples().tolist())


def summarize(samples: Quantiles | Iterable[float] | Any) -> dict[str, float | int | bool | None]:
    """``{"count", "p50", "p90", "p99", "exact"}`` of ``samples`` (linear interpolation); None when empty."""
    if isinstance(samples, Quantiles):
        return samples.summary()
    q = Quantiles(exact_limit=1 << 62)
    q.add(samples)
    return q.summary()
