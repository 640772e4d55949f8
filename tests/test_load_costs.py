"""Load or recompute (kvstrata.core.costs): the decision on given measurements, the warm-up,
the estimates following a change of a tier's speed, absurd measurements ignored, and the
``load.*`` keys refused when out of range."""

from __future__ import annotations

import math

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.costs import ALWAYS, MEASURED, PROBE_S, LoadCosts, load_costs
from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec
from kvstrata.core.deployment import policy_spec

BT = 16  # tokens per block


def measured(cpu: float, ssd: float, token: float, *, margin: float = 0.0, warmup: int = 3,
             remote: float | None = None) -> LoadCosts:
    """Costs measured as ``cpu``/``ssd`` seconds per block and ``token`` seconds per token."""
    costs = LoadCosts(("cpu", "ssd"), "remote" if remote is not None else None, policy=MEASURED, margin=margin,
                      warmup=warmup)
    for n in (1, 4, 2, 8, 3):
        costs.load_done({"cpu": n}, n * cpu)
        costs.load_done({"cpu": n, "ssd": 2 * n}, n * cpu + 2 * n * ssd)
        costs.step_done(n * BT, n * BT * token, BT)
        if remote is not None:
            costs.fetch_done(n, n * remote)
    return costs


def test_every_block_is_loaded_when_loading_is_cheaper() -> None:
    costs = measured(cpu=0.001, ssd=0.002, token=0.001)  # a block: 16 ms to compute, 1-2 ms to load
    assert costs.worth(["cpu"] * 5 + ["ssd"] * 5, BT) == 10


def test_nothing_is_loaded_when_computing_is_cheaper() -> None:
    costs = measured(cpu=0.05, ssd=0.5, token=0.0001)  # 1.6 ms to compute a block
    assert costs.worth(["cpu"] * 3 + ["ssd"] * 3, BT) == 0


def test_a_dram_prefix_is_loaded_and_an_ssd_tail_computed() -> None:
    costs = measured(cpu=0.001, ssd=0.1, token=0.001)  # DRAM 1 ms, SSD 100 ms, compute 16 ms a block
    assert costs.worth(["cpu"] * 4 + ["ssd"] * 6, BT) == 4
    # a short SSD run between DRAM blocks is worth loading when what follows pays for it
    assert costs.worth(["cpu"] * 4 + ["ssd"] + ["cpu"] * 20, BT) == 25
    est = costs.block_seconds()
    assert math.isclose(est["cpu"], 0.001, rel_tol=1e-6) and math.isclose(est["ssd"], 0.1, rel_tol=1e-6)


def test_the_margin_asks_a_load_to_be_that_much_cheaper() -> None:
    assert measured(cpu=0.001, ssd=0.015, token=0.001).worth(["ssd"], BT) == 1  # 15 ms < 16 ms
    assert measured(cpu=0.001, ssd=0.015, token=0.001, margin=0.1).worth(["ssd"], BT) == 0


def test_warm_up_loads_everything_until_enough_samples() -> None:
    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=3)
    for _ in range(2):
        costs.load_done({"ssd": 1}, 10.0)
        costs.step_done(BT, 0.0001, BT)
    assert costs.worth(["ssd"] * 4, BT) == 4  # two samples of each: still warming up
    costs.load_done({"ssd": 1}, 10.0)
    assert costs.worth(["ssd"] * 4, BT) == 4  # the compute rate has two
    costs.step_done(BT, 0.0001, BT)
    assert costs.worth(["ssd"] * 4, BT) == 0
    assert costs.worth(["cpu"] * 2, BT) == 2  # DRAM never measured: loaded


def test_always_loads_everything() -> None:
    costs = measured(cpu=1.0, ssd=1.0, token=1e-9)
    costs.policy = ALWAYS
    assert costs.worth(["ssd"] * 3, BT) == 3


def test_the_estimate_follows_a_slower_tier_within_a_few_loads() -> None:
    costs = measured(cpu=0.001, ssd=0.002, token=0.001)
    assert costs.worth(["ssd"] * 4, BT) == 4
    for _ in range(6):  # the disk became 50x slower
        costs.load_done({"ssd": 4}, 4 * 0.1)
    assert costs.block_seconds()["ssd"] > 0.05
    assert costs.worth(["ssd"] * 4, BT) == 0


def test_a_remote_block_costs_its_fetch_and_its_load_from_dram() -> None:
    costs = measured(cpu=0.001, ssd=0.002, token=0.001, remote=0.03)
    assert math.isclose(costs.block_seconds()["remote"], 0.031, rel_tol=1e-6)
    assert costs.worth(["cpu", "cpu", "remote", "remote"], BT) == 2


def test_absurd_measurements_are_ignored_and_fixed_figures_win() -> None:
    costs = measured(cpu=0.001, ssd=0.002, token=0.001)
    before = costs.block_seconds()
    for bad in (float("nan"), float("inf"), -1.0, 0.0, True):
        costs.load_done({"ssd": 1}, bad)  # type: ignore[arg-type]
        costs.step_done(BT, bad, BT)  # type: ignore[arg-type]
    assert costs.block_seconds() == before
    fixed = LoadCosts(("cpu", "ssd"), policy=MEASURED, block_seconds={"ssd": 1.0}, token_seconds=1e-6)
    assert fixed.worth(["cpu", "ssd"], BT) == 1  # no samples needed: the operator's figures decide


def test_decisions_are_counted_per_tier() -> None:
    costs = measured(cpu=0.001, ssd=0.1, token=0.001)
    tiers = ["cpu"] * 2 + ["ssd"] * 3
    costs.count(tiers, costs.worth(tiers, BT))
    assert costs.decisions["cpu"] == {"loaded": 2, "recomputed": 0}
    assert costs.decisions["ssd"] == {"loaded": 0, "recomputed": 3}


@pytest.mark.parametrize("key,value,match", [
    ("policy", "sometimes", r"load\.policy: expected one of measured, always"),
    ("margin", -0.5, r"load\.margin: expected a fraction of 0 or more"),
    ("warmup", 0, r"load\.warmup"),
    ("ssd_bandwidth", 0, r"load\.ssd_bandwidth: expected bytes per second above 0"),
    ("remote_bandwidth", "fast", r"load\.remote_bandwidth"),
    ("prefill_rate", float("nan"), r"load\.prefill_rate: expected tokens per second above 0"),
    ("deadline", 0.5, r"load\.deadline: expected 0 \(never cut a load\) or a factor from 1 to 1000"),
    ("attention_rate", -1, r"load\.attention_rate: expected token pairs attended per second above 0"),
    ("ssd_latency", -0.001, r"load\.ssd_latency: expected seconds from 0 to 60"),
    ("remote_latency", "1ms", r"load\.remote_latency: expected seconds from 0 to 60"),
])
def test_out_of_range_values_name_the_key(key: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVStrataConfig.from_dict({"load": {key: value}})


def test_an_attention_rate_needs_the_prefill_rate_it_is_part_of() -> None:
    with pytest.raises(ConfigError, match=r"load\.attention_rate: given without load\.prefill_rate"):
        KVStrataConfig.from_dict({"load": {"attention_rate": 1e9}})
    cfg = KVStrataConfig.from_dict({"load": {"prefill_rate": 1000, "attention_rate": 1e6}})
    costs = load_costs(cfg.load, policy_spec(cfg, block_nbytes=4096, gpu_blocks=16), 4096)
    # a block of 16 tokens after 1,024 others: 16 ms for the tokens, 16 x (1,024 + 8) us attending
    assert costs.compute_seconds(1024, 16) == pytest.approx(0.016 + 16 * 1032e-6)


def test_the_load_section_round_trips() -> None:
    cfg = KVStrataConfig.from_dict({"load": {"policy": "measured", "ssd_bandwidth": "2GiB", "margin": 0.25,
                                             "ssd_latency": 0.0005}})
    assert cfg.load.ssd_bandwidth == 2 << 30 and cfg.load.margin == 0.25 and cfg.load.ssd_latency == 0.0005
    assert KVStrataConfig.from_dict(cfg.to_dict()) == cfg


def test_a_latency_needs_the_bandwidth_it_is_part_of() -> None:
    with pytest.raises(ConfigError, match=r"load\.ssd_latency: given without load\.ssd_bandwidth"):
        KVStrataConfig.from_dict({"load": {"ssd_latency": 0.001}})
    cfg = KVStrataConfig.from_dict({"load": {"ssd_bandwidth": "4MiB", "ssd_latency": 0.002, "prefill_rate": 1000}})
    costs = load_costs(cfg.load, policy_spec(cfg, block_nbytes=4096, gpu_blocks=16), 4096)
    assert costs.latency()["ssd"] == 0.002 and costs.block_seconds()["ssd"] == pytest.approx(4096 / (4 << 20))


def test_a_tiers_latency_is_told_apart_once_its_loads_differ_in_size() -> None:
    """A tier costing 2 ms a load and 1 ms a block: loads of one size say nothing of the
    split (the fit goes through the origin, latency 0); a probe's 2 blocks beside whole
    hits of 30 do, and the fit recovers both; an SSD tail's latency is its own."""
    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED)
    for _ in range(3):
        costs.load_done({"ssd": 30}, 0.002 + 30 * 0.001)
    assert costs.latency() == {"ssd": 0.0}
    assert costs.block_seconds()["ssd"] == pytest.approx(0.032 / 30)
    costs.load_done({"ssd": 2}, 0.002 + 2 * 0.001)
    assert costs.latency()["ssd"] == pytest.approx(0.002, rel=1e-6)
    assert costs.block_seconds()["ssd"] == pytest.approx(0.001, rel=1e-6)
    for n in (3, 7, 1, 12):  # mixed loads: each tier read pays its own latency once
        costs.load_done({"cpu": n}, 0.0001 + n * 0.00001)
        costs.load_done({"cpu": n, "ssd": n}, 0.0001 + n * 0.00001 + 0.002 + n * 0.001)
    assert costs.latency()["cpu"] == pytest.approx(0.0001, rel=1e-4)
    assert costs.latency()["ssd"] == pytest.approx(0.002, rel=1e-4)
    assert costs.estimates()["latency_seconds"] == costs.latency()
    for i in range(40):  # then loads of one size only, a little noisy: the old sizes no longer tell the split
        costs.load_done({"ssd": 30}, (0.002 + 30 * 0.001) * (1 + 0.01 * (-1) ** i))
    assert costs.latency()["ssd"] == 0.0
    assert costs.block_seconds()["ssd"] == pytest.approx(0.032 / 30, rel=0.02)


def test_a_short_hit_from_a_tier_with_a_long_latency_is_computed() -> None:
    """A block computes in 1.6 ms and loads in 1 ms once the tier's 10 ms latency is paid:
    4 blocks are cheaper computed (6.4 ms against 14 ms), 40 loaded (64 ms against 50 ms);
    the deadline of a load counts the latency too."""
    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED, margin=0.0, block_seconds={"cpu": 1e-5, "ssd": 0.001},
                      latency_seconds={"ssd": 0.01}, token_seconds=0.0001, deadline=1.0)
    assert costs.worth(["ssd"] * 4, BT) == 0
    assert costs.worth(["ssd"] * 40, BT) == 40
    assert costs.worth(["cpu"] * 3 + ["ssd"] * 4, BT) == 3  # the DRAM prefix still loads
    assert costs.worth_whole(["ssd"] * 4, 4, BT) is False and costs.worth_whole(["ssd"] * 40, 40, BT) is True
    assert costs.deadline(["ssd"] * 40, BT) == pytest.approx(0.01 + 40 * 0.001)  # under computing them: 64 ms
    without = LoadCosts(("cpu", "ssd"), policy=MEASURED, margin=0.0, block_seconds={"cpu": 1e-5, "ssd": 0.001},
                        token_seconds=0.0001)
    assert without.worth(["ssd"] * 4, BT) == 4  # what the same tier gets when its latency is left out


def test_the_cut_is_the_largest_saving_over_every_prefix() -> None:
    """Against the saving of every prefix, computed block by block."""
    from hypothesis import given, settings
    from hypothesis import strategies as hst

    @settings(max_examples=300, deadline=None)
    @given(hst.lists(hst.sampled_from(["cpu", "ssd", "remote"]), max_size=40),
           hst.floats(0.0001, 0.01), hst.floats(0.0, 0.03), hst.floats(0.0, 0.03), hst.floats(0.0, 0.05))
    def check(tiers: list[str], token: float, cpu: float, ssd: float, remote: float) -> None:
        costs = LoadCosts(("cpu", "ssd"), "remote", policy=MEASURED, margin=0.1, token_seconds=token / BT,
                          block_seconds={"cpu": cpu, "ssd": ssd, "remote": remote})
        gain = {t: token - 1.1 * c for t, c in (("cpu", cpu), ("ssd", ssd), ("remote", remote))}
        savings = [sum(gain[t] for t in tiers[:k]) for k in range(len(tiers) + 1)]
        got = costs.worth(tiers, BT)
        assert savings[got] >= max(savings) - 1e-9, (got, savings)

    check()


def test_the_compute_rate_leaves_out_what_every_step_costs() -> None:
    """Steps cost 50 ms whatever they compute, plus 0.5 ms a token: a block of a hit costs
    its tokens' part (a one-block step alone would say 25x that)."""
    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1)
    for tokens in (1, 1, 32, 1, 1024, 1, 64):
        costs.step_done(tokens, 0.05 + tokens * 0.0005, BT)
    assert costs.token_seconds() == pytest.approx(0.0005)
    alone = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1)
    alone.step_done(32, 0.05 + 32 * 0.0005, BT)  # one size seen: the ratio stands in
    assert alone.token_seconds() == pytest.approx((0.05 + 32 * 0.0005) / 32)


def test_later_blocks_of_a_long_prompt_cost_more_to_compute() -> None:
    """Steps cost 20 ms, 0.5 ms a token and 1 us a token for each context token it attends:
    the fit tells the three apart, and a hit deep into a prompt is worth loading where the
    same blocks at its start are not."""
    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, margin=0.0)
    for tokens, before in ((1, 4000), (512, 0), (1, 200), (256, 3000), (1024, 1024), (64, 8000), (1, 9000)):
        att = tokens * (before + tokens / 2)
        costs.step_done(tokens, 0.02 + tokens * 0.0005 + att * 1e-6, BT, att)
    per_token, per_attended = costs.compute_rates()
    assert per_token == pytest.approx(0.0005, rel=1e-6) and per_attended == pytest.approx(1e-6, rel=1e-6)
    assert costs.compute_seconds(0, BT) == pytest.approx(BT * 0.0005 + 1e-6 * BT * BT / 2)
    block = BT * 0.0005  # a block's weights part: 8 ms; its attention adds 16 ms per 1,000 tokens before it
    for _ in range(3):
        costs.load_done({"ssd": 4}, 4 * (block + 0.001))  # a block loads in 9 ms
    assert costs.worth(["ssd"] * 4, BT) == 0                 # at the start of a prompt: computed
    assert costs.worth(["ssd"] * 4, BT, first=1000) == 4     # 16,000 tokens in: loaded
    assert costs.compute_seconds(1000 * BT, 4 * BT) > 10 * costs.compute_seconds(0, 4 * BT)


def test_runs_of_a_hit_are_groupbys_for_every_shape() -> None:
    """The galloping search for a hit's runs (``_runs``) against ``itertools.groupby``: long
    contiguous runs, interleaved tiers past the gallop threshold, and tuples."""
    import random
    from itertools import groupby

    from kvstrata.core.costs import _runs

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.choice([1, 5, 127, 128, 129, 300, 700])
        tiers = [rng.choice(["cpu", "ssd", "remote"]) for _ in range(n)]
        shape = rng.randrange(3)
        if shape == 0:
            tiers.sort()
        elif shape == 1:  # long runs with one stray block inside
            tiers = sorted(tiers)
            tiers[rng.randrange(n)] = "ssd"
        expected = [(t, len(list(r))) for t, r in groupby(tiers)]
        assert _runs(tiers) == expected and _runs(tuple(tiers)) == expected


def test_a_hit_loaded_whole_is_loaded_when_reading_every_entry_beats_computing_it() -> None:
    """A hybrid hit: 4 positions of 16 tokens (64 ms to compute at 1 ms a token), its entries
    every group's blocks: 4 of the full group and 2 of a window from the SSD tier."""
    costs = measured(cpu=0.001, ssd=0.01, token=0.001)
    assert costs.worth_whole(["ssd"] * 6, 4, BT) is True          # 60 ms of reads < 64 ms
    assert costs.worth_whole(["ssd"] * 7, 4, BT) is False         # 70 ms > 64 ms
    assert costs.worth_whole(["cpu"] * 4 + ["ssd"] * 2, 4, BT) is True
    with_margin = measured(cpu=0.001, ssd=0.01, token=0.001, margin=0.1)
    assert with_margin.worth_whole(["ssd"] * 6, 4, BT) is False   # 66 ms with the margin
    assert measured(cpu=0.001, ssd=0.01, token=0.001, warmup=10 ** 6).worth_whole(["ssd"] * 7, 4, BT) is True


def test_a_slow_tier_is_probed_by_a_hit_loaded_whole_once_a_minute() -> None:
    now = [1000.0]
    costs = measured(cpu=0.001, ssd=0.5, token=0.001)
    costs.clock = lambda: now[0]
    costs._sampled["ssd"] = now[0]
    assert costs.worth_whole(["ssd"] * 4, 4, BT) is False
    now[0] += PROBE_S + 1
    assert costs.worth_whole(["ssd"] * 4, 4, BT) is True   # the probe
    assert costs.worth_whole(["ssd"] * 4, 4, BT) is False  # taken: the next one is computed


def test_reads_queued_ahead_are_paid_by_the_next_hit_that_reads_behind_them() -> None:
    """An SSD block: 2 ms to read, 16 ms to compute. Alone, a 10-block SSD hit is loaded; with
    a 100-block load handed over just before (0.2 s of reads ahead on the I/O thread) it is
    computed; a DRAM hit never waits for them; once the I/O thread has worked them off, or
    the load finished, the hit is loaded again."""
    now = [100.0]
    costs = measured(cpu=0.001, ssd=0.002, token=0.001)
    costs.clock = lambda: now[0]
    hit = ["ssd"] * 10
    assert costs.worth(hit, BT) == 10
    costs.handed(7, {"ssd": 100})
    assert costs.queued() == pytest.approx(0.2)
    assert costs.worth(hit, BT) == 0
    assert costs.worth(["cpu"] * 10, BT) == 10
    assert costs.deadline(hit, BT) == pytest.approx(0.16)  # computing the 10 blocks bounds it
    now[0] += 0.15  # 50 ms of reads left: 10 blocks save 160 - 20 - 50 ms
    assert costs.worth(hit, BT) == 10
    costs.finished(7)
    assert costs.queued() == 0.0
    costs.handed(9, {"ssd": 25})  # 50 ms ahead: in the estimate the deadline is twice of, 2 x (20 + 50) ms
    assert costs.deadline(hit, BT) == pytest.approx(0.14)
    costs.finished(9)
    costs.handed(8, {"ssd": 100})
    now[0] += 3600  # never reported: stale, behind no one
    assert costs.queued() == 0.0 and costs.worth(hit, BT) == 10


def test_the_shared_tier_s_decisions_are_counted_once_per_probe() -> None:
    """A remote hit not worth fetching is counted as the remote tier's recomputed blocks
    (the fetch decision is taken once per probe of the server; the local prefix's decision
    is counted when the request is admitted)."""
    from kvstrata.core.driver import DriverCore
    from kvstrata.core.request import RequestState
    from kvstrata.policy import TierPolicy

    costs = measured(cpu=0.001, ssd=0.002, token=0.001, remote=1.0)  # a block from the server: 1 s
    core = DriverCore(TierPolicy(PolicySpec(slab_slots=8, shared=True)), BT, costs=costs)
    st = core.open(RequestState("r", [bytes([i]) * 32 for i in range(6)]))
    assert core.worth_fetching(st, 0, 0, 6) == 0
    assert costs.decisions["remote"] == {"loaded": 0, "recomputed": 6}
    fast = measured(cpu=0.001, ssd=0.002, token=0.001, remote=0.0001)
    core = DriverCore(TierPolicy(PolicySpec(slab_slots=8, shared=True)), BT, costs=fast)
    st = core.open(RequestState("r", [bytes([i]) * 32 for i in range(6)]))
    assert core.worth_fetching(st, 0, 0, 6) == 6
    assert fast.decisions["remote"] == {"loaded": 6, "recomputed": 0}
