"""The SSD tier's write queue (alone) and writer thread (on real files in a temporary
directory, assembled from its parts, so that a test can hold a read open)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.tiers.ssd.coders import Coders
from kvstrata.tiers.ssd.health import Health
from kvstrata.tiers.ssd.lost import LostKeys
from kvstrata.tiers.ssd.reclaim import Reclaim
from kvstrata.tiers.ssd.record import Codec
from kvstrata.tiers.ssd.directory import prepare_directory
from kvstrata.tiers.ssd.recovery import Files, open_files
from kvstrata.tiers.ssd.writequeue import WriteQueue
from kvstrata.tiers.ssd.writer import Writer

MiB = 1024**2
NS = b"N" * 16


def k(i: int) -> bytes:
    return NS + i.to_bytes(32, "big")


def rand(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


# ====================================================================== the queue alone

def test_queue_refuses_past_its_capacity_and_ignores_a_second_put():
    q = WriteQueue(capacity_bytes=3500, batch_bytes=10_000, lost=LostKeys(NS))
    assert [q.put(k(i), bytearray(1000)) for i in range(4)] == [True, True, True, False]
    assert q.queued_bytes == 3000 and q.has_put(k(0)) and not q.has_put(k(3))
    assert q.put(k(0), bytearray(1000)) is False     # full: even a duplicate is refused
    assert q.put(k(0), bytearray(10)) is True        # queued already: nothing more queued
    assert q.queued_bytes == 3000
    work = q.next_work(idle_s=0, linger_s=0)
    assert [p.nskey for p in work.batch] == [k(0), k(1), k(2)] and work.ticket == 0
    assert q.put(k(0), bytearray(b"x" * 10)) is True  # being written: nothing more queued
    assert q.queued_bytes == 3000
    q.finish(work)
    assert q.queued_bytes == 0 and not q.has_put(k(0))


@pytest.mark.parametrize("size", [1000, 300_000])  # copied holding the GIL, and not
def test_queue_recycles_buffers_for_copies(size):
    q = WriteQueue(capacity_bytes=1_000_000, batch_bytes=1_000_000, lost=LostKeys(NS))
    assert q.put(k(0), np.arange(size, dtype=np.uint16).view(np.uint8)[:size])
    work = q.next_work(0, 0)
    first = work.batch[0].raw
    assert bytes(first) == np.arange(size, dtype=np.uint16).view(np.uint8)[:size].tobytes()
    q.finish(work)
    assert q.put(k(1), np.full(size, 7, dtype=np.uint8))
    again = q.next_work(0, 0).batch[0].raw
    assert again is first and bytes(again) == bytes([7]) * size


def test_queue_batches_stop_at_batch_bytes_and_carry_the_flush_ticket():
    q = WriteQueue(capacity_bytes=10 * MiB, batch_bytes=2500, lost=LostKeys(NS))
    for i in range(5):
        q.put(k(i), bytearray(1000))
    waiter = threading.Thread(target=q.flush, args=(10.0,))
    waiter.start()
    time.sleep(0.05)
    first = q.next_work(0, 0)
    second = q.next_work(0, 0)
    third = q.next_work(0, 0)
    assert [len(w.batch) for w in (first, second, third)] == [2, 2, 1]
    assert (first.ticket, second.ticket) == (0, 0) and third.ticket == 1
    for w in (first, second):
        q.finish(w)
    assert waiter.is_alive()
    q.finish(third)
    waiter.join(5)
    assert not waiter.is_alive()


def test_queue_discard_cancels_queued_puts_but_not_taken_ones():
    q = WriteQueue(capacity_bytes=10_000, batch_bytes=1000, lost=LostKeys(NS))
    q.put(k(0), bytearray(1000))
    taken = q.next_work(0, 0)                       # k(0) is being written
    q.put(k(1), bytearray(1000))
    q.discard([k(0), k(1), k(2)])
    assert q.queued_bytes == 1000                   # k(1)'s bytes are released at once
    assert not q.has_put(k(0)) and not q.has_put(k(1))
    assert all(q.discarding(x) for x in (k(0), k(1), k(2)))
    raws, look = q.held([k(0), k(1), k(2), k(3)])
    assert raws == [None] * 4 and look == [False, False, False, True]
    assert q.put(k(1), bytearray(b"n" * 1000))       # a put after the discard is queued
    q.finish(taken)
    work = q.next_work(0, 0)
    assert [p.nskey for p in work.batch] == [k(1)] and bytes(work.batch[0].raw) == b"n" * 1000
    assert sorted(work.discards) == sorted([k(0), k(1), k(2)])
    assert q.discarding(k(0))                       # until the writer has committed it
    q.finish(work)
    assert not q.discarding(k(0)) and q.queued_bytes == 0


def test_queue_accesses_come_out_in_the_order_of_their_last_touch():
    """A key touched again is the most recent: the writer persists accesses in this order
    (a shutdown's hot set must end up most recently used on disk)."""
    q = WriteQueue(capacity_bytes=10_000, batch_bytes=10_000, lost=LostKeys(NS))
    for key in (b"a", b"b", b"c", b"a"):
        q.touch(NS + key)
    assert q.next_work(idle_s=0, linger_s=0).touched == [NS + b"b", NS + b"c", NS + b"a"]


def test_queue_defers_the_accesses_after_one_to_a_block_still_queued():
    """An access to a block not in this batch waits for the batch that writes it; the
    accesses after it wait too, so that the writer applies them all in their order."""
    q = WriteQueue(capacity_bytes=10_000, batch_bytes=1000, lost=LostKeys(NS))
    q.put(k(0), bytearray(1000))
    q.put(k(1), bytearray(1000))                    # not in the first batch
    for i in (7, 1, 8):                             # k(7), k(8): stored records
        q.touch(k(i))
    first = q.next_work(0, 0)
    assert [p.nskey for p in first.batch] == [k(0)] and first.touched == [k(7)]
    q.touch(k(9))                                   # while the writer writes k(0)
    q.finish(first)
    second = q.next_work(0, 0)
    assert [p.nskey for p in second.batch] == [k(1)] and second.touched == [k(1), k(8), k(9)]
    q.finish(second)


def test_queue_failure_drops_everything_and_wakes_flushes():
    q = WriteQueue(capacity_bytes=10_000, batch_bytes=1000, lost=LostKeys(NS))
    q.put(k(0), bytearray(1000))
    taken = q.next_work(0, 0)
    q.put(k(1), bytearray(1000))
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(q.flush(10.0)))
    waiter.start()
    time.sleep(0.05)
    q.fail()
    waiter.join(5)
    assert results == [False] and q.queued_bytes == 0
    assert q.lost.take() == [k(1)[16:]]             # k(0) belongs to the writer's turn
    q.finish(taken)


def test_reports_are_ordered_against_puts_and_discards_of_the_key():
    q = WriteQueue(capacity_bytes=10_000, batch_bytes=1000, lost=LostKeys(NS))
    q.report_lost([k(0), k(1)])
    q.put(k(0), bytearray(10))                      # stored again: no longer lost
    q.discard([k(1)])                               # its owner is done with it
    assert q.lost.take() == []
    q.report_lost([k(0), k(1), k(2)])               # k(0) queued again, k(1) discarding
    assert q.lost.take() == [k(2)[16:]]
    work = q.next_work(0, 0)                        # takes k(0) and the discard of k(1)
    q.discard([k(0)])                               # after the writer took its put
    q.report_dropped(work.batch)                    # ... which then found no room
    assert q.lost.take() == []
    q.finish(work)
    q.put(k(3), bytearray(10))
    work = q.next_work(0, 0)
    q.report_dropped(work.batch)
    assert q.lost.take() == [k(3)[16:]]


# ====================================================================== the writer

class Rig:
    """A writer over real files, with the queue, reclaim and lost keys it shares."""

    def __init__(self, path: Path, capacity: int, map_size: int) -> None:
        self.capacity = capacity
        self.map_size = map_size
        self.health = Health(path)
        self.lost = LostKeys(NS)
        self.queue = WriteQueue(capacity_bytes=64 * MiB, batch_bytes=256 * 1024, lost=self.lost)
        self.reclaim = Reclaim()
        prepare_directory(path)
        files = open_files(path, map_size=map_size, namespace=NS, about={},
                           health=self.health, lost=self.lost)
        assert files is not None, self.health.broken
        self.files: Files = files
        self.writer = Writer(files=files, reclaim=self.reclaim, queue=self.queue,
                             codec=Codec("none"), coders=Coders(False), health=self.health,
                             capacity_bytes=capacity, name="test-writer")
        self.writer.start()

    def fill(self, ids: range, size: int = 65536) -> None:
        for i in ids:
            assert self.queue.put(k(i), rand(size, i))
            assert self.queue.flush(30)  # one block per transaction

    def present(self, i: int) -> bool:
        return self.files.index.has(k(i))

    def pages(self, ids: range) -> dict[int, set[int]]:
        out = {}
        for i in ids:
            hdr = self.files.index.head(k(i))
            if hdr is not None:
                out[i] = set(range(hdr.page, hdr.page + hdr.pages))
        return out

    def close(self) -> None:
        self.queue.stop()
        self.writer.join()
        self.files.close()


@pytest.fixture
def rig(tmp_path: Path):
    rig = Rig(tmp_path / "ssd", capacity=2 * MiB, map_size=5 * MiB)
    yield rig
    rig.close()


def test_evicted_pages_are_not_reused_under_a_running_read(rig):
    """A read that looked up a head before an eviction must never find another block's
    bytes at its pages: their reuse waits for such reads (and for the sync of the eviction)."""
    rig.fill(range(30))
    old = rig.pages(range(30))
    with rig.reclaim.reading():                  # a read in flight since before the evictions
        rig.fill(range(30, 60))
        evicted = set().union(*(old[i] for i in old if not rig.present(i)))
        assert evicted
        new = set().union(*rig.pages(range(30, 60)).values())
        assert not new & evicted
    rig.fill(range(60, 200))                     # the read is over: pages are reused
    assert rig.files.pages.size() <= rig.map_size
    new = set().union(*rig.pages(range(60, 200)).values())
    assert new & evicted
    counts = rig.health.snapshot()
    assert counts["dropped_no_room"] == 0
    lost = rig.lost.take()
    assert lost == [k(i)[16:] for i in range(200) if not rig.present(i)]  # in eviction order
    assert len(lost) == counts["evictions"]


def test_no_room_drops_counts_and_reports_then_recovers(rig):
    """A read that never ends pins every page freed after it began: once the slack is
    used up, batches find no room. They are dropped, counted and reported lost; nothing
    hangs or raises, and writes succeed again when the read is over."""
    limit = rig.map_size // 65536
    with rig.reclaim.reading():
        t0 = time.monotonic()
        rig.fill(range(limit + 40))
        assert time.monotonic() - t0 < 30
        counts = rig.health.snapshot()
        assert counts["dropped_no_room"] > 0 and rig.files.pages.size() <= rig.map_size
        assert rig.files.index.used_bytes() <= rig.capacity
        assert rig.reclaim.quarantined_pages() > 0
    gone = {k(i)[16:] for i in range(limit + 40) if not rig.present(i)}
    assert set(rig.lost.take()) == gone          # evicted or dropped: every one reported
    assert len(gone) == counts["evictions"] + counts["dropped_no_room"]
    rig.fill(range(1000, 1010))
    assert all(rig.present(i) for i in range(1000, 1010))
    assert rig.reclaim.quarantined_pages() == 0


def test_accesses_keep_their_order_when_some_touched_blocks_are_still_queued(rig):
    """Accesses to blocks still queued take effect when the writer inserts them; a stored
    block accessed after them stays the more recent (a shutdown touches the hot blocks
    the tier holds after the others: whether the writer took the others' puts before the
    touches must not change the order on disk)."""
    rig.fill(range(2))                            # k(0), k(1) stored
    with rig.queue.cond:                          # the writer takes nothing meanwhile
        assert rig.queue.put(k(2), rand(65536, 2)) and rig.queue.put(k(3), rand(65536, 3))
        for i in (3, 1, 2, 0):
            rig.queue.touch(k(i))
    assert rig.queue.flush(30)                    # one turn: the puts and the accesses
    assert rig.files.index.keys_lru(NS) == [k(3), k(1), k(2), k(0)]


def test_discards_are_committed_before_the_batch_they_arrive_with(rig):
    rig.fill(range(3))
    rig.queue.discard([k(1)])
    assert rig.queue.put(k(1), rand(65536, 101))
    assert rig.queue.flush(30)
    hdr = rig.files.index.head(k(1))
    assert hdr is not None and hdr.clock == 4     # the new record, after the deletion
    assert rig.health.snapshot()["discarded"] == 1 and rig.lost.take() == []
    assert rig.files.pages.read(hdr.page, 65536) == rand(65536, 101)
