"""One analysis of a trace in one streaming pass: the miss-ratio pass plus the tiered replay.

Each request is read once (a :class:`~kvstrata.trace.reader.TraceReader` reads
the file as the pass goes) and handed to the replay of each admission mode
asked for and to the miss-ratio pass; nothing is kept per request, so memory
follows the trace's distinct blocks, and time its block accesses.

The miss-ratio pass takes requests in batches. When a second CPU is free
(and ``fork`` exists), once the trace has passed ``_PARALLEL_MIN_ACCESSES``
accesses the pass moves to a forked child (taking its state so far with it)
and the batches follow through a pipe, so it runs beside the replay. A
process running other threads (a payload replay's SSD writer) is not
forked: the pass then stays here. The
curve is the same either way. A trace may be a pipe that cannot be read
twice, so if that child dies the analysis fails, saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kvstrata.bench.budget import cores
from kvstrata.bench.mrc import BATCH_ACCESSES, CurvePass, RequestBatch, StackPass
from kvstrata.bench.replay import ReplayError, ReplayOptions, ReplayResult, Replayer, replaying, requests_of
from kvstrata.config.load import LOAD_POLICIES
from kvstrata.policy.spec import ADMISSIONS

if TYPE_CHECKING:
    from kvstrata.trace.reader import Request, Trace, TraceInfo, TraceReader
    from kvstrata.config.schema import KVStrataConfig

__all__ = ["BenchResult", "run_bench"]

_PARALLEL_MIN_ACCESSES = 50_000  # below this the fork costs more than it saves


@dataclass
class BenchResult:
    trace: "TraceInfo"
    stack: StackPass
    replay: ReplayResult
    options: ReplayOptions
    timings_s: dict[str, float] = field(default_factory=dict)
    comparison: dict[str, ReplayResult] = field(default_factory=dict)  # admission mode -> replay
    load_comparison: dict[str, ReplayResult] = field(default_factory=dict)  # load.policy -> replay (with figures)


def run_bench(trace: "Trace | TraceReader", config: "KVStrataConfig", options: ReplayOptions = ReplayOptions(),
              progress: Callable[[int], None] | None = None, compare_admissions: bool = False,
              parallel: bool = True) -> BenchResult:
    """Compute the exact LRU curve of ``trace`` and replay it through the tier policy, in one
    pass; with ``compare_admissions`` also replay it under every other admission mode in the
    same pass. With ``load.prefill_rate`` given, also replay it under the other ``load.policy``
    (the TTFT each estimates from ``load.*``'s figures). ``progress(requests done)`` is
    called every 256 requests; ``parallel=False`` keeps the miss-ratio pass in this process."""
    t0 = time.perf_counter()
    requests = requests_of(trace)
    first = next(requests, None)
    block_size = trace.block_size
    curve = _CurveFeed(block_size, parallel)
    with contextlib.ExitStack() as opened:
        modes = _modes(config, options, compare_admissions)
        loads = _load_modes(config, options)
        replayers = [opened.enter_context(replaying(config, block_size, opts)) for opts in [*modes, *loads]]
        try:
            _pass(itertools.chain(() if first is None else (first,), requests), replayers, curve, progress)
            stack = curve.result()
        finally:
            curve.close()
    results = [rp.result for rp in replayers if rp.result is not None]
    res = BenchResult(trace.info, stack, results[0], options, _timings(time.perf_counter() - t0, results, curve))
    if compare_admissions:
        res.comparison = {r.spec.admission: r for r in results[:len(modes)]}
    if loads and results[0].ttft_s is not None:
        res.load_comparison = {options.load_policy or config.load.policy: results[0],
                               **{o.load_policy: r for o, r in zip(loads, results[len(modes):])}}
    return res


def _modes(config: "KVStrataConfig", options: ReplayOptions, compare: bool) -> list[ReplayOptions]:
    """``options``, then (with ``compare``) the same with each other admission mode."""
    first = options.admission or config.spill.admission
    others = [m for m in ADMISSIONS if compare and m != first]
    return [options, *(dataclasses.replace(options, admission=m) for m in others)]


def _load_modes(config: "KVStrataConfig", options: ReplayOptions) -> list[ReplayOptions]:
    """With figures to decide from (``load.prefill_rate``), ``options`` under the other ``load.policy``."""
    if config.load.prefill_rate is None:
        return []
    first = options.load_policy or config.load.policy
    return [dataclasses.replace(options, load_policy=p) for p in LOAD_POLICIES if p != first]


def _pass(requests: Iterator["Request"], replayers: list[Replayer], curve: "_CurveFeed",
          progress: Callable[[int], None] | None) -> None:
    for n, r in enumerate(requests, 1):
        for rp in replayers:
            rp.step(r)
        curve.add(r)
        if progress is not None and n & 255 == 0:
            progress(n)


def _timings(wall: float, results: list[ReplayResult], curve: "_CurveFeed") -> dict[str, float]:
    replay_s = results[0].wall_s
    compare_s = sum(r.wall_s for r in results[1:])
    here = replay_s + compare_s + curve.here_s
    out = {"load": max(0.0, wall - here), "mrc": curve.seconds, "replay": replay_s, "analysis": wall}
    if len(results) > 1:
        out["compare"] = compare_s
    return out


class _CurveFeed:
    """Batches requests for the miss-ratio pass, here or in a forked child (see the module docstring)."""

    def __init__(self, block_size: int, parallel: bool) -> None:
        self.local: CurvePass | None = CurvePass(block_size)
        self.batch = RequestBatch()
        self.parallel = parallel and _spare_cores()
        self.fed = 0
        self.conn: Any = None
        self.child: Any = None
        self.child_pid: int | None = None
        self.seconds = 0.0   # measuring, wherever it ran
        self.here_s = 0.0    # spent in this process: measuring before the fork, sending after

    def add(self, r: "Request") -> None:
        self.batch.add(r)
        if len(self.batch) >= BATCH_ACCESSES:
            self._flush()

    def _flush(self) -> None:
        batch, self.batch = self.batch, RequestBatch()
        if not len(batch):
            return
        self.fed += len(batch)
        if self.conn is None and self.parallel and self.fed >= _PARALLEL_MIN_ACCESSES:
            if threading.active_count() == 1:  # never fork a process whose other threads may hold locks
                self._fork()
            self.parallel = False
        t0 = time.perf_counter()
        if self.conn is not None:
            if self.conn.poll():  # the child only answers early to report a failure
                raise ReplayError(self._failure())
            self._send(batch.arrays())
        else:
            assert self.local is not None
            self.local.add(batch)
        self.here_s += time.perf_counter() - t0

    def _fork(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe(duplex=True)
        self.child = ctx.Process(target=_curve_child, args=(self.local, there, here), daemon=True)
        self.child.start()
        there.close()
        self.conn, self.child_pid, self.local = here, self.child.pid, None

    def _send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise ReplayError(self._failure()) from None

    def result(self) -> StackPass:
        self._flush()
        if self.conn is None:
            assert self.local is not None
            out = self.local.result()
            self.seconds = out.seconds
            self.here_s = out.seconds
            return out
        self._send(None)
        try:
            status, got = self.conn.recv()
        except (EOFError, OSError):
            raise ReplayError(self._failure()) from None
        if status != "ok":
            raise ReplayError(f"the miss-ratio pass failed in its process: {got}")
        self.seconds = got.seconds
        return got

    def _failure(self) -> str:
        """Why the child stopped: the error it reported, or how it ended."""
        try:
            if self.conn.poll(0):
                status, got = self.conn.recv()
                if status == "error":
                    return f"the miss-ratio pass failed in its process: {got}"
        except (EOFError, OSError):
            pass
        self.child.join(5)
        code = self.child.exitcode
        why = "killed (most likely out of memory)" if code is not None and code < 0 else f"exit status {code}"
        return (f"the miss-ratio pass (process {self.child_pid}) ended without a result: {why}; "
                "--max-distinct-blocks stops a trace too large for this machine's memory before that")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.child is not None:
            self.child.join(1)
            if self.child.is_alive():
                self.child.terminate()
                self.child.join()
            self.child = None


def _curve_child(cp: CurvePass, conn: Any, parent_end: Any) -> None:
    parent_end.close()
    try:
        while (msg := conn.recv()) is not None:
            cp.add_arrays(*msg)
        out = cp.result()
        out.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        conn.send(("ok", out))
    except EOFError:  # the parent went away
        pass
    except BaseException as e:  # reported to the parent, which stops at its next batch
        conn.send(("error", f"{type(e).__name__}: {e}"))
        _drain(conn)
    finally:
        conn.close()


def _drain(conn: Any) -> None:
    """Read and drop the parent's batches up to its end mark (or until it goes away)."""
    try:
        while conn.recv() is not None:
            pass
    except (EOFError, OSError):
        pass


def _spare_cores() -> bool:
    """Can the miss-ratio pass run in a forked child beside the replay (fork, and two cores)?"""
    return hasattr(os, "fork") and cores() >= 2
