"""Percentile summaries of time samples."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["PERCENTILES", "summarize"]

PERCENTILES = (50, 90, 99)


def summarize(samples: Iterable[float] | Any) -> dict[str, float | int | None]:
    """``{"count", "p50", "p90", "p99"}`` of ``samples`` (linear interpolation); None when empty."""
    import numpy as np

    arr = np.asarray(samples if not isinstance(samples, (list, tuple)) else np.fromiter(samples, float),
                     dtype=np.float64)
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({f"p{p}": None for p in PERCENTILES})
        return out
    values = np.percentile(arr, PERCENTILES)
    out.update({f"p{p}": round(float(v), 6) for p, v in zip(PERCENTILES, values)})
    return out
