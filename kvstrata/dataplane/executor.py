"""The executor: applies the tier policy's plans to bytes.

Device blocks <-> the slab (:class:`~kvstrata.tiers.host.HostSlab`) <-> the key-addressed
tiers (the SSD tier, or any kind registered in that role), and the shared tiers (written
behind, read into slab slots by fetch plans). Each backend is reached by its tier's name,
in the role its kind declares. The device side is a :class:`DeviceRows` adapter: kvstrata's
own pool (:class:`PoolRows`, over :class:`~kvstrata.dataplane.transfer.TransferEngine`) for
the library, vLLM's paged KV tensors for the connector's worker half. Nothing else in
kvstrata moves block bytes between tiers.

Each plan runs in the order :mod:`kvstrata.policy.plans` defines: evictions, spills, then
its copies. The result names what could not be done as ``(tier, key)`` pairs for
:meth:`TierPolicy.forget`: a slab slot that does not hold the block the plan expects, a
record that is missing or does not verify, a put a tier refused. Failures below the device
are counted and reported, never raised.

Thread-safety: :meth:`Executor.load` may run on a loader thread while the owner thread runs
:meth:`Executor.store`; the policy's pins keep their slots disjoint, the key-addressed tiers
are thread-safe, and the counters take a lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from kvstrata.dataplane.device_rows import DeviceRows
from kvstrata.policy.plans import SHUTDOWN, FetchPlan, LoadPlan, Spill, StorePlan
from kvstrata.policy.tiers import KNOWN
from kvstrata.tiers.kinds import role_of

if TYPE_CHECKING:
    from kvstrata.tiers.host import HostSlab

__all__ = ["Executor", "NullExecutor", "LoadResult", "Lost"]

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
    possible, e.g. a replay) and the tiers' ``backends`` by tier name, each in the role its
    kind declares (:func:`~kvstrata.tiers.kinds.role_of`): at most one slab, any number of
    key-addressed local tiers (stores) and shared tiers."""

    def __init__(self, device: DeviceRows | None, backends: Mapping[str, Any] | None = None) -> None:
        self.device = device
        self.slab_tier = ""
        self.slab: "HostSlab | None" = None
        self.stores: dict[str, Any] = {}
        self.shared: dict[str, Any] = {}
        for name, backend in (backends or {}).items():
            if backend is None:
                continue
            role = role_of(KNOWN[name])
            if role == "slab":
                self.slab_tier, self.slab = name, backend
            else:
                (self.stores if role == "store" else self.shared)[name] = backend
        self.block_nbytes = device.block_nbytes if device is not None else (self.slab.block_nbytes if self.slab else 0)
        self._lock = threading.Lock()
        self._tags: dict[bytes, bytes] = {}  # key -> tag for its next store record (guarded by _lock)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ tiers

    @property
    def persistent(self) -> Any:
        """The persistent tier's backend: the last key-addressed local tier (None: none)."""
        return next(reversed(self.stores.values()), None)

    @persistent.setter
    def persistent(self, backend: Any) -> None:  # detach (None) the persistent tier
        name = next(reversed(self.stores), None)
        if name is not None and backend is None:
            del self.stores[name]

    @property
    def first_shared(self) -> Any:
        """The first shared tier's backend (None: none)."""
        return next(iter(self.shared.values()), None)

    @first_shared.setter
    def first_shared(self, backend: Any) -> None:  # detach (None) the first shared tier
        name = next(iter(self.shared), None)
        if name is not None and backend is None:
            del self.shared[name]

    def backend(self, tier: str) -> Any:
        """The backend of ``tier`` (None: not one this executor runs)."""
        if tier == self.slab_tier and tier:
            return self.slab
        return self.stores.get(tier) or self.shared.get(tier)

    # ------------------------------------------------------------------ stores

    def store(self, plan: StorePlan) -> Lost:
        """Copy the plan's device blocks down; returns what could not be stored.

        Rows are read in chunks of at most 64 MiB. A shutdown plan is patient: a put
        refused for a full queue waits for the queue to drain and retries (at any other
        time a full queue drops the block rather than stall a step).
        """
        patient = plan.reason == SHUTDOWN
        lost = self.evict(plan.spills, plan.evictions)
        for tier, keys in plan.touches.items():
            if tier in self.stores:
                self._safely("touch_many", self.stores[tier].touch_many, keys)
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
        idx = [i for i in range(lo, hi) if plan.slots[i] >= 0]
        if idx and self.slab is not None:
            self.slab.write([plan.slots[i] for i in idx], [plan.keys[i] for i in idx], rows, [i - lo for i in idx])
            self.count(f"blocks_stored_{self.slab_tier}", len(idx))
        lost: Lost = []
        for tier, chosen in plan.writes.items():
            part = [i for i in chosen if lo <= i < hi]
            if tier in self.shared:
                self.put_shared(tier, [plan.keys[i] for i in part], [rows[i - lo] for i in part])
                continue
            for i in part:
                ok = self.put_row(tier, plan.keys[i], rows[i - lo], count_failure=not patient)
                if not ok and patient and self.flush():
                    ok = self.put_row(tier, plan.keys[i], rows[i - lo])
                if not ok:
                    lost.append((tier, plan.keys[i]))
        return lost

    def evict(self, spills: Sequence[Spill], evictions: Mapping[str, Sequence[bytes]]) -> Lost:
        """Run a plan's evictions and spills: read the spills out of key-addressed tiers, delete
        what the policy evicted, then write the spills where they cascade. In this order a tier
        never holds more than the policy planned for (a writer batch taken between the two
        would otherwise find it over capacity and evict records the policy still holds), and a
        record spilled out of a tier is read before its deletion."""
        rows = self.read_spills(spills)
        for tier, keys in evictions.items():
            if keys and tier in self.stores:
                self._safely("discard", self.stores[tier].discard_many, list(keys))
        lost: Lost = []
        for spill in spills:
            row = rows.get(spill)
            if row is not None and self.put_row(spill.dst, spill.key, row):
                self.count("blocks_spilled")
            else:
                self.count("spill_failures")
                lost.append((spill.dst, spill.key))
        return lost

    def read_spills(self, spills: Sequence[Spill]) -> dict[Spill, np.ndarray]:
        """The bytes of each spill that are still where the plan expects them: a view of its
        slab slot, or a copy read from its key-addressed tier."""
        out: dict[Spill, np.ndarray] = {}
        for spill in spills:
            if spill.slot >= 0:
                if self.slab is not None and self.slab.holds(spill.slot, spill.key):
                    out[spill] = self.slab.view(spill.slot)
            elif spill.src in self.stores:
                row = np.empty((self.block_nbytes,), dtype=np.uint8)
                got = self._safely("get_into", self.stores[spill.src].get_into, [spill.key], [row])
                if got and got[0]:
                    out[spill] = row
        return out

    def add_tags(self, tags: dict[bytes, bytes]) -> None:
        """Tags for the persistent tier's records of blocks about to be stored (see
        ``SSDTier.put``), each used by the next put of its key there; at most :data:`MAX_TAGS`
        wait (the oldest go)."""
        with self._lock:
            self._tags.update(tags)
            for key in list(itertools.islice(self._tags, max(0, len(self._tags) - MAX_TAGS))):
                del self._tags[key]

    def put_row(self, tier: str, key: bytes, row: Any, count_failure: bool = True) -> bool:
        """Queue one block for the key-addressed tier ``tier``; False (counted) when it is refused."""
        tag = None
        if self._tags and tier == next(reversed(self.stores), None):  # the persistent tier's records keep tags
            with self._lock:
                tag = self._tags.pop(key, None)
        args = (key, row) if tag is None else (key, row, tag)
        backend = self.stores.get(tier)
        ok = backend is not None and bool(self._safely("put", backend.put, *args))
        if ok or count_failure:
            self.count(f"blocks_stored_{tier}" if ok else f"store_failures_{tier}")
        return ok

    def put_shared(self, tier: str, keys: Sequence[bytes], rows: Sequence[Any]) -> None:
        """Queue blocks for the shared tier ``tier`` (write-behind; a refused put is counted, and
        the policy keeps no account of a shared tier to correct)."""
        backend = self.shared.get(tier)
        if backend is None or not keys:
            return
        ok = sum(bool(self._safely("remote put", backend.put, k, r)) for k, r in zip(keys, rows))
        self.count(f"blocks_stored_{tier}", ok)
        self.count(f"store_failures_{tier}", len(keys) - ok)

    # ------------------------------------------------------------------ fetches from a shared tier

    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the (first) shared tier holds (0 without one, or when it fails)."""
        backend = next(iter(self.shared.values()), None)
        if backend is None or not keys:
            return 0
        return int(self._safely("remote probe", backend.probe, keys) or 0)

    def fetch(self, plan: FetchPlan, *, evict: bool = True, stop: Callable[[], bool] | None = None,
              ready: Callable[[], bool] | None = None, lost: Lost | None = None) -> int:
        """Run a fetch plan: read its blocks from its shared tier into their slab slots, in
        chunks of at most 64 MiB, up to the first that does not arrive, and queue the
        fetched ones the plan writes to key-addressed tiers. Returns how many arrived; slots
        of the others are cleared (they never hold another block's bytes). ``evict=False``:
        the caller already ran the plan's spills and evictions. ``stop()`` true before a
        chunk (of ``READ_BATCH_BYTES`` then): the rest are not fetched (past the deadline).
        ``ready()`` false when a fetched block is to be put: the work on those tiers that
        must come first has not run, and the put is dropped (counted; appended to ``lost``)."""
        if evict:
            self.evict(plan.spills, plan.evictions)
        source = self.shared.get(plan.source) if plan.source else self.first_shared
        name = plan.source or next(iter(self.shared), "")
        below: dict[int, list[str]] = {}  # block -> the key-addressed tiers it also goes to
        for tier, chosen in plan.writes.items():
            for i in chosen:
                below.setdefault(i, []).append(tier)
        got = 0
        try:
            if source is not None and self.slab is not None:
                step = max(1, _CHUNK_BYTES // max(1, self.block_nbytes))
                step = step if stop is None else min(step, self.read_batch)
                while got < len(plan) and not (stop is not None and stop()):
                    n = min(step, len(plan) - got)
                    rows = np.empty((n, self.block_nbytes), dtype=np.uint8)
                    ok = int(self._safely("remote get", source.get_into, plan.keys[got:got + n], rows) or 0)
                    self.slab.write(plan.slots[got:got + ok], plan.keys[got:got + ok], rows, list(range(ok)))
                    for i in range(ok):
                        for tier in below.get(got + i, ()):
                            self._put_fetched(tier, plan.keys[got + i], rows[i], ready, lost)
                    got += ok
                    if ok < n:
                        break
        finally:  # slots that received nothing hold nothing (a load of them is refused)
            if self.slab is not None:
                for slot in plan.slots[got:]:
                    self.slab.forget(slot)
        self.count(f"blocks_fetched_{name}", got)
        self.count(f"fetch_misses_{name}", len(plan) - got)
        return got

    def _put_fetched(self, tier: str, key: bytes, row: np.ndarray, ready: Callable[[], bool] | None,
                     lost: Lost | None) -> None:
        if ready is None or ready():
            if self.put_row(tier, key, row) or lost is None:
                return
        else:
            self.count(f"store_failures_{tier}")
        if lost is not None:
            lost.append((tier, key))

    # ------------------------------------------------------------------ loads

    def load(self, plan: LoadPlan, *, evict: bool = True) -> LoadResult:
        """Copy the plan's blocks into their device blocks, up to the first that fails.
        ``evict=False``: the caller already ran the plan's spills and evictions."""
        lost = self.evict(plan.spills, plan.evictions) if evict else []
        n = len(plan)
        rows = self.device.staging(n) if self.device is not None else np.empty((n, self.block_nbytes), np.uint8)
        ok = [False] * n
        lost += self._from_slab(plan, rows, ok)
        lost += self.read_keyed(plan, rows, ok)
        loaded = ok.index(False) if False in ok else n
        event = None
        if loaded:
            assert self.device is not None, "a load plan needs a device"
            event = self.device.write(plan.block_ids[:loaded], rows[:loaded])
        return LoadResult(loaded, lost, event)

    def _from_slab(self, plan: LoadPlan, rows: np.ndarray, ok: list[bool]) -> Lost:
        lost: Lost = []
        idx = []
        for i, slot in enumerate(plan.slots):
            if slot < 0:
                continue
            if self.slab is not None and self.slab.holds(slot, plan.keys[i]):
                idx.append(i)
            else:  # the slot was never filled or was overwritten: refuse it, never copy wrong bytes
                lost.append((plan.sources[i], plan.keys[i]))
        if idx:
            assert self.slab is not None
            self.slab.read([plan.slots[i] for i in idx], rows, idx)
            for i in idx:
                ok[i] = True
        self.count(f"blocks_loaded_{self.slab_tier or plan.slab}", len(idx))
        self.count(f"load_failures_{self.slab_tier or plan.slab}", len(lost))
        return lost

    def read_keyed(self, plan: LoadPlan, rows: np.ndarray, ok: list[bool],
                   stop: Callable[[], bool] | None = None, gate: "Gate | None" = None) -> Lost:
        """Read the plan's blocks held in key-addressed tiers (those without a slab slot) into
        ``rows`` (row i for block i), set ``ok[i]`` for each that verified, and write promoted
        ones into their slab slots. Returns what could not be read, except the blocks missed
        while their tier was still verifying its records in the background: that miss says
        nothing of the record (the recovery reports the ones it drops). ``stop()`` true before
        a batch (``READ_BATCH_BYTES``): the rest are not read (the load was cut; the tiers keep
        them, their promotion slots receive nothing). ``gate``: each batch's outcome (``ok``,
        the promotions, the slots emptied) is applied inside ``with gate() as live``, and not
        at all once ``live`` is false: the load was given up (:meth:`Copier.cut`), and its
        owner already reported every block not in then."""
        idx = plan.keyed()
        if not idx:
            return []
        lost: Lost = []
        read = 0
        batch = len(idx) if stop is None else self.read_batch
        started = time.perf_counter()
        for lo in range(0, len(idx), batch):
            if stop is not None and stop():
                break
            part = idx[lo:lo + batch]
            outcome = self._read_batch(plan, part, rows)
            with gate() if gate is not None else contextlib.nullcontext(True) as live:
                if not live:
                    return []
                lost += self._land_batch(plan, part, outcome, rows, ok)
            read += len(part)
        for tier in {plan.sources[i] for i in idx}:  # storage to host memory
            self.count(f"seconds_{tier}_read", time.perf_counter() - started)
        with gate() if gate is not None else contextlib.nullcontext(True) as live:
            if not live:
                return []
            for i in idx[read:]:  # not read: its tier still holds it; its promotion slot stays empty
                lost += self.empty_promotion(plan, i)
                self.count(f"blocks_cut_{plan.sources[i]}")
        return lost

    def _read_batch(self, plan: LoadPlan, part: list[int], rows: np.ndarray) -> list[tuple[bool, bool]]:
        """Read one batch, each block from its tier: ``(hit, unverified)`` per block
        (``unverified``: its tier was still verifying its records when read)."""
        out: dict[int, tuple[bool, bool]] = {}
        by_tier: dict[str, list[int]] = {}
        for i in part:
            by_tier.setdefault(plan.sources[i], []).append(i)
        for tier, chosen in by_tier.items():
            backend = self.stores.get(tier)
            unverified = backend is not None and bool(self._safely("recovering", backend.recovering))
            got = self._safely("get_into", backend.get_into, [plan.keys[i] for i in chosen],
                               [rows[i] for i in chosen]) if backend is not None else None
            for i, hit in zip(chosen, list(got or [False] * len(chosen))):
                out[i] = (bool(hit), unverified)
        return [out[i] for i in part]

    def _land_batch(self, plan: LoadPlan, part: list[int], outcome: list[tuple[bool, bool]], rows: np.ndarray,
                    ok: list[bool]) -> Lost:
        """One batch read: ``ok`` for the blocks that verified, their promotions written, the
        promotion slots of the others emptied; returns what could not be read."""
        lost: Lost = []
        promote = []
        for i, (hit, unverified) in zip(part, outcome):
            tier = plan.sources[i]
            if hit:
                ok[i] = True
                if plan.promote_slots[i] >= 0:
                    promote.append(i)
                self.count(f"bytes_{tier}_read", rows.shape[1])
                self.count(f"blocks_loaded_{tier}")
                continue
            self.count(f"load_failures_{tier}")
            if not unverified:
                lost.append((tier, plan.keys[i]))
            lost += self.empty_promotion(plan, i)
        if promote and self.slab is not None:
            self.slab.write([plan.promote_slots[i] for i in promote], [plan.keys[i] for i in promote], rows, promote)
        return lost

    def empty_promotion(self, plan: LoadPlan, i: int) -> Lost:
        """Block ``i`` of the plan did not arrive: its promotion slot (if any) receives nothing."""
        slot = plan.promote_slots[i]
        if slot < 0:
            return []
        if self.slab is not None:
            self.slab.forget(slot)
        return [(self.slab_tier or plan.slab, plan.keys[i])]

    # ------------------------------------------------------------------ upkeep of the key-addressed tiers

    def take_lost(self) -> Lost:
        """Blocks the key-addressed tiers dropped on their own since the last call (a capacity
        backstop, corrupt records, asynchronous write failures)."""
        out: Lost = []
        for tier, backend in self.stores.items():
            out += [(tier, k) for k in self._safely("take_lost", backend.take_lost) or []]
        return out

    def flush(self) -> bool:
        """Wait until every accepted write of the key-addressed tiers is committed and synced."""
        return all([bool(self._safely("flush", b.flush)) for b in self.stores.values()])

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
                self.counts[name] = self.counts.get(name, 0) + n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class NullExecutor(Executor):
    """Moves no bytes and fails nothing: what a replay of the policy alone needs."""

    def __init__(self) -> None:
        super().__init__(None)

    def store(self, plan: StorePlan) -> Lost:
        return []

    def load(self, plan: LoadPlan, *, evict: bool = True) -> LoadResult:
        return LoadResult(plan.loaded(), [])

    def fetch(self, plan: FetchPlan, *, evict: bool = True) -> int:
        return len(plan)
