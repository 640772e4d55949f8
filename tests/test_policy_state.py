"""TierPolicy against a plain reference model, driven by Hypothesis state machines.

The model keeps each lower tier as plain lists and dicts: ``slot_of`` (key ->
slot), ``lru`` (unpinned keys, least recently used first), ``pinned`` (pinned
keys in the order of their first pin) with ``pins`` (counts), ``freed``
(slots given back, most recently freed last) and ``next_unused`` (slots at or
above it were never handed out). From the documented semantics:

* a slot comes from ``freed`` (most recently freed first), else the lowest
  never-used one, else the least recently used unpinned key is evicted and
  its slot reused; a batch never evicts a key it placed itself;
* pinning takes a key off the LRU list; its last unpin makes it the most
  recently used;
* admission: ``on_compute`` takes computed, ``on_evict`` pageout and evicted,
  both shutdown; computed touches the copies below, pageout/evicted skip keys
  any lower tier holds; new keys get CPU slots, CPU evictions spill to the SSD
  tier without write-through; with write-through (or no room in the CPU
  tier, or no CPU tier) keys the SSD tier lacks go there;
* shutdown: the hot set is the ``SSD slots - pinned`` most recent distinct
  offered keys; the hot keys the SSD tier holds are touched (least recent
  first), then the hot keys it lacks are placed (least recent first);
* ``seed_store`` keeps the most recent of the keys it is given that the SSD tier
  lacks, as many as it has free slots, and returns the older ones (it evicts
  nothing);
* loads pin their sources and touch the SSD copies of their CPU hits (before
  any promotion); inclusive promotion gives SSD hits pinned CPU
  slots; exclusive promotion drops the loaded CPU keys still present at
  complete_load (those before the first block that failed or was held nowhere);
* forget (and the ``lost`` reports of complete_*) removes present keys at
  once, emitting ``lost`` for them only; a pinned one is renamed to the
  tombstone ``b"\\x00kvstrata-tombstone:N"`` (N counts burials across both
  tiers), which keeps its slot and pins (and moves to the end of the pinned
  order) until its last unpin pops it; open plans' pins follow the rename.

Every step compares plans, events (kind, tier, keys, time), event counts, the
order/slots/pins of both tiers (tombstones included), ``lookup``/``holds``
(and that calling them changes nothing), the pins of the open plans and
``TierPolicy.check()``. A simulated executor (a dict slab and a dict SSD)
runs every plan when it is prepared, so in preparation order as the plan
contract requires: every load must read the bytes of the key it asked for,
and every key the policy holds must be where the policy says.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

from kvstrata.policy import (
    COMPUTED, EVENT_KINDS, LOWER_TIERS, SHUTDOWN, STORE_REASONS, LoadPlan, PolicySpec, StorePlan, TierPolicy,
)
from kvstrata.policy.plans import Spill
from kvstrata.policy import holdings
from kvstrata.policy.compact_index import CompactIndex

from policy_sim import TOMBSTONE_PREFIX, SimExecutor

KEYS = tuple(bytes([c]) * 2 for c in b"ABCDEFG")  # a small universe, so that keys meet again
ADMITTED = {"on_compute": ("computed", "shutdown"), "on_evict": ("pageout", "evicted", "shutdown")}


# ---------------------------------------------------------------------------- reference model


class RefTier:
    """One lower tier: keys, slots, LRU order and pins, in plain lists and dicts."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[bytes, int] = {}
        self.lru: list[bytes] = []      # unpinned keys, least recently used first
        self.pinned: list[bytes] = []   # pinned keys, in the order of their first pin
        self.pins: dict[bytes, int] = {}
        self.freed: list[int] = []      # most recently freed last
        self.next_unused = 0
        self.tombs: set[bytes] = set()  # forgotten while pinned: popped at the last unpin

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def order(self) -> list[bytes]:
        return self.lru + self.pinned

    def num_free(self) -> int:
        return len(self.freed) + self.num_slots - self.next_unused

    def touch(self, key: bytes) -> None:
        if key in self.lru:
            self.lru.remove(key)
            self.lru.append(key)

    def _free_slot(self) -> int | None:
        if self.freed:
            return self.freed.pop()
        if self.next_unused < self.num_slots:
            self.next_unused += 1
            return self.next_unused - 1
        return None

    def place(self, keys: list[bytes]) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """Slots for distinct absent ``keys`` one at a time; never evicts a key placed here."""
        assert len(set(keys)) == len(keys) and not any(k in self for k in keys)
        slots: list[int | None] = []
        evicted: list[tuple[bytes, int]] = []
        for key in keys:
            slot = self._free_slot()
            if slot is None:
                victims = [k for k in self.lru if k not in keys]
                if not victims:
                    slots.append(None)
                    continue
                victim = victims[0]
                self.lru.remove(victim)
                slot = self.slot_of.pop(victim)
                evicted.append((victim, slot))
            self.slot_of[key] = slot
            self.lru.append(key)
            slots.append(slot)
        return slots, evicted

    def pin(self, key: bytes) -> int:
        if not self.pins.get(key):
            self.lru.remove(key)
            self.pinned.append(key)
        self.pins[key] = self.pins.get(key, 0) + 1
        return self.slot_of[key]

    def unpin(self, key: bytes) -> None:
        self.pins[key] -= 1
        if self.pins[key] == 0:
            del self.pins[key]
            self.pinned.remove(key)
            self.lru.append(key)
            if key in self.tombs:
                self.tombs.discard(key)
                self.remove(key)

    def remove(self, key: bytes) -> None:
        self.lru.remove(key)
        self.freed.append(self.slot_of.pop(key))

    def bury(self, key: bytes, tomb: bytes) -> None:
        """A pinned ``key`` leaves; ``tomb`` takes its slot and pins (as the last pinned)."""
        self.slot_of[tomb] = self.slot_of.pop(key)
        self.pins[tomb] = self.pins.pop(key)
        self.pinned.remove(key)
        self.pinned.append(tomb)
        self.tombs.add(tomb)


class RefPolicy:
    """What TierPolicy should do, written from its documentation."""

    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
        self.tiers = {"cpu": RefTier(spec.slab_slots) if spec.slab_slots else None,
                      "ssd": RefTier(spec.store_slots) if spec.store_slots else None}
        self.cpu, self.ssd = self.tiers["cpu"], self.tiers["ssd"]
        self.events: list[tuple[str, str, tuple[bytes, ...]]] = []
        self.counts = {kind: dict.fromkeys(LOWER_TIERS, 0) for kind in EVENT_KINDS}
        self.open: dict[int, list[tuple[str, bytes]]] = {}  # plan id -> (tier, key or tombstone) pins
        self.buried: dict[bytes, bytes] = {}  # tombstone -> the key it was
        self.last_plan = 0
        self.last_tomb = 0

    # -- helpers

    def emit(self, kind: str, tier: str, keys: list[bytes]) -> None:
        if keys:
            self.events.append((kind, tier, tuple(keys)))
            self.counts[kind][tier] += len(keys)

    def take_events(self) -> list[tuple[str, str, tuple[bytes, ...]]]:
        out, self.events = self.events, []
        return out

    def new_plan(self) -> int:
        self.last_plan += 1
        self.open[self.last_plan] = []
        return self.last_plan

    def pin(self, plan_id: int, tier: str, key: bytes) -> int:
        self.open[plan_id].append((tier, key))
        return self.tiers[tier].pin(key)

    def held(self, key: bytes) -> bool:
        return any(t is not None and key in t for t in (self.cpu, self.ssd))

    # -- queries

    def lookup(self, keys: list[bytes]) -> list[str]:
        out = []
        for key in keys:
            tier = self.holds(key)
            if tier is None:
                break
            out.append(tier)
        return out

    def holds(self, key: bytes) -> str | None:
        for name in ("cpu", "ssd"):
            tier = self.tiers[name]
            if tier is not None and key in tier:
                return name
        return None

    def touch(self, keys: list[bytes]) -> None:
        for tier in (self.cpu, self.ssd):
            if tier is not None:
                for key in keys:
                    tier.touch(key)

    def seed_store(self, keys: list[bytes]) -> list[bytes]:
        """Keep the most recent of ``keys`` (least recent first) the free slots hold;
        return the older ones."""
        if self.ssd is None:
            return list(keys)
        new = [k for k in dict.fromkeys(keys) if k not in self.ssd]
        cut = max(0, len(new) - self.ssd.num_free())
        slots, evicted = self.ssd.place(new[cut:])
        assert None not in slots and not evicted
        return new[:cut]

    # -- placement

    def put_ssd(self, plan: StorePlan | LoadPlan, keys: list[bytes]) -> list[bytes]:
        """Place absent keys in the SSD tier, pinned for the plan; its evictions go in the plan."""
        assert self.ssd is not None
        slots, evicted = self.ssd.place(keys)
        gone = [k for k, _ in evicted]
        if gone:
            plan.evictions.setdefault("ssd", []).extend(gone)
        self.emit("evicted", "ssd", gone)
        placed = [k for k, s in zip(keys, slots) if s is not None]
        for key in placed:
            self.pin(plan.plan_id, "ssd", key)
        self.emit("stored", "ssd", placed)
        self.emit("dropped", "ssd", [k for k, s in zip(keys, slots) if s is None])
        return placed

    def put_cpu(self, plan: StorePlan | LoadPlan, keys: list[bytes]) -> dict[bytes, int]:
        """CPU slots for absent keys, pinned for the plan; what they evict cascades."""
        assert self.cpu is not None
        slots, evicted = self.cpu.place(keys)
        if evicted:
            self.emit("evicted", "cpu", [k for k, _ in evicted])
            if self.ssd is not None and not self.spec.write_through:
                down = [(k, s) for k, s in evicted if k not in self.ssd]
                if down:
                    placed = self.put_ssd(plan, [k for k, _ in down])
                    plan.spills += [Spill("cpu", s, "ssd", k) for k, s in down if k in placed]
        given = {k: s for k, s in zip(keys, slots) if s is not None}
        for key in given:
            self.pin(plan.plan_id, "cpu", key)
        return given

    # -- stores

    def prepare_store(self, block_ids: list[int], keys: list[bytes], reason: str) -> StorePlan:
        plan = StorePlan(self.new_plan(), reason)
        if reason not in ADMITTED[self.spec.admission] or (self.cpu is None and self.ssd is None):
            return plan
        if reason == SHUTDOWN:
            return self._shutdown(plan, block_ids, keys)
        block_of: dict[bytes, int] = {}
        for block, key in zip(block_ids, keys):
            block_of[key] = block  # a repeated key is stored once
        in_cpu = [k for k in block_of if self.cpu is not None and k in self.cpu]
        if reason == COMPUTED:
            self.touch(list(block_of))
        else:
            block_of = {k: b for k, b in block_of.items() if not self.held(k)}
            in_cpu = []
        new = [k for k in block_of if k not in in_cpu] if self.cpu is not None else []
        slab_slots = self.put_cpu(plan, new) if new else {}
        if slab_slots:
            self.emit("stored", "cpu", list(slab_slots))
        to_ssd: list[bytes] = []
        if self.ssd is not None:
            every = self.spec.write_through or self.cpu is None
            to_ssd = [k for k in block_of if k not in self.ssd
                      and (every or (k not in slab_slots and k not in in_cpu))]
        in_ssd = self.put_ssd(plan, to_ssd) if to_ssd else []
        for key, block in block_of.items():
            if key in slab_slots or key in in_ssd:
                plan.add(block, key, slab_slots.get(key, -1), ("ssd",) if key in in_ssd else ())
        self.emit("dropped", "cpu", [k for k in new if k not in slab_slots and k not in in_ssd
                                     and not (self.ssd is not None and k in self.ssd)])
        return plan

    def _shutdown(self, plan: StorePlan, block_ids: list[int], keys: list[bytes]) -> StorePlan:
        if self.ssd is None:
            return plan
        limit = self.ssd.num_slots - len(self.ssd.pinned)
        hot: dict[bytes, int] = {}  # the most recent distinct offered keys, most recent first
        for block, key in zip(block_ids, keys):
            if len(hot) >= limit:
                break
            hot.setdefault(key, block)
        hot_lru_first = list(hot)[::-1]
        held = [k for k in hot_lru_first if k in self.ssd]
        for key in held:
            self.ssd.touch(key)
        if held:
            plan.touches.setdefault("ssd", []).extend(held)  # the executor refreshes them on disk too
        missing = [k for k in hot_lru_first if k not in self.ssd]
        placed = self.put_ssd(plan, missing) if missing else []
        for key in missing:
            if key in placed:
                plan.add(hot[key], key, -1, ("ssd",))
        return plan

    # -- loads

    def prepare_load(self, req_id: str, keys: list[bytes], block_ids: list[int]) -> LoadPlan:
        plan = LoadPlan(self.new_plan(), req_id, list(block_ids), list(keys), [], [], [-1] * len(keys))
        from_cpu, from_ssd = [], []
        for key in keys:
            if self.cpu is not None and key in self.cpu:
                plan.slots.append(self.pin(plan.plan_id, "cpu", key))
                plan.sources.append("cpu")
                from_cpu.append(key)
            elif self.ssd is not None and key in self.ssd:
                self.pin(plan.plan_id, "ssd", key)
                plan.slots.append(-1)
                plan.sources.append("ssd")
                from_ssd.append(key)
            else:
                plan.slots.append(-1)
                plan.sources.append("")
        if self.ssd is not None:  # a CPU hit is a use of the SSD copy, before any promotion
            for key in from_cpu:
                if key in self.ssd:
                    self.ssd.touch(key)
        self.emit("hit", "cpu", from_cpu)
        self.emit("hit", "ssd", from_ssd)
        if from_ssd and self.cpu is not None and self.spec.promotion == "inclusive":
            given = self.put_cpu(plan, from_ssd)
            plan.promote_slots = [given.get(k, -1) if t == "ssd" else -1 for k, t in zip(keys, plan.sources)]
            self.emit("stored", "cpu", list(given))
            self.emit("dropped", "cpu", [k for k in from_ssd if k not in given])
        return plan

    # -- completion and failures

    def complete(self, plan: StorePlan | LoadPlan, lost: list[tuple[str, bytes]]) -> None:
        for tier, key in self.open.pop(plan.plan_id):
            self.tiers[tier].unpin(key)
        self.forget_pairs(lost)
        if isinstance(plan, LoadPlan) and self.spec.promotion == "exclusive" and self.cpu is not None:
            failed = {k for _, k in lost}  # the device got the blocks before the first failure
            rows = list(zip(plan.keys, plan.slots, plan.sources))
            n = next((i for i, (k, s, t) in enumerate(rows) if k in failed or (s < 0 and t != "ssd")), len(rows))
            self._drop("cpu", [k for k, s, _ in rows[:n] if s >= 0])

    def forget(self, tier: str, keys: list[bytes]) -> None:
        if tier not in LOWER_TIERS:
            raise ValueError(tier)
        if self.tiers[tier] is not None:
            self._drop(tier, keys)

    def forget_pairs(self, lost: list[tuple[str, bytes]]) -> None:
        for tier in LOWER_TIERS:
            keys = [k for t, k in lost if t == tier]
            if keys:
                self.forget(tier, keys)

    def _drop(self, tier: str, keys: list[bytes]) -> None:
        """``keys`` leave ``tier`` now; a pinned one's entry lives on under a tombstone."""
        index = self.tiers[tier]
        present = [k for k in dict.fromkeys(keys) if k in index]
        for key in present:
            if not index.pins.get(key):
                index.remove(key)
                continue
            self.last_tomb += 1
            tomb = TOMBSTONE_PREFIX + str(self.last_tomb).encode()
            index.bury(key, tomb)
            self.buried[tomb] = key
            for pins in self.open.values():
                pins[:] = [(t, tomb if (t, k) == (tier, key) else k) for t, k in pins]
        self.emit("lost", tier, present)


# ---------------------------------------------------------------------------- the machine

key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
unique_keys = st.lists(st.sampled_from(KEYS), max_size=5, unique=True)
seed_lists = st.lists(st.sampled_from(KEYS), max_size=7)


class PolicyMachine(RuleBasedStateMachine):
    """Random verbs on a TierPolicy and on RefPolicy; they must agree after every step."""

    ADMISSION = "on_compute"
    PROMOTION = "inclusive"
    WRITE_THROUGH = True
    COMPACT_SSD = False  # the SSD tier indexed by a CompactIndex (as on large disks)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.next_block = 0
        self.open: list[StorePlan | LoadPlan] = []
        self.sim = SimExecutor(strict=True)

    @initialize(cpu=st.integers(0, 4), ssd=st.integers(0, 4), seed=seed_lists, reseed=seed_lists)
    def setup(self, cpu: int, ssd: int, seed: list[bytes], reseed: list[bytes]) -> None:
        spec = PolicySpec(slab_slots=cpu, store_slots=ssd, admission=self.ADMISSION, promotion=self.PROMOTION,
                          write_through=self.WRITE_THROUGH, pageout_blocks=1 if self.ADMISSION == "on_evict" else 0)
        compact_above = holdings.COMPACT_ABOVE
        holdings.COMPACT_ABOVE = 0 if self.COMPACT_SSD else compact_above  # which SSD index the policy builds
        try:
            self.policy = TierPolicy(spec, clock=lambda: self.now, record_events=True)
        finally:
            holdings.COMPACT_ABOVE = compact_above
        if ssd:
            assert isinstance(self.policy.store, CompactIndex) == self.COMPACT_SSD
        self.ref = RefPolicy(spec)
        assert [self.policy.admits(r) for r in STORE_REASONS] == [r in ADMITTED[self.ADMISSION]
                                                                   for r in STORE_REASONS]
        for keys in (seed, reseed):  # what the SSD tier held at start, least recent first
            returned = self.policy.seed_store(keys)
            assert returned == self.ref.seed_store(keys)
            for key in returned:
                self.sim.disk.pop(key, None)  # the caller deletes them
            self.sim.disk.update((k, k) for k in keys if k not in returned)
        assert self.policy.take_events() == []

    # -- helpers

    def tick(self) -> None:
        self.now += 1.0

    def blocks(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    # -- rules

    @rule(reason=st.sampled_from(STORE_REASONS), keys=key_lists)
    def store(self, reason: str, keys: list[bytes]) -> None:
        self.tick()
        base = self.blocks(len(KEYS))[0]
        block_ids = [base + KEYS.index(k) for k in keys]  # a key offered twice comes from one block
        plan = self.policy.prepare_store(block_ids, keys, reason)
        expected = self.ref.prepare_store(block_ids, keys, reason)
        assert plan == expected
        self.sim.run(plan)
        self.open.append(plan)
        self._compare_events()

    @rule(reason=st.sampled_from(STORE_REASONS), keys=key_lists)
    def store_and_complete(self, reason: str, keys: list[bytes]) -> None:
        """A synchronous driver: the plan completes before anything else happens."""
        self.store(reason, keys)
        self._complete(len(self.open) - 1, None)

    @rule(keys=unique_keys, stale=st.booleans())
    def load(self, keys: list[bytes], stale: bool) -> None:
        self.tick()
        found = self.policy.lookup(keys)
        assert found == self.ref.lookup(keys)
        n = len(found) + (1 if stale and len(found) < len(keys) else 0)  # stale: and the first key not held
        block_ids = self.blocks(n)
        plan = self.policy.prepare_load(f"r{self.next_block}", keys[:n], block_ids)
        expected = self.ref.prepare_load(f"r{self.next_block}", keys[:n], block_ids)
        assert plan == expected
        assert plan.tiers() == found + [""] * (n - len(found))
        self.sim.run(plan)
        self.open.append(plan)
        self._compare_events()

    @rule(keys=unique_keys, stale=st.booleans())
    def load_and_complete(self, keys: list[bytes], stale: bool) -> None:
        self.load(keys, stale)
        self._complete(len(self.open) - 1, None)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def complete_oldest(self, data: st.DataObject) -> None:
        self._complete(0, data)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def complete_any(self, data: st.DataObject) -> None:
        self._complete(data.draw(st.integers(0, len(self.open) - 1), label="which"), data)

    def _complete(self, which: int, data: st.DataObject | None) -> None:
        """Complete an open plan; ``data`` draws the copies that failed (none without it)."""
        self.tick()
        plan = self.open.pop(which)
        used = self._used(plan)
        lost: list[tuple[str, bytes]] = []
        if data is not None and used:
            failures = st.lists(st.sampled_from(used), min_size=1, max_size=3, unique=True)
            lost = data.draw(st.one_of(st.just([]), st.just([]), st.just([]), failures), label="lost")
        if isinstance(plan, LoadPlan):
            self.policy.complete_load(plan, lost)
        else:
            self.policy.complete_store(plan, lost)
        self.ref.complete(plan, lost)
        self._compare_events()

    @rule(tier=st.sampled_from(LOWER_TIERS + ("gpu",)), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def forget(self, tier: str, keys: list[bytes]) -> None:
        self.tick()
        if tier not in LOWER_TIERS:
            with pytest.raises(ValueError, match=tier):
                self.policy.forget(tier, keys)
        else:
            self.policy.forget(tier, keys)
            self.ref.forget(tier, keys)
        self._compare_events()

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.tick()
        self.policy.touch(keys)
        self.ref.touch(keys)
        self._compare_events()

    def _compare_events(self) -> None:
        events = self.policy.take_events()
        assert [(e.kind, e.tier, e.keys) for e in events] == self.ref.take_events()
        assert all(e.time == self.now for e in events)
        assert self.policy.counts.snapshot() == self.ref.counts

    @staticmethod
    def _used(plan: StorePlan | LoadPlan) -> list[tuple[str, bytes]]:
        """(tier, key) pairs whose copies an executor could report as failed."""
        if isinstance(plan, LoadPlan):
            out = [("cpu" if s >= 0 else "ssd", k) for k, s, t in zip(plan.keys, plan.slots, plan.sources)
                   if s >= 0 or t == "ssd"]
            out += [("cpu", k) for k, s in zip(plan.keys, plan.promote_slots) if s >= 0]
        else:
            out = [("cpu", k) for k, s in zip(plan.keys, plan.slots) if s >= 0]
            out += [("ssd", plan.keys[i]) for i in plan.goes_to("ssd")]
        out += [("ssd", spill.key) for spill in plan.spills]
        return list(dict.fromkeys(out))

    # -- invariants

    @invariant()
    def agrees_with_the_model(self) -> None:
        """Queries first, then the whole state: the queries must have changed nothing."""
        for n in range(len(KEYS) + 1):
            assert self.policy.lookup(list(KEYS[:n])) == self.ref.lookup(list(KEYS[:n]))
        assert self.policy.lookup(list(reversed(KEYS))) == self.ref.lookup(list(reversed(KEYS)))
        assert [self.policy.holds(k) for k in KEYS] == [self.ref.holds(k) for k in KEYS]
        assert self.policy.take_events() == []
        self.policy.check()
        for name, index in (("cpu", self.policy.slab), ("ssd", self.policy.store)):
            ref = self.ref.tiers[name]
            if ref is None:
                assert index is None
                continue
            assert list(index) == ref.order()
            assert index.lru_keys() == ref.lru
            assert {k: index.lookup(k) for k in index} == ref.slot_of
            assert {k: index.pin_count(k) for k in index if index.pin_count(k)} == ref.pins
            assert index.num_free == ref.num_free()
            assert index.num_pinned == len(ref.pinned)
        assert self.policy.occupancy() == {n: len(t.slot_of) if t else 0 for n, t in self.ref.tiers.items()}
        assert self.policy.pinned() == {n: len(t.pinned) if t else 0 for n, t in self.ref.tiers.items()}

    @invariant()
    def open_plans_hold_their_slots(self) -> None:
        """Every slot and SSD key an open plan reads or writes is pinned for it (under a
        tombstone once forgotten), and no CPU slot is written by two open plans."""
        cpu, ssd = self.policy.slab, self.policy.store
        written: list[int] = []
        for plan in self.open:
            held = {(t, self.ref.buried.get(k, k)): k for t, k in self.ref.open[plan.plan_id]}

            def pinned(tier: str, key: bytes, slot: int | None = None) -> None:
                name = held[(tier, key)]
                index = cpu if tier == "cpu" else ssd
                assert index.pin_count(name) >= 1
                if slot is not None:
                    assert index.lookup(name) == slot

            if isinstance(plan, LoadPlan):
                for key, slot, source, promote in zip(plan.keys, plan.slots, plan.sources,
                                                      plan.promote_slots):
                    if slot >= 0:
                        pinned("cpu", key, slot)
                    elif source == "ssd":
                        pinned("ssd", key)
                    if promote >= 0:
                        pinned("cpu", key, promote)
                        written.append(promote)
            else:
                to_ssd = set(plan.goes_to("ssd"))
                for i, (key, slot) in enumerate(zip(plan.keys, plan.slots)):
                    if slot >= 0:
                        pinned("cpu", key, slot)
                        written.append(slot)
                    if i in to_ssd:
                        pinned("ssd", key)
            for _, slot, _, key in plan.spills:
                pinned("ssd", key)
                assert any(cpu.lookup(k) == slot and cpu.pin_count(k) for k in cpu)
        assert len(written) == len(set(written)), f"a CPU slot written by two open plans: {written}"

    @invariant()
    def the_executor_holds_what_the_policy_holds(self) -> None:
        """Plans run in preparation order leave every held key's bytes where the policy says."""
        for key in KEYS:
            if self.policy.slab is not None and key in self.policy.slab:
                assert self.sim.slab.get(self.policy.slab.lookup(key)) == key
            if self.policy.store is not None and key in self.policy.store:
                assert self.sim.disk.get(key) == key


MODES = [(a, p, wt) for a in ("on_compute", "on_evict") for p in ("inclusive", "exclusive")
         for wt in (True, False) if not (a == "on_compute" and p == "exclusive")]

SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _case(admission: str, promotion: str, write_through: bool, compact: bool = False) -> type:
    """The machine's TestCase for one mode (one pytest test per mode)."""
    machine = type(f"PolicyMachine_{admission}_{promotion}_{'wt' if write_through else 'nowt'}", (PolicyMachine,),
                   {"ADMISSION": admission, "PROMOTION": promotion, "WRITE_THROUGH": write_through,
                    "COMPACT_SSD": compact})
    case = machine.TestCase
    case.settings = SETTINGS
    return case


for _mode in MODES:
    globals()[f"Test_{_mode[0]}_{_mode[1]}_{'wt' if _mode[2] else 'nowt'}"] = _case(*_mode)
del _mode
# The SSD tier's flat-array index (what large disks get), in the two modes that use the SSD most.
Test_compact_ssd_on_compute = _case("on_compute", "inclusive", False, compact=True)
Test_compact_ssd_on_evict = _case("on_evict", "exclusive", False, compact=True)


def test_every_valid_mode_has_a_machine() -> None:
    assert len(MODES) == 6
    assert ("on_compute", "exclusive", True) not in MODES


# ---------------------------------------------------------------------------- other eviction orders

class _Anything:
    """Equal to whatever it is compared with."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


class _NoReference:
    """The machine's reference model is LRU's; under another order only the policy's own
    invariants and the executor's bytes are checked (the orders have reference tests of their
    own in tests/test_eviction.py)."""

    counts = _Anything()

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: _Anything()


class OrderMachine(PolicyMachine):
    """The policy under S3-FIFO or ARC, with ``second_hit`` admission or without: pins,
    tombstones, cascades and spills must still never lose track of a slot, and every load
    must read its own key's bytes (the strict executor asserts it)."""

    EVICTION = "s3fifo"
    SSD_ADMISSION = "always"

    @initialize(cpu=st.integers(0, 4), ssd=st.integers(0, 4), seed=seed_lists, reseed=seed_lists)
    def setup(self, cpu: int, ssd: int, seed: list[bytes], reseed: list[bytes]) -> None:
        from kvstrata.policy.tiers import declare

        tiers = declare(cpu, ssd or None, write_through=self.WRITE_THROUGH, cpu_eviction=self.EVICTION,
                        ssd_eviction=self.EVICTION, ssd_admission=(self.SSD_ADMISSION, 3))
        spec = PolicySpec(admission=self.ADMISSION, promotion=self.PROMOTION, write_through=self.WRITE_THROUGH,
                          pageout_blocks=1 if self.ADMISSION == "on_evict" else 0, tiers=tiers)
        self.policy = TierPolicy(spec, clock=lambda: self.now, record_events=True)
        self.ref = _NoReference()
        for keys in (seed, reseed):
            returned = self.policy.seed_store(keys)
            for key in returned:
                self.sim.disk.pop(key, None)
            self.sim.disk.update((k, k) for k in keys if k not in returned)
        self.policy.take_events()

    @invariant()
    def agrees_with_the_model(self) -> None:
        before = [self.policy.lookup(list(KEYS[:n])) for n in range(len(KEYS) + 1)]
        assert [self.policy.holds(k) for k in KEYS] is not None
        assert before == [self.policy.lookup(list(KEYS[:n])) for n in range(len(KEYS) + 1)]  # queries change nothing
        self.policy.check()
        for index in (self.policy.slab, self.policy.store):
            if index is not None:
                index._lru.check() if hasattr(index._lru, "check") else None
                assert len(index._lru) + index.num_pinned == len(index)

    @invariant()
    def open_plans_hold_their_slots(self) -> None:
        pass  # needs the reference's record of what each plan pinned; policy.check() covers the pins


def _order_case(eviction: str, admission: str, write_through: bool, spill_admission: str) -> type:
    machine = type(f"OrderMachine_{eviction}_{admission}", (OrderMachine,),
                   {"EVICTION": eviction, "SSD_ADMISSION": admission, "WRITE_THROUGH": write_through,
                    "ADMISSION": spill_admission})
    case = machine.TestCase
    case.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


Test_order_s3fifo = _order_case("s3fifo", "always", False, "on_compute")
Test_order_arc_second_hit = _order_case("arc", "second_hit", True, "on_compute")
Test_order_s3fifo_second_hit_on_evict = _order_case("s3fifo", "second_hit", False, "on_evict")
Test_order_lru_second_hit = _order_case("lru", "second_hit", False, "on_compute")


def test_a_key_the_plan_evicted_from_the_ssd_tier_is_not_spilled_back_by_the_same_plan() -> None:
    """A DRAM hit that second_hit writes down evicts from the SSD tier; the promotion of the
    same load then evicts that key from the CPU tier: it must not cascade back, since spills
    run before the plan's deletions (found by the machine above)."""
    machine = type("M", (OrderMachine,), {"EVICTION": "s3fifo", "SSD_ADMISSION": "second_hit",
                                          "WRITE_THROUGH": False, "ADMISSION": "on_evict"})
    state = machine()
    state.setup(cpu=3, ssd=3, seed=[], reseed=[b"CC"])
    state.store_and_complete(keys=[b"EE"], reason="pageout")
    state.load_and_complete(keys=[b"EE", b"CC"], stale=False)
    state.store_and_complete(keys=[b"BB", b"FF", b"AA"], reason="shutdown")
    state.forget(keys=[b"AA"], tier="cpu")
    state.load_and_complete(keys=[b"BB", b"CC"], stale=False)
    state.store_and_complete(keys=[b"CC"], reason="shutdown")
    state.load_and_complete(keys=[b"BB", b"EE", b"FF"], stale=False)
    state.agrees_with_the_model()
    state.the_executor_holds_what_the_policy_holds()
