"""One analysis of a trace: the miss-ratio pass plus the tiered replay.

The two are independent: when a second CPU is free (and ``fork`` exists), the
miss-ratio pass runs in a forked child while this process replays, and its
result comes back through a pipe. Without one, or if the child fails, the pass
runs here. The curve is the same either way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tierkv.bench.mrc import StackPass, build_mrc
from tierkv.bench.replay import ReplayOptions, ReplayResult, replay
from tierkv.policy.spec import ADMISSIONS

if TYPE_CHECKING:
    from tierkv.bench.traces import Trace
    from tierkv.config import TierKVConfig

__all__ = ["BenchResult", "run_bench"]

_PARALLEL_MIN_ACCESSES = 50_000  # below this the fork costs more than it saves


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
    curve = _curve_alongside(trace)
    result = replay(trace, config, options, progress)
    stack, curve_s = curve()
    t2 = time.perf_counter()
    res = BenchResult(trace, stack, result, options, {"mrc": curve_s, "replay": result.wall_s, "analysis": t2 - t0})
    if compare_admissions:
        res.comparison[result.spec.admission] = result
        for mode in ADMISSIONS:
            if mode not in res.comparison:
                res.comparison[mode] = replay(trace, config, dataclasses.replace(options, admission=mode))
        res.timings_s["compare"] = time.perf_counter() - t2
    return res


def _timed_curve(trace: "Trace") -> tuple[StackPass, float]:
    t0 = time.perf_counter()
    stack = build_mrc(trace)
    return stack, time.perf_counter() - t0


def _curve_alongside(trace: "Trace") -> Callable[[], tuple[StackPass, float]]:
    """Start the miss-ratio pass; the returned function yields ``(result, seconds it took)``."""
    if trace.num_accesses < _PARALLEL_MIN_ACCESSES or not _spare_cpu():
        done = _timed_curve(trace)
        return lambda: done
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_curve_child, args=(trace, send), daemon=True)
    child.start()
    send.close()

    def result() -> tuple[StackPass, float]:
        try:
            got: Any = recv.recv()
        except (EOFError, OSError):
            got = None
        finally:
            recv.close()
            child.join()
        return got if got is not None else _timed_curve(trace)

    return result


def _curve_child(trace: "Trace", send: Any) -> None:
    try:
        send.send(_timed_curve(trace))
    except BaseException:  # the parent computes the curve itself
        send.send(None)
    finally:
        send.close()


def _spare_cpu() -> bool:
    if not hasattr(os, "fork"):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except AttributeError:
        return (os.cpu_count() or 1) >= 2
