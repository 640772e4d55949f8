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
* :meth:`prepare_fetch` / :meth:`complete_fetch`: slab slots (pinned) for blocks a
  driver found on the shared tier; the fetched ones are slab hits from then on, the
  others are forgotten.
* :meth:`forget`: an executor found blocks missing or corrupt.
* :meth:`clear`: every block below is stale (the model's weights changed).
* :meth:`take_events`: the recorded :class:`~kvstrata.policy.events.PolicyEvent`
  batches, when ``record_events`` is on.

The local tiers form a chain, in the order they are declared from the device down: the
slab (if any), then the key-addressed tiers. Each tier's evictions cascade to the tier
its declaration names (``cascade``), which may evict and cascade in turn. A store places
a block in the top tier; what the slab cannot take goes to the first key-addressed tier,
and with write-through every block also goes to the persistent tier (the last one).

Recency rules: a hit is a use of every copy below the tier it came from. A
device-pool hit (:meth:`touch`) refreshes the block in every lower tier; a hit from
a tier (:meth:`prepare_load`) refreshes its copies in the tiers below it, so the
persistent tier stays a superset of what is hot above it; the source copy is pinned
during the load and most recent after; a recomputed block refreshes the copies
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
from kvstrata.policy.tiers import SECOND_HIT

__all__ = ["TierPolicy"]


class TierPolicy:
    """Placement over the tiers ``spec.tiers`` declares (see the module docstring), sized and
    ruled by a :class:`PolicySpec`."""

    def __init__(self, spec: PolicySpec, *, clock: Callable[[], float] = time.monotonic,
                 observers: Iterable[Observer] = (), record_events: bool = False) -> None:
        self.spec = spec
        self.clock = clock
        tiers = spec.tiers
        assert tiers is not None
        #: what the tiers' eviction orders may weigh blocks by beyond their uses (the driver teaches it)
        self.order_context = OrderContext(16, spec.attention_share)
        self.holdings = Holdings(tiers, self.order_context)
        local = [t for t in tiers.local if self.holdings.index(t.name) is not None]
        #: the local tiers that hold blocks, from the device down, and their membership
        self.chain: tuple[str, ...] = tuple(t.name for t in local)
        self._held = [(t.name, self.holdings.held(t.name)) for t in local]
        keyed = [t.name for t in local if not t.slab]
        #: the tiers' names by role: the slab, the persistent (last key-addressed) tier, the first shared tier
        self.slab_tier = next((t.name for t in local if t.slab), "")
        self.store_tier = keyed[-1] if keyed else ""
        self.shared_tier = tiers.shared[0].name if tiers.shared else ""
        #: what a store sends below the slab: with write-through the persistent tier, else the first key-addressed
        self._below = self.store_tier if spec.write_through else (keyed[0] if keyed else "")
        self._cascades = {t.name: t.cascade for t in local if t.cascade in self.chain}
        self.slab, self.store = self.holdings.index(self.slab_tier), self.holdings.index(self.store_tier)
        #: the local tiers statistics name (every built-in local kind, then this deployment's others)
        self.lower_tiers: tuple[str, ...] = (*LOWER_TIERS, *(n for n in self.chain if n not in LOWER_TIERS))
        self.counts = EventCounts((*self.lower_tiers, *(t.name for t in tiers.shared)))
        # second_hit admission: the keys each such tier saw once
        self._ghosts = {t.name: Ghost(t.ghost_keys) for t in (*local, *tiers.shared) if t.admission == SECOND_HIT}
        self.log = EventLog(self.counts, observers, record_events)
        self._emit = self.log.emit
        self._next_plan = 0

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """The tier holding each key of the longest prefix of ``keys`` held below (the highest
        one that does). Pure: nothing is pinned, touched or counted."""
        out: list[str] = []
        held = self._held
        for key in keys:
            for name, members in held:
                if key in members:
                    out.append(name)
                    break
            else:
                break
        return out

    def holds(self, key: bytes) -> str | None:
        """The highest lower tier holding ``key``, or None."""
        return next((name for name, members in self._held if key in members), None)

    def add_observer(self, observer: Observer) -> None:
        """Send every later event batch to ``observer`` too."""
        self.log.observers.append(observer)

    def held_in(self, tier: str, key: bytes) -> bool:
        """Does lower tier ``tier`` hold ``key``?"""
        return key in self.holdings.held(tier)

    @property
    def pageout_blocks(self) -> int:
        """How many least recently used free device blocks a driver offers for page-out."""
        return self.spec.pageout_blocks

    def admits(self, reason: str) -> bool:
        return self.spec.admits(reason)

    def occupancy(self) -> dict[str, int]:
        indexes = self.holdings.indexes
        return {t: len(indexes[t]) if t in indexes else 0 for t in self.lower_tiers}

    def capacity(self) -> dict[str, int]:
        return self.spec.capacity()

    def pinned(self) -> dict[str, int]:
        indexes = self.holdings.indexes
        return {t: indexes[t].num_pinned if t in indexes else 0 for t in self.lower_tiers}

    # ------------------------------------------------------------------ recency

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` recently used in every lower tier holding them."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        for index in self.holdings.indexes.values():
            index.touch_many(keys)

    def seed_store(self, keys_lru_first: Iterable[bytes]) -> list[bytes]:
        """Hold what the persistent tier already holds (least recently used first): at
        start-up, or later (a tier that finished recovering) beside what is held by then.

        Keys already held are skipped; the newest of the others fill the free slots and
        nothing held is evicted for them. Returns the keys that do not fit (the oldest):
        the caller deletes them from the tier. Emits no events.
        """
        index = self.store
        if index is None:
            return list(keys_lru_first)
        keys = list(dict.fromkeys(keys_lru_first))
        if len(index):  # (at start-up it is empty: a million keys need not be looked up)
            held = self.holdings.held(self.store_tier)
            keys = [k for k in keys if k not in held]
        keep = keys[max(0, len(keys) - index.num_free):]
        index.allocate_many(keep)
        return keys[:len(keys) - len(keep)]

    # ------------------------------------------------------------------ loads

    def prepare_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> LoadPlan:
        """Plan copying ``keys`` (a prefix :meth:`lookup` found below) into ``block_ids``.

        Pins every source, and (inclusive promotion) gives blocks read from a key-addressed
        tier a slab slot, pinned too, evicting and cascading as a store would.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        slab = self.slab_tier
        plan = LoadPlan(self._plan_id(), req_id, list(block_ids), list(keys), [], [], [-1] * len(keys), slab=slab)
        plan.sources = [next((n for n, m in self._held if k in m), "") for k in plan.keys]
        by_tier: dict[str, list[bytes]] = {}
        for key, tier in zip(plan.keys, plan.sources):
            if tier:
                by_tier.setdefault(tier, []).append(key)
        slot = {}
        for tier, found in by_tier.items():
            pinned = self.holdings.pin(tier, plan.plan_id, found)
            if tier == slab:
                slot = dict(zip(found, pinned))
        plan.slots = [slot.get(k, -1) if t == slab else -1 for k, t in zip(plan.keys, plan.sources)]
        self._touch_below(by_tier)
        now = self.clock()
        for tier in self.chain:
            self._emit("hit", tier, by_tier.get(tier, []), now)
        from_slab = by_tier.get(slab, []) if slab else []
        if from_slab and self.store_tier in self._ghosts:
            self._admit_hits(plan, [k for k in from_slab if k not in self.holdings.held(self.store_tier)], slot, now)
        keyed = [k for k, t in zip(plan.keys, plan.sources) if t and t != slab]
        if keyed and slab and self.spec.promotion == "inclusive":
            self._promote(plan, keyed, now)
        return plan

    def _touch_below(self, by_tier: dict[str, list[bytes]]) -> None:
        """A hit from a tier is a use of the block's copies in the tiers below it (as a device
        hit is of all, see :meth:`touch`): the persistent tier stays a superset of what is hot
        above it. Before the promotions, whose cascades may evict."""
        above: list[bytes] = []
        for name, members in self._held:
            if above:
                index = self.holdings.indexes[name]
                index.touch_many([k for k in above if k in members])
            above = above + by_tier.get(name, [])

    def _admit_hits(self, plan: LoadPlan, keys: list[bytes], slot: dict[bytes, int], now: float) -> None:
        """``second_hit``: a slab hit of a block the persistent tier lacks is a sighting; the
        second one writes the block down from its (pinned) slab slot, a spill run before the load."""
        tier = self.store_tier
        gone = set(plan.evictions.get(tier, ()))  # (as in _cascade: the deletion runs after the spill)
        keys = [k for k in dict.fromkeys(keys) if k not in gone]  # a key named twice is one sighting
        placed = self._place(plan, tier, self._second(tier, keys, now), now)
        plan.spills.extend(Spill(self.slab_tier, slot[k], tier, k) for k in placed)

    def _second(self, tier: str, keys: list[bytes], now: float) -> list[bytes]:
        """The ``keys`` a tier's admission takes: all of them (``always``), or those seen once
        before within its ghost window (``second_hit``; the others are remembered and
        reported ``rejected``)."""
        ghost = self._ghosts.get(tier)
        if ghost is None or not keys:
            return keys
        taken = [k for k in keys if ghost.seen(k)]
        if len(taken) < len(keys):
            took = set(taken)
            self._emit("rejected", tier, [k for k in keys if k not in took], now)
        return taken

    def _promote(self, plan: LoadPlan, keys: list[bytes], now: float) -> None:
        """Give blocks read from key-addressed tiers pinned slab slots (promote_slots),
        cascading what that evicts."""
        placed = self._place(plan, self.slab_tier, keys, now)
        plan.promote_slots = [placed.get(k, -1) if s < 0 and t else -1
                              for k, s, t in zip(plan.keys, plan.slots, plan.sources)]
        self._emit("dropped", self.slab_tier, [k for k in keys if k not in placed], now)

    def complete_load(self, plan: LoadPlan, lost: Iterable[tuple[str, bytes]] = (),
                      loaded: int | None = None) -> None:
        """The load finished: release its pins. ``lost``: ``(tier, key)`` the executor
        could not read (forgotten). ``loaded``: how many blocks reached the device (by
        default what ``lost`` leaves, :meth:`LoadPlan.loaded`; 0 for a cancelled load).
        Exclusive promotion moves the loaded slab blocks up; the rest stay where they are."""
        lost = list(lost)
        self.holdings.release(plan.plan_id)
        self.forget_pairs(lost)
        if self.spec.promotion == "exclusive" and self.slab_tier:
            n = plan.loaded(lost) if loaded is None else loaded
            moved = [k for k, s in zip(plan.keys[:n], plan.slots[:n]) if s >= 0]
            self.forget(self.slab_tier, moved)  # moved up (keys forgotten above are gone already)

    # ------------------------------------------------------------------ stores

    def prepare_store(self, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> StorePlan:
        """Offer device blocks for storing; returns the plan admission and placement made.

        ``computed`` blocks a tier already holds are touched there; ``pageout``
        and ``evicted`` blocks that any lower tier holds are skipped. The others
        get a slab slot (evicting the least recently used, which cascades down).
        With write-through, blocks the persistent tier lacks go there too; without, the
        blocks the slab has no room for go to the first key-addressed tier. ``shutdown``
        offers device blocks most recently used first: the most recent that fit go to
        the persistent tier.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        plan = StorePlan(self._plan_id(), reason, slab=self.slab_tier)
        if not self.spec.admits(reason) or not self.spec.has_lower_tier:
            return plan
        if reason == SHUTDOWN:
            self._plan_shutdown(plan, block_ids, keys)
        else:
            self._plan_store(plan, block_ids, keys, reason)
        return plan

    def _plan_store(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> None:
        now = self.clock()
        slab, below = self.slab_tier, self._below
        offered = dict(zip(keys, block_ids))  # a repeated key is stored once
        in_slab = self.holdings.held(slab)
        if reason == COMPUTED:  # a recomputed block is a use of the copies below
            present = {k for k in offered if k in in_slab}
            for name, members in self._held:
                self.holdings.indexes[name].touch_many([k for k in offered if k in members])
        else:  # paged out or evicted: only blocks no lower tier holds go down, nothing is touched
            offered = {k: b for k, b in offered.items() if self.holds(k) is None}
            present = set()
        # New to this replica's lower tiers: the shared tier gets them (it is never asked first:
        # SET NX keeps what another replica stored)
        shared = self.shared_tier
        fresh = set(self._second(shared, [k for k in offered if self.holds(k) is None], now)) if shared else set()
        new = [k for k in offered if k not in in_slab] if slab else []
        slots = self._place(plan, slab, new, now) if new else {}
        wanted = self._second(below, self._wanted(offered, slots, present), now) if below else []
        placed = self._place(plan, below, wanted, now) if wanted else {}
        stored = [k for k in offered if k in slots or k in placed or k in fresh]
        plan.keys = stored
        plan.block_ids = [offered[k] for k in stored]
        plan.slots = [slots.get(k, -1) for k in stored]
        for tier, taken in ((below, placed), (shared, fresh)):
            if taken:
                plan.writes[tier] = [i for i, k in enumerate(stored) if k in taken]
        if fresh:
            self._emit("stored", shared, [k for k in stored if k in fresh], now)
        if len(slots) < len(new):
            nowhere = [k for k in new if k not in slots and self.holds(k) in (None, slab)]
            self._emit("dropped", slab, nowhere, now)

    def _wanted(self, offered: dict[bytes, int], slots: dict[bytes, int], present: set[bytes]) -> list[bytes]:
        """Keys that go below the slab: all the tier lacks with write-through (or without a
        slab), else those the slab could not take."""
        held = self.holdings.held(self._below)
        if self.spec.write_through or not self.slab_tier:
            return [k for k in offered if k not in held]
        return [k for k in offered if k not in held and k not in slots and k not in present]

    def _plan_shutdown(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        tier, index = self.store_tier, self.store
        if index is None:
            return
        chosen, held = select_for_shutdown(zip(block_ids, keys), self.holdings.held(tier).__contains__,
                                           index.num_slots - index.num_pinned)
        index.touch_many(held)  # hot blocks already stored are kept, here and on disk
        if held:
            plan.touches[tier] = list(held)
        now = self.clock()
        placed = self._place(plan, tier, [k for _, k in chosen], now)
        shared = self.shared_tier
        in_slab = self.holdings.held(self.slab_tier)
        for block, key in chosen:
            if key in placed:
                plan.add(block, key, -1, (tier, shared) if shared and key not in in_slab else (tier,))
        if shared:
            self._emit("stored", shared, [plan.keys[i] for i in plan.goes_to(shared)], now)

    def complete_store(self, plan: StorePlan, lost: Iterable[tuple[str, bytes]] = ()) -> None:
        """The plan's copies finished: release its pins; forget ``(tier, key)`` that failed."""
        self.holdings.release(plan.plan_id)
        self.forget_pairs(lost)

    # ------------------------------------------------------------------ fetches from the shared tier

    def prepare_fetch(self, keys: Sequence[bytes], req_id: str = "") -> FetchPlan:
        """Pinned slab slots for ``keys`` (the continuation of a prefix, none of them held in
        the slab) that a driver found on the shared tier, placed as a store would (with
        write-through also a place in the persistent tier). Truncated at the first key that
        finds no slot."""
        slab = self.slab_tier
        plan = FetchPlan(self._plan_id(), req_id=req_id, source=self.shared_tier, slab=slab)
        if not slab or not self.shared_tier:
            return plan
        in_slab = self.holdings.held(slab)
        want = list(dict.fromkeys(keys))
        want = want[:next((i for i, k in enumerate(want) if k in in_slab), len(want))]
        if not want:
            return plan
        now = self.clock()
        slots = self._place(plan, slab, want, now)
        n = next((i for i, k in enumerate(want) if k not in slots), len(want))
        unplaced = want[n:]
        if unplaced:  # placed beyond a gap: of no use to the prefix
            self.forget(slab, [k for k in unplaced if k in slots])
            self._emit("dropped", slab, [k for k in unplaced if k not in slots], now)
        want = want[:n]
        store = self.store_tier
        if want and store and self.spec.write_through:
            held = self.holdings.held(store)
            placed = self._place(plan, store, self._second(store, [k for k in want if k not in held], now), now)
            if placed:
                plan.writes[store] = [i for i, k in enumerate(want) if k in placed]
        plan.keys = want
        plan.slots = [slots[k] for k in want]
        return plan

    def complete_fetch(self, plan: FetchPlan, fetched: int) -> None:
        """The fetch ran: its first ``fetched`` blocks are in their slots (slab hits from now
        on, a ``hit`` of the shared tier); the others are forgotten where they were placed."""
        self.holdings.release(plan.plan_id)
        self._emit("hit", plan.source, plan.keys[:fetched], self.clock())
        missed = plan.keys[fetched:]
        if missed:
            self.forget(plan.slab, missed)
            for tier, idx in plan.writes.items():
                below = [plan.keys[i] for i in idx if i >= fetched]
                if below:
                    self.forget(tier, below)

    # ------------------------------------------------------------------ placement

    def _place(self, plan: StorePlan | LoadPlan | FetchPlan, tier: str, keys: list[bytes],
               now: float) -> dict[bytes, int]:
        """Slots in ``tier`` for absent ``keys`` (pinned for the plan). What that evicts leaves
        (deleted by the plan from a key-addressed tier) and cascades down."""
        placed, evicted = self.holdings.place(tier, plan.plan_id, keys)
        if evicted:
            gone = [k for k, _ in evicted]
            if tier != self.slab_tier:
                plan.evictions.setdefault(tier, []).extend(gone)
            self._emit("evicted", tier, gone, now)
            self._cascade(plan, tier, evicted, now)
        self._emit("stored", tier, list(placed), now)
        if len(placed) < len(keys) and tier != self.slab_tier:
            self._emit("dropped", tier, [k for k in keys if k not in placed], now)
        return placed

    def _cascade(self, plan: StorePlan | LoadPlan | FetchPlan, tier: str, evicted: list[tuple[bytes, int]],
                 now: float) -> None:
        """Keys ``tier`` evicted go down to the tier it cascades to, if any: spills, run before
        the plan's copies (a slab slot's before it is rewritten, a record's before its deletion)."""
        target = self._cascades.get(tier)
        if target is None:
            return
        # (a key this plan already evicted from the target does not come back by a spill)
        gone = set(plan.evictions.get(target, ()))
        held = self.holdings.held(target)
        down = [(k, s) for k, s in evicted if k not in held and k not in gone]
        if target in self._ghosts:
            taken = set(self._second(target, [k for k, _ in down], now))
            down = [(k, s) for k, s in down if k in taken]
        if not down:
            return
        placed = self._place(plan, target, [k for k, _ in down], now)
        keyed = tier != self.slab_tier
        plan.spills.extend(Spill(tier, -1 if keyed else s, target, k) for k, s in down if k in placed)

    # ------------------------------------------------------------------ failures

    def forget(self, tier: str, keys: Iterable[bytes]) -> None:
        """The tier does not hold ``keys`` after all (a failed copy, a corrupt or vanished
        record): they leave it now (a pinned entry keeps its slot until its plans complete)."""
        if tier not in self.lower_tiers:
            raise ValueError(f"tier: expected one of {self.lower_tiers}, got {tier!r}")
        self._emit("lost", tier, self.holdings.forget(tier, keys), self.clock())

    def clear(self) -> list[bytes]:
        """Every block the lower tiers hold is stale (the weights changed in place, so the
        fingerprint did not): forget them all, reported as ``evicted``; returns the persistent
        tier's keys the executor must delete. Entries pinned by open plans are buried like
        forgotten ones and their keys returned too (deleted after the plans' writes). What
        ``second_hit`` admission saw is forgotten too: a block seen before is not seen with
        these weights."""
        now = self.clock()
        self._ghosts = {name: Ghost(g.capacity) for name, g in self._ghosts.items()}
        persistent: list[bytes] = []
        for tier in self.chain:
            index = self.holdings.indexes[tier]
            keys = [k for k in index if not k.startswith(TOMBSTONE_PREFIX)]
            gone = self.holdings.forget(tier, keys)
            self._emit("evicted", tier, gone, now)
            if tier == self.store_tier:
                persistent = gone
        return persistent

    def forget_pairs(self, lost: Iterable[tuple[str, bytes]]) -> None:
        """:meth:`forget` for ``(tier, key)`` pairs."""
        lost = list(lost)
        unknown = {t for t, _ in lost} - set(self.lower_tiers)
        if unknown:
            raise ValueError(f"lost: tiers are {self.lower_tiers}, got {sorted(unknown)}")
        for tier in self.lower_tiers:
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
