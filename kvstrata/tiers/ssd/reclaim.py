"""Page reclaim: when pages of a deleted record may hold another record.

A commit that deletes or evicts records frees their page extents, but those
pages must not be written again while anything could still pair an old head
with them:

* a crash: until the deletion is synced, a restart may find the old head
  committed, so the pages keep their old bytes until then;
* a running read: a read looks its heads up in an index snapshot, then reads
  the pages. A read that began before the deleting commit may hold the old
  head, so the pages wait until every such read has ended.

So an extent freed by commit ``c`` is quarantined and released once ``c`` is
synced and no read that began at a commit count below ``c`` is running (a
read's *epoch* is the commit count when it began: its snapshot holds every
commit up to it, and no later one is needed to find the head it reads). If
the disk reorders writes anyway, the record checksum catches it.

Threads: the writer thread owns the commit counters and the quarantine
(:meth:`Reclaim.committed`, :meth:`Reclaim.mark_synced`, :meth:`Reclaim.release`);
reading threads only enter and leave epochs (:meth:`Reclaim.reading`). The
running epochs are guarded by :attr:`Reclaim.lock`. A read samples
``commits`` while the writer may be incrementing it: it then sees the old
count, which only holds pages longer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["Reclaim"]

Extent = tuple[int, int]  # (first page, pages)


class Reclaim:
    """The quarantine of freed page extents and the epochs of running reads."""

    def __init__(self) -> None:
        self.commits = 0        # write transactions committed since open (writer)
        self.synced = 0         # ... of which are durable (writer)
        self.lock = threading.Lock()
        self._readers: dict[int, int] = {}  # epoch -> reads running (guarded by lock)
        self._quarantine: list[tuple[int, list[Extent]]] = []  # (commit, extents) (writer)

    def committed(self, freed: list[Extent]) -> None:
        """One more commit, which freed ``freed``."""
        self.commits += 1
        if freed:
            self._quarantine.append((self.commits, freed))

    def mark_synced(self) -> None:
        """Every commit so far is durable."""
        self.synced = self.commits

    def release(self) -> list[Extent]:
        """Take the quarantined extents that may be written again."""
        with self.lock:
            oldest = min(self._readers, default=self.commits)
        ready = min(oldest, self.synced)
        free: list[Extent] = []
        waiting = []
        for commit, extents in self._quarantine:
            if commit <= ready:
                free.extend(extents)
            else:
                waiting.append((commit, extents))
        self._quarantine = waiting
        return free

    def quarantined_pages(self) -> int:
        """Pages freed but not yet released."""
        return sum(n for _, extents in self._quarantine for _, n in extents)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Mark a read as running: pages freed by later commits stay quarantined until it ends."""
        with self.lock:
            epoch = self.commits
            self._readers[epoch] = self._readers.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                left = self._readers[epoch] - 1
                if left:
                    self._readers[epoch] = left
                else:
                    del self._readers[epoch]
