"""The copier: runs store and load plans asynchronously, so that no step waits for a copy.

It drives an :class:`~kvstrata.dataplane.executor.Executor` (the slab, the SSD tier and the
counters) over a device with streams (:mod:`kvstrata.system.streams`):

* **stores**: the device blocks are gathered on kvstrata's low-priority store
  stream, after an event the caller recorded on the compute stream once the
  blocks' KV was written (never after the whole stream): straight into their
  slab slots for the CPU tier, into pinned staging for blocks bound only for
  the SSD tier. The SSD puts then run on the I/O thread, which waits for the
  gather's event (off the step thread). :meth:`Copier.store` returns at once.
* **loads** (:class:`~kvstrata.dataplane.loads.LoadPipeline`): SSD blocks are
  read into pinned staging (and promoted into their slab slots) on the I/O
  thread; CPU blocks are scattered from the slab, and SSD blocks from staging,
  on the load stream, once what they read is ready.
* **completion** is polled (:meth:`Copier.poll`: ``Event.query`` and
  ``Future.done``, never a wait): a store plan is done when its SSD puts were
  queued, a load when its scatter ran. A load cut at its deadline while its
  reads are out is given up at once (:meth:`Copier.cut`): staging is a bounce
  buffer, and a read that returns later is used by nothing.

Ordering rules (each one is a test in ``tests/test_copier_state.py``, which
removes it and watches bytes go wrong):

1. A gather waits for the compute event its store was submitted with.
2. **The fence.** A device block is not rewritten while a gather out of it is
   pending: :meth:`Copier.fence` makes the compute stream (before the forward
   that reuses blocks the engine handed out again) wait for the gathers still
   reading those blocks. Nothing is held and nothing blocks the host: work
   waits on the device only when a block is really reused before its copy
   ran. A load starts after the compute work queued before it (the blocks'
   previous owner may not have finished writing them); as its blocks were
   fenced before it was queued, that also orders it after their gathers.
3. A load's scatter from a slab slot waits for the pending write into that
   slot (a store's gather: an event; a promotion on the I/O thread: the load
   is submitted only once that finished).
4. Every SSD operation (deletions, spills, puts, reads) runs on one I/O
   thread in the order the policy planned them. A spill copies its slot when
   it is planned (the slot may be rewritten by the next gather). With inline
   streams (the CPU backend, where the forward and the copies share the
   cores) changes run at once when nothing is queued before them: the SSD
   tier's ``put`` only queues the block for its writer. Fetches from the
   remote tier run on a lane of their own (:meth:`Copier.fetch`).
5. Admission: blocks bound only for the SSD tier and spills hold host
   staging until their puts are queued; past ``staging_bytes`` in flight
   they are dropped (counted as ``stores_dropped``, reported lost), never
   waited for. CPU destinations are slab slots the policy pinned for the plan.

Threads: the owner (step) thread calls every method and owns every field; the
I/O thread runs the SSD work and the slab writes of promotions (slots the
policy pinned for that plan, under the load's lock), the fetch lane the
fetches; their results travel back through futures.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor as FuturesExecutor
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Mapping, Sequence

import numpy as np

from kvstrata.dataplane.copy_jobs import CopyRows, Finished, PendingStore, evict_and_spill, put_rows
from kvstrata.dataplane.io_lanes import IOQueue, fetch_job, io_result
from kvstrata.dataplane.executor import Executor, Lost
from kvstrata.dataplane.loads import LoadPipeline
from kvstrata.policy.plans import FetchPlan, LoadPlan, Spill, StorePlan
from kvstrata.system.streams import Event, InlineStreams, Stream, Streams

__all__ = ["CopyRows", "Copier", "Finished", "IOQueue"]

log = logging.getLogger(__name__)


class Copier:
    """Asynchronous stores and loads over ``rows`` (the device's blocks) and ``executor``."""

    def __init__(self, executor: Executor, rows: CopyRows, streams: Streams, *,
                 staging_bytes: int = 256 * 1024**2, io: "FuturesExecutor | None" = None,
                 fetch_io: "FuturesExecutor | None" = None) -> None:
        self.ex = executor
        self.rows = rows
        self.streams = streams
        self.store_stream: Stream = streams.new_stream(low_priority=True)
        self.load_stream: Stream = streams.new_stream(low_priority=False)
        self.staging_bytes = staging_bytes
        self._staged = 0
        inline = isinstance(streams, InlineStreams)
        self._io = IOQueue(io, inline)
        # fetches from the remote tier on a lane of their own: never behind a disk read that
        # does not return (``io`` given alone, a test's fake, runs both lanes)
        self._net = IOQueue(fetch_io if fetch_io is not None else io, inline, name="kvstrata-fetch")
        self._stores: list[PendingStore] = []
        self._reading: dict[int, Event] = {}        # device block -> gather still reading it
        self._slot_event: dict[int, Event] = {}     # slab slot -> gather writing it
        self._slot_io: dict[int, Future[Any]] = {}  # slab slot -> promotion writing it
        self._loading = LoadPipeline(executor, rows, streams, self.load_stream, self._io, self._slot_event,
                                     self._slot_io)
        self._spills: list[tuple[Future[Any], int]] = []  # SSD deletions and spills, staging bytes held
        self._fetches: list[tuple[FetchPlan, Future[int], threading.Event]] = []
        self._fetch_lost: dict[int, Lost] = {}          # fetch plan id -> SSD puts its fetch dropped
        self._switched: Future[Any] | None = None       # the latest move to another remote generation
        self._lost: Lost = []

    # ------------------------------------------------------------------ SSD work, in plan order

    def evict(self, spills: Sequence[Spill], evictions: Mapping[str, Sequence[bytes]]) -> None:
        """Queue a plan's evictions and spills on the I/O thread (rule 4). A spill out of a slab
        slot is copied now (the slot may be rewritten by the next gather); past the staging
        budget it is dropped."""
        copies: list[tuple[Spill, np.ndarray | None]] = []
        slab, size = self.ex.slab, self.rows.block_nbytes
        for spill in spills:
            if spill.slot < 0:
                copies.append((spill, None))  # read on the I/O thread, before the deletions
            elif slab is not None and slab.holds(spill.slot, spill.key) and self._admit(size):
                copies.append((spill, slab.view(spill.slot).copy()))
            else:
                self.ex.count("spill_failures")
                self._lost.append((spill.dst, spill.key))
        if copies or any(evictions.values()):
            fut = self._io.submit(evict_and_spill, self.ex, {t: list(k) for t, k in evictions.items()}, copies)
            self._spills.append((fut, size * sum(row is not None for _, row in copies)))

    def discard_all(self) -> None:
        """Delete every record of the key-addressed tiers (after the work queued so far)."""
        for tier, backend in self.ex.stores.items():
            self._spills.append((self._io.submit(lambda t=tier, b=backend: self.ex.evict([], {t: list(b.keys())})), 0))

    def use_shared_generation(self, token: bytes | None) -> None:
        """Move the remote tier to generation ``token`` after the work queued so far (rule 4):
        puts queued before it go to the generation they were planned in, fetches queued
        after it read the new one."""
        shared = self.ex.first_shared
        if shared is not None:
            self._switched = self._io.submit(lambda: shared.use_generation(token) or [])
            self._spills.append((self._switched, 0))

    def _admit(self, nbytes: int) -> bool:
        if self._staged + nbytes > self.staging_bytes:
            return False
        self._staged += nbytes
        return True

    # ------------------------------------------------------------------ stores

    def store(self, plan: StorePlan, after: Event) -> None:
        """Queue the plan: its spills and deletions, the gather (after ``after``) and the
        SSD puts. Returns without waiting for any of it."""
        self.evict(plan.spills, plan.evictions)
        for tier, keys in plan.touches.items():
            if tier in self.ex.stores:
                self._io.submit(self.ex.stores[tier].touch_many, list(keys))
        slab, size = self.ex.slab, self.rows.block_nbytes
        from_slab = [i for i, s in enumerate(plan.slots) if s >= 0 and slab is not None]
        in_slab = set(from_slab)
        below = {t: set(idx) for t, idx in plan.writes.items() if t in self.ex.stores or t in self.ex.shared}
        host_only = [i for i in range(len(plan)) if i not in in_slab and any(i in idx for idx in below.values())]
        lost: Lost = []
        staged = host_only
        if host_only and not self._admit(size * len(host_only)):  # rule 5: dropped, never waited for
            staged = []
            lost = [(t, plan.keys[i]) for t, idx in below.items() if t in self.ex.stores for i in host_only if i in idx]
            self.ex.count("stores_dropped", len(host_only))
        staging = self.rows.staging(len(staged)) if staged else None
        blocks = [plan.block_ids[i] for i in from_slab + staged]
        if blocks:
            self._after_compute(after)
            self.store_stream.submit(lambda: self._gather(plan, from_slab, staged, staging))
        gathered = self.store_stream.record()
        for b in blocks:
            self._reading[b] = gathered
        for i in from_slab:
            assert slab is not None
            slab.keys[plan.slots[i]] = plan.keys[i]  # loads of it wait for ``gathered`` (rule 3)
            self._slot_event[plan.slots[i]] = gathered
        self.ex.count(f"blocks_stored_{self.ex.slab_tier or plan.slab}", len(from_slab))
        puts = [(t, plan.keys[i], ("slab", plan.slots[i])) for t, idx in below.items() for i in from_slab if i in idx]
        puts += [(t, plan.keys[i], ("staging", j)) for t, idx in below.items() for j, i in enumerate(staged) if i in idx]
        io = self._io.submit(self._put_io, gathered, puts, staging)
        self._stores.append(PendingStore(plan, gathered, io, size * len(staged), lost, time.perf_counter(),
                                   size * len(blocks)))

    def _gather(self, plan: StorePlan, from_slab: list[int], staged: list[int], staging: np.ndarray | None) -> None:
        if from_slab:
            assert self.ex.slab is not None
            self.rows.gather([plan.block_ids[i] for i in from_slab], self.ex.slab.array,
                             [plan.slots[i] for i in from_slab])
        if staged:
            assert staging is not None
            self.rows.gather([plan.block_ids[i] for i in staged], staging, range(len(staged)))

    def _put_io(self, gathered: Event, puts: list[tuple[str, bytes, tuple[str, int]]],
                staging: np.ndarray | None) -> Lost:
        """On the I/O thread: wait for the gather, then queue the puts, each to its tier
        (a shared tier's are write-behind, copied by its queue)."""
        if not puts:
            return []
        self._wait_gathered(gathered)
        return put_rows(self.ex, puts, staging)

    # ------------------------------------------------------------------ remote fetches

    def fetch(self, plan: FetchPlan) -> None:
        """Queue a fetch from the remote tier into the plan's slab slots on the fetch lane
        (its spills, copied now, and its SSD deletions queue on the I/O thread). The fetched
        blocks the plan sends to the SSD tier are put there only once the SSD work queued
        before the fetch ran, and dropped (reported lost) when it has not: a disk read that
        does not return delays no fetch. Loads of those slots wait for it (rule 3);
        :meth:`poll` reports how many blocks arrived."""
        self.evict(plan.spills, plan.evictions)
        cut = threading.Event()
        before = self._io.last_change  # the fetched blocks' SSD puts come after it (rule 4)
        switched = self._switched      # ... and its reads after a move to another generation
        lost = self._fetch_lost.setdefault(plan.plan_id, [])
        io: Future[int] = self._net.submit(fetch_job(self.ex, plan, cut, before, switched, lost), changes=False)
        slab = self.ex.slab
        if slab is not None:
            for slot, key in zip(plan.slots, plan.keys):
                slab.keys[slot] = key  # later loads of it wait for ``io`` and check again (rule 3)
                self._slot_io[slot] = io
        self._fetches.append((plan, io, cut))

    # ------------------------------------------------------------------ loads

    def load(self, plan: LoadPlan, after: Event | None = None) -> None:
        """Queue the plan's copies into its device blocks (its spills and deletions ran
        through :meth:`evict` when it was planned), after ``after``: an event on the compute
        stream recorded once the plan's blocks were fenced (:meth:`fence`) and before any
        forward that reads them (default: recorded now). The pipeline: :mod:`kvstrata.dataplane.loads`."""
        self._loading.load(plan, after)

    def cut(self, req_id: str) -> None:
        """The load or fetch of ``req_id`` reads no more (past its deadline): a load copies in
        the blocks in and reports the rest not loaded, for the engine to compute, at the next
        :meth:`poll` whatever its reads do (:func:`~kvstrata.dataplane.copy_jobs.give_up`); a
        fetch reports what arrived."""
        self._loading.cut(req_id)
        for plan, _, cut in self._fetches:
            if plan.req_id == req_id:
                cut.set()

    # The waits, one method per ordering rule (the tests remove each in turn).

    def _after_compute(self, after: Event) -> None:
        """Rule 1: the store stream's next gather waits for the blocks' KV."""
        self.store_stream.wait(after)

    def _wait_gathered(self, gathered: Event) -> None:
        """Rule 4 (on the I/O thread): puts read rows only once their gather ran."""
        gathered.synchronize()

    # ------------------------------------------------------------------ fences and completion

    def fence(self, block_ids: Sequence[int], stream: Stream | None = None) -> None:
        """Make ``stream`` (default: the current compute stream) wait for pending gathers out
        of ``block_ids`` before it rewrites them (rule 2). Never blocks the host."""
        if not self._reading:
            return
        target = stream if stream is not None else self.streams.current()
        for b in block_ids:
            self._fence_one(b, target)

    def reading(self) -> list[int]:
        """Device blocks a pending gather still reads."""
        return list(self._reading)

    def _fence_one(self, block_id: int, stream: Stream) -> None:
        if (event := self._reading.get(block_id)) is not None:
            stream.wait(event)

    def poll(self) -> Finished:
        """Collect what completed; never waits."""
        out = Finished()
        now = time.perf_counter()
        for job in self._stores:
            if not job.copied and job.gathered.query():
                job.copied = True
                self._release_sources(job)
                self.ex.count("bytes_d2h", job.nbytes)
                self.ex.count("seconds_d2h", now - job.started)
        while self._stores and self._stores[0].copied and self._stores[0].io.done():
            job = self._stores.pop(0)  # in order: plans complete in the order they were prepared
            self._staged -= job.staged
            out.stored.append(job.plan.plan_id)
            out.lost += job.lost + io_result(job.io)
        self._loading.advance()
        self._loading.collect(out, now)
        while self._fetches and self._fetches[0][1].done():
            plan, fut, _ = self._fetches.pop(0)
            try:
                out.fetched[plan.plan_id] = int(fut.result())
            except Exception:
                log.exception("kvstrata: a remote fetch failed; its blocks count as not fetched")
                out.fetched[plan.plan_id] = 0
            out.lost += self._fetch_lost.pop(plan.plan_id, [])
            for slot in plan.slots:
                if self._slot_io.get(slot) is fut:
                    del self._slot_io[slot]
        while self._spills and self._spills[0][0].done():
            fut, staged = self._spills.pop(0)
            self._staged -= staged
            out.lost += io_result(fut)
        out.lost += self._lost
        self._lost = []
        return out

    def _release_sources(self, job: PendingStore) -> None:
        for b in job.plan.block_ids:
            if self._reading.get(b) is job.gathered:
                del self._reading[b]
        for slot in job.plan.slots:
            if self._slot_event.get(slot) is job.gathered:
                del self._slot_event[slot]

    def wait_io(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the SSD reads of a pending load (host work only, no
        device wait): an engine with nothing but loads to wait for would otherwise spin."""
        pending = self._loading.reading()
        pending += [fut for _, fut, _ in self._fetches if not fut.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def fetching(self) -> bool:
        """Fetches from the remote tier not yet reported by :meth:`poll`."""
        return bool(self._fetches)

    @property
    def busy(self) -> bool:
        """Stores or loads not yet reported by :meth:`poll`."""
        return bool(self._stores or self._loading.jobs or self._spills or self._fetches)

    def drain(self, timeout_s: float = 60.0) -> Finished:
        """Wait for everything queued (shutdown only: this blocks) and collect it."""
        deadline = time.monotonic() + timeout_s
        out = Finished()
        while True:
            for job in self._stores:
                job.gathered.synchronize()
            self._loading.synchronize()
            for lane in (self._io, self._net):
                if lane.last is not None:
                    try:
                        lane.last.result(timeout=max(0.0, deadline - time.monotonic()))
                    except FuturesTimeout:
                        raise
                    except Exception:  # the job failed: poll reads and reports its outcome
                        pass
            step = self.poll()
            out.stored += step.stored
            out.lost += step.lost
            out.loads.update(step.loads)
            out.fetched.update(step.fetched)
            out.returned += step.returned
            if not self.busy or time.monotonic() > deadline:
                return out

    def close(self) -> None:
        self._io.shutdown()
        self._net.shutdown()
