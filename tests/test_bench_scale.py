"""`kvstrata bench` at scale: one streaming pass whose memory follows the trace's distinct blocks, not its
accesses or requests; results equal to the exact in-memory computation; bounded summaries within their
stated error; traces too large for memory refused before they run it out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.bench import analysis
from kvstrata.bench.analysis import run_bench
from kvstrata.bench.deployment import default_config
from kvstrata.bench.mrc import CurvePass, RequestBatch, build_mrc
from kvstrata.bench.replay import ReplayError, ReplayOptions, replay, replaying
from kvstrata.bench.stackdist import StackDistances
from kvstrata.bench.stats import RELATIVE_ERROR, Quantiles
from kvstrata.trace.reader import Request, TraceError, TraceReader, load_trace
from kvstrata.config.schema import KVStrataConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")


def cfg(tmp_path: Path, *, gpu: int = 16, cpu: int = 32, ssd: int = 64) -> KVStrataConfig:
    """Block size 4 tokens, 1 KiB per block; capacities in blocks."""
    return KVStrataConfig.from_dict({
        "block_size": 4, "model": {"block_nbytes": 1024}, "gpu": {"num_blocks": gpu},
        "cpu": {"capacity": cpu * 1024}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": ssd * 1024}})


def chat_requests(n_requests: int, distinct: int, seed: int = 0) -> list[Request]:
    """One a second: first every block 0..distinct-1 in prompts of 8, then prompts of 1-8 consecutive
    blocks from a random start."""
    rng = np.random.default_rng(seed)
    reqs = [Request(float(i), list(range(s, min(s + 8, distinct))), 32, 4, min(8, distinct - s))
            for i, s in enumerate(range(0, distinct, 8))][:n_requests]
    for i in range(len(reqs), n_requests):
        start = int(rng.integers(0, distinct))
        n = int(rng.integers(1, 9))
        blocks = [(start + j) % distinct for j in range(n)]
        reqs.append(Request(float(i), blocks, 4 * n, int(rng.integers(0, 50)), n))
    return reqs


def write_mooncake(path: Path, requests: list[Request]) -> Path:
    with open(path, "w") as fh:
        for r in requests:
            fh.write(json.dumps({"timestamp": int(1000 * r.timestamp), "input_length": 512 * len(r.blocks),
                                 "output_length": r.output_length, "hash_ids": r.blocks}) + "\n")
    return path


# ------------------------------------------------------------------ stack distances


def plain_distances(accesses: list[int]) -> list[int]:
    """Reference: distinct blocks between consecutive accesses, by brute force."""
    out = []
    for t, b in enumerate(accesses):
        prev = [i for i in range(t) if accesses[i] == b]
        out.append(len(set(accesses[prev[-1] + 1:t])) if prev else -1)
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=80), st.integers(2, 9), st.integers(1, 7))
def test_stack_distances_are_exact_across_compactions(accesses: list[int], min_slots: int, chunk: int) -> None:
    sd = StackDistances(min_slots)   # a few slots: the structure compacts and grows many times
    got: list[int] = []
    for i in range(0, len(accesses), chunk):
        got += sd.feed(accesses[i:i + chunk])
    assert got == plain_distances(accesses)
    assert sd.distinct == len(set(accesses))


def test_stack_memory_follows_distinct_blocks_not_accesses() -> None:
    rng = np.random.default_rng(1)

    def retained(n: int, distinct: int) -> int:
        sd = StackDistances()
        sd.feed(list(range(distinct)))
        sd.feed(rng.integers(0, distinct, n).tolist())
        return sd.retained_bytes()

    small, long = retained(20_000, 5_000), retained(400_000, 5_000)
    assert long == small, (small, long)
    assert retained(20_000, 200_000) > 4 * small   # what it does hold grows with distinct blocks


# ------------------------------------------------------------------ memory of a whole pass


def curve_retained(requests: list[Request]) -> int:
    cp = CurvePass(4)
    batch = RequestBatch()
    for r in requests:
        batch.add(r)
        if len(batch) >= 4096:
            cp.add(batch)
            batch = RequestBatch()
    cp.add(batch)
    return cp.retained_bytes()


def test_curve_pass_memory_follows_distinct_blocks_not_accesses() -> None:
    base = curve_retained(chat_requests(5_000, 2_000))
    longer = curve_retained(chat_requests(100_000, 2_000))         # 20x the accesses, same blocks
    assert longer <= base + 64 * 1024, (base, longer)
    assert curve_retained(chat_requests(5_000, 40_000)) > 2 * base  # it does grow with distinct blocks


def replay_retained(tmp_path: Path, requests: list[Request]) -> int:
    with replaying(cfg(tmp_path), 4) as rp:
        for r in requests:
            rp.step(r)
    assert rp.result is not None and rp.result.accesses == sum(len(r.blocks) for r in requests)
    assert rp.result.request_hits == []   # nothing per request unless record_requests
    return rp.tracker.retained_bytes() + sum(lc.retained_bytes() for lc in rp.lifecycle.values())


@pytest.mark.long
def test_replay_memory_follows_distinct_blocks_not_accesses(tmp_path: Path) -> None:
    base = replay_retained(tmp_path, chat_requests(5_000, 2_000))
    longer = replay_retained(tmp_path, chat_requests(100_000, 2_000))
    assert longer <= base + 256 * 1024, (base, longer)


def test_reader_keeps_no_request_and_one_id_per_distinct_block(tmp_path: Path) -> None:
    reqs = chat_requests(3_000, 500)
    reader = TraceReader(write_mooncake(tmp_path / "t.jsonl", reqs))
    seen = [list(r.blocks) for r in reader]
    builder = reader._loader.builder
    assert builder is not None and builder.requests == [] and builder.last is None
    assert len(builder.ids) == 500 == reader.info.num_distinct_blocks == reader.info.id_bound
    assert sorted({b for blocks in seen for b in blocks}) == list(range(500))   # dense ids, no gaps
    assert (reader.info.num_requests, reader.info.num_accesses) == (3_000, sum(map(len, seen)))


def test_dense_ids_do_not_grow_with_repeated_accesses(tmp_path: Path) -> None:
    """Ids are 0..distinct-1 whatever the number of accesses (arrays indexed by them stay that size)."""
    tr = load_trace(write_mooncake(tmp_path / "t.jsonl", chat_requests(2_000, 50)))
    assert tr.id_bound == tr.num_distinct_blocks == 50
    assert max(b for r in tr.requests for b in r.blocks) == 49


def peak_rss_kib(trace: Path) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "bench", "--trace", str(trace), "--quiet"],
                            cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read() if proc.stderr else ""
    return usage.ru_maxrss


@pytest.mark.long
def test_bench_peak_memory_does_not_grow_with_accesses(tmp_path: Path) -> None:
    """10x the requests over the same blocks: the previous analysis kept ~400 bytes per access
    (100 MB more here); a streaming one keeps what the blocks need."""
    blocks = 20_000
    small = write_mooncake(tmp_path / "small.jsonl", chat_requests(8_000, blocks))
    large = write_mooncake(tmp_path / "large.jsonl", chat_requests(80_000, blocks, seed=1))
    base, grown = peak_rss_kib(small), peak_rss_kib(large)
    assert grown < base + 20 * 1024, (base, grown)


# ------------------------------------------------------------------ same results


def strip(report: dict) -> dict:
    drop = ("timings_s", "peak_rss_bytes", "wall_s")
    return {k: strip(v) if isinstance(v, dict) else v for k, v in report.items() if k not in drop}


@pytest.mark.parametrize("name, block_size", [("small_mooncake.jsonl", 4), ("small_qwen.jsonl", None),
                                              ("small_kvstrata.jsonl", 4), ("tiers.jsonl", 4)])
def test_streamed_analysis_equals_the_in_memory_one(tmp_path: Path, name: str, block_size: int | None) -> None:
    from kvstrata.bench.report import build_report

    config = cfg(tmp_path, gpu=8, cpu=2, ssd=4)
    path = DATA / name
    streamed = run_bench(TraceReader(path, block_size=block_size), config)
    in_memory = run_bench(load_trace(path, block_size=block_size), config)
    assert strip(build_report(streamed)) == strip(build_report(in_memory))


def test_curve_of_a_reader_equals_the_curve_of_the_loaded_trace(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", chat_requests(20_000, 3_000))
    a, b = build_mrc(TraceReader(path)), build_mrc(load_trace(path))
    assert np.array_equal(a.mrc.cumulative, b.mrc.cumulative)
    assert a.reuse_gaps.summary() == b.reuse_gaps.summary() and a.distinct_blocks == 3_000


def test_admission_modes_in_one_pass_equal_separate_replays(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path / "t.jsonl", chat_requests(3_000, 400)))
    config = cfg(tmp_path, gpu=24, cpu=40, ssd=80)
    both = run_bench(trace, config, compare_admissions=True)
    assert set(both.comparison) == {"on_compute", "on_evict"}
    for mode, got in both.comparison.items():
        alone = replay(trace, config, ReplayOptions(admission=mode))
        assert (got.hit_blocks, got.miss_reasons, got.stats["spills"]) == \
            (alone.hit_blocks, alone.miss_reasons, alone.stats["spills"])


@pytest.fixture
def single_threaded() -> None:
    """The analysis forks its miss-ratio child only from a process with no other thread
    (a thread may hold a lock at the fork). Tests that ran earlier in this process may have
    left tqdm's monitor thread (vLLM's progress bars start it): stop it, then require that
    no other thread is left."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm
        from tqdm._monitor import TMonitor

        tqdm.monitor_interval = 0  # none again (every tqdm subclass reads this)
        for monitor in [t for t in threading.enumerate() if isinstance(t, TMonitor)]:
            monitor.exit()  # stops and joins it
    assert threading.active_count() == 1, f"other threads alive: {threading.enumerate()}"


@pytest.mark.skipif(not analysis._spare_cores(), reason="the miss-ratio child needs a second CPU and fork")
@pytest.mark.usefixtures("single_threaded")
def test_curve_in_a_child_process_equals_the_curve_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(write_mooncake(tmp_path / "t.jsonl", chat_requests(4_000, 700)))
    here = run_bench(trace, cfg(tmp_path), parallel=False)
    monkeypatch.setattr(analysis, "_PARALLEL_MIN_ACCESSES", 1)
    monkeypatch.setattr(analysis, "BATCH_ACCESSES", 512)   # many batches through the pipe
    child = run_bench(trace, cfg(tmp_path))
    assert here.stack.peak_rss_bytes is None and child.stack.peak_rss_bytes
    assert np.array_equal(here.stack.mrc.cumulative, child.stack.mrc.cumulative)
    assert here.stack.reuse_gaps.summary() == child.stack.reuse_gaps.summary()
    assert here.replay.hit_blocks == child.replay.hit_blocks


@pytest.mark.skipif(not analysis._spare_cores(), reason="the miss-ratio child needs a second CPU and fork")
@pytest.mark.parametrize("how, message", [("raise", "failed in its process: RuntimeError: boom"),
                                          ("kill", "killed (most likely out of memory)")])
@pytest.mark.usefixtures("single_threaded")
def test_a_failed_curve_child_fails_the_analysis_with_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               how: str, message: str) -> None:
    parent = os.getpid()
    real = CurvePass.add_arrays

    def add_arrays(self: CurvePass, *arrays: bytes) -> None:
        if os.getpid() != parent:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("boom")
        real(self, *arrays)

    monkeypatch.setattr(CurvePass, "add_arrays", add_arrays)
    monkeypatch.setattr(analysis, "_PARALLEL_MIN_ACCESSES", 1)
    monkeypatch.setattr(analysis, "BATCH_ACCESSES", 512)
    trace = load_trace(write_mooncake(tmp_path / "t.jsonl", chat_requests(2_000, 300)))
    with pytest.raises(ReplayError, match="miss-ratio pass") as exc:
        run_bench(trace, cfg(tmp_path))
    assert message in str(exc.value)


# The previous analysis (every request and access kept, exact percentiles of every sample) on the
# Mooncake conversation trace and the default deployment: these values must not move.
MOONCAKE_REPORT = {
    "hit_rate": {"gpu": 0.042534, "cpu": 0.002887, "ssd": 0.220135, "total": 0.265556},
    "ideal_hit_rate": 0.366412,
    "reuse_gap_s": (113.999, 519.0, 1578.0),
    "lifetime_s": (246.0, 357.0, 674.999),  # 677.999 before CPU hits refreshed the SSD copy
    "idle_before_evict_s": (242.999, 260.999, 267.0),
    "gpu_idle_before_evict_s": (3.0, 9.0, 30.0),
}


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_report_equals_the_previous_exact_computation() -> None:
    from kvstrata.bench.report import build_report

    r = build_report(run_bench(TraceReader(MOONCAKE), default_config()))
    want = MOONCAKE_REPORT
    assert r["hit_rate"] == want["hit_rate"] and r["ideal_hit_rate"] == want["ideal_hit_rate"]
    for what in ("reuse_gap_s", "lifetime_s", "idle_before_evict_s"):
        assert (r[what]["p50"], r[what]["p90"], r[what]["p99"]) == want[what] and r[what]["exact"]
    gpu = r["idle_before_evict_s"]["tiers"]["gpu"]
    assert (gpu["p50"], gpu["p90"], gpu["p99"]) == want["gpu_idle_before_evict_s"]
    assert (r["requests"], r["block_accesses"], r["distinct_blocks"]) == (12031, 288500, 182790)


# ------------------------------------------------------------------ bounded summaries


FLOATS = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(FLOATS, st.sampled_from([0.0, 1.0, 2.5])), min_size=1, max_size=300),
       st.integers(1, 5))
def test_quantiles_are_numpys_percentiles_while_exact(samples: list[float], parts: int) -> None:
    q = Quantiles()
    for part in np.array_split(np.asarray(samples), parts):
        q.add(part)
    ps = [0, 1, 50, 90, 99, 100]
    assert q.exact and q.count == len(samples)
    assert q.quantiles(np.asarray(ps) / 100) == pytest.approx(np.percentile(samples, ps), rel=1e-12, abs=1e-12)
    assert sorted(q) == sorted(samples)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(1e-6, 1e9), st.just(0.0)), min_size=1, max_size=400), st.integers(1, 20))
def test_sketched_quantiles_stay_within_the_relative_error(samples: list[float], limit: int) -> None:
    q = Quantiles(exact_limit=limit)
    for part in np.array_split(np.asarray(samples), 3):
        q.add(part)
    ps = np.array([0, 10, 50, 90, 99, 100])
    exact = np.percentile(samples, ps)
    got = q.quantiles(ps / 100)
    assert np.all(np.abs(got - exact) <= RELATIVE_ERROR * exact * (1 + 1e-9) + 1e-12), (got, exact)
    assert q.exact == (len(set(samples)) <= limit)


def test_sketch_memory_is_bounded_by_the_range_of_values() -> None:
    rng = np.random.default_rng(0)
    q = Quantiles()
    for _ in range(20):
        q.add(rng.uniform(0.001, 86_400, 100_000))   # 2M distinct values from a millisecond to a day
    assert not q.exact and q.count == 2_000_000
    assert q.retained_bytes() <= 8 * 10_000                  # ln(8.64e7) / ln((1 + a) / (1 - a)) counters
    assert q.quantiles([0.5])[0] == pytest.approx(43_200, rel=0.01)


def test_merging_quantiles_equals_adding_every_sample() -> None:
    rng = np.random.default_rng(3)
    a_s, b_s = rng.exponential(10, 5000), rng.exponential(100, 7000)
    for limit in (10, 1 << 16):
        a, b, both = Quantiles(limit), Quantiles(limit), Quantiles(limit)
        a.add(a_s)
        b.add(b_s)
        both.add(np.concatenate((a_s, b_s)))
        a.merge(b)
        assert a.count == both.count and a.summary() == both.summary()


# ------------------------------------------------------------------ streaming and bad input


def test_requests_come_out_as_their_lines_arrive_from_a_pipe() -> None:
    """The reader hands out a request before the writer has written the rest: nothing is read ahead whole."""
    r, w = os.pipe()
    wrote_rest = threading.Event()
    line = b'{"timestamp": %d, "hash_ids": [1, 2, %d]}\n'

    def feed() -> None:
        with os.fdopen(w, "wb", buffering=0) as fh:
            fh.write(line % (0, 3))
            got_first.wait(10)
            fh.write(b"".join(line % (i, i + 3) for i in range(1, 1000)))
            wrote_rest.set()

    got_first = threading.Event()
    writer = threading.Thread(target=feed)
    writer.start()
    try:
        requests = iter(TraceReader(f"/dev/fd/{r}"))
        first = next(requests)
        assert not wrote_rest.is_set() and first.blocks == [0, 1, 2]
        got_first.set()
        assert sum(1 for _ in requests) == 999
    finally:
        got_first.set()
        writer.join()
        os.close(r)


def test_a_reader_is_read_once(tmp_path: Path) -> None:
    reader = TraceReader(DATA / "small_mooncake.jsonl")
    assert len(list(reader)) == 4
    with pytest.raises(TraceError, match="read once"):
        iter(reader)


def test_too_many_distinct_blocks_stops_the_pass_at_the_line_that_crossed(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", [Request(float(i), [2 * i, 2 * i + 1], 8, 0, 2) for i in range(10)])
    with pytest.raises(TraceError, match=rf"^{path}:4: more than 7 distinct blocks \(--max-distinct-blocks\)"):
        list(TraceReader(path, max_distinct_blocks=7, skip_bad_lines=True))   # not a bad line: fatal
    assert len(list(TraceReader(path, max_distinct_blocks=20))) == 10
    asked: list[tuple[str, int]] = []
    list(TraceReader(path, max_distinct_blocks=lambda fmt, bs: asked.append((fmt, bs)) or None))
    assert asked == [("mooncake", 512)]


def test_default_limit_follows_available_memory_and_the_trace_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstrata.bench import budget

    monkeypatch.setattr(budget, "available_memory_bytes", lambda: 8 << 30)
    hashes, tokens = budget.default_max_distinct_blocks("mooncake", 512), budget.default_max_distinct_blocks(
        "kvstrata", 16)
    assert hashes * budget.BYTES_PER_DISTINCT_BLOCK <= 0.8 * (8 << 30) and hashes > 20_000_000
    assert tokens < hashes
    monkeypatch.setattr(budget, "available_memory_bytes", lambda: None)
    assert budget.default_max_distinct_blocks() is None


def test_one_pass_does_not_build_a_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_bench` on a reader never materialises the request list (load_trace is not involved)."""
    from kvstrata.trace import reader as traces

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the whole trace was built")

    monkeypatch.setattr(traces.TraceBuilder, "build", refuse)
    res = run_bench(TraceReader(write_mooncake(tmp_path / "t.jsonl", chat_requests(500, 80))), cfg(tmp_path))
    assert res.trace.num_requests == 500 and res.replay.requests == 500
