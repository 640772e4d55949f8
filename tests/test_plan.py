"""KV memory planning: the seed's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.plan import ModelShape, kv_pool_bytes, make_plan, render_plan, shape_from_hf_config
from kvstrata.errors import ConfigError

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


def test_llama3_8b_48gib_pool_at_8192() -> None:
    plan = make_plan(ModelShape(32, 8, 128, "fp16"), kv_pool_bytes(kv_pool_gib=48), 8192)
    assert plan.bytes_per_token == 131072
    assert plan.pool_tokens == 393_216 and plan.max_concurrency == 48.0
    assert plan.fp8_bytes_per_token == 65536 and plan.fp8_pool_tokens == 786_432
    assert plan.fp8_max_concurrency == 96.0
    text = render_plan(plan)
    assert "GPU KV cache size: 393,216 tokens" in text
    assert "Maximum concurrency for 8,192 tokens per request: 48.00x" in text and "96.00x" in text


def test_hf_config_gives_layout_and_dtype(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA3_8B))
    s = shape_from_hf_config(p)
    assert (s.layers, s.kv_heads, s.head_dim, s.dtype) == (32, 8, 128, "bf16")
    assert s.bytes_per_token() == 131072
    nested = {"model_type": "x", "text_config": {**LLAMA3_8B, "head_dim": 64}}
    p.write_text(json.dumps(nested))
    assert shape_from_hf_config(p).head_dim == 64


def test_pool_from_gpu_memory() -> None:
    assert kv_pool_bytes(gpu_mem_gib=80, weights_gib=16, util=0.9) == int((80 * 0.9 - 16) * 1024**3)
    with pytest.raises(ConfigError, match="--weights-gib"):
        kv_pool_bytes(gpu_mem_gib=24, weights_gib=30)
    with pytest.raises(ConfigError, match="--kv-pool-gib"):
        kv_pool_bytes()


def test_bad_model_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        shape_from_hf_config(tmp_path / "missing.json")
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        shape_from_hf_config(p)
