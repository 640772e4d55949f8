"""The executor: applies the tier policy's plans to bytes.

Device blocks <-> the CPU slab (:class:`~kvstrata.tiers.host.HostSlab`) <-> the
SSD tier, and the shared remote tier (:class:`~kvstrata.tiers.remote.RemoteTier`:
written behind, read into slab slots by fetch plans). The device side is a :class:`DeviceRows` adapter: kvstrata's own pool
(:class:`PoolRows`, over :class:`~kvstrata.dataplane.transfer.TransferEngine`) for the
library, vLLM's paged KV tensors for the connector's worker half. Nothing
else in kvstrata moves block bytes between tiers.

Each plan runs in the order :mod:`kvstrata.policy.plans` defines: spills, SSD
evictions, then its copies. The result names what could not be done as
``(tier, key)`` pairs for :meth:`TierPolicy.forget`: a slab slot that does
not hold the block the plan expects, an SSD record that is missing or does
not verify, a put the SSD tier refused. Failures below the device are
counted and reported, never raised.

Thread-safety: :meth:`Executor.load` may run on a loader thread while the
owner thread runs :meth:`Executor.store`; the policy's pins keep their slots
disjoint, the SSD tier is thread-safe, and the counters take a lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

import numpy as np

from kvstrata.policy.plans import SHUTDOWN, FetchPlan, LoadPlan, StorePlan
from kvstrata.policy.tiers import CPU, SSD

if TYPE_CHECKING:
    from kvstrata.tiers.host import HostSlab
    from kvstrata.tiers.remote.tier import RemoteTier
    from kvstrata.tiers.ssd import SSDTier
    from kvstrata.dataplane.transfer import TransferEngine

__all__ = ["DeviceRows", "PoolRows", "Executor", "NullExecutor", "LoadResult", "Lost"]

log = logging.getLogger(__name__)

Lost = list[tuple[str, bytes]]
Gate = Callable[[], ContextManager[bool]]  # see Executor.read_ssd
_CHUNK_BYTES = 64 * 1024**2   # device rows read per copy while storing
MAX_TAGS = 1 << 16             # SSD record tags waiting for their puts
COUNTERS = ("blocks_loaded_cpu", "blocks_loaded_ssd", "blocks_stored_cpu", "blocks_stored_ssd", "blocks_spilled",
            "load_failures_cpu", "load_failures_ssd", "store_failures_ssd", "spill_failures", "stores_dropped",
            "bytes_d2h", "bytes_h2d", "seconds_d2h", "seconds_h2d", "blocks_stored_remote", "store_failures_remote",
            "blocks_fetched_remote", "fetch_misses_remote", "bytes_ssd_read", "seconds_ssd_read", "blocks_cut_ssd")
READ_BATCH_BYTES = 1024**2     # what a load or fetch reads (at least a block) between two checks of its deadline


class DeviceRows(Protocol):
    """Whole blocks of the device KV storage, as host rows of ``block_nbytes`` bytes."""

    block_nbytes: int

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host copy ``[len(block_ids), block_nbytes]`` uint8, complete on return."""

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        """Copy host ``rows`` into the blocks; returns an event to wait on before the
        blocks are read, or None when the copy is complete."""

    def staging(self, n: int) -> np.ndarray:
        """Host rows ``[n, block_nbytes]`` uint8 to gather a load into before :meth:`write`
        (pinned when the device is a GPU, so the copy up needs no second host copy)."""


class PoolRows:
    """:class:`DeviceRows` over kvstrata's own pool through a :class:`TransferEngine`."""

    def __init__(self, engine: "TransferEngine") -> None:
        self.engine = engine
        self.block_nbytes = engine.block_nbytes

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        return self.engine.read_rows(block_ids).numpy()

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        return self.engine.write_rows(block_ids, rows)

    def staging(self, n: int) -> np.ndarray:
        return host_rows(n, self.block_nbytes, pinned=self.engine.cuda)


def host_rows(n: int, block_nbytes: int, *, pinned: bool) -> np.ndarray:
    """``[n, block_nbytes]`` uint8 host rows, in page-locked memory when ``pinned``."""
    if not pinned:
        return np.empty((n, block_nbytes), dtype=np.uint8)
    import torch

    return torch.empty((n, block_nbytes), dtype=torch.uint8, pin_memory=True).numpy()


@dataclass
class LoadResult:
    """``loaded``: leading blocks of the plan now in (or on their way to) their device
    blocks; ``event``: wait on it before reading them (None: done). ``read``: blocks moved
    per tier and ``seconds`` the copies took (for the load-or-recompute estimates)."""

    loaded: int
    lost: Lost = field(default_factory=list)
    event: Any = None
    read: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    stalled: bool = False  # cut while its reads were still out: reported with what was in then


class Executor:
    """Runs plans against ``device`` (None: stores and loads of device blocks are not
    possible, e.g. a replay), a slab (None: no CPU tier) and an SSD tier (None: none)."""

    def __init__(self, device: DeviceRows | None, slab: "HostSlab | None", ssd: "SSDTier | None",
                 remote: "RemoteTier | None" = None) -> None:
        self.device = device
        self.slab = slab
        self.ssd = ssd
        self.remote = remote
        self.block_nbytes = device.block_nbytes if device is not None else (slab.block_nbytes if slab else 0)
        self._lock = threading.Lock()
        self._tags: dict[bytes, bytes] = {}  # key -> tag for its SSD record (guarded by _lock)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ stores

    def store(self, plan: StorePlan) -> Lost:
        """Copy the plan's device blocks down; returns what could not be stored.

        Rows are read in chunks of at most 64 MiB. A shutdown plan is patient: an
        SSD put refused for a full queue waits for the queue to drain and retries
        (at any other time a full queue drops the block rather than stall a step).
        """
        patient = plan.reason == SHUTDOWN
        lost = self.evict(plan.spills, plan.ssd_evictions)
        if plan.ssd_touches and self.ssd is not None:
            self._safely("touch_many", self.ssd.touch_many, plan.ssd_touches)
        if not plan.keys:
            return lost
        assert self.device is not None, "a store plan needs a device"
        step = max(1, _CHUNK_BYTES // max(1, self.block_nbytes))
        for lo in range(0, len(plan), step):
            lost += self._store_chunk(plan, lo, min(len(plan), lo + step), patient)
        return lost

    def _store_chunk(self, plan: StorePlan, lo: int, hi: int, patient: bool) -> Lost:
        assert self.device is not None
        rows = self.device.read(plan.block_ids[lo:hi])
        idx = [i for i in range(lo, hi) if plan.cpu_slots[i] >= 0]
        if idx and self.slab is not None:
            self.slab.write([plan.cpu_slots[i] for i in idx], [plan.keys[i] for i in idx], rows, [i - lo for i in idx])
            self.count("blocks_stored_cpu", len(idx))
        if plan.to_remote:
            self.put_remote([plan.keys[i] for i in range(lo, hi) if plan.to_remote[i]],
                             [rows[i - lo] for i in range(lo, hi) if plan.to_remote[i]])
        lost: Lost = []
        for i in range(lo, hi):
            if not plan.to_ssd[i]:
                continue
            ok = self.put_row(plan.keys[i], rows[i - lo], count_failure=not patient)
            if not ok and patient and self.flush():
                ok = self.put_row(plan.keys[i], rows[i - lo])
            if not ok:
                lost.append((SSD, plan.keys[i]))
        return lost

    def evict(self, spills: Sequence[tuple[int, bytes]], ssd_evictions: Sequence[bytes]) -> Lost:
        """Delete what the policy evicted from the SSD tier, then spill evicted CPU slots to
        it. In this order the tier never holds more than the policy planned for: a writer
        batch taken between the two would otherwise find it over capacity and evict records
        the policy still holds."""
        lost: Lost = []
        if ssd_evictions and self.ssd is not None:
            self._safely("discard", self.ssd.discard_many, list(ssd_evictions))
        for slot, key in spills:
            if self.slab is not None and self.slab.holds(slot, key) and self.put_row(key, self.slab.view(slot)):
                self.count("blocks_spilled")
            else:
                self.count("spill_failures")
                lost.append((SSD, key))
        return lost

    def add_tags(self, tags: dict[bytes, bytes]) -> None:
        """Tags for the SSD records of blocks about to be stored (see ``SSDTier.put``), each
        used by the next put of its key; at most :data:`MAX_TAGS` wait (the oldest go)."""
        with self._lock:
            self._tags.update(tags)
            for key in list(itertools.islice(self._tags, max(0, len(self._tags) - MAX_TAGS))):
                del self._tags[key]

    def put_row(self, key: bytes, row: Any, count_failure: bool = True) -> bool:
        """Queue one block for the SSD tier; False (counted) when it is refused."""
        tag = None
        if self._tags:
            with self._lock:
                tag = self._tags.pop(key, None)
        args = (key, row) if tag is None else (key, row, tag)
        ok = self.ssd is not None and bool(self._safely("put", self.ssd.put, *args))
        if ok or count_failure:
            self.count("blocks_stored_ssd" if ok else "store_failures_ssd")
        return ok

    def put_remote(self, keys: Sequence[bytes], rows: Sequence[Any]) -> None:
        """Queue blocks for the remote tier (write-behind; a refused put is counted, and the
        policy keeps no account of the remote tier to correct)."""
        if self.remote is None or not keys:
            return
        ok = sum(bool(self._safely("remote put", self.remote.put, k, r)) for k, r in zip(keys, rows))
        self.count("blocks_stored_remote", ok)
        self.count("store_failures_remote", len(keys) - ok)

    # ------------------------------------------------------------------ remote fetches

    def probe_remote(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the remote tier holds (0 without one, or when it fails)."""
        if self.remote is None or not keys:
            return 0
        return int(self._safely("remote probe", self.remote.probe, keys) or 0)

    def fetch(self, plan: FetchPlan, *, evict: bool = True, stop: Callable[[], bool] | None = None,
              ssd_ready: Callable[[], bool] | None = None, lost: Lost | None = None) -> int:
        """Run a fetch plan: read its blocks from the remote tier into their slab slots, in
        chunks of at most 64 MiB, up to the first that does not arrive, and queue the
        fetched ones the plan sends to the SSD tier. Returns how many arrived; slots of the
        others are cleared (they never hold another block's bytes). ``evict=False``: the
        caller already ran the plan's spills and evictions. ``stop()`` true before a chunk
        (of ``READ_BATCH_BYTES`` then): the rest are not fetched (past the deadline).
        ``ssd_ready()`` false when a fetched block is to be put: the SSD work that must come
        first has not run, and the put is dropped (counted; appended to ``lost``)."""
        if evict:
            self.evict(plan.spills, plan.ssd_evictions)
        got = 0
        try:
            if self.remote is not None and self.slab is not None:
                step = max(1, _CHUNK_BYTES // max(1, self.block_nbytes))
                step = step if stop is None else min(step, self.read_batch)
                while got < len(plan) and not (stop is not None and stop()):
                    n = min(step, len(plan) - got)
                    rows = np.empty((n, self.block_nbytes), dtype=np.uint8)
                    ok = int(self._safely("remote get", self.remote.get_into, plan.keys[got:got + n], rows) or 0)
                    self.slab.write(plan.cpu_slots[got:got + ok], plan.keys[got:got + ok], rows, list(range(ok)))
                    for i in range(ok):
                        if plan.to_ssd[got + i]:
                            self._put_fetched(plan.keys[got + i], rows[i], ssd_ready, lost)
                    got += ok
                    if ok < n:
                        break
        finally:  # slots that received nothing hold nothing (a load of them is refused)
            if self.slab is not None:
                for slot in plan.cpu_slots[got:]:
                    self.slab.forget(slot)
        self.count("blocks_fetched_remote", got)
        self.count("fetch_misses_remote", len(plan) - got)
        return got

    def _put_fetched(self, key: bytes, row: np.ndarray, ready: Callable[[], bool] | None, lost: Lost | None) -> None:
        if ready is None or ready():
            if self.put_row(key, row) or lost is None:
                return
        else:
            self.count("store_failures_ssd")
        if lost is not None:
            lost.append((SSD, key))

    # ------------------------------------------------------------------ loads

    def load(self, plan: LoadPlan, *, evict: bool = True) -> LoadResult:
        """Copy the plan's blocks into their device blocks, up to the first that fails.
        ``evict=False``: the caller already ran the plan's spills and evictions."""
        lost = self.evict(plan.spills, plan.ssd_evictions) if evict else []
        n = len(plan)
        rows = self.device.staging(n) if self.device is not None else np.empty((n, self.block_nbytes), np.uint8)
        ok = [False] * n
        lost += self._from_cpu(plan, rows, ok)
        lost += self.read_ssd(plan, rows, ok)
        loaded = ok.index(False) if False in ok else n
        event = None
        if loaded:
            assert self.device is not None, "a load plan needs a device"
            event = self.device.write(plan.block_ids[:loaded], rows[:loaded])
        return LoadResult(loaded, lost, event)

    def _from_cpu(self, plan: LoadPlan, rows: np.ndarray, ok: list[bool]) -> Lost:
        lost: Lost = []
        idx = []
        for i, slot in enumerate(plan.cpu_slots):
            if slot < 0:
                continue
            if self.slab is not None and self.slab.holds(slot, plan.keys[i]):
                idx.append(i)
            else:  # the slot was never filled or was overwritten: refuse it, never copy wrong bytes
                lost.append((CPU, plan.keys[i]))
        if idx:
            assert self.slab is not None
            self.slab.read([plan.cpu_slots[i] for i in idx], rows, idx)
            for i in idx:
                ok[i] = True
        self.count("blocks_loaded_cpu", len(idx))
        self.count("load_failures_cpu", len(lost))
        return lost

    def read_ssd(self, plan: LoadPlan, rows: np.ndarray, ok: list[bool],
                 stop: Callable[[], bool] | None = None, gate: "Gate | None" = None) -> Lost:
        """Read the plan's SSD blocks (those without a CPU slot) into ``rows`` (row i for
        block i), set ``ok[i]`` for each that verified, and write promoted ones into their
        slab slots. Returns what could not be read, except the SSD blocks missed while the
        tier was still verifying its records in the background: that miss says nothing of
        the record (the recovery reports the ones it drops). ``stop()`` true before a batch
        (``READ_BATCH_BYTES``): the rest are not read (the load was cut; the tier keeps
        them, their promotion slots receive nothing). ``gate``: each batch's outcome (``ok``,
        the promotions, the slots emptied) is applied inside ``with gate() as live``, and
        not at all once ``live`` is false: the load was given up (:meth:`Copier.cut`), and
        its owner already reported every block not in then."""
        idx = [i for i, f in enumerate(plan.from_ssd) if f and plan.cpu_slots[i] < 0]
        if not idx:
            return []
        unverified = self.ssd is not None and bool(self._safely("recovering", self.ssd.recovering))
        started = time.perf_counter()
        lost: Lost = []
        read = 0
        batch = len(idx) if stop is None else self.read_batch
        for lo in range(0, len(idx), batch):
            if stop is not None and stop():
                break
            part = idx[lo:lo + batch]
            got = self._safely("get_into", self.ssd.get_into, [plan.keys[i] for i in part],
                               [rows[i] for i in part]) if self.ssd is not None else None
            hits = list(got or [False] * len(part))
            with gate() if gate is not None else contextlib.nullcontext(True) as live:
                if not live:
                    return []
                lost += self._land_batch(plan, part, hits, rows, ok, unverified)
            read += len(part)
        self.count("seconds_ssd_read", time.perf_counter() - started)  # storage to host memory
        with gate() if gate is not None else contextlib.nullcontext(True) as live:
            if not live:
                return []
            for i in idx[read:]:  # not read: the SSD tier still holds it; its promotion slot stays empty
                lost += self.empty_promotion(plan, i)
            self.count("blocks_cut_ssd", len(idx) - read)
        return lost

    def _land_batch(self, plan: LoadPlan, part: list[int], hits: list[bool], rows: np.ndarray,
                    ok: list[bool], unverified: bool) -> Lost:
        """One batch read: ``ok`` for the blocks that verified, their promotions written, the
        promotion slots of the others emptied; returns what could not be read."""
        lost: Lost = []
        promote = []
        for i, hit in zip(part, hits):
            if hit:
                ok[i] = True
                if plan.promote_slots[i] >= 0:
                    promote.append(i)
                continue
            if not unverified:
                lost.append((SSD, plan.keys[i]))
            lost += self.empty_promotion(plan, i)
        if promote and self.slab is not None:
            self.slab.write([plan.promote_slots[i] for i in promote], [plan.keys[i] for i in promote], rows, promote)
        n_hits = sum(map(bool, hits))
        self.count("bytes_ssd_read", n_hits * rows.shape[1])
        self.count("blocks_loaded_ssd", n_hits)
        self.count("load_failures_ssd", len(part) - n_hits)
        return lost

    def empty_promotion(self, plan: LoadPlan, i: int) -> Lost:
        """Block ``i`` of the plan did not arrive: its promotion slot (if any) receives nothing."""
        slot = plan.promote_slots[i]
        if slot < 0:
            return []
        if self.slab is not None:
            self.slab.forget(slot)
        return [(CPU, plan.keys[i])]

    # ------------------------------------------------------------------ SSD upkeep

    def take_lost(self) -> Lost:
        """Blocks the SSD tier dropped on its own since the last call (its capacity backstop,
        corrupt records, asynchronous write failures)."""
        if self.ssd is None:
            return []
        keys = self._safely("take_lost", self.ssd.take_lost) or []
        return [(SSD, k) for k in keys]

    def flush(self) -> bool:
        """Wait until every accepted SSD write is committed and synced."""
        return self.ssd is None or bool(self._safely("flush", self.ssd.flush))

    def _safely(self, what: str, fn: Any, *args: Any) -> Any:
        """Call into the SSD or remote tier; they promise not to raise, and they never take the
        engine down."""
        try:
            return fn(*args)
        except Exception:
            if what not in self._logged:
                self._logged.add(what)
                log.exception("%s failed; counted as a miss or a dropped store",
                              what if what.startswith("remote") else f"SSD tier: {what}")
            return None

    @property
    def read_batch(self) -> int:
        """Blocks read between two checks of a deadline."""
        return max(1, READ_BATCH_BYTES // max(1, self.block_nbytes))

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[name] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class NullExecutor(Executor):
    """Moves no bytes and fails nothing: what a replay of the policy alone needs."""

    def __init__(self) -> None:
        super().__init__(None, None, None)

    def store(self, plan: StorePlan) -> Lost:
        return []

    def load(self, plan: LoadPlan, *, evict: bool = True) -> LoadResult:
        return LoadResult(plan.loaded(), [])

    def fetch(self, plan: FetchPlan, *, evict: bool = True) -> int:
        return len(plan)
