"""``second_hit`` admission to the SSD and remote tiers (kvstrata.policy.ghost and the policy)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy.ghost import Ghost
from kvstrata.policy.plans import Spill
from kvstrata.policy.tiers import CPU, KNOWN, REMOTE, SSD, TierList
from kvstrata.core.deployment import policy_spec

K = [hashlib.sha256(b"%d" % i).digest() for i in range(64)]


def policy(cpu: int, ssd: int, *, write_through: bool = True, ghost: int = 16, remote: bool = False) -> TierPolicy:
    tiers = [dataclasses.replace(KNOWN[CPU], capacity=cpu, cascade=None if write_through else SSD),
             dataclasses.replace(KNOWN[SSD], capacity=ssd, admission="second_hit", ghost_keys=ghost)]
    if remote:
        tiers.append(dataclasses.replace(KNOWN[REMOTE], server="s", admission="second_hit", ghost_keys=ghost))
    return TierPolicy(PolicySpec(write_through=write_through, tiers=TierList(tuple(tiers))))


def store(p: TierPolicy, keys: list[bytes]) -> None:
    plan = p.prepare_store(list(range(len(keys))), keys, "computed")
    p.complete_store(plan)


# ---------------------------------------------------------------------------- the ghost

def test_the_ghost_admits_the_second_sighting_once() -> None:
    g = Ghost(4)
    assert [g.seen(K[0]), g.seen(K[0]), g.seen(K[0])] == [False, True, False]  # taken: forgotten again


def test_the_ghost_forgets_the_oldest_beyond_its_window() -> None:
    g = Ghost(3)
    for k in K[:4]:  # K[0] is pushed out by K[3]
        assert not g.seen(k)
    assert len(g) == 3 and K[0] not in g
    assert not g.seen(K[0]) and g.seen(K[2]) and g.seen(K[3])


def test_the_ghost_recycles_slots_freed_by_admissions() -> None:
    g = Ghost(2)
    assert not g.seen(K[0]) and g.seen(K[0])  # slot 0 is empty again, but the ring goes on
    assert not g.seen(K[1]) and not g.seen(K[2])  # K[2] takes slot 0 (nothing left to push out)
    assert not g.seen(K[3])  # slot 1: K[1] leaves
    assert K[1] not in g and g.seen(K[2]) and g.seen(K[3])
    assert len(g) == 0


def test_the_ghost_is_bounded_and_a_few_bytes_per_key() -> None:
    g = Ghost(1000)
    for i in range(20_000):
        g.seen(hashlib.sha256(b"x%d" % i).digest())
    assert len(g) == 1000 and g.nbytes() <= 1000 * 32  # 8-byte fingerprints, a table at most half full


# ---------------------------------------------------------------------------- the policy

def test_write_through_takes_a_block_on_its_second_sighting_a_cpu_hit() -> None:
    p = policy(cpu=8, ssd=8)
    store(p, K[:2])
    assert p.lookup(K[:2]) == [CPU, CPU] and len(p.store) == 0  # seen once: the SSD tier did not take them
    assert p.counts.counts["rejected"][SSD] == 2
    load = p.prepare_load("r", K[:1], [7])  # a CPU hit is the second sighting: written down from its slot
    assert load.spills == [Spill(CPU, load.slots[0], SSD, K[0])] and (SSD, K[0]) in load.placed()
    p.complete_load(load)
    assert K[0] in p.store and K[1] not in p.store
    p.check()


def test_a_block_computed_again_is_taken_on_its_second_offer() -> None:
    p = policy(cpu=1, ssd=8)
    store(p, [K[0]])
    store(p, [K[1]])  # evicts K[0] from the CPU tier (write-through: nothing cascades)
    assert p.holds(K[0]) is None
    store(p, [K[0]])  # recomputed: offered a second time
    assert K[0] in p.store and K[1] not in p.store


def test_without_write_through_an_eviction_is_a_sighting_and_the_second_cascades() -> None:
    p = policy(cpu=1, ssd=8, write_through=False)
    store(p, [K[0]])
    store(p, [K[1]])  # K[0] cascades: seen once, dropped
    assert p.holds(K[0]) is None and p.counts.counts["rejected"][SSD] == 1
    store(p, [K[0]])  # back in the CPU tier, K[1] cascades (its first sighting)
    store(p, [K[1]])  # K[0] cascades again: taken
    assert p.holds(K[0]) == SSD and p.holds(K[1]) == CPU


def test_the_ghost_window_bounds_what_counts_as_a_second_sighting() -> None:
    p = policy(cpu=1, ssd=8, ghost=2)
    for k in K[:4]:
        store(p, [k])  # K[0], K[1] pushed out of the two-key window by K[2], K[3]
    store(p, [K[0]])
    assert K[0] not in p.store
    store(p, [K[3]])
    assert K[3] in p.store


def test_shutdown_keeps_the_hot_set_whatever_the_admission() -> None:
    p = policy(cpu=8, ssd=8)
    plan = p.prepare_store([0, 1], K[:2], "shutdown")
    assert len(plan) == 2 and plan.goes_to(SSD) == [0, 1]


def test_the_remote_tier_gets_a_block_new_to_this_replica_on_its_second_offer() -> None:
    p = policy(cpu=1, ssd=1, remote=True)
    plan = p.prepare_store([0], [K[0]], "computed")
    assert 0 not in plan.goes_to(REMOTE)
    p.complete_store(plan)
    store(p, [K[1]])  # K[0] leaves the CPU tier (and never reached the SSD tier)
    assert p.holds(K[0]) is None
    plan = p.prepare_store([0], [K[0]], "computed")
    assert plan.keys.index(K[0]) in plan.goes_to(REMOTE) and p.counts.counts["stored"][REMOTE] == 1


@pytest.mark.parametrize("overrides, message", [
    ({"ssd.admission": "twice"}, r"^ssd.admission: expected one of always, second_hit; got 'twice'"),
    ({"ssd.ghost_keys": 0}, r"^ssd.ghost_keys: must be >= 1"),
    ({"ssd.ghost_keys": 10**12}, r"^ssd.ghost_keys: must be <= 67108864"),
    ({"remote.admission": "lfu"}, r"^remote.admission: expected one of always, second_hit"),
])
def test_bad_admission_settings_are_config_errors_naming_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        KVStrataConfig.from_dict({}, overrides)


def test_the_config_declares_the_admission_with_a_bounded_default_window() -> None:
    cfg = KVStrataConfig.from_dict({}, {"cpu.capacity": 4096 * 4, "ssd.capacity": "1GiB",
                                        "ssd.admission": "second_hit"})
    spec = policy_spec(cfg, block_nbytes=4096, gpu_blocks=8)
    ssd = spec.tiers[SSD]
    assert ssd.admission == "second_hit" and ssd.ghost_keys == min(spec.store_slots, 1 << 20)
    explicit = KVStrataConfig.from_dict({}, {"ssd.admission": "second_hit", "ssd.ghost_keys": 7})
    assert policy_spec(explicit, block_nbytes=4096, gpu_blocks=8).tiers[SSD].ghost_keys == 7


def test_second_hit_on_an_ssd_tier_that_holds_no_block_is_inert() -> None:
    tiers = TierList((dataclasses.replace(KNOWN[CPU], capacity=4),
                      dataclasses.replace(KNOWN[SSD], capacity=0, admission="second_hit", ghost_keys=4)))
    p = TierPolicy(PolicySpec(tiers=tiers))
    for _ in range(3):  # store, hit, store again, hit again: no SSD index to place into, no crash
        store(p, [K[0]])
        p.complete_load(p.prepare_load("r", [K[0]], [1]))
    p.check()


def test_a_key_named_twice_in_one_load_is_one_sighting() -> None:
    p = policy(cpu=4, ssd=4, write_through=False)
    store(p, [K[0]])
    load = p.prepare_load("r", [K[0], K[0]], [0, 1])
    assert load.spills == []
    p.complete_load(load)
