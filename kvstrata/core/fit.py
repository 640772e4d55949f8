"""The decayed least-squares fits behind the load estimates (:mod:`kvstrata.core.costs`).

Threads: the owner of the :class:`~kvstrata.core.costs.LoadCosts` that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["DECAY", "Fit", "solve"]

DECAY = 0.8  # weight of a sample once the next one arrived: about five samples carry the estimate
_SPREAD = 0.25  # a tier's latency is fitted once its loads' sizes vary by this much of their mean (std)


@dataclass
class Fit:
    """Decayed least squares of ``seconds = sum_t (n_t x c_t + [n_t > 0] x l_t)`` over the
    tiers ``names``: ``c_t`` seconds per block, ``l_t`` a fixed latency per load that reads
    the tier (a seek, a round trip)."""

    names: tuple[str, ...]
    xx: list[list[float]] = field(default_factory=list)
    xy: list[float] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = 2 * len(self.names)  # each tier's blocks, then whether the load read it
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.seen = dict.fromkeys(self.names, 0)

    def add(self, blocks: Mapping[str, int], seconds: float) -> None:
        counts = [float(blocks.get(t, 0)) for t in self.names]
        x = counts + [1.0 if c > 0 else 0.0 for c in counts]
        for i in range(len(x)):
            self.xy[i] = self.xy[i] * DECAY + x[i] * seconds
            for j in range(len(x)):
                self.xx[i][j] = self.xx[i][j] * DECAY + x[i] * x[j]
        for t, v in zip(self.names, counts):
            if v > 0:
                self.seen[t] += 1

    def solve(self) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds per block and latency of each tier seen (non-negative); tiers never seen
        are absent. While the loads do not tell a tier's latency from its blocks (their sizes,
        weighted as the fit weighs them, vary by less than :data:`_SPREAD` of their mean), or
        the fit makes one negative, its latency is 0 and the seconds per block a fit through
        the origin."""
        idx = [i for i, t in enumerate(self.names) if self.seen[t]]
        spread = [i for i in idx if self._varied(i)]
        both = idx + [len(self.names) + i for i in spread]
        sol = solve([[self.xx[i][j] for j in both] for i in both], [self.xy[i] for i in both]) if spread else None
        latency = dict.fromkeys((self.names[i] for i in idx), 0.0)
        if sol is not None and min(sol) >= 0:
            latency.update((self.names[i], v) for i, v in zip(spread, sol[len(idx):]))
            return {self.names[i]: v for i, v in zip(idx, sol)}, latency
        return self._through_origin(idx), latency

    def _varied(self, i: int) -> bool:
        """Do the decayed sizes of the loads that read tier ``i`` vary enough to fit its latency?"""
        j = len(self.names) + i  # the tier's "the load read it" feature
        loads, blocks, squares = self.xx[j][j], self.xx[j][i], self.xx[i][i]
        if loads <= 0 or blocks <= 0:
            return False
        mean = blocks / loads
        return squares / loads - mean * mean >= (_SPREAD * mean) ** 2

    def _through_origin(self, idx: list[int]) -> dict[str, float]:
        a = [[self.xx[i][j] for j in idx] for i in idx]
        b = [self.xy[i] for i in idx]
        sol = solve(a, b)
        if sol is None:  # collinear so far (every load mixed the tiers in one ratio): share alike
            total = sum(self.xx[i][i] for i in idx)
            rate = sum(b) / total if total > 0 else 0.0
            sol = [rate] * len(idx)
        return {self.names[i]: max(0.0, v) for i, v in zip(idx, sol)}


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]
