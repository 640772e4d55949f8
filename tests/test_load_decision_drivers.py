"""The load-or-recompute decision in the drivers that measure nothing (the library and the
replay of ``kvstrata bench``): from ``load.*``'s figures, the same rule as the vLLM
connector's (kvstrata.core.costs). A tier slower than computing is not loaded; with no
figures, or ``always``, every hit is."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from kvstrata import KVStrataConfig, TieredKVCache
from kvstrata.bench.analysis import run_bench
from kvstrata.bench.deployment import recorded_config, recorded_deployment, recorded_load
from kvstrata.bench.replay import ReplayOptions
from kvstrata.cli.commands import main
from kvstrata.config.schema import TraceConfig
from kvstrata.policy import PolicySpec
from kvstrata.trace.reader import load_trace
from kvstrata.trace.recorder import RecordedRequest, TraceRecorder
from kvstrata.core.deployment import policy_spec

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


def recording(tmp: Path, load: object) -> Path:
    """A recording of the chat trace by the recorder itself, its measurements carrying the
    plugin's cost estimates ``load`` (as ``stats()["load"]`` gives them)."""
    tmp.mkdir()
    cfg = config(tmp)
    deployment = recorded_deployment(cfg, block_size=BS, block_nbytes=NBYTES, gpu_blocks=16,
                                     capacity_blocks={"gpu": 16, **policy_spec(
                                         cfg, block_nbytes=NBYTES, gpu_blocks=16).capacity()},
                                     engine={"name": "test", "version": "0"})
    rec = TraceRecorder(TraceConfig.from_dict({"path": str(tmp / "rec"), "insecure_hashes": True}), block_size=BS,
                        deployment=deployment)
    for i, line in enumerate(chat_trace(tmp / "t.jsonl").read_text().splitlines()):
        toks = json.loads(line)["token_ids"]
        keys = [hashlib.sha256(repr(toks[:(b + 1) * BS]).encode()).digest() for b in range(len(toks) // BS)]
        rec.admitted(str(i))
        rec.finished(str(i), RecordedRequest(arrival=rec.started + i, finish=rec.started + i + 0.5,
                                             input_length=len(toks), output_length=1, keys=keys, output_keys=[]))
    rec.measured({"block_size": BS, "block_nbytes": NBYTES, "load": load})
    rec.close()
    return tmp / "rec"


def test_a_recording_replays_both_policies_from_the_costs_the_plugin_measured(tmp_path: Path) -> None:
    """The plugin's estimates in a recording's measurements are the replay's figures: an SSD
    block measured at 100 ms against 16 ms to compute is recomputed under ``measured``; a
    ``--set`` figure overrides the recorded one; forged estimates leave the replay without
    figures, never stop it."""
    load = {"policy": "measured", "block_seconds": {"cpu": 1e-5, "ssd": 0.1}, "token_seconds": 1e-3,
            "attended_seconds": 1e-9, "decisions": {}}
    trace = recording(tmp_path / "slow", load)

    def bench(trace: Path, *sets: str) -> dict:
        out = trace.parent / "r.json"
        assert main(["bench", "--trace", str(trace), "--json", str(out), "--quiet",
                     *(a for s in sets for a in ("--set", s))]) == 0
        return json.loads(out.read_text())

    report = bench(trace)["load_comparison"]
    assert report["measured"]["block_seconds"]["ssd"] == pytest.approx(0.1, rel=1e-6)
    assert report["measured"]["token_seconds"] == pytest.approx(1e-3)
    assert report["always"]["hit_rate"]["ssd"] > 0 and report["measured"]["decisions"]["ssd"]["loaded"] == 0
    assert report["measured"]["decisions"]["ssd"]["recomputed"] > 0
    assert report["measured"]["mean_ttft_s"] < report["always"]["mean_ttft_s"]
    fast = bench(trace, "load.ssd_bandwidth=1GiB")["load_comparison"]  # the operator's figure wins
    assert fast["measured"]["decisions"]["ssd"]["recomputed"] == 0
    for forged in ({"block_seconds": "x", "token_seconds": True}, {"block_seconds": {"ssd": -1.0}},
                   {"block_seconds": {"cpu": 1e-5, "ssd": 0.1}, "token_seconds": float("nan")}, "load"):
        got = bench(recording(tmp_path / f"forged-{len(str(forged))}", forged))
        assert got["load_comparison"] == {} and got["hit_rate"]["ssd"] > 0


def test_recorded_estimates_become_the_load_figures_the_deployment_did_not_fix() -> None:
    measured = {"block_nbytes": NBYTES, "load": {"block_seconds": {"cpu": 1e-5, "ssd": 0.1, "remote": 0.0},
                                                 "latency_seconds": {"cpu": 0.0, "ssd": 0.003, "remote": 0.5},
                                                 "token_seconds": 1e-3, "attended_seconds": 1e-9}}
    assert recorded_load(measured) == {"cpu_bandwidth": round(NBYTES / 1e-5), "ssd_bandwidth": round(NBYTES / 0.1),
                                       "ssd_latency": 0.003,  # the remote's has no bandwidth to be part of
                                       "prefill_rate": pytest.approx(1e3), "attention_rate": pytest.approx(1e9)}
    deployment = recorded_deployment(config(Path("/nonexistent"), **{"load.ssd_bandwidth": "1GiB"}), block_size=BS,
                                     block_nbytes=NBYTES, gpu_blocks=16, capacity_blocks={},
                                     engine={"name": "test", "version": "0"})
    cfg = recorded_config(deployment, ["load.prefill_rate=500"], measured)
    assert cfg.load.ssd_bandwidth == 1 << 30 and cfg.load.ssd_latency is None  # fixed while recording: kept, as the plugin had it
    assert cfg.load.cpu_bandwidth == round(NBYTES / 1e-5) and cfg.load.prefill_rate == 500  # --set wins
    assert recorded_load({"block_nbytes": NBYTES, "load": {"attended_seconds": 1e-9}}) == {}  # no rate to be part of


def test_a_hybrid_hit_is_loaded_whole_or_computed_whole(tmp_path: Path) -> None:
    """A full-attention group and a 2-block window (``model.groups``): the replay weighs a
    hit's blocks of both groups together; from the slow SSD tier it computes the whole hit,
    from a fast one it loads it, as ``always`` does."""
    trace = load_trace(chat_trace(tmp_path / "t.jsonl"), block_size=BS)
    hybrid = {"model.groups": f"full,sliding:{2 * BS}"}
    slow = run_bench(trace, config(tmp_path, **figures("40KiB"), **hybrid), ReplayOptions(decode_s_per_token=0.0))
    measured, always = slow.load_comparison["measured"], slow.load_comparison["always"]
    assert always.hit_blocks["ssd"] > 0 and measured.hit_blocks["ssd"] == 0
    decided = measured.load["decisions"]["ssd"]
    assert decided["loaded"] == 0 and decided["recomputed"] > always.hit_blocks["ssd"]  # every group's blocks
    fast = run_bench(trace, config(tmp_path, **figures("1GiB"), **hybrid), ReplayOptions(decode_s_per_token=0.0))
    assert fast.load_comparison["measured"].hit_blocks == fast.load_comparison["always"].hit_blocks
    assert fast.load_comparison["measured"].hit_blocks["ssd"] > 0
