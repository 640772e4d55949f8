"""The tier policy: which lower tier holds each block, and what moves when.

One bytes-free object decides placement for every driver: the library's
:class:`kvstrata.library.tiered.TieredKVCache`, the vLLM connector's scheduler half and
the ``kvstrata bench`` replay. Drivers report facts (a prompt's blocks, blocks
that were computed, evicted or are about to be) and apply the plans they get
back through an executor; they decide nothing themselves.

Verbs (in the manner of vLLM's ``OffloadingManager``):

* :meth:`lookup`: the tiers of the longest prefix of keys held below. Pure:
  no I/O, no pins, no recency change.
* :meth:`touch`: mark keys recently used (a device-pool hit on them).
* :meth:`prepare_load` / :meth:`complete_load`: pin the sources of a load,
  place promotions; release them once the copies finished.
* :meth:`prepare_store` / :meth:`complete_store`: admission, placement,
  cascade and evictions for blocks offered for a reason (see
  :mod:`kvstrata.policy.plans`); release once written.
* :meth:`prepare_fetch` / :meth:`complete_fetch`: CPU slots (pinned) for blocks a
  driver found on the shared remote tier; the fetched ones are CPU hits from then
  on, the others are forgotten.
* :meth:`forget`: an executor found blocks missing or corrupt.
* :meth:`clear`: every block below is stale (the model's weights changed).
* :meth:`take_events`: the recorded :class:`~kvstrata.policy.events.PolicyEvent`
  batches, when ``record_events`` is on.

Recency rules: a hit is a use of every copy below the tier it came from. A
device-pool hit (:meth:`touch`) refreshes the block in every lower tier; a CPU
hit (:meth:`prepare_load`) refreshes its SSD copy, so the persistent tier stays
a superset of what is hot above it; an SSD hit refreshes the SSD copy (pinned
during the load, most recent after); a recomputed block refreshes the copies
below (``prepare_store(..., COMPUTED)``). All refreshes of a request happen
before its promotions: drivers call :meth:`touch` for the device-pool hits
before :meth:`prepare_load`, which refreshes before it places promotions
(whose cascades may evict).

Lifetime rules: every slot a plan reads or writes (load sources, promotion
slots, store targets, cascade targets) is pinned from ``prepare_*`` until
``complete_*``; a pinned entry is never evicted or reused. Executors run
plans in the order they were prepared (see :mod:`kvstrata.policy.plans`). A key
forgotten while pinned leaves at once (lookups stop finding it); its entry
keeps the slot under a tombstone until the plans that pinned it complete.

Threading: not thread-safe. One owner thread (an engine's scheduler thread)
calls every verb; executors run elsewhere and report back through that thread.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from kvstrata.policy.events import LOWER_TIERS, EventCounts, EventLog, Observer, PolicyEvent
from kvstrata.policy.plans import COMPUTED, SHUTDOWN, FetchPlan, LoadPlan, Spill, StorePlan
from kvstrata.policy.holdings import TOMBSTONE_PREFIX, Holdings
from kvstrata.policy.spec import PolicySpec
from kvstrata.policy.ghost import Ghost
from kvstrata.policy.hot_set import select_for_shutdown
from kvstrata.policy.orders import OrderContext
from kvstrata.policy.tiers import KNOWN, SECOND_HIT

__all__ = ["TierPolicy"]


class TierPolicy:
    """Placement over the tiers ``spec.tiers`` declares: a slab tier (host memory the device
    copies to and from; promotions and remote fetches land in it), a persistent tier below it
    (its evictions cascade there), and shared tiers, sized and ruled by a :class:`PolicySpec`."""

    def __init__(self, spec: PolicySpec, *, clock: Callable[[], float] = time.monotonic,
                 observers: Iterable[Observer] = (), record_events: bool = False) -> None:
        self.spec = spec
        self.clock = clock
        tiers = spec.tiers
        assert tiers is not None
        slab, store, shared = tiers.slab(), tiers.store(), tiers.shared
        # the names of the roles (a role no tier plays keeps its kind's name: nothing is ever placed there)
        self._c = slab.name if slab is not None else next(n for n, t in KNOWN.items() if t.slab)
        self._s = store.name if store is not None else next(n for n, t in KNOWN.items() if not t.slab and not t.shared)
        self._r = shared[0].name if shared else ""
        #: the tiers' names by role: the slab, the (first) key-addressed tier, the (first) shared tier
        self.slab_tier, self.store_tier, self.shared_tier = self._c, self._s, self._r
        #: what the tiers' eviction orders may weigh blocks by beyond their uses (the driver teaches it)
        self.order_context = OrderContext(16, spec.attention_share)
        self.holdings = Holdings(tiers, self.order_context)
        self.cpu, self.ssd = self.holdings.index(self._c), self.holdings.index(self._s)
        self._cpu, self._ssd = self.holdings.held(self._c), self.holdings.held(self._s)  # for lookups
        self.counts = EventCounts((*LOWER_TIERS, *(t.name for t in shared)))
        self._cascades_to = slab.cascade if slab is not None else None
        # second_hit admission: the keys each such tier saw once
        self._ghost_s = Ghost(store.ghost_keys) if self.ssd is not None and store.admission == SECOND_HIT else None
        self._ghost_r = Ghost(shared[0].ghost_keys) if shared and shared[0].admission == SECOND_HIT else None
        self.log = EventLog(self.counts, observers, record_events)
        self._emit = self.log.emit
        self._next_plan = 0

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """``cpu`` or ``ssd`` for each key of the longest prefix of ``keys`` held below.
        Pure: nothing is pinned, touched or counted."""
        cpu, ssd, c, s = self._cpu, self._ssd, self._c, self._s
        out: list[str] = []
        for key in keys:
            if key in cpu:
                out.append(c)
            elif key in ssd:
                out.append(s)
            else:
                break
        return out

    def holds(self, key: bytes) -> str | None:
        """The highest lower tier holding ``key`` (``cpu``/``ssd``), or None."""
        if key in self._cpu:
            return self._c
        if key in self._ssd:
            return self._s
        return None

    def add_observer(self, observer: Observer) -> None:
        """Send every later event batch to ``observer`` too."""
        self.log.observers.append(observer)

    def held_in(self, tier: str, key: bytes) -> bool:
        """Does lower tier ``tier`` (``cpu``/``ssd``) hold ``key``?"""
        return key in self.holdings.held(tier)

    @property
    def pageout_blocks(self) -> int:
        """How many least recently used free device blocks a driver offers for page-out."""
        return self.spec.pageout_blocks

    def admits(self, reason: str) -> bool:
        return self.spec.admits(reason)

    def occupancy(self) -> dict[str, int]:
        indexes = self.holdings.indexes
        return {t: len(indexes[t]) if t in indexes else 0 for t in LOWER_TIERS}

    def capacity(self) -> dict[str, int]:
        return self.spec.capacity()

    def pinned(self) -> dict[str, int]:
        indexes = self.holdings.indexes
        return {t: indexes[t].num_pinned if t in indexes else 0 for t in LOWER_TIERS}

    # ------------------------------------------------------------------ recency

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` recently used in every lower tier holding them."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        for index in (self.cpu, self.ssd):
            if index is not None:
                index.touch_many(keys)

    def seed_ssd(self, keys_lru_first: Iterable[bytes]) -> list[bytes]:
        """Hold what the persistent tier already holds (least recently used first): at
        start-up, or later (a tier that finished recovering) beside what is held by then.

        Keys already held are skipped; the newest of the others fill the free slots and
        nothing held is evicted for them. Returns the keys that do not fit (the oldest):
        the caller deletes them from the tier. Emits no events.
        """
        if self.ssd is None:
            return list(keys_lru_first)
        keys = list(dict.fromkeys(keys_lru_first))
        if len(self.ssd):  # (at start-up it is empty: a million keys need not be looked up)
            keys = [k for k in keys if k not in self._ssd]
        keep = keys[max(0, len(keys) - self.ssd.num_free):]
        self.ssd.allocate_many(keep)
        return keys[:len(keys) - len(keep)]

    # ------------------------------------------------------------------ loads

    def prepare_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> LoadPlan:
        """Plan copying ``keys`` (a prefix :meth:`lookup` found below) into ``block_ids``.

        Pins every source, and (inclusive promotion) gives SSD hits a CPU slot,
        pinned too, evicting and cascading as a store would.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        c, s = self._c, self._s
        plan = LoadPlan(self._plan_id(), req_id, list(block_ids), list(keys), [], [], [-1] * len(keys), slab=c)
        in_cpu, in_ssd = self._cpu, self._ssd
        from_cpu = [k for k in plan.keys if k in in_cpu]
        from_ssd = [k for k in plan.keys if k not in in_cpu and k in in_ssd]
        cpu_slot = dict(zip(from_cpu, self.holdings.pin(self._c, plan.plan_id, from_cpu))) if from_cpu else {}
        if from_ssd:
            self.holdings.pin(self._s, plan.plan_id, from_ssd)
        plan.slots = [cpu_slot.get(k, -1) for k in plan.keys]
        plan.sources = [c if k in cpu_slot else s if k in in_ssd else "" for k in plan.keys]
        if from_cpu and self.ssd is not None:
            # A CPU hit is a use of the block's SSD copy too (as a GPU hit is of both, see
            # touch): the persistent tier stays a superset of what is hot above it. Before
            # the promotions below, whose cascades may evict from the SSD tier.
            self.ssd.touch_many([k for k in from_cpu if k in in_ssd])
        now = self.clock()
        self._emit("hit", self._c, from_cpu, now)
        self._emit("hit", self._s, from_ssd, now)
        if from_cpu and self._ghost_s is not None:
            self._admit_hits(plan, [k for k in from_cpu if k not in in_ssd], cpu_slot, now)
        if from_ssd and self.cpu is not None and self.spec.promotion == "inclusive":
            self._promote(plan, from_ssd, now)
        return plan

    def _admit_hits(self, plan: LoadPlan, keys: list[bytes], cpu_slot: dict[bytes, int], now: float) -> None:
        """``second_hit``: a CPU hit of a block the SSD tier lacks is a sighting; the second
        one writes the block down from its (pinned) slab slot, a spill run before the load."""
        gone = set(plan.evictions.get(self._s, ()))  # (as in _cascade: the deletion runs after the spill)
        keys = [k for k in dict.fromkeys(keys) if k not in gone]  # a key named twice is one sighting
        placed = self._place_ssd(plan, self._second(self._ghost_s, self._s, keys, now), now)
        plan.spills.extend(Spill(self._c, cpu_slot[k], self._s, k) for k in placed)

    def _second(self, ghost: Ghost | None, tier: str, keys: list[bytes], now: float) -> list[bytes]:
        """The ``keys`` a tier's admission takes: all of them (``always``), or those seen once
        before within its ghost window (``second_hit``; the others are remembered and
        reported ``rejected``)."""
        if ghost is None or not keys:
            return keys
        taken = [k for k in keys if ghost.seen(k)]
        if len(taken) < len(keys):
            took = set(taken)
            self._emit("rejected", tier, [k for k in keys if k not in took], now)
        return taken

    def _promote(self, plan: LoadPlan, keys: list[bytes], now: float) -> None:
        """Give SSD hits pinned CPU slots (promote_slots), cascading what that evicts."""
        placed = self._place_cpu(plan, keys, now)
        plan.promote_slots = [placed.get(k, -1) if s < 0 and t else -1 for k, s, t in zip(plan.keys, plan.slots, plan.sources)]
        self._emit("dropped", self._c, [k for k in keys if k not in placed], now)

    def complete_load(self, plan: LoadPlan, lost: Iterable[tuple[str, bytes]] = (),
                      loaded: int | None = None) -> None:
        """The load finished: release its pins. ``lost``: ``(tier, key)`` the executor
        could not read (forgotten). ``loaded``: how many blocks reached the device (by
        default what ``lost`` leaves, :meth:`LoadPlan.loaded`; 0 for a cancelled load).
        Exclusive promotion moves the loaded CPU blocks up; the rest stay where they are."""
        lost = list(lost)
        self.holdings.release(plan.plan_id)
        self.forget_pairs(lost)
        if self.spec.promotion == "exclusive":
            n = plan.loaded(lost) if loaded is None else loaded
            moved = [k for k, s in zip(plan.keys[:n], plan.slots[:n]) if s >= 0]
            self.forget(self._c, moved)  # moved up (keys forgotten above are gone already)

    # ------------------------------------------------------------------ stores

    def prepare_store(self, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> StorePlan:
        """Offer device blocks for storing; returns the plan admission and placement made.

        ``computed`` blocks a tier already holds are touched there; ``pageout``
        and ``evicted`` blocks that any lower tier holds are skipped. The others
        get a CPU slot (evicting the least recently used, which cascades to the
        SSD tier without write-through). With write-through, or when the CPU tier
        has no room, blocks the SSD tier lacks go there. ``shutdown`` offers
        device blocks most recently used first: the most recent that fit go to
        the SSD tier.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        plan = StorePlan(self._plan_id(), reason, slab=self._c)
        if not self.spec.admits(reason) or not self.spec.has_lower_tier:
            return plan
        if reason == SHUTDOWN:
            self._plan_shutdown(plan, block_ids, keys)
        else:
            self._plan_store(plan, block_ids, keys, reason)
        return plan

    def _plan_store(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> None:
        now = self.clock()
        cpu, ssd = self.cpu, self.ssd
        cpu_keys, ssd_keys = self._cpu, self._ssd
        offered = dict(zip(keys, block_ids))  # a repeated key is stored once
        if reason == COMPUTED:  # a recomputed block is a use of the copies below
            present = [k for k in offered if k in cpu_keys]
            if cpu is not None:
                cpu.touch_many(present)
            if ssd is not None:
                ssd.touch_many([k for k in offered if k in ssd_keys])
        else:  # paged out or evicted: only blocks no lower tier holds go down, nothing is touched
            offered = {k: b for k, b in offered.items() if k not in cpu_keys and k not in ssd_keys}
            present = []
        # New to this replica's lower tiers: the remote tier gets them (it is never asked first:
        # SET NX keeps what another replica stored)
        fresh = set(self._second(self._ghost_r, self._r, [k for k in offered if k not in cpu_keys and k not in ssd_keys],
                                 now)) if self.spec.remote else set()
        new = [k for k in offered if k not in cpu_keys] if cpu is not None else []
        slots = self._place_cpu(plan, new, now) if new else {}
        to_ssd = self._second(self._ghost_s, self._s, self._ssd_wanted(offered, slots, set(present)), now)
        placed_ssd = self._place_ssd(plan, to_ssd, now) if to_ssd else {}
        stored = [k for k in offered if k in slots or k in placed_ssd or k in fresh]
        plan.keys = stored
        plan.block_ids = [offered[k] for k in stored]
        plan.slots = [slots.get(k, -1) for k in stored]
        for tier, taken in ((self._s, placed_ssd), (self._r, fresh)):
            if taken:
                plan.writes[tier] = [i for i, k in enumerate(stored) if k in taken]
        if fresh:
            self._emit("stored", self._r, [k for k in stored if k in fresh], now)
        if len(slots) < len(new):
            nowhere = [k for k in new if k not in slots and k not in placed_ssd and k not in ssd_keys]
            self._emit("dropped", self._c, nowhere, now)

    def _ssd_wanted(self, offered: dict[bytes, int], cpu_slots: dict[bytes, int], in_cpu: set[bytes]) -> list[bytes]:
        """Keys that go to the SSD tier: all it lacks with write-through, else those
        the CPU tier could not take."""
        ssd = self.ssd
        if ssd is None:
            return []
        held = self._ssd
        if self.spec.write_through or self.cpu is None:
            return [k for k in offered if k not in held]
        return [k for k in offered if k not in held and k not in cpu_slots and k not in in_cpu]

    def _plan_shutdown(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        ssd = self.ssd
        if ssd is None:
            return
        chosen, held = select_for_shutdown(zip(block_ids, keys), self._ssd.__contains__,
                                           ssd.num_slots - ssd.num_pinned)
        ssd.touch_many(held)  # hot blocks already stored are kept, here and on disk
        if held:
            plan.touches[self._s] = list(held)
        now = self.clock()
        placed = self._place_ssd(plan, [k for _, k in chosen], now)
        remote = self.spec.remote
        for block, key in chosen:
            if key in placed:
                plan.add(block, key, -1, (self._s, self._r) if remote and key not in self._cpu else (self._s,))
        if remote:
            self._emit("stored", self._r, [plan.keys[i] for i in plan.goes_to(self._r)], now)

    def complete_store(self, plan: StorePlan, lost: Iterable[tuple[str, bytes]] = ()) -> None:
        """The plan's copies finished: release its pins; forget ``(tier, key)`` that failed."""
        self.holdings.release(plan.plan_id)
        self.forget_pairs(lost)

    # ------------------------------------------------------------------ remote fetches

    def prepare_fetch(self, keys: Sequence[bytes], req_id: str = "") -> FetchPlan:
        """Pinned CPU slots for ``keys`` (the continuation of a prefix, none of them held in
        the CPU tier) that a driver found on the remote tier, placed as a store would (with
        write-through also an SSD place). Truncated at the first key that finds no slot."""
        plan = FetchPlan(self._plan_id(), req_id=req_id, source=self._r, slab=self._c)
        if self.cpu is None or not self.spec.remote:
            return plan
        want = list(dict.fromkeys(keys))
        want = want[:next((i for i, k in enumerate(want) if k in self._cpu), len(want))]
        if not want:
            return plan
        now = self.clock()
        slots = self._place_cpu(plan, want, now)
        n = next((i for i, k in enumerate(want) if k not in slots), len(want))
        unplaced = want[n:]
        if unplaced:  # placed beyond a gap: of no use to the prefix
            self.forget(self._c, [k for k in unplaced if k in slots])
            self._emit("dropped", self._c, [k for k in unplaced if k not in slots], now)
        want = want[:n]
        to_ssd: dict[bytes, int] = {}
        if want and self.ssd is not None and self.spec.write_through:
            wanted = self._second(self._ghost_s, self._s, [k for k in want if k not in self._ssd], now)
            to_ssd = self._place_ssd(plan, wanted, now)
        plan.keys = want
        plan.slots = [slots[k] for k in want]
        if to_ssd:
            plan.writes[self._s] = [i for i, k in enumerate(want) if k in to_ssd]
        return plan

    def complete_fetch(self, plan: FetchPlan, fetched: int) -> None:
        """The fetch ran: its first ``fetched`` blocks are in their slots (CPU hits from now
        on, a ``hit`` of the remote tier); the others are forgotten where they were placed."""
        self.holdings.release(plan.plan_id)
        now = self.clock()
        self._emit("hit", self._r, plan.keys[:fetched], now)
        missed = plan.keys[fetched:]
        if missed:
            self.forget(self._c, missed)
            for tier, idx in plan.writes.items():
                below = [plan.keys[i] for i in idx if i >= fetched]
                if below:
                    self.forget(tier, below)

    # ------------------------------------------------------------------ placement

    def _place_cpu(self, plan: StorePlan | LoadPlan, keys: list[bytes], now: float) -> dict[bytes, int]:
        """CPU slots for absent ``keys`` (pinned for the plan); cascades what they evict."""
        placed, evicted = self.holdings.place(self._c, plan.plan_id, keys)
        self._cascade(plan, evicted, now)
        self._emit("stored", self._c, list(placed), now)
        return placed

    def _place_ssd(self, plan: StorePlan | LoadPlan, keys: list[bytes], now: float) -> dict[bytes, int]:
        """Place absent ``keys`` in the SSD tier (pinned for the plan); evictions go in the plan."""
        placed, evicted = self.holdings.place(self._s, plan.plan_id, keys)
        gone = [k for k, _ in evicted]
        if gone:
            plan.evictions.setdefault(self._s, []).extend(gone)
        self._emit("evicted", self._s, gone, now)
        self._emit("stored", self._s, list(placed), now)
        if len(placed) < len(keys):
            self._emit("dropped", self._s, [k for k in keys if k not in placed], now)
        return placed

    def _cascade(self, plan: StorePlan | LoadPlan, evicted: list[tuple[bytes, int]], now: float) -> None:
        """Keys the slab tier evicted go down to the tier it cascades to, if any (without
        write-through: a spill, slab slot -> SSD, executed before the slot is rewritten)."""
        if not evicted:
            return
        self._emit("evicted", self._c, [k for k, _ in evicted], now)
        if self.ssd is None or self._cascades_to != self._s:
            return
        # (a key this plan already evicted from the SSD tier does not come back by a spill: spills
        # run before the plan's deletions, which would remove it again)
        gone = set(plan.evictions.get(self._s, ()))
        down = [(k, s) for k, s in evicted if k not in self._ssd and k not in gone]
        if self._ghost_s is not None:
            taken = set(self._second(self._ghost_s, self._s, [k for k, _ in down], now))
            down = [(k, s) for k, s in down if k in taken]
        if not down:
            return
        placed = self._place_ssd(plan, [k for k, _ in down], now)
        plan.spills.extend(Spill(self._c, s, self._s, k) for k, s in down if k in placed)

    # ------------------------------------------------------------------ failures

    def forget(self, tier: str, keys: Iterable[bytes]) -> None:
        """The tier does not hold ``keys`` after all (a failed copy, a corrupt or vanished
        record): they leave it now (a pinned entry keeps its slot until its plans complete)."""
        if tier not in LOWER_TIERS:
            raise ValueError(f"tier: expected one of {LOWER_TIERS}, got {tier!r}")
        self._emit("lost", tier, self.holdings.forget(tier, keys), self.clock())

    def clear(self) -> list[bytes]:
        """Every block the lower tiers hold is stale (the weights changed in place, so the
        fingerprint did not): forget them all, reported as ``evicted``; returns the SSD
        keys the executor must delete. Entries pinned by open plans are buried like
        forgotten ones and their keys returned too (deleted after the plans' writes). What
        ``second_hit`` admission saw is forgotten too: a block seen before is not seen with
        these weights."""
        now = self.clock()
        if self._ghost_s is not None:
            self._ghost_s = Ghost(self._ghost_s.capacity)
        if self._ghost_r is not None:
            self._ghost_r = Ghost(self._ghost_r.capacity)
        ssd_keys: list[bytes] = []
        for tier in LOWER_TIERS:
            index = self.holdings.index(tier)
            if index is None:
                continue
            keys = [k for k in index if not k.startswith(TOMBSTONE_PREFIX)]
            gone = self.holdings.forget(tier, keys)
            self._emit("evicted", tier, gone, now)
            if tier == self._s:
                ssd_keys = gone
        return ssd_keys

    def forget_pairs(self, lost: Iterable[tuple[str, bytes]]) -> None:
        """:meth:`forget` for ``(tier, key)`` pairs."""
        lost = list(lost)
        unknown = {t for t, _ in lost} - set(LOWER_TIERS)
        if unknown:
            raise ValueError(f"lost: tiers are {LOWER_TIERS}, got {sorted(unknown)}")
        for tier in LOWER_TIERS:
            keys = [k for t, k in lost if t == tier]
            if keys:
                self.forget(tier, keys)

    # ------------------------------------------------------------------ events

    def _plan_id(self) -> int:
        """A new plan's id (its pins are recorded from now until it completes)."""
        self._next_plan += 1
        self.holdings.open(self._next_plan)
        return self._next_plan

    def take_events(self) -> list[PolicyEvent]:
        """Events recorded since the last call (empty unless ``record_events`` is on)."""
        return self.log.take()

    def check(self) -> None:
        """Assert the accounting invariants (tests)."""
        self.holdings.check()
