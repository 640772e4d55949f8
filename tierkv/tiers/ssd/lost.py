"""Keys the SSD tier dropped on its own, kept until its owner takes them.

A tier drops records without being asked when its capacity LRU evicts them,
when they do not verify (at a read or at open), and when a put it accepted
cannot be written (no room, a write error, the tier disabled). An external
policy that indexes the tier's keys learns about those through
:meth:`SSDTier.take_lost`; records it deleted itself (``discard_many``) and
puts that returned False are never reported.

Threads: the writer thread (and recovery, before it starts) adds keys; any
thread forgets keys (a put that stores a key again) and takes them. Every
method holds :attr:`LostKeys.lock`, except the lock-free emptiness check in
:meth:`LostKeys.forget` (a key added concurrently with its re-put is
genuinely lost afterwards, so missing it there is right).
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

    def forget(self, key: bytes) -> None:
        """Withdraw a report: ``key`` (without prefix) is being stored again."""
        if not self._keys:
            return
        with self.lock:
            self._keys.pop(key, None)

    def forget_many(self, keys: Iterable[bytes]) -> None:
        if not self._keys:
            return
        with self.lock:
            for key in keys:
                self._keys.pop(key, None)

    def take(self) -> list[bytes]:
        """Every key reported since the last call, oldest first (without prefix)."""
        with self.lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys

    def __len__(self) -> int:
        return len(self._keys)
