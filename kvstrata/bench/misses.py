"""Why a replayed request's blocks missed, and how long blocks stayed cached.

Per block the replay keeps a state byte (never seen, cached, or the tier it last
left) and three times, in arrays indexed by the trace's dense block ids, so the
memory follows the trace's distinct blocks. :func:`classify` turns the states a
request's blocks had before it ran into miss reasons without a per-block loop.

Threads: the replay's one thread.
"""

from __future__ import annotations

from array import array

from kvstrata.bench.stats import Quantiles
from kvstrata.policy.tiers import CPU, GPU, SSD

__all__ = ["MISS_REASONS", "Tracker", "classify", "first_reason"]

MISS_REASONS = ("new", "evicted_gpu", "evicted_cpu", "evicted_ssd", "prefix_miss", "last_token", "rejected", "other")

# per-block state while replaying
_NEVER, _CACHED = 0, 1
_LEFT = {GPU: 2, CPU: 3, SSD: 4}
_STATE_REASON = {2: "evicted_gpu", 3: "evicted_cpu", 4: "evicted_ssd"}


_FLUSH = 1 << 16  # whole-cache samples buffered before they go into their Quantiles


class Tracker:
    """Per-block state for miss reasons and whole-cache lifetimes (arrays grown with the block ids)."""

    def __init__(self) -> None:
        self.state = bytearray()
        self.entered = array("d")
        self.last = array("d")
        self.left = array("d")  # when the block left the last tier that held it
        self.lifetime, self.idle = Quantiles(), Quantiles()
        self._life: list[float] = []
        self._idle: list[float] = []

    def cover(self, top: int) -> None:
        """Room for block ids below ``top``."""
        n = len(self.state)
        if top > n:
            grow = max(top, 2 * n, 1024) - n
            self.state.extend(bytes(grow))
            self.entered.extend(array("d", bytes(8 * grow)))
            self.last.extend(array("d", bytes(8 * grow)))
            self.left.extend(array("d", bytes(8 * grow)))

    def left_many(self, keys: list[bytes], tier: str, now: float) -> None:
        """These blocks left the last tier that held them (``tier``)."""
        state, code, entered, last, left = self.state, _LEFT[tier], self.entered, self.last, self.left
        life, idle = self._life, self._idle
        for key in keys:
            block = _block(key)
            if state[block] == _CACHED:
                state[block] = code
                left[block] = now
                life.append(now - entered[block])
                idle.append(now - last[block])
        if len(life) >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        self.lifetime.add(self._life)
        self.idle.add(self._idle)
        self._life, self._idle = [], []

    def retained_bytes(self) -> int:
        return len(self.state) + 8 * (len(self.entered) + len(self.last) + len(self.left) + len(self._life)
                                      + len(self._idle)) + \
            self.lifetime.retained_bytes() + self.idle.retained_bytes()

    def touch(self, blocks: list[int], now: float) -> None:
        state, entered, last = self.state, self.entered, self.last
        for b in blocks:
            if state[b] != _CACHED:
                state[b] = _CACHED
                entered[b] = now
            last[b] = now


def classify(before: bytes, hit: int, hittable: int, reasons: dict[str, int]) -> None:
    """Why each block after the first ``hit`` missed, from its state before the request
    (``before[j]``): counted per state with ``bytes.count``, no per-block loop."""
    if hittable < len(before):
        reasons["last_token"] += len(before) - max(hit, hittable)
    seg = before[hit:hittable]
    if not seg:
        return
    reasons["new"] += seg.count(_NEVER)
    cached = seg.count(_CACHED)
    if cached:  # still cached: unreachable behind an earlier miss, or (the first one) not served
        first = seg[0] == _CACHED
        reasons["other"] += first
        reasons["prefix_miss"] += cached - first
    for code, reason in _STATE_REASON.items():
        reasons[reason] += seg.count(code)


_FIRST_REASON = {_NEVER: "new", _CACHED: "other", **_STATE_REASON}


def first_reason(before: bytes, hit: int) -> str:
    """Why the first missed block (index ``hit``) missed, from its state before the request."""
    return _FIRST_REASON.get(before[hit], "other") if hit < len(before) else "last_token"


def _block(key: bytes) -> int:
    return int.from_bytes(key, "little")
