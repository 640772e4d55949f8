"""What the copier moves and tracks: the rows interface, and its queued stores and loads.

:class:`CopyRows` is what a device offers the copier (whole blocks as host rows);
:class:`Finished` is what :meth:`kvstrata.dataplane.copier.Copier.poll` reports;
:class:`PendingStore` and :class:`PendingLoad` are the copier's records of plans in flight.

Threads: the copier's owner thread.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from kvstrata.dataplane.executor import Executor, LoadResult, Lost
from kvstrata.policy.plans import LoadPlan, Spill, StorePlan
from kvstrata.system.streams import Event, elapsed_s

__all__ = ["CopyRows", "Finished", "PendingStore", "PendingLoad", "evict_and_spill", "give_up", "moved", "put_rows"]


class CopyRows(Protocol):
    """Whole device blocks copied as host rows of ``block_nbytes`` bytes (device work:
    called inside :meth:`Stream.submit`)."""

    block_nbytes: int

    def gather(self, block_ids: Sequence[int], dst: np.ndarray, dst_rows: Sequence[int]) -> None:
        """``dst[dst_rows[i]] = block block_ids[i]``."""

    def scatter(self, src: np.ndarray, src_rows: Sequence[int], block_ids: Sequence[int]) -> None:
        """``block block_ids[i] = src[src_rows[i]]``."""

    def staging(self, n: int) -> np.ndarray:
        """Host rows ``[n, block_nbytes]`` uint8 (pinned on a GPU)."""


@dataclass
class Finished:
    """What :meth:`Copier.poll` found complete: store plan ids, blocks lost (``(tier, key)``,
    for the policy to forget), and finished loads by request id."""

    stored: list[int] = field(default_factory=list)
    lost: Lost = field(default_factory=list)
    loads: dict[str, LoadResult] = field(default_factory=dict)
    fetched: dict[int, int] = field(default_factory=dict)  # fetch plan id -> blocks that arrived
    returned: list[str] = field(default_factory=list)  # requests whose given-up reads have now returned


@dataclass
class PendingStore:
    """A store plan the copier queued: its gather, its I/O, the staging it holds."""

    plan: StorePlan
    gathered: Event
    io: "Future[Lost]"
    staged: int             # staging bytes held until ``io`` is done
    lost: Lost
    started: float
    nbytes: int
    copied: bool = False


@dataclass
class PendingLoad:
    """A load the copier queued: its staging rows, its SSD reads, the slab writes it waits on.

    ``given_up``: the load was cut while its reads were still out (a read that does not
    return, or reads queued behind one); it was reported with the blocks in at that moment.
    The I/O thread applies each batch's outcome (``ok``, promotions) only inside
    :meth:`live`, and nothing once the load is given up: what it reads later lands in
    ``staging`` alone, which no one reads again (a bounce buffer: the device blocks are only
    ever written by the scatter, on the owner thread). Guarded by ``lock``."""

    plan: LoadPlan
    staging: np.ndarray | None
    ok: list[bool]
    lost: Lost
    io: "Future[Lost] | None"          # the SSD reads (None: no SSD block)
    waits_on: list["Future[Any]"]      # I/O jobs writing slab slots this load reads
    after: Event | None = None         # the compute stream when the load was queued
    scattered: Event | None = None
    loaded: int = 0
    started: float = 0.0
    cut: threading.Event = field(default_factory=threading.Event)  # read no more SSD blocks
    io_s: list[float] = field(default_factory=lambda: [0.0])     # the SSD reads' seconds (set by them)
    scatter_s: float = 0.0             # the copies into the device blocks (inline streams: their time)
    scatter_start: Event | None = None  # a timed event before them (a device that keeps times measures them)
    lock: threading.Lock = field(default_factory=threading.Lock)
    given_up: bool = False
    stalled: bool = False  # given up while its reads were still out

    @contextlib.contextmanager
    def live(self) -> Iterator[bool]:
        """Whether the I/O thread may still apply what it read (held while it does)."""
        with self.lock:
            yield not self.given_up

    def seconds(self) -> float:
        """What the load took once it is done: its SSD reads, then its copies into the device
        blocks (the device's own time between two timed events where it keeps times)."""
        device_s = elapsed_s(self.scatter_start, self.scattered) \
            if self.scatter_start is not None and self.scattered is not None else None
        return self.io_s[0] + (self.scatter_s if device_s is None else device_s)


def evict_and_spill(ex: Executor, evictions: dict[str, list[bytes]],
                    copies: list[tuple[Spill, "np.ndarray | None"]]) -> Lost:
    """On the I/O thread: read the spills out of key-addressed tiers (``None`` rows), delete
    ``evictions`` (per tier), then put the spills where they cascade."""
    read = ex.read_spills([s for s, row in copies if row is None])
    ex.evict([], evictions)
    lost: Lost = []
    for spill, row in copies:
        row = read.get(spill) if row is None else row
        if row is not None and ex.put_row(spill.dst, spill.key, row):
            ex.count("blocks_spilled")
        else:
            ex.count("spill_failures")
            lost.append((spill.dst, spill.key))
    return lost


def moved(job: PendingLoad) -> dict[str, int]:
    """Blocks a load moved, per tier it read them from: those copied in from the slab, and
    every SSD block read (a block read after the first miss cost its read too)."""
    plan = job.plan
    out: dict[str, int] = {}
    for i, tier in enumerate(plan.sources):
        slab = plan.slots[i] >= 0
        if tier and ((slab and i < job.loaded) or (not slab and job.ok[i])):
            out[tier] = out.get(tier, 0) + 1
    return out


def give_up(job: PendingLoad, ex: Executor, slot_io: "dict[int, Future[Any]]", waiting: "list[Future[Any]]") -> bool:
    """Give a cut load up (see :attr:`PendingLoad.given_up`): what is in now is loaded; a
    slab block whose promotion is still out (``waiting``) is not read, an SSD block not yet
    read is not loaded (its promotion slot emptied, reported lost). True when its reads are
    still out (``stalled``): their promotions no longer hold slots (``slot_io``)."""
    with job.lock:
        job.given_up = True
    plan = job.plan
    for i, slot in enumerate(plan.slots):
        if slot >= 0 and job.ok[i] and slot_io.get(slot) in waiting:
            job.ok[i] = False
        elif slot < 0 and plan.sources[i] and not job.ok[i]:
            job.lost += ex.empty_promotion(plan, i)
            ex.count(f"blocks_cut_{plan.sources[i]}")
    if job.io is None or job.io.done():
        return False
    job.stalled = True
    for slot in plan.promote_slots:
        if slot >= 0 and slot_io.get(slot) is job.io:
            del slot_io[slot]
    return True


def put_rows(ex: Executor, puts: Sequence[tuple[str, bytes, tuple[str, int]]], staging: np.ndarray | None) -> Lost:
    """On the I/O thread, once a store's gather ran: queue its puts, each ``(tier, key,
    where)`` with its row from ``("slab", slot)`` or ``("staging", row)`` (a shared tier's are
    write-behind, copied by its queue); returns the puts the key-addressed tiers refused."""

    def row(where: str, i: int) -> np.ndarray:
        return ex.slab.array[i] if where == "slab" else staging[i]  # type: ignore[union-attr,index]

    lost: Lost = []
    shared: dict[str, list[tuple[bytes, np.ndarray]]] = {}
    for tier, key, (where, i) in puts:
        if tier in ex.shared:
            shared.setdefault(tier, []).append((key, row(where, i)))
        elif not ex.put_row(tier, key, row(where, i)):
            lost.append((tier, key))
    for tier, sends in shared.items():
        ex.put_shared(tier, [k for k, _ in sends], [r for _, r in sends])
    return lost
