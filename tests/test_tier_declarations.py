"""The tiers below the device as an ordered list of declarations (kvstrata.policy.tiers)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy.tiers import CPU, KNOWN, REMOTE, SSD, Tier, TierList, declare, describe_tiers
from kvstrata.core.deployment import policy_spec

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def tier(name: str, **kw) -> Tier:
    return dataclasses.replace(KNOWN[name], **kw)


def test_a_deployment_declares_its_tiers_in_order_from_the_config() -> None:
    cfg = KVStrataConfig.from_dict({"cpu": {"capacity": 4096 * 10}, "ssd": {"path": "/nonexistent", "capacity": "1GiB"},
                                    "spill": {"write_through": False},
                                    "remote": {"url": "redis://user:hunter2@127.0.0.1:6379/0"}})
    spec = policy_spec(cfg, block_nbytes=4096, gpu_blocks=8)
    tiers = spec.tiers
    assert tiers.names == (CPU, SSD, REMOTE)
    assert tiers[CPU].capacity == 10 and tiers[CPU].cascade == SSD and tiers[CPU].medium == "CPU"
    assert tiers[SSD].capacity == spec.store_slots > 0 and tiers[SSD].medium == "STORAGE"
    assert tiers[REMOTE].shared and tiers[REMOTE].medium is None
    assert "hunter2" not in repr(tiers) and "hunter2" not in describe_tiers(tiers)  # the server, never its password
    assert spec.capacity() == {CPU: 10, SSD: spec.store_slots}


def test_write_through_means_the_cpu_tier_cascades_nowhere() -> None:
    tiers = declare(4, 8, write_through=True)
    assert tiers[CPU].cascade is None and tiers.names == (CPU, SSD)
    assert declare(4, None, write_through=False)[CPU].cascade is None  # no SSD tier: evictions are dropped


def test_the_policy_follows_the_declared_cascade() -> None:
    """The same sizes, without write-through: declared without a cascade, CPU evictions are
    dropped; with one, they go down to the SSD tier."""
    def evicted_to_ssd(cascade: str | None) -> bool:
        tiers = TierList((tier(CPU, capacity=1, cascade=cascade), tier(SSD, capacity=4)))
        policy = TierPolicy(PolicySpec(write_through=False, tiers=tiers))
        for i, key in enumerate((A, B)):
            policy.complete_store(policy.prepare_store([i], [key], "computed"))
        return policy.holds(A) == SSD

    assert evicted_to_ssd(SSD) and not evicted_to_ssd(None)


def test_events_stats_and_capacities_iterate_the_declared_tiers() -> None:
    policy = TierPolicy(PolicySpec(tiers=TierList((tier(CPU, capacity=2), tier(REMOTE, server="s")))))
    assert set(policy.counts.counts["stored"]) == {CPU, SSD, REMOTE}
    assert policy.capacity() == {CPU: 2, SSD: 0} and policy.occupancy() == {CPU: 0, SSD: 0}
    assert policy.spec.shared and policy.spec.slab_slots == 2 and policy.spec.store_slots == 0


@pytest.mark.parametrize("tiers, message", [
    ((tier(CPU, capacity=2, cascade=SSD), tier(SSD, capacity=4, cascade=CPU)),
     r"^cpu.cascade: the cascade cpu -> ssd -> cpu is a cycle"),
    ((tier(CPU, capacity=2, cascade=SSD), tier(SSD, capacity=0)),
     r"^ssd.capacity: 'cpu' cascades its evicted blocks into 'ssd', which holds no block"),
    ((tier(CPU, capacity=2), tier(REMOTE)), r"^remote.url: the shared tier 'remote' has no server"),
    ((tier(CPU, capacity=2, cascade="nvme"),), r"^cpu.cascade: no tier named 'nvme'"),
    ((tier(CPU, capacity=2, cascade=REMOTE), tier(REMOTE, server="s")), r"^cpu.cascade: 'remote' is shared"),
    ((tier(CPU, capacity=2), tier(SSD, capacity=2, cascade=CPU)), r"^ssd.cascade: 'cpu' is above 'ssd'"),
    ((tier(CPU, capacity=2), tier(CPU, capacity=3)), r"^cpu: a tier named 'cpu' is declared twice"),
    ((tier(SSD, capacity=2), tier(REMOTE, server="s")), r"^cpu.capacity: the shared tier fetches blocks"),
    ((tier(CPU, capacity=-1),), r"^cpu.capacity: expected a non-negative number of blocks"),
    ((Tier("nvme", capacity=2),), r"^nvme: no executor runs a tier named 'nvme'"),
    ((tier(SSD, capacity=2, slab=True),), r"^ssd: the 'ssd' tier is a persistent store"),
])
def test_declarations_that_make_no_sense_are_config_errors_naming_the_key(tiers, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TierList(tiers)


def test_an_ssd_tier_of_no_block_that_the_cpu_tier_cascades_into_is_refused_at_start() -> None:
    cfg = KVStrataConfig.from_dict({"cpu": {"capacity": 4096 * 10}, "spill": {"write_through": False},
                                    "ssd": {"path": "/nonexistent", "capacity": 4096}})
    with pytest.raises(ConfigError, match=r"^ssd.capacity: 'cpu' cascades its evicted blocks into 'ssd'"):
        policy_spec(cfg, block_nbytes=4096, gpu_blocks=8)
    through = dataclasses.replace(cfg, spill=dataclasses.replace(cfg.spill, write_through=True))
    assert policy_spec(through, block_nbytes=4096, gpu_blocks=8).store_slots == 0  # nothing cascades there


def test_plans_name_tiers_as_the_declarations_do() -> None:
    policy = TierPolicy(PolicySpec(slab_slots=1, store_slots=4, write_through=False))
    store = policy.prepare_store([0], [A], "computed")
    policy.complete_store(store)
    second = policy.prepare_store([1], [B], "computed")  # evicts A from the CPU tier: a spill to the SSD tier
    assert sorted(second.placed()) == sorted([(CPU, B), (SSD, A)])
    policy.complete_store(second)
    load = policy.prepare_load("r", [A, B], [5, 6])
    assert load.tiers() == [SSD, CPU] and all(t in policy.spec.tiers for t, _ in load.placed())
