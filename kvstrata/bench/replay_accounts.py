"""What a replay counts of blocks: each tier's lifecycles, the whole cache's, and why blocks missed.

:class:`ReplayAccounts` is the replay's bookkeeping beside its placement
(:class:`~kvstrata.bench.replay.Replayer` places; this only watches):

* per tier, each block's lifecycle (:class:`~kvstrata.bench.lifelog.LifecycleLog`): the
  device pool's from what the replay sees it do, the lower tiers' from the policy's events
  (:attr:`ReplayAccounts.observers`);
* per trace block, its state and times (:class:`~kvstrata.bench.misses.Tracker`): a block
  that left a tier and is held nowhere else has left the whole cache (:meth:`ReplayAccounts.settle`);
* per request, why its blocks missed (:func:`~kvstrata.bench.misses.classify`), and with
  ``explain`` why its first missed block did, and since when.

Threads: the replay's one thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container

from kvstrata.bench.lifelog import LifecycleLog
from kvstrata.bench.misses import MISS_REASONS, Tracker, classify, first_reason
from kvstrata.core.metrics import TIERS, LifecycleRecorder
from kvstrata.policy import LOWER_TIERS
from kvstrata.policy.tiers import GPU

if TYPE_CHECKING:
    from kvstrata.trace.reader import Request

__all__ = ["ReplayAccounts"]

Blocks = list[tuple[int, bytes]]  # (device block, key)


class ReplayAccounts:
    """Lifecycles per tier, the whole cache's lifetimes and miss reasons of one replay
    (``explain``: each request's first miss too)."""

    def __init__(self, explain: bool = False) -> None:
        self.tracker = Tracker()
        self.lifecycle = {t: LifecycleLog() for t in TIERS}
        self.reasons = dict.fromkeys(MISS_REASONS, 0)
        self.misses: list[dict[str, Any]] | None = [] if explain else None
        self._left: list[tuple[list[bytes], str]] = []
        # the policy's events: the lower tiers' lifecycles, and what left a tier (settled per step)
        self.observers = [LifecycleRecorder({t: self.lifecycle[t] for t in LOWER_TIERS}), self._observe]

    def _observe(self, kind: str, tier: str, keys: Any, now: float) -> None:
        if kind in ("evicted", "lost", "dropped"):
            self._left.append((list(keys), tier))

    # ------------------------------------------------------------------ requests

    def arrived(self, r: "Request") -> None:
        """A request arrived: its blocks are followed from now on."""
        if r.blocks or r.output_blocks:
            self.tracker.cover(max([*r.blocks, *r.output_blocks]) + 1)

    def rejected(self, r: "Request", rid: int, now: float) -> None:
        """The request needs more blocks than the whole pool: each of its blocks missed."""
        self.reasons["rejected"] += len(r.blocks)
        if self.misses is not None:
            self.misses.append(self._miss(r, rid, 0, "rejected", now))

    def before(self, r: "Request") -> bytes:
        """The states of the request's blocks before it ran (what :meth:`served` classifies)."""
        return bytes(map(self.tracker.state.__getitem__, r.blocks))

    def served(self, r: "Request", rid: int, before: bytes, hits: int, now: float) -> None:
        """Request ``rid``'s first ``hits`` blocks were served from cache: why the rest missed."""
        classify(before, hits, r.hittable, self.reasons)
        if self.misses is not None and hits < r.hittable:
            self.misses.append(self._miss(r, rid, hits, first_reason(before, hits), now))
        self.tracker.touch([*r.blocks, *r.output_blocks], now)

    def _miss(self, r: "Request", rid: int, hit: int, reason: str, now: float) -> dict[str, Any]:
        """Why request ``rid``'s block ``hit`` (its first miss) missed, and since when."""
        out: dict[str, Any] = {"request": rid, "line": r.line, "timestamp": r.timestamp, "blocks": len(r.blocks),
                               "hittable": r.hittable, "hit": hit, "first_miss": hit, "reason": reason}
        if reason.startswith("evicted_"):
            block = r.blocks[hit]
            out["left_s_ago"] = now - self.tracker.left[block]
            out["last_used_s_ago"] = now - self.tracker.last[block]
        return out

    # ------------------------------------------------------------------ the device pool

    def gpu_hits(self, keys: list[bytes], now: float) -> None:
        self.lifecycle[GPU].access_many(keys, now)

    def loaded(self, keys: list[bytes], now: float) -> None:
        """Blocks loaded from below entered the device pool."""
        self.lifecycle[GPU].enter_many(keys, now)

    def computed(self, computed: Blocks, rows: Any, now: float) -> None:
        """Computed blocks the pool registered enter it (a duplicate of a cached block does not:
        ``rows[block].block_hash`` is its key only when registered)."""
        self.lifecycle[GPU].enter_many([k for b, k in computed if rows[b].block_hash == k], now)

    def evicted(self, evicted: Blocks, now: float) -> None:
        """The device pool handed these blocks out again."""
        if evicted:
            self.lifecycle[GPU].leave_many([h for _, h in evicted], now)

    def settle(self, gpu_evicted: list[bytes], cached: Container[bytes], held: Callable[[bytes], Any],
               now: float) -> None:
        """Blocks that left a tier in this step and are held nowhere now (not ``cached`` on the
        device, ``held`` by no tier below) have left the cache."""
        left, self._left = self._left, []
        leave = self.tracker.left_many
        top, named = len(self.tracker.state), int.from_bytes
        for keys, tier in [*left, (gpu_evicted, GPU)]:  # a lower tier first: it held the block last
            # the tracker follows a position by its chain key (group 0's, a trace's block id): other
            # groups' keys are hashes (1 in 2**64/top names a block)
            gone = [k for k in keys if k not in cached and held(k) is None and named(k, "little") < top]
            if gone:
                leave(gone, tier, now)

    def close(self) -> dict[str, Any]:
        """The samples of every tier's lifecycles (the whole cache's are in :attr:`tracker`)."""
        self.tracker.flush()
        return {t: lc.samples() for t, lc in self.lifecycle.items()}
