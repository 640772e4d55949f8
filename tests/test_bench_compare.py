"""``kvstrata bench --compare``: every eviction x admission at several capacities, reproducible row by row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.bench.compare import ALPHAS, capacity_points, compare
from kvstrata.bench.optimal import belady_hits
from kvstrata.bench.workloads import generate
from kvstrata.cli.commands import main
from kvstrata.config.schema import KVStrataConfig
from kvstrata.system.values import EVICTIONS, TIER_ADMISSIONS

SCALE = "0.3"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    where = tmp_path_factory.mktemp("compare")
    out, png = where / "cmp.json", where / "cmp.png"
    assert main(["bench", "--compare", "--scale", SCALE, "--quiet", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot was drawn
    return json.loads(out.read_text())


def test_every_eviction_and_admission_at_three_capacities(report: dict) -> None:
    rows = report["compare"]
    points = {(r["cpu_blocks"], r["ssd_blocks"]) for r in rows}
    assert len(points) == 3
    policies = [r for r in rows if r["eviction"] != "optimal"]
    assert {(r["eviction"], r["admission"]) for r in policies} == {(e, a) for e in EVICTIONS for a in TIER_ADMISSIONS}
    assert len(policies) == 3 * len(EVICTIONS) * len(TIER_ADMISSIONS)
    for r in rows:
        assert {"eviction", "admission", "cpu_blocks", "ssd_blocks", "set", "hit_rate", "ssd_bytes_written"} <= set(r)
        assert 0 <= r["hit_rate"] <= 1
    # second_hit writes less to the SSD tier than always, at the same point and eviction
    by = {(r["cpu_blocks"], r["eviction"], r["admission"]): r for r in policies}
    for (cpu, ev, adm), r in by.items():
        if adm == "second_hit":
            assert r["ssd_bytes_written"] < by[cpu, ev, "always"]["ssd_bytes_written"]


def test_cost_rows_name_the_weight_replaying_the_first_quarter_chose(report: dict) -> None:
    cost = [r for r in report["compare"] if r["eviction"] == "cost"]
    assert len(cost) == 3 * len(TIER_ADMISSIONS)
    for r in cost:
        assert r["alpha"] in ALPHAS and f"cpu.eviction=cost:{r['alpha']:g}" in r["set"]
        assert r["prefill_flops_saved"] > 0
    others = [r for r in report["compare"] if r["eviction"] not in ("cost", "optimal")]
    assert all(r["alpha"] is None and r["prefill_flops_saved"] > 0 for r in others)


@pytest.mark.parametrize("which", [0, 6, 15, 23])  # lru, and cost at each end
def test_a_rows_set_reproduces_its_hit_rate_in_a_plain_run(report: dict, tmp_path: Path, which: int) -> None:
    row = [r for r in report["compare"] if r["eviction"] != "optimal"][which]
    out = tmp_path / "plain.json"
    args = ["bench", "--scale", SCALE, "--quiet", "--json", str(out)]
    for s in row["set"]:
        args += ["--set", s]
    assert main(args) == 0
    plain = json.loads(out.read_text())
    assert plain["hit_rate"]["total"] == pytest.approx(row["hit_rate"], abs=1e-6)


def test_capacity_points_are_fractions_of_the_working_set() -> None:
    assert capacity_points(1000) == [(25, 100), (62, 250), (125, 500)]
    assert capacity_points(10) == [(1, 4), (1, 5)]  # a small trace: fewer, smaller points, none repeated


@pytest.mark.long
def test_forked_workers_replay_the_same_rows_as_one_process() -> None:
    trace = generate(scale=0.1)
    cfg = KVStrataConfig.from_dict({})
    timing = ("policy_ns_per_op", "replay_s")
    one, two = (compare(trace, cfg, workers=n) for n in (1, 2))
    assert two["workers"] == 2
    assert [{k: v for k, v in r.items() if k not in timing} for r in one["rows"]] == \
        [{k: v for k, v in r.items() if k not in timing} for r in two["rows"]]


def test_given_points_are_replayed_as_given() -> None:
    trace = generate(scale=0.1)
    cfg = KVStrataConfig.from_dict({})
    got = compare(trace, cfg, points=[(8, 64)])
    assert {(r["cpu_blocks"], r["ssd_blocks"]) for r in got["rows"]} == {(8, 64)}


@pytest.mark.parametrize("flag", [["--explain"], ["--admission", "both"], ["--payload"]])
def test_compare_refuses_flags_it_does_not_run(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--compare", "--scale", "0.05", *flag]) != 0
    err = capsys.readouterr().err
    assert "not with --compare" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- the optimum

def brute_force_hits(accesses: list[int], capacity: int) -> int:
    """The most hits any cache of ``capacity`` blocks gets: every admit/evict choice tried."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i: int, cached: frozenset) -> int:
        if i == len(accesses):
            return 0
        b = accesses[i]
        if b in cached:
            return 1 + best(i + 1, cached)
        options = [best(i + 1, cached)]  # bypass
        if len(cached) < capacity:
            options.append(best(i + 1, cached | {b}))
        else:
            options += [best(i + 1, (cached - {v}) | {b}) for v in cached]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(accesses=st.lists(st.integers(0, 6), max_size=12), capacity=st.integers(0, 4))
def test_belady_is_the_optimum(accesses: list[int], capacity: int) -> None:
    assert belady_hits(accesses, [capacity])[capacity] == brute_force_hits(accesses, capacity)


def test_the_optimum_bounds_every_policy_at_every_point(report: dict) -> None:
    rows = report["compare"]
    optimal = {(r["cpu_blocks"], r["ssd_blocks"]): r["hit_rate"] for r in rows if r["eviction"] == "optimal"}
    assert len(optimal) == 3
    for r in rows:
        assert r["hit_rate"] <= optimal[r["cpu_blocks"], r["ssd_blocks"]] + 1e-9, r


def test_a_comparison_that_would_not_fit_the_memory_is_refused_before_it_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--compare", "--scale", "0.1", "--max-memory", "1MiB"]) != 0
    err = capsys.readouterr().err
    assert "--compare: replaying its 24 rows" in err and "more than --max-memory 1.0 MiB" in err


@pytest.mark.parametrize("args, message", [
    (["--set", "ssd.path=null"], "--compare: the SSD tier is off"),
    (["--set", "remote.url=redis://127.0.0.1:1/0", "--set", "remote.capacity=1GiB"],
     "--compare: compares this replica's own tiers"),
    (["--replicas", "2"], "--replicas: not with --compare"),
    (["--plot", "cmp.txt"], "--plot: cmp.txt: unsupported format 'txt'"),
])
def test_compare_refuses_what_it_cannot_compare(args: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--compare", "--scale", "0.05", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_rejected_requests_are_said_and_counted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    assert main(["bench", "--compare", "--scale", "0.05", "--set", "gpu.num_blocks=1", "--json", str(out)]) == 0
    assert "rejected in every row (larger than the GPU pool)" in capsys.readouterr().out
    assert json.loads(out.read_text())["rejected_requests"] > 0


def test_a_trace_of_requests_without_blocks_counts_no_distinct_block(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 8, "output_length": 1, "hash_ids": []})
                             + "\n" for i in range(3)))
    out = tmp_path / "c.json"
    assert main(["bench", "--compare", "--trace", str(trace), "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["distinct_blocks"] == 0
