"""The copier's load pipeline: a load's SSD reads into staging on the I/O thread, then its
scatter onto the load stream once what it copies is ready (rules 2 and 3 of
:mod:`kvstrata.dataplane.copier`), given up when it is cut while its reads are out.

Threads: :class:`LoadPipeline` is called from the copier's owner thread and owns its fields;
the reads run on the I/O thread and report back through their futures.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvstrata.dataplane.copy_jobs import CopyRows, Finished, PendingLoad, give_up, moved
from kvstrata.dataplane.executor import Executor, LoadResult, Lost
from kvstrata.dataplane.io_lanes import IOQueue, io_result, timed
from kvstrata.system.streams import Event, Stream, Streams
from kvstrata.policy.plans import LoadPlan

__all__ = ["LoadPipeline"]


class LoadPipeline:
    """The copier's loads, from queued to collected. ``slot_event`` (slab slot -> gather
    writing it) and ``slot_io`` (slab slot -> I/O job promoting into it) are the copier's,
    shared: stores and fetches fill them, loads wait on them."""

    def __init__(self, executor: Executor, rows: CopyRows, streams: Streams, stream: Stream, io: IOQueue,
                 slot_event: "dict[int, Event]", slot_io: "dict[int, Future[Any]]") -> None:
        self.ex = executor
        self.rows = rows
        self.streams = streams
        self.stream = stream
        self._io = io
        self._slot_event = slot_event
        self._slot_io = slot_io
        self.jobs: list[PendingLoad] = []
        self.stranded: dict[str, Future[Any]] = {}  # request -> reads of its given-up load, still out

    def load(self, plan: LoadPlan, after: Event | None = None) -> None:
        """Queue the plan's copies into its device blocks after ``after`` (default: the
        compute stream now); see :meth:`kvstrata.dataplane.copier.Copier.load`."""
        n = len(plan)
        staging = self.rows.staging(n) if plan.keyed() else np.empty((0, self.rows.block_nbytes), np.uint8)
        ok = [False] * n
        lost: Lost = []
        slab = self.ex.slab
        waits: list[Future[Any]] = []
        for i, slot in enumerate(plan.slots):
            if slot < 0:
                continue
            if slab is not None and slab.holds(slot, plan.keys[i]):
                ok[i] = True
                waits += self._promotions_into(slot)
            else:  # never filled or overwritten: refused, never copied
                lost.append((plan.sources[i], plan.keys[i]))
        self.ex.count(f"load_failures_{self.ex.slab_tier or plan.slab}", len(lost))
        job = PendingLoad(plan, staging, ok, lost, None, waits, started=time.perf_counter())
        if plan.keyed():
            job.io = self._io.submit(timed, job.io_s, self._read, job, changes=False)
            for slot, key in zip(plan.promote_slots, plan.keys):
                if slot >= 0 and slab is not None:
                    slab.keys[slot] = key  # later loads of it wait for ``io`` and check again (rule 3)
                    self._slot_io[slot] = job.io
        job.after = after if after is not None else self.streams.current().record()
        self.jobs.append(job)
        self.advance()

    def _read(self, job: PendingLoad) -> Lost:
        """On the I/O thread: the load's SSD reads (none once it was given up)."""
        with job.lock:
            staging = job.staging
            if job.given_up or staging is None:
                return []
        return self.ex.read_keyed(job.plan, staging, job.ok, job.cut.is_set, job.live)

    def cut(self, req_id: str) -> None:
        """The loads of ``req_id`` read no more (past its deadline)."""
        for job in self.jobs:
            if job.plan.req_id == req_id:
                job.cut.set()

    def advance(self) -> None:
        """Submit the scatter of every load whose host-side work is done (rule 3), or that was
        cut while its reads or the promotions it waits for were out."""
        for job in self.jobs:
            if job.scattered is not None:
                continue
            waiting = [f for f in job.waits_on if not f.done() and f not in self.stranded.values()]
            if job.cut.is_set() and (waiting or (job.io is not None and not job.io.done())):
                self._give_up(job, waiting)
            elif waiting or (job.io is not None and not job.io.done()):
                continue
            if job.io is not None and job.io.done():
                job.lost += io_result(job.io)
            self._recheck_slots(job)
            self._scatter(job)

    def _give_up(self, job: PendingLoad, waiting: "list[Future[Any]]") -> None:
        """A cut load whose reads (or the promotions it waits for) are still out (:func:`give_up`)."""
        if give_up(job, self.ex, self._slot_io, waiting):
            self.stranded[job.plan.req_id] = job.io  # type: ignore[assignment]

    def _recheck_slots(self, job: PendingLoad) -> None:
        """A promotion this load waited for may have failed (its slot was emptied): refuse
        such slots now rather than copy what they hold."""
        slab, plan = self.ex.slab, job.plan
        if not job.waits_on or slab is None:
            return
        for i, slot in enumerate(plan.slots):
            if slot >= 0 and job.ok[i] and not slab.holds(slot, plan.keys[i]):
                job.ok[i] = False
                job.lost.append((plan.sources[i], plan.keys[i]))
                self.ex.count(f"load_failures_{plan.sources[i]}")

    def _scatter(self, job: PendingLoad) -> None:
        plan = job.plan
        loaded = job.ok.index(False) if False in job.ok else len(plan)
        job.loaded = loaded
        from_slab = [i for i in range(loaded) if plan.slots[i] >= 0]
        keyed = [i for i in range(loaded) if plan.slots[i] < 0]
        stream = self.stream
        if loaded:
            self._after_queued_compute(job, stream)
        for i in range(loaded):
            if plan.slots[i] >= 0:
                self._wait_slot(plan.slots[i], stream)
        slab = self.ex.slab
        job.scatter_start = stream.record(timed=True)  # after the waits: the copies alone are timed
        t0 = time.perf_counter()
        if from_slab:
            assert slab is not None
            stream.submit(lambda: self.rows.scatter(slab.array, [plan.slots[i] for i in from_slab],
                                                    [plan.block_ids[i] for i in from_slab]))
        if keyed:
            stream.submit(lambda: self.rows.scatter(job.staging, keyed, [plan.block_ids[i] for i in keyed]))
        job.scatter_s = time.perf_counter() - t0  # the copies themselves on inline streams (a GPU: see poll)
        job.scattered = stream.record(timed=True)
        self.ex.count(f"blocks_loaded_{self.ex.slab_tier or plan.slab}", len(from_slab))

    # The waits, one method per ordering rule (the tests remove each in turn).

    def _after_queued_compute(self, job: PendingLoad, stream: Stream) -> None:
        """Rule 2 for loads: the scatter starts after the compute work queued before the load
        (the blocks' previous owner may still be writing them, and gathers out of them were
        fenced on that stream)."""
        if job.after is not None:
            stream.wait(job.after)

    def _wait_slot(self, slot: int, stream: Stream) -> None:
        """Rule 3: no scatter from a slab slot a pending gather is writing."""
        if (event := self._slot_event.get(slot)) is not None:
            stream.wait(event)

    def _promotions_into(self, slot: int) -> "list[Future[Any]]":
        """Rule 3: a load of a slot waits for the I/O job promoting into it."""
        fut = self._slot_io.get(slot)
        return [fut] if fut is not None else []

    # ------------------------------------------------------------------ completion

    def collect(self, out: Finished, now: float) -> None:
        """Into ``out``: the loads whose scatter ran, and the requests whose given-up reads
        have now returned. Never waits."""
        remaining = []
        for job in self.jobs:
            if job.scattered is not None and job.scattered.query():
                out.loads[job.plan.req_id] = LoadResult(job.loaded, job.lost, read=moved(job), seconds=job.seconds(),
                                                        stalled=job.stalled)
                with job.lock:
                    job.staging = None  # reads still out (given up) read into nothing
                self.ex.count("bytes_h2d", job.loaded * self.rows.block_nbytes)
                self.ex.count("seconds_h2d", now - job.started)
                self._release_slots(job)
            else:
                remaining.append(job)
        self.jobs = remaining
        for req_id in [r for r, fut in self.stranded.items() if fut.done()]:
            del self.stranded[req_id]
            out.returned.append(req_id)

    def _release_slots(self, job: PendingLoad) -> None:
        for slot in job.plan.promote_slots:
            if job.io is not None and self._slot_io.get(slot) is job.io:
                del self._slot_io[slot]

    def reading(self) -> "list[Future[Any]]":
        """The SSD reads of pending loads still out."""
        return [job.io for job in self.jobs if job.io is not None and not job.io.done()]

    def synchronize(self) -> None:
        """Wait for the scatters submitted so far (shutdown only)."""
        for job in self.jobs:
            if job.scattered is not None:
                job.scattered.synchronize()
