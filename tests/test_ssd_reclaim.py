"""Page reclaim of the SSD tier, alone (no LMDB, no files): when freed pages may be reused."""

from __future__ import annotations

import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.tiers.ssd.reclaim import Reclaim


def test_freed_pages_wait_for_the_sync():
    r = Reclaim()
    r.committed([(0, 16)])
    r.committed([])
    assert r.release() == [] and r.quarantined_pages() == 16
    r.mark_synced()
    assert r.release() == [(0, 16)] and r.quarantined_pages() == 0
    assert r.release() == []


def test_a_read_holds_pages_freed_after_it_began():
    r = Reclaim()
    r.committed([(0, 4)])              # commit 1, before the read
    with r.reading():
        r.committed([(4, 4)])          # commit 2: the read may hold the old head
        r.mark_synced()
        assert r.release() == [(0, 4)]
        with r.reading():              # a read that began after commit 2 holds nothing of it
            r.committed([(8, 4)])
            r.mark_synced()
            assert r.release() == []   # the first read still runs
        assert r.release() == []
    assert r.release() == [(4, 4), (8, 4)]


def test_only_the_oldest_running_read_counts():
    r = Reclaim()
    first = r.reading()
    first.__enter__()
    r.committed([(0, 1)])
    second = r.reading()
    second.__enter__()
    r.committed([(1, 1)])
    r.mark_synced()
    second.__exit__(None, None, None)
    assert r.release() == []           # the first read began before both commits
    first.__exit__(None, None, None)
    assert sorted(r.release()) == [(0, 1), (1, 1)]


def test_reads_from_many_threads_leave_no_epoch_behind():
    r = Reclaim()
    barrier = threading.Barrier(8)

    def read() -> None:
        barrier.wait()
        for _ in range(2000):
            with r.reading():
                pass

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for i in range(500):
        r.committed([(i, 1)])
    for t in threads:
        t.join()
    r.mark_synced()
    assert len(r.release()) == 500


class ReclaimModel(RuleBasedStateMachine):
    """Against the rule itself: an extent freed by commit c is released only when c is
    synced and no read that began before c runs, and then it is released exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.r = Reclaim()
        self.reads: list[tuple[object, int]] = []   # (context, commits when it began)
        self.freed_at: dict[int, int] = {}          # page -> commit that freed it
        self.released: set[int] = set()
        self.next_page = 0

    @rule(n=st.integers(0, 3))
    def commit(self, n: int) -> None:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        self.r.committed([(p, 1) for p in pages])
        for p in pages:
            self.freed_at[p] = self.r.commits

    @rule()
    def begin_read(self) -> None:
        ctx = self.r.reading()
        ctx.__enter__()
        self.reads.append((ctx, self.r.commits))

    @precondition(lambda self: self.reads)
    @rule(i=st.integers(0, 100))
    def end_read(self, i: int) -> None:
        ctx, _ = self.reads.pop(i % len(self.reads))
        ctx.__exit__(None, None, None)  # type: ignore[attr-defined]

    @rule()
    def sync(self) -> None:
        self.r.mark_synced()

    @rule()
    def release(self) -> None:
        oldest = min((began for _, began in self.reads), default=self.r.commits)
        for page, n in self.r.release():
            assert n == 1 and page not in self.released
            freed = self.freed_at[page]
            assert freed <= self.r.synced and freed <= oldest
            self.released.add(page)
        if not self.reads and self.r.synced == self.r.commits:
            assert self.r.quarantined_pages() == 0  # nothing can hold them any more

    @invariant()
    def nothing_lost(self) -> None:
        assert self.r.quarantined_pages() + len(self.released) == len(self.freed_at)


ReclaimModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                          deadline=None)
test_reclaim_model = ReclaimModel.TestCase
