"""The SSD tier's writer thread: batches from the write queue into the index and page file.

Each turn takes a batch from the :class:`~kvstrata.tiers.ssd.writequeue.WriteQueue`,
encodes it (compression and checksums, on the codec threads) and commits it
in one write transaction, which also applies the turn's deletions (discards
first, then records found corrupt), persists accesses, and evicts least
recently used records down to the capacity. Puts of keys already stored
count as accesses. The batch's bodies get one extent of the page file when
one fits (else one each, best fit) and are written, a run of adjacent pages
per ``pwritev``, before their heads are inserted (in key order, in one call),
so a committed head always points at a written body.

Syncs (page file first, then the index) happen at a flush, past
:data:`SYNC_BYTES` of unsynced writes, after :data:`SYNC_INTERVAL_S`, at stop,
and whenever a batch found no room; pages freed by deletions go through
:class:`~kvstrata.tiers.ssd.reclaim.Reclaim` and are handed back to the
free-space map after a sync. A batch that finds no room is retried (the
first retry after syncing the evictions, later ones after evicting more);
when the map is full, room is made by evicting and committing twice (LMDB
reuses freed pages two commits later). A batch that still finds no room is
dropped and counted; a write error or a full disk drops the batch (the next
one tries again); a failed sync is counted and retried; any other index
error disables the tier. Every drop and failed sync makes the next flush
return False. The writer never raises.

Threads: one writer thread per tier owns everything here: the free-space
map, the records per namespace (:attr:`Files.counts`), the commit and sync
counters, the unsynced byte count, and every write transaction; the owner
reads them (:meth:`Writer.settled`, the map for the snapshot) only after the
thread stopped. It shares the queue (its condition), the page file
(positionless I/O), :class:`~kvstrata.tiers.ssd.reclaim.Reclaim` (its lock),
and the health counters (their lock) with other threads; it reports lost keys
through the queue.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.tiers.ssd.record import Codec, Encoded

if TYPE_CHECKING:
    from kvstrata.tiers.ssd.coders import Coders
    from kvstrata.tiers.ssd.health import Health
    from kvstrata.tiers.ssd.index import WriteTxn
    from kvstrata.tiers.ssd.reclaim import Reclaim
    from kvstrata.tiers.ssd.recovery import Files
    from kvstrata.tiers.ssd.writequeue import Put, Work, WriteQueue

__all__ = ["Writer"]

log = logging.getLogger("kvstrata.tiers.ssd")

IDLE_S = 1.0                   # an idle writer wakes this often to persist accesses
LINGER_S = 0.005               # a writer that woke on one put waits this long for a batch to fill
SYNC_BYTES = 64 * 1024**2      # unsynced commits are synced at a flush, past this many bytes,
SYNC_INTERVAL_S = 1.0          # or after this long
MAX_ATTEMPTS = 4
TIME_MARK_S = 60.0             # a time mark (WriteTxn.mark_time) at most this often
RETRY_S = 0.25                 # after a failed turn (a full disk): pause before the next


def wall_clock() -> float:
    """The time marks' clock (seconds since the epoch); tests move it."""
    return time.time()


@dataclass
class _Changes:
    """What one transaction must do (deletions and accesses are done once, even when the
    new records find no room)."""

    encoded: list[Encoded]
    touched: list[bytes] = field(default_factory=list)
    bad: list[bytes] = field(default_factory=list)
    discards: list[bytes] = field(default_factory=list)

    def committed(self) -> None:
        """The deletions and accesses are committed: retries carry only the new records."""
        self.touched, self.bad, self.discards = [], [], []

    def __bool__(self) -> bool:
        return bool(self.encoded or self.touched or self.bad or self.discards)


class Writer:
    """The writer thread of one tier (start it with :meth:`start`; it stops when the
    queue is stopped and drained)."""

    def __init__(self, *, files: "Files", reclaim: "Reclaim", queue: "WriteQueue", codec: Codec,
                 coders: "Coders", health: "Health", capacity_bytes: int, name: str) -> None:
        self.files = files
        self.reclaim = reclaim
        self.queue = queue
        self.codec = codec
        self.coders = coders
        self.health = health
        self.capacity_bytes = capacity_bytes
        self._unsynced = 0
        self._exact = True  # the free-space map accounts for every page
        self._last_sync = time.monotonic()
        self._marked_at = 0.0  # wall time of the last time mark (WriteTxn.mark_time)
        self._closing = False  # the last turn: it marks the time whatever the last mark's age
        self._unmarked = False  # a commit since the last time mark (the last turn marks it)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    # ================================================================== the loop

    def _loop(self) -> None:
        while True:
            work = self.queue.next_work(IDLE_S, LINGER_S)
            sync = bool(work.ticket) or work.stop or self._unsynced >= SYNC_BYTES or (
                self._unsynced > 0 and time.monotonic() - self._last_sync >= SYNC_INTERVAL_S)
            busy = work.batch or work.touched or work.bad or work.discards
            self._closing = work.stop
            ok = True
            if self.health.broken is None and (busy or sync):
                ok = self._write_safely(work, sync)
            self.queue.finish(work)
            if work.stop:
                if not self._unsynced:  # the last reads are over: their pages are free now
                    self._release()
                return
            if not ok:  # do not spin on a full disk: the requeued deletions wait a little
                time.sleep(RETRY_S)

    def _write_safely(self, work: "Work", sync: bool) -> bool:
        """One turn; False when it failed (its puts dropped, its deletions requeued)."""
        from kvstrata.tiers.ssd.index import DiskFull, IndexFailure
        changes = _Changes([], work.touched, work.bad, work.discards)
        try:
            changes.encoded = self._encode(work.batch)
            unplaced = {e.nskey for e in self._write_with_retries(changes, sync)}
            if unplaced:
                self.health.write_failed("dropped_no_room", len(unplaced), "noroom",
                                         f"dropped {len(unplaced)} blocks: no room in the page "
                                         "file even after evicting (fragmented free pages)")
                self.queue.report_dropped([p for p in work.batch if p.nskey in unplaced])
            return True
        except (OSError, DiskFull) as exc:  # disk full, I/O error: the next turn tries again
            self._dropped(work, f"writing failed, dropping the batch: {exc}")
            if changes and not self._commit_alone(changes):  # deletions need no page writes
                self.queue.requeue_discards(changes.discards)  # a later turn retries them
        except IndexFailure as exc:
            self._dropped(work, f"writing the index failed: {exc}")
            self.health.fail(f"write failed: {exc}")
            self.queue.fail()
        except Exception as exc:
            self._dropped(work, f"unexpected error in the writer, batch dropped: {exc!r}")
            log.exception("SSD tier at %s: unexpected error in the writer; batch dropped",
                          self.health.path)
        return False

    def _commit_alone(self, changes: _Changes) -> bool:
        """Commit a failed turn's deletions and accesses without its new records, and sync
        (their pages become reusable); False when that fails too (the disk has no room
        even for the index)."""
        try:
            self._commit(_Changes([], changes.touched, changes.bad, changes.discards))
            self._sync()
            return True
        except Exception:
            return False

    def _dropped(self, work: "Work", why: str) -> None:
        """A turn that failed: its puts are lost."""
        self.health.write_failed("dropped_write_error", len(work.batch), "write", why)
        self.queue.report_dropped(work.batch)

    def _encode(self, batch: list["Put"]) -> list[Encoded]:
        """Compress and checksum a batch."""
        codec = self.codec
        return self.coders.map(lambda item: Encoded(item.nskey, item.raw, codec, item.tag), batch)

    # ================================================================== commits

    def _write_with_retries(self, changes: _Changes, sync: bool) -> list[Encoded]:
        """Commit one batch, evicting more and retrying when the page file has no room
        for it or the map is full; sync when asked to. Returns the records dropped."""
        from kvstrata.tiers.ssd.index import MapFull
        unplaced = changes.encoded
        stored = not changes and not (self._closing and self._unmarked)
        step = max(self.capacity_bytes // 8, sum(e.footprint for e in changes.encoded))
        for attempt in range(MAX_ATTEMPTS):
            if stored:
                break
            extra = max(0, attempt - 1) * step  # first retry: only the synced evictions
            try:
                unplaced = self._commit(changes, extra)
                stored = not unplaced
                changes.committed()
                if not stored:  # evictions committed: make them durable so their pages free up
                    self._sync()
            except MapFull:
                self.health.count("map_full_retries")
                self.health.log_once("mapfull", "the map is full (fragmented free pages); "
                                     "evicting more and retrying")
                self._make_room(max(step, extra))
        if self._unsynced and (sync or not stored):
            self._sync()
        return [] if stored else unplaced

    def _make_room(self, extra: int) -> None:
        """Evict ``extra`` bytes beyond the capacity and commit twice, so that the
        freed index pages become reusable (LMDB reuses pages two commits after freeing).
        Readers left behind by dead processes pin old pages: they are cleared first. A
        map still too full for these commits leaves the batch to be dropped, not the
        tier disabled."""
        from kvstrata.tiers.ssd.index import MapFull
        self.files.index.clear_stale_readers()
        try:
            self._commit(_Changes([]), extra=extra)
            self._commit(_Changes([]))
        except MapFull:
            pass

    def _commit(self, changes: _Changes, extra: int = 0) -> list[Encoded]:
        """One write transaction: deletions, accesses, evictions, then the new bodies and
        heads, and the accesses to those. Puts of keys already stored count as accesses and
        leave ``changes.encoded``. Returns the new records the page file had no room for
        (all of them or none; everything else is committed either way)."""
        taken: list[tuple[int, int]] = []
        try:
            with self.files.index.write() as tx:
                discarded, corrupt = self._delete(tx, changes)
                for nskey in changes.touched:
                    tx.retouch(nskey)
                stored = tx.present([e.nskey for e in changes.encoded])
                new = [e for e in changes.encoded if e.nskey not in stored]
                for e in changes.encoded if stored else ():
                    if e.nskey in stored:  # a put of a stored key: an access
                        tx.retouch(e.nskey)
                evicted = tx.evict(self.capacity_bytes - sum(e.footprint for e in new) - extra)
                placed = self._place(new, taken)
                if placed:
                    self._write_bodies(new)
                    tx.insert_many(new)
                    self._retouch_after_insert(tx, changes.touched, {e.nskey for e in new})
                now = wall_clock()
                self._unmarked = not (self._closing or now - self._marked_at >= TIME_MARK_S)
                if not self._unmarked:
                    tx.mark_time(now)
                    self._marked_at = now
        except BaseException:
            for extent in taken:
                self.files.space.free(*extent)
            raise
        changes.encoded = new
        self.reclaim.committed(tx.freed)
        self._unsynced += 1
        self._exact = self._exact and not tx.leaked
        self.files.add_counts(tx.counts)
        self.health.add({"discarded": discarded, "corrupt_deleted": len(corrupt),
                         "evictions": len(evicted), "puts_present": len(stored)})
        self.queue.report_lost(corrupt + evicted)
        if placed:
            self._account(new)
        return [] if placed else new

    @staticmethod
    def _retouch_after_insert(tx: "WriteTxn", touched: list[bytes], inserted: set[bytes]) -> None:
        """Accesses to records inserted by this transaction (accessed while queued) take
        effect only now: apply again, in order, the first of them and every access after
        it, so that the accesses keep their order (a stored key accessed after a queued
        one stays the more recent, however the writer's turns fell)."""
        first = next((i for i, nskey in enumerate(touched) if nskey in inserted), None)
        for nskey in touched[first:] if first is not None else ():
            tx.retouch(nskey)

    @staticmethod
    def _delete(tx: "WriteTxn", changes: _Changes) -> tuple[int, list[bytes]]:
        """Delete discarded records, then those found corrupt. Returns how many discarded
        records were there, and the keys of the corrupt ones that were (a second report
        of the same record finds it gone)."""
        discarded = sum(1 for nskey in changes.discards if tx.delete(nskey))
        return discarded, [nskey for nskey in changes.bad if tx.delete(nskey)]

    def _place(self, new: list[Encoded], taken: list[tuple[int, int]]) -> bool:
        """Give every new record's body pages in the page file (all or none): one extent
        for the whole batch when one fits (its bodies then go down in one write), else an
        extent per record, best fit."""
        space = self.files.space
        bodies = [e for e in new if e.pages]
        total = sum(e.pages for e in bodies)
        page = space.allocate(total) if len(bodies) > 1 else None
        if page is not None:
            taken.append((page, total))
            for e in bodies:
                e.page = page
                page += e.pages
            return True
        for e in bodies:
            page = space.allocate(e.pages)
            if page is None:
                for extent in taken:
                    space.free(*extent)
                taken.clear()
                return False
            taken.append((page, e.pages))
            e.page = page
        return True

    def _write_bodies(self, new: list[Encoded]) -> None:
        """Write the bodies, one call per run of adjacent pages."""
        runs: list[tuple[int, list[Any]]] = []
        end = -1
        for e in sorted((e for e in new if e.pages), key=lambda e: e.page):
            if e.page != end:
                runs.append((e.page, []))
            runs[-1][1].append(e.body)
            end = e.page + e.pages
        for page, bodies in runs:
            self.files.pages.write_run(page, bodies)
        self._unsynced += sum(len(e.body) for e in new)

    def _account(self, new: list[Encoded]) -> None:
        self.health.add({"blocks_written": len(new), "batches_committed": 1,
                         "bytes_raw": sum(e.raw_len for e in new),
                         "bytes_stored": sum(e.payload_len for e in new)})

    def _sync(self) -> None:
        """Make every commit so far durable (page file first), then hand the pages they
        freed back to the free-space map where no read could still see them. A sync that
        fails is counted (the next flush returns False) and retried at the next one; the
        pages stay reserved until a sync succeeds."""
        from kvstrata.tiers.ssd.index import IndexFailure
        try:
            self.files.pages.sync()
            self.files.index.sync()
        except (OSError, IndexFailure) as exc:
            self.health.write_failed("sync_errors", 0, "sync", f"sync failed: {exc}")
            return
        self.health.count("syncs")
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.reclaim.mark_synced()
        self._release()

    def _release(self) -> None:
        """Return the quarantined pages no read and no crash can pair with an old head."""
        for page, pages in self.reclaim.release():
            self.files.space.free(page, pages)

    # ================================================================== at close

    def settled(self) -> bool:
        """After the writer stopped: every commit synced, every freed page back in the
        free-space map, and no page whose owner is unknown (a deleted head that did not
        verify). Only then does the map describe the page file exactly."""
        return (not self._thread.is_alive() and self._unsynced == 0 and self._exact
                and self.reclaim.quarantined_pages() == 0)
