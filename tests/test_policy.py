"""TierPolicy by example: admission, cascade, write-through, promotion, shutdown, seeding,
forgetting, PolicySpec and plans, each with the exact plan, events and tier contents.

Plans may depend on earlier ones (a load reading a slot an earlier load promotes into, a
key deleted from the SSD tier by one plan and written by a later one); the plan contract
has executors run plans in the order the policy prepared them. :class:`SimExecutor` runs
plans that way over dicts, to check what an executor keeping that order would read and
hold."""

from __future__ import annotations

import pickle

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.policy import LoadPlan, PolicySpec, StorePlan, TierPolicy
from kvstrata.policy.plans import Spill
from kvstrata.policy.hot_set import select_for_shutdown
from kvstrata.tiers.ssd import capacity_blocks
from kvstrata.core.deployment import policy_spec

from policy_sim import TOMBSTONE_PREFIX, SimExecutor

A, B, C, D, E, X, Y, Z = (bytes([c]) * 32 for c in b"ABCDEXYZ")  # block hashes
TOMB = TOMBSTONE_PREFIX  # the key a pinned entry takes when its key is forgotten (+ a counter)


def make(**spec) -> TierPolicy:
    return TierPolicy(PolicySpec(**spec), clock=lambda: 0.0, record_events=True)


def events(policy: TierPolicy) -> list[tuple[str, str, tuple[bytes, ...]]]:
    return [(e.kind, e.tier, e.keys) for e in policy.take_events()]


def sp(slot: int, key: bytes) -> Spill:
    """A spill of slab slot ``slot`` from the CPU tier down to the SSD tier."""
    return Spill("cpu", slot, "ssd", key)


def stored(policy: TierPolicy, keys: list[bytes], reason: str = "computed") -> StorePlan:
    """Offer ``keys`` (blocks 100, 101, ...) and complete the plan at once."""
    plan = policy.prepare_store(list(range(100, 100 + len(keys))), keys, reason)
    policy.complete_store(plan)
    return plan


def tiers(policy: TierPolicy) -> tuple[list[bytes], list[bytes]]:
    """Keys of each tier in eviction order (unpinned least recently used first, then pinned)."""
    return (list(policy.slab) if policy.slab else [], list(policy.store) if policy.store else [])


# ---------------------------------------------------------------------------- admission


def test_on_compute_stores_computed_blocks_and_ignores_evicted_ones() -> None:
    policy = make(slab_slots=2)
    plan = policy.prepare_store([7], [A], "computed")
    assert plan == StorePlan(1, "computed", block_ids=[7], keys=[A], slots=[0], writes={})
    assert events(policy) == [("stored", "cpu", (A,))]
    policy.complete_store(plan)
    for reason in ("pageout", "evicted"):
        plan = policy.prepare_store([8], [B], reason)
        assert plan.empty and len(plan) == 0 and plan.reason == reason
        policy.complete_store(plan)
    assert policy.lookup([A, B]) == ["cpu"]
    assert events(policy) == []
    assert [policy.admits(r) for r in ("computed", "pageout", "evicted", "shutdown")] == [True, False, False, True]


def test_on_evict_stores_evicted_and_paged_out_blocks_and_ignores_computed_ones() -> None:
    policy = make(slab_slots=3, admission="on_evict")
    assert stored(policy, [A], "computed").empty
    assert stored(policy, [A], "evicted") == StorePlan(2, "evicted", [100], [A], [0], {})
    assert stored(policy, [B], "pageout") == StorePlan(3, "pageout", [100], [B], [1], {})
    assert policy.lookup([A, B]) == ["cpu", "cpu"]
    assert [policy.admits(r) for r in ("computed", "pageout", "evicted", "shutdown")] == [False, True, True, True]


def test_pageout_and_evicted_skip_keys_any_tier_holds_and_touch_nothing() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict", write_through=False)
    for key in (A, B, C, D):  # C pushes A down to the SSD tier, D pushes B
        stored(policy, [key], "evicted")
    assert tiers(policy) == ([C, D], [A, B])
    policy.take_events()
    for reason in ("pageout", "evicted"):
        plan = policy.prepare_store([1, 2], [A, C], reason)
        assert plan.empty
        policy.complete_store(plan)
    assert tiers(policy) == ([C, D], [A, B])  # a touch would have moved C after D and A after B
    assert events(policy) == []


def test_computed_touches_the_copies_below_it_already_has() -> None:
    policy = make(slab_slots=3, store_slots=3)
    stored(policy, [A, B, C])
    assert tiers(policy) == ([A, B, C], [A, B, C])
    assert stored(policy, [A]).empty
    assert tiers(policy) == ([B, C, A], [B, C, A])
    policy.take_events()
    plan = stored(policy, [D])  # evicts B, not A, from both tiers
    assert plan.slots == [1] and plan.evictions == {"ssd": [B]}
    assert tiers(policy) == ([C, A, D], [C, A, D])
    assert events(policy) == [("evicted", "cpu", (B,)), ("stored", "cpu", (D,)),
                              ("evicted", "ssd", (B,)), ("stored", "ssd", (D,))]


def test_a_key_offered_twice_is_stored_once() -> None:
    policy = make(slab_slots=4, store_slots=4)
    plan = policy.prepare_store([5, 6, 5], [A, B, A], "computed")
    assert plan.keys == [A, B] and plan.block_ids == [5, 6] and plan.slots == [0, 1]
    assert policy.pinned() == {"cpu": 2, "ssd": 2}


def test_no_lower_tier_admits_nothing() -> None:
    policy = make(admission="on_evict")
    for reason in ("computed", "pageout", "evicted", "shutdown"):
        assert policy.prepare_store([1], [A], reason).empty
    assert policy.lookup([A]) == [] and events(policy) == []


def test_prepare_rejects_block_ids_that_do_not_match_keys() -> None:
    policy = make(slab_slots=2)
    with pytest.raises(ValueError, match="^block_ids:"):
        policy.prepare_store([1, 2], [A], "computed")
    with pytest.raises(ValueError, match="^block_ids:"):
        policy.prepare_load("r", [A], [])


# ---------------------------------------------------------------------------- cascade and write-through


def test_without_write_through_a_cpu_eviction_spills_to_ssd() -> None:
    policy = make(slab_slots=2, store_slots=2, write_through=False)
    first = stored(policy, [A, B])
    assert first.slots == [0, 1] and first.writes == {}
    assert tiers(policy) == ([A, B], [])
    policy.take_events()

    plan = policy.prepare_store([10], [C], "computed")
    assert plan == StorePlan(2, "computed", [10], [C], slots=[0], writes={}, spills=[sp(0, A)])
    assert events(policy) == [("evicted", "cpu", (A,)), ("stored", "ssd", (A,)), ("stored", "cpu", (C,))]
    assert policy.lookup([A]) == ["ssd"] and policy.lookup([C]) == ["cpu"]
    assert policy.store.pin_count(A) == 1 and policy.slab.pin_count(C) == 1  # until the spill is written
    policy.complete_store(plan)
    assert policy.pinned() == {"cpu": 0, "ssd": 0}

    assert stored(policy, [D]).spills == [sp(1, B)]
    assert tiers(policy) == ([C, D], [A, B])
    policy.take_events()
    plan = stored(policy, [E])  # the spill of C makes the SSD tier evict A
    assert (plan.slots, plan.spills, plan.evictions) == ([0], [sp(0, C)], {"ssd": [A]})
    assert events(policy) == [("evicted", "cpu", (C,)), ("evicted", "ssd", (A,)), ("stored", "ssd", (C,)),
                              ("stored", "cpu", (E,))]
    assert tiers(policy) == ([D, E], [B, C])


def test_the_cascade_skips_keys_the_ssd_tier_already_holds() -> None:
    policy = make(slab_slots=1, store_slots=2, write_through=False)
    stored(policy, [A])
    stored(policy, [B])                       # spills A
    assert tiers(policy) == ([B], [A])
    assert stored(policy, [A]).spills == [sp(0, B)]  # A comes back to the CPU tier, B goes down
    assert tiers(policy) == ([A], [A, B])
    policy.take_events()
    plan = stored(policy, [B])                # evicts A, which the SSD tier holds: no spill
    assert plan == StorePlan(4, "computed", [100], [B], [0], {})
    assert events(policy) == [("evicted", "cpu", (A,)), ("stored", "cpu", (B,))]


def test_write_through_sends_every_cpu_store_to_ssd_and_never_spills() -> None:
    policy = make(slab_slots=2, store_slots=4)
    plan = policy.prepare_store([1, 2, 3], [A, B, C], "computed")
    assert plan == StorePlan(1, "computed", [1, 2, 3], [A, B, C], slots=[0, 1, -1], writes={"ssd": [0, 1, 2]})
    assert events(policy) == [("stored", "cpu", (A, B)), ("stored", "ssd", (A, B, C))]
    policy.complete_store(plan)
    plan = stored(policy, [D])
    assert plan == StorePlan(2, "computed", [100], [D], slots=[0], writes={"ssd": [0]})
    assert events(policy) == [("evicted", "cpu", (A,)), ("stored", "cpu", (D,)), ("stored", "ssd", (D,))]
    assert policy.lookup([A, B, C, D]) == ["ssd", "cpu", "ssd", "cpu"]


def test_write_through_never_spills_even_a_key_the_ssd_tier_lacks() -> None:
    policy = make(slab_slots=2, store_slots=1)
    stored(policy, [A])
    stored(policy, [B])  # the SSD tier evicts A; the CPU tier keeps both
    assert tiers(policy) == ([A, B], [B])
    plan = stored(policy, [C])
    assert plan == StorePlan(3, "computed", [100], [C], slots=[0], writes={"ssd": [0]}, evictions={"ssd": [B]})
    assert policy.lookup([A]) == []  # evicted from the CPU tier, not spilled


def test_a_store_goes_to_ssd_only_when_every_cpu_slot_is_pinned() -> None:
    policy = make(slab_slots=1, store_slots=2, write_through=False)
    held = policy.prepare_store([0], [A], "computed")  # in flight: A's slot is pinned
    plan = policy.prepare_store([1], [B], "computed")
    assert plan == StorePlan(2, "computed", [1], [B], slots=[-1], writes={"ssd": [0]})
    assert events(policy) == [("stored", "cpu", (A,)), ("stored", "ssd", (B,))]
    policy.complete_store(held)
    policy.complete_store(plan)
    assert tiers(policy) == ([A], [B])


def test_a_store_is_dropped_when_no_tier_has_room() -> None:
    policy = make(slab_slots=1)
    held = policy.prepare_store([0], [A], "computed")
    policy.take_events()
    plan = policy.prepare_store([1], [B], "computed")
    assert plan.empty
    assert events(policy) == [("dropped", "cpu", (B,))]
    assert policy.lookup([B]) == []
    policy.complete_store(held)

    policy = make(slab_slots=1, store_slots=1, write_through=False)
    policy.prepare_store([0], [A], "computed")  # pins the CPU slot
    policy.prepare_store([1], [B], "computed")  # pins the SSD slot
    policy.take_events()
    assert policy.prepare_store([2], [C], "computed").empty
    assert events(policy) == [("dropped", "ssd", (C,)), ("dropped", "cpu", (C,))]
    assert policy.counts.snapshot()["dropped"] == {"cpu": 1, "ssd": 1}


# ---------------------------------------------------------------------------- promotion


def test_inclusive_promotion_gives_ssd_hits_a_pinned_cpu_slot() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict")
    assert policy.seed_store([A, B]) == []
    assert policy.lookup([A, B, C]) == ["ssd", "ssd"]
    plan = policy.prepare_load("r1", [A, B], [5, 6])
    assert plan == LoadPlan(1, "r1", [5, 6], [A, B], slots=[-1, -1], sources=["ssd", "ssd"],
                            promote_slots=[0, 1])
    assert plan.tiers() == ["ssd", "ssd"]
    assert events(policy) == [("hit", "ssd", (A, B)), ("stored", "cpu", (A, B))]
    assert policy.pinned() == {"cpu": 2, "ssd": 2}
    policy.complete_load(plan)
    assert policy.pinned() == {"cpu": 0, "ssd": 0}
    assert tiers(policy) == ([A, B], [A, B])  # the SSD copies stay

    again = policy.prepare_load("r2", [A, B], [7, 8])
    assert again == LoadPlan(2, "r2", [7, 8], [A, B], slots=[0, 1], sources=["cpu", "cpu"],
                             promote_slots=[-1, -1])
    assert events(policy) == [("hit", "cpu", (A, B))]
    policy.complete_load(again)


def test_promotion_evicts_and_cascades_like_a_store() -> None:
    policy = make(slab_slots=1, store_slots=2, admission="on_evict", write_through=False)
    stored(policy, [A], "evicted")
    stored(policy, [B], "evicted")  # spills A
    policy.take_events()
    plan = policy.prepare_load("r", [A], [9])
    assert plan == LoadPlan(3, "r", [9], [A], [-1], ["ssd"], promote_slots=[0], spills=[sp(0, B)])
    assert events(policy) == [("hit", "ssd", (A,)), ("evicted", "cpu", (B,)), ("stored", "ssd", (B,)),
                              ("stored", "cpu", (A,))]
    policy.complete_load(plan)
    assert tiers(policy) == ([A], [A, B])


def test_exclusive_promotion_moves_loaded_cpu_blocks_out_of_the_cpu_tier() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict", promotion="exclusive")
    stored(policy, [A, B], "evicted")
    assert tiers(policy) == ([A, B], [A, B])
    policy.take_events()
    plan = policy.prepare_load("r", [A], [3])
    assert plan.slots == [0] and plan.promote_slots == [-1]
    assert policy.lookup([A]) == ["cpu"]  # until the load completes
    policy.complete_load(plan)
    assert policy.lookup([A]) == ["ssd"]
    assert tiers(policy) == ([B], [B, A])  # the CPU hit refreshed A's SSD copy
    assert events(policy) == [("hit", "cpu", (A,)), ("lost", "cpu", (A,))]

    plan = policy.prepare_load("r", [A], [3])  # an SSD hit is not promoted
    assert plan.sources == ["ssd"] and plan.promote_slots == [-1]
    policy.complete_load(plan)
    assert tiers(policy) == ([B], [B, A])  # the read was a use of A's SSD copy

    plan = policy.prepare_load("r", [B], [4])  # a failed CPU read is forgotten, once
    policy.take_events()
    policy.complete_load(plan, [("cpu", B)])
    assert events(policy) == [("lost", "cpu", (B,))]
    assert tiers(policy) == ([], [A, B])  # the CPU hit refreshed B's SSD copy (still good)


def test_a_load_that_names_a_key_twice_releases_every_pin() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict")
    policy.seed_store([A])
    plan = policy.prepare_load("r", [A, A], [1, 2])
    assert plan.sources == ["ssd", "ssd"] and plan.promote_slots == [0, 0]
    policy.complete_load(plan)
    assert policy.pinned() == {"cpu": 0, "ssd": 0}
    policy.check()


def test_a_load_of_a_key_no_tier_holds_plans_no_source() -> None:
    policy = make(slab_slots=2, store_slots=2)
    stored(policy, [A])
    plan = policy.prepare_load("r", [A, B], [1, 2])
    assert plan.tiers() == ["cpu", ""] and plan.slots == [0, -1] and plan.sources == ["cpu", ""]
    policy.complete_load(plan)
    assert policy.pinned() == {"cpu": 0, "ssd": 0}


# ---------------------------------------------------------------------------- shutdown


def test_shutdown_stores_the_most_recent_blocks_up_to_the_ssd_capacity() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict")
    plan = policy.prepare_store([1, 2, 3], [A, B, C], "shutdown")  # most recently used first
    assert plan == StorePlan(1, "shutdown", block_ids=[2, 1], keys=[B, A], slots=[-1, -1], writes={"ssd": [0, 1]})
    assert events(policy) == [("stored", "ssd", (B, A))]
    policy.complete_store(plan)
    assert tiers(policy) == ([], [B, A])  # A, the most recent, is the most recent there too


def test_shutdown_skips_keys_the_ssd_tier_holds() -> None:
    policy = make(store_slots=3)  # on_compute takes shutdown too
    policy.seed_store([X])
    plan = policy.prepare_store([1, 2, 3], [A, X, B], "shutdown")
    assert plan.keys == [B, A] and plan.block_ids == [3, 1] and plan.evictions == {}
    policy.complete_store(plan)
    assert tiers(policy) == ([], [X, B, A])


def test_shutdown_leaves_room_for_pinned_ssd_slots() -> None:
    policy = make(store_slots=2)
    held = policy.prepare_store([0], [X], "computed")  # X's SSD slot is pinned
    plan = policy.prepare_store([1, 2], [A, B], "shutdown")
    assert plan.keys == [A] and plan.evictions == {}
    policy.complete_store(held)
    policy.complete_store(plan)
    assert tiers(policy) == ([], [X, A])


def test_shutdown_without_an_ssd_tier_stores_nothing() -> None:
    policy = make(slab_slots=4)
    assert policy.prepare_store([1], [A], "shutdown").empty
    assert policy.lookup([A]) == []


def test_shutdown_keeps_the_most_recent_offered_blocks() -> None:
    """The hot set counts offered keys the SSD tier already holds: with 2 slots holding X
    and [A, X, B] offered (most recent first) it is {A, X}; B, the least recent, stays out
    and X is not evicted for it."""
    policy = make(store_slots=2, admission="on_evict")
    policy.seed_store([X])
    plan = policy.prepare_store([1, 2, 3], [A, X, B], "shutdown")
    assert plan == StorePlan(1, "shutdown", block_ids=[1], keys=[A], slots=[-1], writes={"ssd": [0]},
                             touches={"ssd": [X]})  # X's recency is refreshed on disk too
    assert events(policy) == [("stored", "ssd", (A,))]
    policy.complete_store(plan)
    assert tiers(policy) == ([], [X, A])


def test_shutdown_touches_the_hot_keys_the_ssd_tier_holds_before_placing_the_others() -> None:
    policy = make(store_slots=3, admission="on_evict")
    policy.seed_store([Y, X, Z])  # Y is the least recent
    plan = policy.prepare_store([1, 2, 3, 4], [A, Y, B, X], "shutdown")  # hot: A, Y, B
    # Y, touched first, is not evicted to place B and A: X and Z are
    assert plan == StorePlan(1, "shutdown", block_ids=[3, 1], keys=[B, A], slots=[-1, -1],
                             writes={"ssd": [0, 1]}, evictions={"ssd": [X, Z]}, touches={"ssd": [Y]})
    assert events(policy) == [("evicted", "ssd", (X, Z)), ("stored", "ssd", (B, A))]
    policy.complete_store(plan)
    assert tiers(policy) == ([], [Y, B, A])


def test_select_for_shutdown_returns_the_hot_blocks_to_store_and_the_hot_keys_held() -> None:
    offered = [(1, A), (2, X), (3, A), (4, B), (5, C)]  # most recently used first; A offered twice
    assert select_for_shutdown(offered, {X}.__contains__, 3) == ([(4, B), (1, A)], [X])
    assert select_for_shutdown(offered, {X}.__contains__, 2) == ([(1, A)], [X])
    assert select_for_shutdown(offered, {A, B, C, X}.__contains__, 9) == ([], [C, B, X, A])
    assert select_for_shutdown(offered, lambda key: False, 0) == ([], [])


# ---------------------------------------------------------------------------- seed_store


def test_seed_ssd_places_keys_least_recent_first_in_free_slots_only() -> None:
    policy = make(store_slots=2)
    assert policy.seed_store([A]) == []
    assert policy.seed_store([B, C, B]) == [B]  # one free slot: C, the more recent, takes it
    assert tiers(policy) == ([], [A, C])
    assert policy.seed_store([C]) == []  # already held: nothing moves
    assert tiers(policy) == ([], [A, C])
    assert events(policy) == []


def test_seed_ssd_later_keeps_what_is_held_and_returns_what_does_not_fit() -> None:
    """A tier that finished recovering after the engine started: what the policy placed
    since (newer) stays; the recovered keys fill the free slots, newest first."""
    policy = make(store_slots=3)
    stored(policy, [A])
    policy.take_events()
    assert policy.seed_store([B, A, C, D]) == [B]  # A is held already; 2 free slots: C and D
    assert tiers(policy)[1] == [A, C, D]
    assert policy.lookup([C, D]) == ["ssd", "ssd"]
    assert events(policy) == []


def test_seed_ssd_places_keys_least_recent_first() -> None:
    policy = make(store_slots=2)
    assert policy.seed_store([B, C, B]) == []
    assert tiers(policy) == ([], [B, C])
    assert policy.seed_store([B]) == []  # already held: nothing moves
    assert tiers(policy) == ([], [B, C])
    assert events(policy) == []


def test_seed_ssd_without_an_ssd_tier_returns_every_key() -> None:
    assert make(slab_slots=2).seed_store([A, B]) == [A, B]


def test_seed_ssd_overflow_returns_the_oldest_keys() -> None:
    """With 2 slots and [A, B, C, D] (least recent first) it keeps C and D, the most recent,
    and returns A and B for deletion."""
    policy = make(store_slots=2)
    assert policy.seed_store([A, B, C, D]) == [A, B]
    assert tiers(policy) == ([], [C, D])
    assert policy.lookup([C, D, A]) == ["ssd", "ssd"]
    assert events(policy) == []


def test_seed_ssd_into_a_full_tier_keeps_nothing_new() -> None:
    policy = make(store_slots=2)
    assert policy.seed_store([A, B]) == []
    assert policy.seed_store([C, D]) == [C, D]
    assert tiers(policy) == ([], [A, B])


# ---------------------------------------------------------------------------- forget


def test_forget_of_a_pinned_key_is_immediate_and_its_slot_stays_taken_until_its_plans_complete() -> None:
    policy = make(slab_slots=3)
    store = policy.prepare_store([0], [A], "computed")  # slot 0
    load = policy.prepare_load("r", [A], [1])           # a second pin
    policy.take_events()
    policy.forget("cpu", [A, B, A])  # B is not held: ignored; A is reported once
    assert events(policy) == [("lost", "cpu", (A,))]
    assert policy.lookup([A]) == [] and policy.holds(A) is None and A not in policy.slab
    tomb = TOMB + b"1"  # the entry, its slot and its pins live on under a tombstone
    assert list(policy.slab) == [tomb] and policy.slab.lookup(tomb) == 0 and policy.slab.pin_count(tomb) == 2
    assert policy.slab.num_free == 2 and policy.pinned() == {"cpu": 1, "ssd": 0}
    policy.check()
    policy.forget("cpu", [A])  # no longer held: nothing to report
    assert events(policy) == []

    again = policy.prepare_store([2], [A], "computed")  # a store places A again, in a new slot
    assert again.slots == [1] and policy.lookup([A]) == ["cpu"]
    policy.complete_store(store)
    assert policy.slab.pin_count(tomb) == 1 and policy.slab.num_free == 1  # the load still holds slot 0
    policy.complete_load(load)
    assert tomb not in policy.slab and list(policy.slab) == [A] and policy.slab.num_free == 2
    policy.check()
    policy.complete_store(again)
    assert stored(policy, [C]).slots == [0]  # the most recently freed slot is reused first
    assert policy.counts.snapshot()["lost"] == {"cpu": 1, "ssd": 0}


def test_clear_forgets_every_block_below_and_returns_the_ssd_keys_to_delete() -> None:
    """After an in-place weight update every stored block is stale: nothing below is a hit
    any more, the SSD records are to be deleted (those an open plan pins too, once their
    writes are done), and the slots are reused as the pins are released."""
    policy = make(slab_slots=3, store_slots=4)  # write-through: computed blocks go to both
    stored(policy, [A, B])
    pending = policy.prepare_store([5], [C], "computed")  # C pinned in both tiers
    policy.take_events()
    assert sorted(policy.clear()) == sorted([A, B, C])
    assert sorted(events(policy)) == sorted([("evicted", "cpu", (A, B, C)), ("evicted", "ssd", (A, B, C))])
    assert policy.lookup([A]) == [] and policy.lookup([C]) == [] and policy.occupancy() == {"cpu": 1, "ssd": 1}
    assert policy.clear() == [] and events(policy) == []  # the tombstone of C is not a block
    policy.complete_store(pending)
    assert policy.occupancy() == {"cpu": 0, "ssd": 0} and policy.counts.snapshot()["lost"] == {"cpu": 0, "ssd": 0}
    policy.check()
    again = stored(policy, [A])  # stored afresh: a hit again
    assert policy.lookup([A]) == ["cpu"] and again.slots


def test_forget_renames_the_pins_of_every_open_plan() -> None:
    policy = make(slab_slots=2, store_slots=2, admission="on_evict", promotion="exclusive", write_through=False)
    stored(policy, [A, B], "evicted")
    spill = policy.prepare_store([3], [C], "evicted")  # C into A's slot: A spills to the SSD tier
    assert spill.spills == [sp(0, A)] and policy.store.pin_count(A) == 1
    load = policy.prepare_load("r", [A], [4])          # reads A from the SSD tier: a second pin
    assert load.tiers() == ["ssd"]
    policy.forget("ssd", [A])
    tomb = TOMB + b"1"
    assert policy.lookup([A]) == [] and list(policy.store) == [tomb] and policy.store.pin_count(tomb) == 2
    policy.complete_load(load)
    assert policy.store.pin_count(tomb) == 1
    policy.check()
    policy.complete_store(spill)
    assert tiers(policy) == ([B, C], []) and policy.store.num_free == 2
    policy.check()


def test_forget_of_an_unpinned_key_is_immediate() -> None:
    policy = make(slab_slots=2, store_slots=2)
    stored(policy, [A, B])
    policy.forget("ssd", [A])
    assert policy.lookup([A, B]) == ["cpu", "cpu"] and tiers(policy) == ([A, B], [B])
    policy.forget("cpu", [A])
    assert policy.lookup([A]) == []
    with pytest.raises(ValueError, match="^tier:.*'gpu'"):
        policy.forget("gpu", [A])


def test_forget_in_a_tier_that_is_off_does_nothing() -> None:
    policy = make(slab_slots=2)
    stored(policy, [A])
    policy.take_events()
    policy.forget("ssd", [A])
    policy.complete_store(policy.prepare_store([], [], "computed"), [("ssd", A)])
    assert policy.lookup([A]) == ["cpu"] and events(policy) == []
    assert make(store_slots=2).forget("cpu", [A]) is None


def test_complete_store_forgets_the_copies_that_failed() -> None:
    policy = make(slab_slots=2, store_slots=2)
    plan = policy.prepare_store([1, 2], [A, B], "computed")
    policy.take_events()
    policy.complete_store(plan, [("ssd", A), ("cpu", B)])
    assert events(policy) == [("lost", "cpu", (B,)), ("lost", "ssd", (A,))]
    assert policy.lookup([A, B]) == ["cpu", "ssd"]
    assert policy.pinned() == {"cpu": 0, "ssd": 0}


def test_lost_counts_a_forgotten_block_once() -> None:
    """A pinned key forgotten twice (and reported lost again when its plan completes) is lost once."""
    policy = make(slab_slots=2)
    plan = policy.prepare_store([0], [A], "computed")
    policy.forget("cpu", [A])
    policy.forget("cpu", [A])
    policy.complete_store(plan, [("cpu", A)])
    assert policy.counts.snapshot()["lost"]["cpu"] == 1
    assert events(policy) == [("stored", "cpu", (A,)), ("lost", "cpu", (A,))]


def test_exclusive_load_of_a_forgotten_key_counts_it_lost_once() -> None:
    """Exclusive complete_load drops only the loaded CPU keys the tier still holds."""
    policy = make(slab_slots=2, admission="on_evict", promotion="exclusive")
    stored(policy, [A], "evicted")
    load = policy.prepare_load("r", [A], [1])
    policy.forget("cpu", [A])
    policy.complete_load(load)
    assert policy.lookup([A]) == [] and policy.occupancy() == {"cpu": 0, "ssd": 0}
    assert policy.counts.snapshot()["lost"]["cpu"] == 1
    policy.check()


def test_exclusive_loads_of_one_key_move_it_up_once() -> None:
    policy = make(slab_slots=2, admission="on_evict", promotion="exclusive")
    stored(policy, [A], "evicted")
    first = policy.prepare_load("r1", [A], [1])
    second = policy.prepare_load("r2", [A], [2])
    assert first.slots == second.slots == [0]
    policy.take_events()
    policy.complete_load(first)  # A leaves; its slot stays taken while the second load reads it
    assert events(policy) == [("lost", "cpu", (A,))]
    assert policy.lookup([A]) == [] and policy.slab.num_free == 1
    policy.complete_load(second)
    assert events(policy) == [] and policy.slab.num_free == 2
    policy.check()


def test_exclusive_promotion_keeps_the_cpu_blocks_a_failed_load_never_delivered() -> None:
    """The device gets the blocks before the first failure; the CPU blocks after it were
    not loaded (they are recomputed), so they stay in the CPU tier. A cancelled load moves
    nothing."""
    policy = make(slab_slots=3, store_slots=3, admission="on_evict", promotion="exclusive", write_through=False)
    policy.seed_store([A])
    stored(policy, [B, C], "evicted")
    load = policy.prepare_load("r", [A, B, C], [1, 2, 3])
    assert load.tiers() == ["ssd", "cpu", "cpu"] and load.loaded([("ssd", A)]) == 0
    policy.complete_load(load, [("ssd", A)])
    assert tiers(policy) == ([B, C], [])
    cancelled = policy.prepare_load("r2", [B, C], [4, 5])
    policy.complete_load(cancelled, loaded=0)
    assert policy.lookup([B, C]) == ["cpu", "cpu"]
    policy.complete_load(policy.prepare_load("r3", [B, C], [4, 5]))
    assert policy.lookup([B, C]) == [] and policy.occupancy() == {"cpu": 0, "ssd": 0}
    policy.check()


def test_a_forgotten_pinned_key_is_not_found_by_lookup() -> None:
    """Nor does a load pin it again (which would extend its stay)."""
    policy = make(slab_slots=2)
    plan = policy.prepare_store([0], [A], "computed")
    policy.forget("cpu", [A])
    assert policy.lookup([A]) == [] and policy.holds(A) is None
    load = policy.prepare_load("r", [A], [1])
    assert load.tiers() == [""] and policy.slab.pin_count(TOMB + b"1") == 1
    policy.complete_store(plan)
    policy.complete_load(load)
    assert policy.occupancy() == {"cpu": 0, "ssd": 0}


def test_an_evicted_block_whose_lower_copy_was_lost_is_stored_again() -> None:
    """on_evict skips offered blocks a lower tier holds; a key forgotten while a load pins it
    is no longer held, so the block the device evicts is stored again, in the free slot."""
    policy = make(slab_slots=2, admission="on_evict")
    stored(policy, [A], "evicted")
    load = policy.prepare_load("r", [A], [1])
    policy.forget("cpu", [A])               # the executor found A's slot corrupt
    plan = policy.prepare_store([1], [A], "evicted")
    assert plan == StorePlan(3, "evicted", [1], [A], slots=[1], writes={})
    policy.complete_load(load)
    policy.complete_store(plan)
    assert policy.lookup([A]) == ["cpu"] and policy.slab.lookup(A) == 1
    assert policy.occupancy() == {"cpu": 1, "ssd": 0}


# ---------------------------------------------------------------------------- plans of one step


def test_every_slot_of_an_open_plan_is_pinned_until_complete() -> None:
    policy = make(slab_slots=2, store_slots=2, write_through=False)
    stored(policy, [A, B])
    store = policy.prepare_store([3], [C], "computed")  # C into A's slot; A spills
    load = policy.prepare_load("r", [B], [4])
    assert policy.slab.pin_count(C) == 1 and policy.store.pin_count(A) == 1 and policy.slab.pin_count(B) == 1
    # no unpinned CPU slot to take: D goes to the SSD tier's free slot
    third = policy.prepare_store([5], [D], "computed")
    assert third == StorePlan(4, "computed", [5], [D], [-1], {"ssd": [0]})
    policy.complete_load(load)
    policy.complete_store(store)
    policy.complete_store(third)
    assert policy.pinned() == {"cpu": 0, "ssd": 0}
    policy.check()


def test_an_ssd_key_deleted_by_one_open_plan_and_written_by_a_later_one_is_held_in_order() -> None:
    """An SSD key one open plan deletes (ssd_evictions) may be stored again by a later plan.
    The contract (kvstrata.policy.plans): executors run plans in the order they were prepared.
    In that order the record the policy holds exists; in the other order the deletion
    would remove the new record."""
    policy = make(store_slots=2)
    sim = SimExecutor()
    sim.run(stored(policy, [A]))
    sim.run(stored(policy, [C]))
    first = policy.prepare_store([1], [B], "computed")   # evicts A
    second = policy.prepare_store([2], [A], "computed")  # stores A again, evicting C
    assert first == StorePlan(3, "computed", [1], [B], [-1], {"ssd": [0]}, evictions={"ssd": [A]})
    assert second == StorePlan(4, "computed", [2], [A], [-1], {"ssd": [0]}, evictions={"ssd": [C]})
    assert tiers(policy) == ([], [B, A])

    reversed_order = SimExecutor(list(sim.disk))
    for plan in (first, second):
        sim.run(plan)
    assert sim.disk == {B: B, A: A} and sim.misplaced(policy) == []
    for plan in (second, first):
        reversed_order.run(plan)
    assert reversed_order.misplaced(policy) == [("ssd", A)]
    policy.complete_store(second)
    policy.complete_store(first)
    assert sim.misplaced(policy) == []


def test_a_load_may_read_the_slot_an_earlier_open_load_promotes_into_in_order() -> None:
    """An inclusive promotion places the key in the CPU tier at prepare_load, so a load
    prepared later reads the slot the first one writes. The contract: executors run plans
    (loads on one first-in-first-out thread) in the order they were prepared; in that
    order the second load reads the promoted bytes, in the other it would read the slot
    before they arrive."""
    policy = make(slab_slots=2, store_slots=2, admission="on_evict")
    policy.seed_store([A])
    first = policy.prepare_load("r1", [A], [1])
    second = policy.prepare_load("r2", [A], [2])
    assert first.tiers() == ["ssd"] and first.promote_slots == [0]
    assert second.tiers() == ["cpu"] and second.slots == [0]
    assert policy.slab.pin_count(A) == 2  # neither load's slot is reused before it completes

    sim = SimExecutor([A])
    assert [sim.run(first), sim.run(second)] == [[A], [A]]
    other = SimExecutor([A])
    assert other.run(second) == [None]
    policy.complete_load(second)
    policy.complete_load(first)
    assert sim.misplaced(policy) == [] and tiers(policy) == ([A], [A])


def test_plans_run_in_preparation_order_hold_every_key_where_the_policy_says() -> None:
    """Spills, a promotion read by a later load, a key forgotten while pinned and spilled
    again, SSD evictions, plans completed out of order: run in preparation order (the
    contract), every load reads its own key's bytes and every key the policy holds is
    where it says."""
    policy = make(slab_slots=2, store_slots=3, admission="on_evict", write_through=False)
    sim = SimExecutor()

    def store(key: bytes) -> StorePlan:
        plan = policy.prepare_store([7], [key], "evicted")
        sim.run(plan)
        assert sim.misplaced(policy) == []
        return plan

    def load(keys: list[bytes]) -> LoadPlan:
        plan = policy.prepare_load("r", keys, list(range(len(keys))))
        assert sim.run(plan) == keys
        return plan

    def complete(*plans: StorePlan | LoadPlan) -> None:
        for plan in plans:
            (policy.complete_load if isinstance(plan, LoadPlan) else policy.complete_store)(plan)
            assert sim.misplaced(policy) == []

    complete(store(A), store(B))
    s2 = store(C)
    assert s2.spills == [sp(0, A)]
    l1 = load([A])
    assert (l1.promote_slots, l1.spills) == ([1], [sp(1, B)])
    l2 = load([A])
    assert l2.slots == [1]  # the slot l1 promotes into
    policy.forget("ssd", [A])   # pinned by s2 and l1: a tombstone keeps its SSD slot
    complete(s2, l2)
    s3 = store(D)
    assert s3.spills == [sp(0, C)] and tiers(policy)[1] == [B, TOMB + b"1", C]
    complete(l1)
    s4 = store(E)
    assert s4.spills == [sp(1, A)]  # A spills to the SSD tier again, into the tombstone's slot
    s5 = store(X)
    assert (s5.writes, s5.evictions) == ({"ssd": [0]}, {"ssd": [B]})
    complete(s3)
    s6 = store(B)
    assert (s6.slots, s6.spills, s6.evictions) == ([0], [sp(0, D)], {"ssd": [C]})
    l3 = load([B, A, E, D])
    assert l3.tiers() == ["cpu", "ssd", "cpu", "ssd"]
    complete(l3, s6, s5, s4)
    assert tiers(policy) == ([B, E], [D, X, A])
    assert policy.pinned() == {"cpu": 0, "ssd": 0}
    policy.check()


# ---------------------------------------------------------------------------- PolicySpec


def config(tmp_path, spill: dict, cpu: int, ssd: int | None, block: int = 4096) -> KVStrataConfig:
    return KVStrataConfig.from_dict({
        "model": {"block_nbytes": block},
        "cpu": {"capacity": cpu},
        "ssd": {"path": str(tmp_path) if ssd is not None else None, "capacity": ssd or 0},
        "spill": spill,
    })


def test_policy_spec_from_config_sizes_tiers_in_blocks(tmp_path) -> None:
    block = 4096
    cfg = config(tmp_path, {"admission": "on_evict", "watermark": 0.25, "write_through": False},
                 cpu=10 * block + block - 1, ssd=50 * block)
    spec = policy_spec(cfg, block_nbytes=block, gpu_blocks=10)
    assert spec.slab_slots == 10  # capacity // block bytes
    assert spec.store_slots == capacity_blocks(50 * block, block)
    assert 0 < spec.store_slots < 50  # records cost more than their payload
    assert spec.pageout_blocks == 2  # int(0.25 * 10)
    assert (spec.admission, spec.promotion, spec.write_through) == ("on_evict", "inclusive", False)

    small = config(tmp_path, {"admission": "on_evict", "watermark": 0.01}, cpu=block, ssd=None)
    spec = policy_spec(small, block_nbytes=block, gpu_blocks=10)
    assert (spec.slab_slots, spec.store_slots, spec.pageout_blocks) == (1, 0, 1)  # at least one block

    compute = config(tmp_path, {"admission": "on_compute"}, cpu=4 * block, ssd=None)
    assert policy_spec(compute, block_nbytes=block, gpu_blocks=10).pageout_blocks == 0

    nothing = config(tmp_path, {"admission": "on_evict", "watermark": 0.5}, cpu=block - 1, ssd=None)
    spec = policy_spec(nothing, block_nbytes=block, gpu_blocks=10)
    assert (spec.slab_slots, spec.store_slots, spec.pageout_blocks, spec.has_lower_tier) == (0, 0, 0, False)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"admission": "lru"}, "spill.admission"),
    ({"promotion": "move"}, "spill.promotion"),
    ({"slab_slots": -1}, "slab_slots"),
    ({"slab_slots": "4"}, "slab_slots"),
    ({"store_slots": 2.0}, "store_slots"),
    ({"store_slots": True}, "store_slots"),
    ({"pageout_blocks": -3}, "pageout_blocks"),
])
def test_policy_spec_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        PolicySpec(**kwargs)


def test_policy_spec_rejects_exclusive_promotion_under_on_compute() -> None:
    """As SpillConfig does: a loaded block would be stored again as soon as its request computes."""
    with pytest.raises(ConfigError, match=r"^spill\.promotion:"):
        PolicySpec(admission="on_compute", promotion="exclusive")
    assert PolicySpec(admission="on_evict", promotion="exclusive").promotion == "exclusive"


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_policy_spec_rejects_a_write_through_that_is_not_a_bool(value: object) -> None:
    """``"false"``, a non-empty string, would otherwise turn write-through on."""
    with pytest.raises(ConfigError, match=r"^spill\.write_through:"):
        PolicySpec(write_through=value)


@pytest.mark.parametrize("block", [0, -4096, True, 4096.0, "4096"])
def test_policy_spec_from_config_rejects_a_block_size_that_is_not_positive(tmp_path, block: object) -> None:
    cfg = config(tmp_path, {"admission": "on_evict"}, cpu=1 << 20, ssd=None)
    with pytest.raises(ConfigError, match="^block_nbytes:"):
        policy_spec(cfg, block_nbytes=block, gpu_blocks=10)


# ---------------------------------------------------------------------------- plans


def test_plans_survive_a_pickle_round_trip() -> None:
    policy = make(slab_slots=1, store_slots=2, admission="on_evict", write_through=False)
    stored(policy, [A], "evicted")
    stored(policy, [B], "evicted")
    stored(policy, [C], "evicted")  # spills B: the SSD tier holds A and B
    store = stored(policy, [D], "evicted")  # spills C, which evicts A
    assert store == StorePlan(4, "evicted", [100], [D], [0], {}, spills=[sp(0, C)], evictions={"ssd": [A]})
    load = policy.prepare_load("req-7", [B, E], [11, 12])  # promotes B: spills D, which evicts C
    assert load == LoadPlan(5, "req-7", [11, 12], [B, E], slots=[-1, -1], sources=["ssd", ""],
                            promote_slots=[0, -1], spills=[sp(0, D)], evictions={"ssd": [C]})
    for plan in (load, store):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            copy = pickle.loads(pickle.dumps(plan, protocol))
            assert type(copy) is type(plan) and copy == plan and vars(copy) == vars(plan)


def test_a_cpu_hit_refreshes_the_ssd_copy_before_promotions() -> None:
    """A block kept hot by CPU hits alone is also the most recent on SSD: when the CPU tier
    evicts it later, the SSD tier still holds it (the persistent tier stays a superset of
    what is hot above it). The refresh comes before the plan's promotions, whose cascade
    evicts the SSD tier's least recently used block: C, not A."""
    policy = make(slab_slots=2, store_slots=3)
    stored(policy, [A], "computed")
    stored(policy, [B], "computed")
    stored(policy, [C], "computed")  # CPU: B, C (A evicted); SSD: A, B, C
    assert tiers(policy) == ([B, C], [A, B, C])
    plan = policy.prepare_load("r", [B], [1])
    policy.complete_load(plan)
    assert tiers(policy) == ([C, B], [A, C, B])
    plan = policy.prepare_load("r2", [A, B], [2, 3])  # A from SSD (promoted), B from CPU
    policy.complete_load(plan)
    assert tiers(policy) == ([B, A], [C, B, A])  # C, only in the SSD tier now, is the oldest there
