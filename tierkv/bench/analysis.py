"""One analysis of a trace: the miss-ratio pass plus the tiered replay."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tierkv.bench.mrc import StackPass, build_mrc
from tierkv.bench.replay import ReplayOptions, ReplayResult, replay

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


def run_bench(trace: "Trace", config: "TierKVConfig", options: ReplayOptions = ReplayOptions(),
              progress: Callable[[int], None] | None = None) -> BenchResult:
    """Compute the exact LRU curve of ``trace`` and replay it through the tiered cache."""
    t0 = time.perf_counter()
    stack = build_mrc(trace)
    t1 = time.perf_counter()
    result = replay(trace, config, options, progress)
    t2 = time.perf_counter()
    return BenchResult(trace, stack, result, options, {"mrc": t1 - t0, "replay": t2 - t1})
