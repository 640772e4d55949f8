"""Seeding the policy from what its persistent tier (the SSD tier) already holds, at start-up and after a recovery.

Every driver that opens SSD tiers (the library cache, the vLLM scheduler) holds
what they already store through one :class:`StoreSeeding`: :meth:`~StoreSeeding.start`
at start-up, then :meth:`~StoreSeeding.poll` once per step (a request, a scheduler
step). A tier that recovers in the background after an unclean shutdown lists
nothing until its walk has vouched for its records; the first poll after every
such tier is done reads the keys again and holds the verified ones beside what
the policy placed meanwhile (newest first, while free slots last). Keys that do
not fit, or that only some ranks hold, are returned for the driver to delete.

Threads: the driver's thread (the policy's).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Protocol, Sequence

if TYPE_CHECKING:
    from kvstrata.policy.manager import TierPolicy

__all__ = ["StoreSeeding", "Recovering", "ReadKeys"]

log = logging.getLogger("kvstrata.policy")

# () -> (keys every tier holds, least recently used first; keys only some hold)
ReadKeys = Callable[[], "tuple[list[bytes], list[bytes]]"]


class Recovering(Protocol):
    """A tier whose background recovery may still be going on."""

    def recovering(self) -> bool: ...


class StoreSeeding:
    """Holds in ``policy`` the blocks ``read`` lists; again once every tier of
    ``recovering`` (those still recovering when the driver opened them) is done."""

    def __init__(self, policy: "TierPolicy", read: ReadKeys, recovering: Sequence[Recovering]) -> None:
        self.policy = policy
        self._read = read
        self._recovering = [t for t in recovering if t.recovering()]  # before the first read

    @property
    def pending(self) -> bool:
        """Whether a recovery's records are still to be held (a later :meth:`poll` does it)."""
        return bool(self._recovering)

    def start(self) -> list[bytes]:
        """Hold what the tiers list now; the keys to delete."""
        return self._seed(frozenset())

    def poll(self, leaving: Collection[bytes] = frozenset()) -> list[bytes]:
        """Once no tier is recovering any more: hold what they verified, apart from
        ``leaving`` (deletions the driver planned but did not send yet); the keys to
        delete. Cheap while a recovery goes on, nothing once seeded."""
        if not self._recovering or any(t.recovering() for t in self._recovering):
            return []
        self._recovering = []
        held = len(self.policy.store or ())
        delete = self._seed(leaving)
        log.info("kvstrata: the SSD tier's recovery is over: %d of its blocks held",
                 len(self.policy.store or ()) - held)
        return delete

    def cancel(self) -> None:
        """What a recovery verifies is stale (the tiers are being emptied): never hold it."""
        self._recovering = []

    def _seed(self, leaving: Collection[bytes]) -> list[bytes]:
        whole, partial = self._read()
        if leaving:
            whole = [k for k in whole if k not in leaving]
        return partial + self.policy.seed_store(whole)
