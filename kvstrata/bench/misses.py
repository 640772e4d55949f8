"""Why a replayed request's blocks missed, and how long blocks stayed cached.

Per block the replay keeps a state byte (never seen, cached, or the tier it last
left: a code per tier of the deployment, in its order) and three times, in arrays indexed by the trace's dense block ids, so the
memory follows the trace's distinct blocks. :func:`classify` turns the states a
request's blocks had before it ran into miss reasons without a per-block loop.

Threads: the replay's one thread.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from kvstrata.bench.stats import Quantiles
from kvstrata.policy.events import TIERS

__all__ = ["MISS_REASONS", "Tracker", "classify", "first_reason", "miss_reasons"]


def miss_reasons(tiers: Sequence[str]) -> tuple[str, ...]:
    """Every reason a block of a deployment with ``tiers`` (the device first) misses for:
    ``evicted_<tier>`` for each tier, the tier that held the block last."""
    return ("new", *(f"evicted_{t}" for t in tiers), "prefix_miss", "last_token", "rejected", "other")


#: the reasons of a deployment of the built-in tiers
MISS_REASONS = miss_reasons(TIERS)

# per-block state while replaying: never seen, cached, then a code per tier (the last to hold it)
_NEVER, _CACHED, _FIRST_LEFT = 0, 1, 2


_FLUSH = 1 << 16  # whole-cache samples buffered before they go into their Quantiles


class Tracker:
    """Per-block state for miss reasons and whole-cache lifetimes (arrays grown with the block
    ids), for a deployment of ``tiers`` (the device first; :data:`TIERS` by default)."""

    def __init__(self, tiers: Sequence[str] = TIERS) -> None:
        if len(tiers) > 256 - _FIRST_LEFT:
            raise ValueError(f"tiers: at most {256 - _FIRST_LEFT} tiers have a state code, got {len(tiers)}")
        self.tiers = tuple(tiers)
        self.codes = {t: _FIRST_LEFT + i for i, t in enumerate(self.tiers)}
        #: the miss reason of each state code: why a block in that state missed
        self.state_reasons: dict[int, str] = {_NEVER: "new", _CACHED: "other",
                                        **{c: f"evicted_{t}" for t, c in self.codes.items()}}
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
        state, code, entered, last, left = self.state, self.codes[tier], self.entered, self.last, self.left
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


    def classify(self, before: bytes, hit: int, hittable: int, reasons: dict[str, int]) -> None:
        """:func:`classify` with this tracker's state codes."""
        classify(before, hit, hittable, reasons, self.state_reasons)

    def first_reason(self, before: bytes, hit: int) -> str:
        """:func:`first_reason` with this tracker's state codes."""
        return first_reason(before, hit, self.state_reasons)


_BUILTIN = Tracker().state_reasons  # the state codes' reasons of a deployment of the built-in tiers


def classify(before: bytes, hit: int, hittable: int, reasons: dict[str, int],
             codes: dict[int, str] = _BUILTIN) -> None:
    """Why each block after the first ``hit`` missed, from its state before the request
    (``before[j]``; ``codes``: the reason of each state, :attr:`Tracker.state_reasons`): counted
    per state with ``bytes.count``, no per-block loop."""
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
    for code, reason in codes.items():
        if code >= _FIRST_LEFT:
            reasons[reason] += seg.count(code)


def first_reason(before: bytes, hit: int, codes: dict[int, str] = _BUILTIN) -> str:
    """Why the first missed block (index ``hit``) missed, from its state before the request
    (``codes``: the reason of each state, :attr:`Tracker.state_reasons`)."""
    return codes.get(before[hit], "other") if hit < len(before) else "last_token"


def _block(key: bytes) -> int:
    return int.from_bytes(key, "little")
