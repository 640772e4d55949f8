"""What the tier policy reports: one event per decision, per tier, with a timestamp.

Kinds (``tier`` is ``cpu``, ``ssd`` or ``remote``; the remote tier is shared and
not held by the policy, so it has only ``stored`` (queued for it) and ``hit``
(fetched from it into CPU slots)):

* ``stored``: blocks placed in the tier (a store, a promotion, a cascade);
* ``hit``: blocks a load reads from the tier;
* ``evicted``: blocks the tier's LRU pushed out to make room;
* ``dropped``: blocks offered for storing that found no room (every slot pinned);
* ``rejected``: blocks offered that the tier's ``second_hit`` admission did not take
  (seen for the first time within its window);
* ``lost``: blocks the tier turned out not to hold (a failed copy, a corrupt or
  vanished record, an exclusive promotion that moved them up).

Metrics, the bench statistics and KV-cache events all consume these; none of
them keeps its own idea of where a block is. Observers receive batches:
``observer(kind, tier, keys, now)``; ``keys`` is valid only during the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvstrata.policy.tiers import GPU, LOWER, REMOTE, SHARED

__all__ = ["EVENT_KINDS", "LOWER_TIERS", "TIERS", "REMOTE", "EVENT_TIERS", "PolicyEvent", "Observer", "EventCounts", "EventLog"]

EVENT_KINDS = ("stored", "hit", "evicted", "dropped", "lost", "rejected")
LOWER_TIERS = LOWER  # the tiers a policy places blocks in
TIERS = (GPU, *LOWER_TIERS)  # every tier, as statistics and metrics name them
EVENT_TIERS = (*LOWER_TIERS, *SHARED)  # the tiers events name

Observer = Callable[[str, str, Sequence[bytes], float], None]


@dataclass(frozen=True)
class PolicyEvent:
    """One batch of keys that underwent the same event (see the module docstring)."""

    kind: str
    tier: str
    keys: tuple[bytes, ...]
    time: float


class EventCounts:
    """Blocks per event kind and tier (the policy always keeps one)."""

    __slots__ = ("counts",)

    def __init__(self, tiers: Sequence[str] = LOWER_TIERS) -> None:
        self.counts = {kind: dict.fromkeys(tiers, 0) for kind in EVENT_KINDS}

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {kind: dict(v) for kind, v in self.counts.items()}


class EventLog:
    """Where a policy's events go: its counts, its observers and (``record``) a list a driver
    takes from."""

    def __init__(self, counts: EventCounts, observers: Iterable[Observer] = (), record: bool = False) -> None:
        self.counts = counts
        self.observers: list[Observer] = list(observers)
        self._events: list[PolicyEvent] | None = [] if record else None

    def emit(self, kind: str, tier: str, keys: Sequence[bytes], now: float) -> None:
        if not keys:
            return
        self.counts.counts[kind][tier] += len(keys)
        for observer in self.observers:
            observer(kind, tier, keys, now)
        if self._events is not None:
            self._events.append(PolicyEvent(kind, tier, tuple(keys), now))

    def take(self) -> list[PolicyEvent]:
        """Events recorded since the last call (empty unless recording)."""
        if self._events is None:
            return []
        out, self._events = self._events, []
        return out
