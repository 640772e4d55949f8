"""Reads queued on the workers' I/O thread, and tiers taken out while a read there stalls.

The reads of the tiers behind the slab tier (the SSD tier's) run on one I/O thread per
worker, in order: a load handed over behind others waits for their reads.
:class:`ReadQueue` keeps the estimated reads of every load from its hand-over
(:meth:`ReadQueue.handed`) to the end of its reads (:meth:`ReadQueue.finished`), and says
how long a new load would wait behind them (:meth:`ReadQueue.ahead`): their estimated
reads less the time the I/O thread has worked since the oldest was handed over, and
never less than the age of a read still out past its expected time (a read that does
not return is ahead of everything for as long as it is out, not for its estimate).

**Stalls.** A load cut at its deadline while its reads were still out (a read that does
not return, or reads queued behind one) was given up by the workers
(:meth:`ReadQueue.stalled`): its reads stay in the queue, at their age, until the
workers say they returned (:meth:`ReadQueue.returned`), and each tier it read trips
that tier's breaker (:class:`~kvstrata.system.breaker.Breaker`, the one the remote tier uses
in front of its server): while open, the tier is out of the
load-or-recompute decision (its blocks are computed) but for one probe of a few
blocks after each cooldown; a load that reads the tier and is not given up closes it
(:meth:`ReadQueue.read`).

Threads: the driver's owner thread (the breakers take their own locks).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from kvstrata.system.breaker import Breaker

__all__ = ["ReadQueue", "STALL_COOLDOWN_S", "STALL_MAX_COOLDOWN_S"]

_QUEUE_MAX = 4096  # loads followed in flight at most
_STALE_S = 60.0    # a load in flight longer than this (and than 10x its estimate) is dropped from the queue
STALL_COOLDOWN_S = 1.0       # a stalled tier is probed again after this, doubled after each failed probe ...
STALL_MAX_COOLDOWN_S = 30.0  # ... up to this


class ReadQueue:
    """The loads whose reads queue on the I/O thread, and a breaker per tier that stalled."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._queue: dict[int, tuple[float, float, frozenset[str]]] = {}  # plan -> (handed over, reads, tiers)
        self._stuck: set[int] = set()          # plans given up with their reads still out
        self._breakers: dict[str, Breaker] = {}
        self._probe_at: dict[str, float] = {}  # tier -> when its probe was let through

    def handed(self, plan_id: int, reads: float, tiers: Iterable[str]) -> None:
        """A load with ``reads`` seconds of reads of ``tiers`` on the I/O thread was handed over."""
        self._queue[plan_id] = (self.clock(), reads, frozenset(tiers))
        while len(self._queue) > _QUEUE_MAX:  # finishes that never came
            plan = next(iter(self._queue))
            del self._queue[plan]
            self._stuck.discard(plan)

    def finished(self, plan_id: int) -> None:
        """The load finished; its reads are ahead of nothing unless it was given up with them out."""
        if plan_id not in self._stuck:
            self._queue.pop(plan_id, None)

    def stalled(self, plan_id: int, tiers: Iterable[str] = ()) -> None:
        """The load was given up at its deadline with its reads still out: they stay ahead (at
        their age) until :meth:`returned`, and each tier it read (``tiers``, else those it was
        handed over with) is taken out until a probe of it succeeds."""
        entry = self._queue.get(plan_id)
        if entry is not None:
            self._stuck.add(plan_id)
        for tier in set(tiers) | (entry[2] if entry is not None else frozenset()):
            breaker = self._breaker(tier)
            if breaker.state == "closed" or self._probe_at.pop(tier, None) is not None:
                breaker.failure()  # opens it, or a failed probe: longer out (loads given up meanwhile are not probes)

    def returned(self, plan_id: int) -> None:
        """The reads of a given-up load returned."""
        self._stuck.discard(plan_id)
        self._queue.pop(plan_id, None)

    def read(self, tier: str) -> None:
        """A load read ``tier`` and was not given up: the tier is back if it was out."""
        breaker = self._breakers.get(tier)
        if breaker is not None:
            breaker.success()
            self._probe_at.pop(tier, None)

    def ahead(self) -> float:
        """Seconds of reads a new load of a queued tier waits behind (see the module docstring)."""
        if not self._queue:
            return 0.0
        now = self.clock()
        stale = [p for p, (at, reads, _) in self._queue.items()
                 if p not in self._stuck and now - at > max(_STALE_S, 10 * reads)]
        for plan_id in stale:  # a load whose end was never reported is behind no one for ever
            del self._queue[plan_id]
        if not self._queue:
            return 0.0
        first = min(at for at, _, _ in self._queue.values())
        left = sum(r for _, r, _ in self._queue.values()) - (now - first)
        overdue = [now - at for p, (at, reads, _) in self._queue.items() if p in self._stuck or now - at > reads]
        return max(0.0, left, *overdue)

    def stalls(self) -> bool:
        """Has any tier stalled (its breaker not closed)?"""
        return any(b.state != "closed" for b in self._breakers.values())

    def probe(self, tier: str) -> bool | None:
        """For a stalled tier: True when a hit may probe it now (one at a time, after the
        cooldown; the caller loads a few of its blocks), False while it stays out; None when
        the tier is not stalled. A probe whose outcome never came (its request went away)
        counts as failed once the longest cooldown passed."""
        breaker = self._breakers.get(tier)
        if breaker is None or breaker.state == "closed":
            return None
        now = self.clock()
        since = self._probe_at.get(tier)
        if since is not None and now - since > STALL_MAX_COOLDOWN_S:
            breaker.failure()
            self._probe_at.pop(tier, None)
        if breaker.allow():
            self._probe_at[tier] = now
            return True
        return False

    def _breaker(self, tier: str) -> Breaker:
        if tier not in self._breakers:
            self._breakers[tier] = Breaker(failures=1, cooldown=STALL_COOLDOWN_S,
                                           max_cooldown=STALL_MAX_COOLDOWN_S, clock=self.clock)
        return self._breakers[tier]
