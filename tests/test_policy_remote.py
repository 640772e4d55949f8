"""The tier policy with a remote tier: which stores go to it, and fetches into CPU slots,
each with the exact plan and events."""

from __future__ import annotations

import pytest

from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy.plans import Spill

A, B, C, D, E = (bytes([c]) * 32 for c in b"ABCDE")


def make(**spec) -> TierPolicy:
    return TierPolicy(PolicySpec(shared=True, **spec), clock=lambda: 0.0, record_events=True)


def events(policy: TierPolicy) -> list[tuple[str, str, tuple[bytes, ...]]]:
    return [(e.kind, e.tier, e.keys) for e in policy.take_events()]


def test_blocks_new_to_the_lower_tiers_go_to_the_remote_tier_once() -> None:
    policy = make(slab_slots=2, store_slots=4)
    plan = policy.prepare_store([0, 1], [A, B], "computed")
    assert len(plan) == 2 and plan.goes_to("remote") == [0, 1] and plan.goes_to("ssd") == [0, 1]
    assert ("stored", "remote", (A, B)) in events(policy)
    policy.complete_store(plan)
    again = policy.prepare_store([2, 3], [A, C], "computed")  # A recomputed: held below, not sent again
    assert again.keys == [C] and again.goes_to("remote") == [0]
    policy.complete_store(again)
    assert policy.counts.snapshot()["stored"]["remote"] == 3


def test_a_block_no_local_tier_can_take_still_goes_to_the_remote_tier() -> None:
    policy = make(slab_slots=1)
    held = policy.prepare_store([0], [A], "computed")  # pins the only CPU slot
    plan = policy.prepare_store([1], [B], "computed")
    assert plan.keys == [B] and plan.slots == [-1] and plan.goes_to("ssd") == [] and plan.goes_to("remote") == [0]
    policy.complete_store(held), policy.complete_store(plan)
    assert policy.lookup([B]) == []


def test_without_a_remote_tier_plans_carry_no_remote_work() -> None:
    policy = TierPolicy(PolicySpec(slab_slots=2))
    assert "remote" not in policy.prepare_store([0], [A], "computed").writes
    assert len(policy.prepare_fetch([B])) == 0
    assert "remote" not in policy.counts.snapshot()["stored"]


def test_a_fetch_places_pinned_cpu_slots_and_only_arrived_blocks_become_hits() -> None:
    policy = make(slab_slots=3, store_slots=8)
    plan = policy.prepare_fetch([A, B, C])
    assert plan.keys == [A, B, C] and sorted(plan.slots) == [0, 1, 2] and plan.writes.get("ssd") == [0, 1, 2]
    assert policy.pinned()["cpu"] == 3
    # placed (pinned) at once, as promotions are: a load planned meanwhile runs after the fetch
    # (plans run in order) and reads the slot only if its block arrived (the slab tags slots)
    assert policy.lookup([A, B, C]) == ["cpu"] * 3
    policy.complete_fetch(plan, 2)  # only what arrived stays
    assert policy.lookup([A, B, C]) == ["cpu", "cpu"]
    assert policy.holds(C) is None and policy.pinned() == {"cpu": 0, "ssd": 0}
    evs = events(policy)
    assert ("hit", "remote", (A, B)) in evs and ("lost", "cpu", (C,)) in evs and ("lost", "ssd", (C,)) in evs


def test_a_fetch_evicts_like_a_store_and_stops_at_the_first_block_without_a_slot() -> None:
    policy = make(slab_slots=2, store_slots=4, write_through=False)
    stored = policy.prepare_store([0], [A], "computed")
    policy.complete_store(stored)
    pinned = policy.prepare_store([1], [B], "computed")  # B's slot stays pinned
    policy.take_events()
    plan = policy.prepare_fetch([C, D, E])  # A is evicted (spilled to SSD); D and E find no slot
    assert plan.keys == [C] and plan.spills == [Spill("cpu", stored.slots[0], "ssd", A)]
    assert not plan.writes.get("ssd")
    assert ("dropped", "cpu", (D, E)) in events(policy)
    policy.complete_fetch(plan, 1)
    policy.complete_store(pinned)
    assert policy.lookup([C]) == ["cpu"] and policy.holds(A) == "ssd"


def test_a_fetch_stops_at_a_block_the_cpu_tier_holds() -> None:
    policy = make(slab_slots=4)
    policy.complete_store(policy.prepare_store([0], [B], "computed"))
    assert policy.prepare_fetch([A, B, C]).keys == [A]


def test_a_remote_tier_needs_a_cpu_tier() -> None:
    with pytest.raises(ConfigError, match="cpu.capacity: the shared tier"):
        PolicySpec(store_slots=4, shared=True)
