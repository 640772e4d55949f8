"""The load-or-recompute decision in the drivers that measure nothing (the library and the
replay of ``kvstrata bench``): from ``load.*``'s figures, the same rule as the vLLM
connector's (kvstrata.core.costs). A tier slower than computing is not loaded; with no
figures, or ``always``, every hit is."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvstrata import KVStrataConfig, TieredKVCache
from kvstrata.bench.analysis import run_bench
from kvstrata.bench.replay import ReplayOptions
from kvstrata.cli import main
from kvstrata.trace.reader import load_trace

BS = 16
NBYTES = 4096


def figures(ssd_bandwidth: str, **more: object) -> dict[str, object]:
    # 16 tokens at 1,000 tokens/s: 16 ms to compute a block; 4 KiB at 40 KiB/s: 100 ms to read it
    return {"load.prefill_rate": 1000, "load.cpu_bandwidth": "1GiB", "load.ssd_bandwidth": ssd_bandwidth, **more}


def chat_trace(path: Path) -> Path:
    """Six system prompts of 4 blocks taken in turn: the 16-block GPU pool holds two."""
    rng = random.Random(0)
    systems = [[rng.randrange(2, 500) for _ in range(4 * BS)] for _ in range(6)]
    with open(path, "w") as fh:
        for i in range(60):
            toks = systems[i % 6] + [rng.randrange(2, 500) for _ in range(rng.randint(5, 40))]
            fh.write(json.dumps({"timestamp": i, "token_ids": toks, "output_length": 1}) + "\n")
    return path


def config(tmp: Path, **load: object) -> KVStrataConfig:
    return KVStrataConfig.from_dict({"block_size": BS, "model": {"block_nbytes": NBYTES}, "gpu": {"num_blocks": 16}},
                                    {"cpu.capacity": 0, "ssd.path": str(tmp / "ssd"), "ssd.capacity": "8MiB",
                                     **load})


def test_the_replay_computes_what_a_slow_tier_would_load_and_estimates_ttft(tmp_path: Path) -> None:
    trace = load_trace(chat_trace(tmp_path / "t.jsonl"), block_size=BS)
    slow = run_bench(trace, config(tmp_path, **figures("40KiB")), ReplayOptions(decode_s_per_token=0.0))
    measured, always = slow.load_comparison["measured"], slow.load_comparison["always"]
    assert always.hit_blocks["ssd"] > 0 and measured.hit_blocks["ssd"] == 0
    assert measured.load["decisions"]["ssd"]["recomputed"] == always.hit_blocks["ssd"]
    assert measured.load["mean_ttft_s"] < always.load["mean_ttft_s"]
    fast = run_bench(trace, config(tmp_path, **figures("1GiB")), ReplayOptions(decode_s_per_token=0.0))
    assert fast.load_comparison["measured"].hit_blocks == fast.load_comparison["always"].hit_blocks
    assert fast.load_comparison["measured"].load["mean_ttft_s"] == pytest.approx(
        fast.load_comparison["always"].load["mean_ttft_s"])
    bare = run_bench(trace, config(tmp_path), ReplayOptions(decode_s_per_token=0.0))  # no figures: nothing decided
    assert bare.load_comparison == {} and bare.replay.ttft_s is None
    assert bare.replay.hit_blocks == always.hit_blocks


def test_kvstrata_bench_prints_and_writes_the_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = chat_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    sets = [f"{k}={v}" for k, v in {**figures("40KiB"), "block_size": BS, "model.block_nbytes": NBYTES,
                                     "gpu.num_blocks": 16, "cpu.capacity": 0, "ssd.path": str(tmp_path / "ssd"),
                                     "ssd.capacity": "8MiB"}.items()]
    assert main(["bench", "--trace", str(trace), "--json", str(out), *(a for s in sets for a in ("--set", s))]) == 0
    text = capsys.readouterr().out
    assert "Load or recompute: TTFT per request" in text and "ssd 0 (" in text
    report = json.loads(out.read_text())["load_comparison"]
    assert report["measured"]["mean_ttft_s"] < report["always"]["mean_ttft_s"]
    assert report["measured"]["decisions"]["ssd"]["loaded"] == 0


def test_the_library_computes_what_a_slow_tier_would_load(tmp_path: Path) -> None:
    tokens = list(range(2, 2 + 6 * BS + 1))
    for bandwidth, expected in (("40KiB", 0), ("1GiB", 6 * BS)):
        (tmp_path / bandwidth).mkdir()
        cfg = config(tmp_path / bandwidth, **figures(bandwidth), **{"gpu.device": "cpu"})
        with TieredKVCache(cfg) as cache:
            cache.allocate("a", tokens).wait()
            cache.commit("a")
            cache.free("a")
            cache.flush()
        with TieredKVCache(cfg) as cache:  # a new cache: only the SSD tier holds the prompt
            got = cache.allocate("b", tokens)
            got.wait()
            assert got.num_cached_tokens == expected, bandwidth
            cache.free("b")
