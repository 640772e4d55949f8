"""Whether the SSD tier is usable, its counters, and warnings logged once.

Shared by every thread of a tier:

* ``counts`` is guarded by :attr:`Health.lock`; :meth:`Health.count` and
  :meth:`Health.snapshot` take it.
* ``broken`` and ``closed`` are set once (by the thread that opens or fails
  the tier, and by the owner at close) and read without a lock: a reader that
  misses the change by one call sees a working tier one call longer, which is
  harmless (every part still degrades to misses on its own errors).
* The log-once set is checked and filled without a lock: at worst a warning
  is logged twice.
* ``pid`` is the opening process: a tier used after ``fork()`` reports itself
  unusable in the child and never touches the environment there.
* Calls that touch the open files from other threads run between
  :meth:`Health.enter` and :meth:`Health.leave` (or inside :meth:`Health.using`;
  a count guarded by the lock): :meth:`Health.quiesce`, at close, marks the
  tier closed and waits for them before the files close.
* ``failures`` (blocks accepted, then dropped by a write error or for want of
  room, and failed syncs) and ``last_error`` are guarded by the lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Health", "COUNTERS"]

log = logging.getLogger("kvstrata.tiers.ssd")

COUNTERS = (
    "puts", "puts_present", "dropped_queue_full", "dropped_unavailable",
    "dropped_write_error", "blocks_written", "batches_committed", "bytes_raw",
    "bytes_stored", "gets", "hits", "misses", "corrupt_deleted", "read_errors",
    "evictions", "map_full_retries", "syncs", "dropped_no_room", "discarded", "sync_errors")


class Health:
    """Counters, the disabled state and log-once warnings of the tier at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pid = os.getpid()
        self.broken: str | None = None
        self.closed = False
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._users = 0
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._logged: set[str] = set()
        self.failures = 0
        self.last_error: str | None = None

    def count(self, name: str, n: int = 1) -> None:
        if os.getpid() != self.pid:  # after fork the lock may be held by a thread the child lacks
            return
        with self.lock:
            self._counts[name] += n

    def add(self, counts: dict[str, int]) -> None:
        """Add to several counters at once."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            for name, n in counts.items():
                self._counts[name] += n

    def write_failed(self, counter: str, n: int, kind: str, message: str) -> None:
        """``n`` accepted blocks (0: a failed sync) did not reach the disk: count them, keep
        ``message`` as the last error, log it once per ``kind``."""
        with self.lock:
            self._counts[counter] += n
            self.failures += 1
            self.last_error = message
        self.log_once(kind, "%s", message)

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter (unlocked in a forked child: its lock may never be freed)."""
        if os.getpid() != self.pid:
            return dict(self._counts)
        with self.lock:
            return dict(self._counts)

    def log_once(self, kind: str, message: str, *args: Any) -> None:
        """Log a warning about this tier, once per ``kind``."""
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("SSD tier at %s: " + message, self.path, *args)

    def fail(self, message: str) -> None:
        """Disable the tier (misses, dropped puts) and log the first reason as an error."""
        if self.broken is None:
            self.broken = message
            log.error("SSD tier at %s disabled: %s", self.path, message)

    def usable(self) -> bool:
        """Open, not disabled, and in the process that opened it."""
        if os.getpid() != self.pid:
            self.log_once("fork", "used in pid %d but opened in pid %d; a tier must not "
                          "cross fork(), open a new one in the child", os.getpid(), self.pid)
            return False
        return self.broken is None and not self.closed

    def enter(self, counter: str | None = None) -> bool:
        """Count ``counter`` (if given) and say whether the tier is usable; while True, the
        caller uses the files until :meth:`leave`, and :meth:`quiesce` waits for that."""
        if os.getpid() != self.pid:
            return self.usable()  # False, logged once; the lock may be held forever here
        with self.lock:
            if counter is not None:
                self._counts[counter] += 1
            ok = self.broken is None and not self.closed
            self._users += ok
        return ok

    def leave(self) -> None:
        """The end of a use :meth:`enter` allowed."""
        with self.lock:
            self._users -= 1
            if not self._users:
                self._idle.notify_all()

    @contextlib.contextmanager
    def using(self) -> Iterator[bool]:
        """Whether the tier is usable; while True, :meth:`quiesce` waits for the block."""
        ok = self.enter()
        try:
            yield ok
        finally:
            if ok:
                self.leave()

    def quiesce(self) -> None:
        """Mark the tier closed and wait until no call is using its files."""
        with self.lock:
            self.closed = True
            while self._users:
                self._idle.wait()
