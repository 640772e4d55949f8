"""Keys the SSD tier dropped on its own, kept until its owner takes them.

A tier drops records without being asked when its capacity LRU evicts them,
when they do not verify (at a read or at open), and when a put it accepted
cannot be written (no room, a write error, the tier disabled). An external
policy that indexes the tier's keys learns about those through
:meth:`SSDTier.take_lost`; records it deleted itself (``discard_many``) and
puts that returned False are never reported.

Threads: the write queue adds and withdraws keys while holding its own
condition (see :mod:`~kvstrata.tiers.ssd.writequeue`: that orders every report
against the puts and discards of the same key), recovery adds keys before the
writer starts, and any thread takes them. :attr:`LostKeys.lock` guards the
keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

__all__ = ["LostKeys", "LOST_MAX"]

LOST_MAX = 1_000_000  # unread keys kept; beyond this the oldest are dropped and counted


class LostKeys:
    """Lost keys of one namespace, oldest first, at most ``limit`` of them."""

    def __init__(self, prefix: bytes, limit: int = LOST_MAX) -> None:
        if limit < 1:
            raise ValueError(f"limit: expected >= 1, got {limit}")
        self.prefix = prefix
        self.limit = limit
        self.overflow = 0  # keys dropped unread because more than ``limit`` accumulated
        self.lock = threading.Lock()
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, nskeys: Iterable[bytes]) -> None:
        """Report stored keys (namespace prefix included) as lost; keys of other
        namespaces are ignored."""
        n = len(self.prefix)
        keys = [k[n:] for k in nskeys if k.startswith(self.prefix)]
        if not keys:
            return
        with self.lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)
                self.overflow += 1

    def withdraw(self, nskeys: Iterable[bytes]) -> None:
        """Withdraw reports of these keys (namespace prefix included): they are being
        stored again, or their owner discarded them."""
        if not self._keys:
            return
        n = len(self.prefix)
        with self.lock:
            for nskey in nskeys:
                self._keys.pop(nskey[n:], None)

    def take(self) -> list[bytes]:
        """Every key reported since the last call, oldest first (without prefix)."""
        with self.lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys

    def __len__(self) -> int:
        return len(self._keys)
