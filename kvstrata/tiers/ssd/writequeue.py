"""The SSD tier's write queue: blocks accepted by ``put`` until the writer has written them.

Callers put their blocks here (the queue copies what the caller may reuse)
and return at once; the writer thread takes them in batches. Besides the
blocks, the queue carries what the next write transaction must also do:
deletions asked for by ``discard_many``, records readers found corrupt,
accesses to persist, and flush tickets.

Bounded by bytes: a put that would take the queue past its capacity, or come
after it stopped, is refused (the caller counts it). Copy buffers of written
blocks are kept for reuse, up to the same capacity (fresh allocations
page-fault, which makes a block copy several times slower than a memcpy).
Small blocks are copied holding the GIL, and every :attr:`WriteQueue.eager_bytes`
queued the putting thread hands the GIL to the writer (one ``sleep(0)``): a
producer that never releases it would leave the writer waiting for the
interpreter's switch interval (5 ms) at each of its I/O calls.

A discarded key is *discarding* from ``discard_many`` until the writer has
committed its deletion. A queued put of it is cancelled at once (its buffer
recycled); a put the writer has already taken is written, then deleted by the
next transaction. A put of a discarding key is queued again even if the old
record is still stored, and reads treat a discarding key as absent.

Keys the tier drops on its own are reported to :class:`~kvstrata.tiers.ssd.lost.LostKeys`
through the queue, under its condition, so that each report is ordered
against the puts and discards of the same key: a put that queues a key
withdraws earlier reports of it (and a deletion that committed just before
it is not reported); a discard withdraws them and suppresses later reports
of the discarded record (an eviction or corruption of a discarding key, a
put that was taken before it).

Threads: every field, and every change to the lost keys, is guarded by
:attr:`WriteQueue.cond` except
``_touched`` (accesses, filled lock-free by reading threads; a touch that
races the writer taking the set may be lost, which only costs recency) and
the lock-free membership checks of :meth:`WriteQueue.has_put` and
:meth:`WriteQueue.discarding` (callers re-check under the lock where it
matters). Callers use the first group of methods; the writer thread the
second (:meth:`WriteQueue.next_work`, :meth:`WriteQueue.finish`,
:meth:`WriteQueue.fail`, :meth:`WriteQueue.requeue_discards` and the reports).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from kvstrata.tiers.ssd.lost import LostKeys

__all__ = ["WriteQueue", "Work", "Put"]

_MAX_TOUCHED = 1 << 16   # pending recency updates kept between writer batches
_EAGER_BYTES = 1024**2   # a batch of this much is written without lingering for more
_GIL_COPY_BYTES = 256 * 1024  # blocks up to this size are copied without releasing the GIL


class Put:
    """One queued block. ``taken`` once the writer has it; ``live`` until cancelled;
    ``discarded`` when a discard of its key came after the writer took it; ``tag``: what
    the caller keeps beside the record (see :meth:`kvstrata.tiers.ssd.tier.SSDTier.put`)."""

    __slots__ = ("nskey", "raw", "tag", "taken", "live", "discarded")

    def __init__(self, nskey: bytes, raw: bytes | bytearray, tag: bytes | None = None) -> None:
        self.nskey = nskey
        self.raw = raw
        self.tag = tag
        self.taken = False
        self.live = True
        self.discarded = False


@dataclass
class Work:
    """What one turn of the writer takes from the queue."""

    batch: list[Put]
    touched: list[bytes]
    bad: list[bytes]
    discards: list[bytes]
    ticket: int      # the flush ticket this turn completes (0: none)
    stop: bool       # the last turn: the queue is closed and drained


class WriteQueue:
    """Blocks waiting for the writer, at most ``capacity_bytes`` of them; batches of
    about ``batch_bytes``; dropped keys reported to ``lost``."""

    def __init__(self, capacity_bytes: int, batch_bytes: int, lost: "LostKeys") -> None:
        self.capacity_bytes = capacity_bytes
        self.batch_bytes = batch_bytes
        self.eager_bytes = min(batch_bytes, _EAGER_BYTES)  # a batch worth writing at once
        self.lost = lost
        self.cond = threading.Condition()
        self.queued_bytes = 0
        self.failed = False
        self._queue: deque[Put] = deque()
        self._pending: dict[bytes, Put] = {}     # queued or being written
        self._spare: dict[int, list[bytearray]] = {}  # copy buffers for reuse, by size
        self._spare_bytes = 0
        self._touched: dict[bytes, None] = {}
        self._bad: dict[bytes, None] = {}
        self._discards: dict[bytes, None] = {}   # asked for, not yet taken by the writer
        self._discarding: dict[bytes, None] = {}  # taken, not yet committed
        self._flush_req = 0
        self._flush_done = 0
        self._stop = False

    # ================================================================== callers

    def has_put(self, nskey: bytes) -> bool:
        """A put of ``nskey`` is queued or being written, and no discard undoes it."""
        item = self._pending.get(nskey)
        return item is not None and (not item.taken or not self.discarding(nskey))

    def discarding(self, nskey: bytes) -> bool:
        """A deletion of ``nskey`` was asked for and is not yet committed."""
        return nskey in self._discards or nskey in self._discarding

    def discards_pending(self) -> bool:
        """Some deletion was asked for and is not yet committed."""
        return bool(self._discards or self._discarding)

    def put(self, nskey: bytes, data: bytes | bytearray | np.ndarray, tag: bytes | None = None) -> bool:
        """Queue a block for ``nskey``: ``data`` is kept as it is (bytes-likes: the queue
        now owns them) or copied (a C-contiguous array: into a recycled buffer when one
        fits). False, queueing nothing, when the queue is full, stopped or failed; True
        without queueing when a put of ``nskey`` is already there.

        Blocks up to :data:`_GIL_COPY_BYTES` are copied under the lock, holding the GIL
        (handing the GIL to the writer and back would cost more than the copy); larger
        ones before it, with the GIL released. Past every :attr:`eager_bytes` queued, the
        caller hands the GIL over, so that the writer takes the batch at once."""
        small = isinstance(data, np.ndarray) and data.nbytes <= _GIL_COPY_BYTES
        raw = self._copy_large(data) if isinstance(data, np.ndarray) and not small else data
        size = data.nbytes if small else len(raw)
        with self.cond:
            if self.queued_bytes + size > self.capacity_bytes or self._stop or self.failed:
                self._recycle(raw)
                return False
            if self.has_put(nskey):
                self._recycle(raw)
                return True
            if small:
                raw = self._copy_small(data)
            ready = self._append(Put(nskey, raw, tag))
        if ready and small:
            time.sleep(0)
        return True

    def _append(self, item: Put) -> bool:
        """Queue ``item``; whether a batch became ready with it. Hold ``cond``."""
        eager, before = self.eager_bytes, self.queued_bytes
        self.queued_bytes += len(item.raw)
        ready = before // eager != self.queued_bytes // eager
        if ready or not self._queue:  # what the writer may be waiting for
            self.cond.notify_all()
        self._queue.append(item)
        self._pending[item.nskey] = item
        self.lost.withdraw((item.nskey,))
        return ready

    def _spare_for(self, nbytes: int) -> bytearray | None:
        """A recycled buffer of ``nbytes``, if any. Hold ``cond``."""
        spare = self._spare.get(nbytes)
        if not spare:
            return None
        self._spare_bytes -= nbytes
        return spare.pop()

    def _copy_small(self, arr: np.ndarray) -> bytearray:
        """A copy of ``arr`` made holding the GIL. Hold ``cond``."""
        src = memoryview(arr).cast("B")
        buf = self._spare_for(arr.nbytes)
        if buf is None:
            return bytearray(src)
        memoryview(buf)[:] = src
        return buf

    def _copy_large(self, arr: np.ndarray) -> bytearray:
        """A copy of ``arr`` made with the GIL released (without holding ``cond``)."""
        with self.cond:
            buf = self._spare_for(arr.nbytes)
        if buf is None:
            buf = bytearray(arr.nbytes)
        np.copyto(np.frombuffer(buf, dtype=np.uint8), arr.reshape(-1).view(np.uint8))
        return buf

    def discard(self, nskeys: Sequence[bytes]) -> None:
        """Have the writer delete these records; cancel their queued puts; withdraw and
        suppress reports of them as lost."""
        with self.cond:
            for nskey in nskeys:
                item = self._pending.get(nskey)
                if item is not None and not item.taken:
                    item.live = False
                    del self._pending[nskey]
                    self.queued_bytes -= len(item.raw)
                    self._recycle(item.raw)
                elif item is not None:
                    item.discarded = True
                self._discards[nskey] = None
            self.lost.withdraw(nskeys)
            self.cond.notify_all()

    def touch(self, nskey: bytes) -> None:
        """Record an access; the writer persists it in its next transaction, after the
        accesses recorded before it (a key accessed again moves to the end)."""
        touched = self._touched
        if len(touched) < _MAX_TOUCHED:
            touched.pop(nskey, None)
            touched[nskey] = None

    def report_bad(self, nskey: bytes) -> None:
        """Have the writer delete a record that does not verify."""
        with self.cond:
            if nskey not in self._bad:
                self._bad[nskey] = None
                self.cond.notify_all()

    def held(self, nskeys: Sequence[bytes]) -> tuple[list[bytes | None], list[bool]]:
        """Per key, a copy of its queued block (or None), and whether to look on disk
        (not when queued, nor when discarding)."""
        with self.cond:  # the writer recycles a buffer once its block is written
            if not self._discards and not self._discarding:
                items = [self._pending.get(k) for k in nskeys]
                return ([None if i is None else _frozen(i.raw) for i in items],
                        [i is None for i in items])
            raws: list[bytes | None] = []
            look: list[bool] = []
            for nskey in nskeys:
                held = self.has_put(nskey)
                raws.append(_frozen(self._pending[nskey].raw) if held else None)
                look.append(not held and not self.discarding(nskey))
            return raws, look

    def flush(self, timeout: float | None) -> bool:
        """Wait until everything queued so far is committed and synced. False on timeout
        or when the writer failed."""
        with self.cond:
            self._flush_req += 1
            ticket = self._flush_req
            self.cond.notify_all()
            done = self.cond.wait_for(
                lambda: self._flush_done >= ticket or self.failed, timeout)
        return bool(done) and not self.failed

    def stop(self) -> None:
        """Let the writer finish what is queued and stop."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()

    # ================================================================== writer

    def next_work(self, idle_s: float, linger_s: float) -> Work:
        """Wait up to ``idle_s`` for work, then up to ``linger_s`` for a batch worth a
        commit (so that small puts share one); take it."""
        with self.cond:
            self.cond.wait_for(self._has_work, idle_s)
            self.cond.wait_for(self._batch_ready, linger_s)
            batch, ticket = self._take_batch()
            touched = self._take_touched()
            bad, self._bad = list(self._bad), {}
            discards = list(self._discards)
            self._discarding.update(dict.fromkeys(discards))  # first: lock-free readers see one of the two
            self._discards = {}
            stop = self._stop and not self._queue
        return Work(batch, touched, bad, discards, ticket, stop)

    def finish(self, work: Work) -> None:
        """The writer is done with ``work`` (written, dropped, or failed)."""
        with self.cond:
            for item in work.batch:
                if self._pending.get(item.nskey) is item:
                    del self._pending[item.nskey]
                self.queued_bytes = max(0, self.queued_bytes - len(item.raw))
                self._recycle(item.raw)
            for nskey in work.discards:
                self._discarding.pop(nskey, None)
            if work.ticket:
                self._flush_done = max(self._flush_done, work.ticket)
            self.cond.notify_all()

    def report_lost(self, nskeys: Sequence[bytes]) -> None:
        """Stored records the writer deleted on its own (evicted, corrupt). Not reported:
        those of discarding keys (they were going anyway), and those of keys put again
        since the deletion committed (the new put will store them or be reported)."""
        if nskeys:
            with self.cond:
                self.lost.add([k for k in nskeys
                               if not self.discarding(k) and not self.has_put(k)])

    def report_dropped(self, items: Sequence[Put]) -> None:
        """Taken puts the writer could not write; those discarded since are not reported."""
        if items:
            with self.cond:
                self.lost.add([item.nskey for item in items if not item.discarded])

    def requeue_discards(self, nskeys: Sequence[bytes]) -> None:
        """Deletions that a failed transaction did not commit: do them in the next one."""
        with self.cond:
            self._discards.update(dict.fromkeys(nskeys))
            self.cond.notify_all()

    def fail(self) -> None:
        """The tier is disabled: drop everything queued (reported lost), wake every flush."""
        with self.cond:
            self.lost.add([k for k, item in self._pending.items() if not item.taken])
            self.failed = True
            self._queue.clear()
            self._pending.clear()
            self.queued_bytes = 0
            self.cond.notify_all()

    def _has_work(self) -> bool:
        return bool(self._queue or self._bad or self._discards or self._stop
                    or self._flush_req > self._flush_done)

    def _batch_ready(self) -> bool:
        """Worth a commit: enough bytes to keep the disk busy while more are being queued
        (writing overlaps the callers' copies), a flush or a stop."""
        return (self.queued_bytes >= self.eager_bytes or not self._queue
                or self._stop or self._flush_req > self._flush_done)

    def _take_batch(self) -> tuple[list[Put], int]:
        """Up to ``batch_bytes`` of queued blocks; the flush ticket they complete, if any."""
        batch: list[Put] = []
        size = 0
        queue = self._queue
        while queue:
            item = queue[0]
            if item.live and batch and size + len(item.raw) > self.batch_bytes:
                break
            queue.popleft()
            if item.live:
                item.taken = True
                batch.append(item)
                size += len(item.raw)
        done = not queue and self._flush_req > self._flush_done
        return batch, (self._flush_req if done else 0)

    def _take_touched(self) -> list[bytes]:
        """Accesses to apply now. An access to a block still queued waits for the batch
        that writes it (applied earlier, it would find no record), and so do the accesses
        after it, which keeps their order. Hold ``cond``."""
        touched, self._touched = list(self._touched), {}  # one C call: readers may add meanwhile
        pending = self._pending
        first = next((i for i, k in enumerate(touched) if k in pending and not pending[k].taken), None)
        if first is None:
            return touched
        arrived, self._touched = self._touched, dict.fromkeys(touched[first:])
        for k in list(arrived):  # touched meanwhile (one C call): after the deferred ones
            self.touch(k)
        return touched[:first]

    def _recycle(self, raw: bytes | bytearray) -> None:
        """Keep a copy buffer for reuse, up to the queue's capacity in all. Hold ``cond``."""
        if isinstance(raw, bytearray) and self._spare_bytes + len(raw) <= self.capacity_bytes:
            self._spare.setdefault(len(raw), []).append(raw)
            self._spare_bytes += len(raw)


def _frozen(raw: bytes | bytearray) -> bytes:
    return bytes(raw) if isinstance(raw, bytearray) else raw
