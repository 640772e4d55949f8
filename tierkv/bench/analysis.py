"""One analysis of a trace: the miss-ratio pass plus the tiered replay."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tierkv.bench.mrc import StackPass, build_mrc
from tierkv.bench.replay import ReplayOptions, ReplayResult, replay
from tierkv.policy.spec import ADMISSIONS

if TYPE_CHECKING:
    from tierkv.bench.traces import Trace
    from tierkv.config import TierKVConfig

__all__ = ["BenchResult", "run_bench"]


@dataclass
class BenchResult:
    trace: "Trace"
    stack: StackPass
    replay: ReplayResult
    options: ReplayOptions
    timings_s: dict[str, float] = field(default_factory=dict)
    comparison: dict[str, ReplayResult] = field(default_factory=dict)  # admission mode -> replay


def run_bench(trace: "Trace", config: "TierKVConfig", options: ReplayOptions = ReplayOptions(),
              progress: Callable[[int], None] | None = None, compare_admissions: bool = False) -> BenchResult:
    """Compute the exact LRU curve of ``trace`` and replay it through the tier policy;
    with ``compare_admissions`` also replay it under every other admission mode."""
    t0 = time.perf_counter()
    stack = build_mrc(trace)
    t1 = time.perf_counter()
    result = replay(trace, config, options, progress)
    t2 = time.perf_counter()
    res = BenchResult(trace, stack, result, options, {"mrc": t1 - t0, "replay": t2 - t1})
    if compare_admissions:
        res.comparison[result.spec.admission] = result
        for mode in ADMISSIONS:
            if mode not in res.comparison:
                res.comparison[mode] = replay(trace, config, dataclasses.replace(options, admission=mode))
        res.timings_s["compare"] = time.perf_counter() - t2
    return res
