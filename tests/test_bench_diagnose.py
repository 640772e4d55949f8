"""The pool-size verdicts of ``kvstrata bench``: reuse-gap P90 against idle-before-evict P50
per tier, and whether a tier that is too small loses hits or only costs loads from the
tiers below it."""

from __future__ import annotations

import pytest

from kvstrata.bench.analysis import run_bench
from kvstrata.bench.diagnose import pool_check, pool_checks
from kvstrata.bench.report import build_report


@pytest.mark.parametrize("reuse, idle, evictions, held_below, verdict", [
    (5.0, 9.0, 3, False, "ok"),
    (9.0, 5.0, 3, False, "too_small"),
    (9.0, 5.0, 3, True, "too_small_held_below"),
    (9.0, 5.0, 0, True, "no_evictions"),
    (None, 5.0, 3, False, "not_enough_samples"),
])
def test_pool_check_verdicts(reuse: float | None, idle: float, evictions: int, held_below: bool,
                             verdict: str) -> None:
    assert pool_check("cpu", reuse, idle, evictions, held_below=held_below)["verdict"] == verdict


def test_the_last_tier_is_too_small_whatever_holds_below() -> None:
    """Nothing lies below the SSD tier (or the whole cache): its evictions are lost hits."""
    for scope in ("ssd", "cache"):
        check = pool_check(scope, 9.0, 5.0, 3, held_below=True)
        assert check["verdict"] == "too_small" and "evicted before they are reused" in check["message"]


def _samples(p90: float | None, p50: float | None, count: int) -> dict:
    return {"count": count, "p50": p50, "p90": p90, "p99": p90, "exact": True}


@pytest.mark.parametrize("cache_evictions, cpu_verdict", [(0, "too_small_held_below"), (7, "too_small")])
def test_a_tier_is_held_below_only_when_nothing_left_the_whole_cache(cache_evictions: int,
                                                                    cpu_verdict: str) -> None:
    reuse = {"gpu": _samples(1.0, 0.5, 9), "cpu": _samples(9.0, 4.0, 9), "ssd": _samples(2.0, 1.0, 9),
             "trace": _samples(9.0, 3.0, 9)}
    idle = {"gpu": _samples(3.0, 2.0, 9), "cpu": _samples(6.0, 5.0, 9), "ssd": _samples(None, None, 0),
            "cache": _samples(8.0 if cache_evictions else None, 8.0 if cache_evictions else None, cache_evictions)}
    pools = pool_checks(reuse, idle, {"gpu": 9, "cpu": 9, "ssd": cache_evictions})
    assert pools["cpu"]["verdict"] == cpu_verdict
    assert pools["gpu"]["verdict"] == "ok"
    assert pools["cpu"]["held_below"] is (cache_evictions == 0)


def test_the_default_workload_reports_dram_misses_as_loads_from_the_ssd_tier() -> None:
    """The built-in workload on the default deployment: the SSD tier keeps every block, so
    DRAM that evicts blocks before their reuse costs SSD loads, not hits, and says so."""
    from kvstrata.bench.deployment import default_config
    from kvstrata.bench.workloads import generate

    report = build_report(run_bench(generate("mixed", 0), default_config()))
    pools = report["diagnosis"]["pools"]
    assert pools["cache"]["verdict"] == "no_evictions" and report["hit_rate"]["ssd"] > 0
    assert pools["cpu"]["verdict"] == "too_small_held_below", pools["cpu"]
    assert any("costs loads, not hits" in m for m in report["diagnosis"]["messages"])
