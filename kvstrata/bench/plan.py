"""KV memory planning (the seed's section 8): bytes per token, pool tokens, concurrency.

bytes/token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.
The pool is ``--kv-pool-gib`` or ``gpu_mem x util - weights``; it is cut
into whole blocks (``block_size`` tokens, as vLLM does), and the maximum
concurrency is pool tokens / max_model_len, the worst case where every
request uses the whole context.

A model with sliding-window layers beside full attention (``layer_types`` or
``sliding_window_pattern`` in its config: Gemma 3, gpt-oss, Mistral) is planned as
vLLM's hybrid allocator keeps it, which kvstrata leaves on: the layers of each kind
fall into KV-cache groups of ``group_size`` layers (the fewer layers of a kind; the
more when the kinds are within 1.5x of each other: vLLM's rule, the last group of a
kind padded), a block holds one group's layers for ``block_size`` tokens, and a
request holds every block in a full-attention group but in a sliding one only its
window and the tokens in flight (a chunked prefill's batch of ``max_num_batched_tokens``,
freed as the window moves on), plus one block: vLLM's own admission bound. Its
concurrency is pool blocks / the blocks one ``max_model_len`` request holds. Layers that keep a state (linear attention,
Mamba) are sized by vLLM from their state shapes, which a plan does not model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError

__all__ = ["DTYPE_BYTES", "ModelShape", "Plan", "shape_from_hf_config", "kv_pool_bytes", "make_plan", "render_plan"]

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
_HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}
GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "fp16"
    name: str = "model"
    sliding_layers: int = 0   # of ``layers``, those with a sliding window of ``window`` tokens
    window: int = 0

    def bytes_per_token(self, dtype: str | None = None) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype or self.dtype]

    def groups(self) -> tuple[int, int, int]:
        """vLLM's hybrid allocator: (layers per group, full-attention groups, sliding groups)."""
        full, sliding = self.layers - self.sliding_layers, self.sliding_layers
        kinds = [n for n in (full, sliding) if n]
        size = min(kinds)
        if max(kinds) < 1.5 * size:
            size = max(kinds)
        return size, -(-full // size), -(-sliding // size)


@dataclass(frozen=True)
class Plan:
    """``groups``: "" for one full-attention group, else vLLM's groups (``full x1, sliding:1024 x5``)."""

    model: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_model_len: int
    kv_pool_bytes: int
    bytes_per_token: int
    pool_blocks: int
    pool_tokens: int
    max_concurrency: float
    fp8_bytes_per_token: int
    fp8_pool_tokens: int
    fp8_max_concurrency: float
    groups: str = ""
    blocks_per_request: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {v!r}")
    return v


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """Read layers, KV heads, head dim and dtype from a Hugging Face ``config.json``."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: model config not found") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read a JSON model config ({e})") from None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    layers = _positive(cfg.get("num_hidden_layers"), f"{p}: num_hidden_layers")
    heads = _positive(cfg.get("num_attention_heads"), f"{p}: num_attention_heads")
    kv_heads = _positive(cfg.get("num_key_value_heads") or heads, f"{p}: num_key_value_heads")
    head_dim = cfg.get("head_dim") or _positive(cfg.get("hidden_size"), f"{p}: hidden_size") // heads
    head_dim = _positive(head_dim, f"{p}: head_dim")
    dtype = _HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), "fp16")
    name = cfg.get("_name_or_path") or (cfg.get("architectures") or [p.parent.name])[0]
    sliding, window = _sliding_layers(cfg, layers, p)
    return ModelShape(layers, kv_heads, head_dim, dtype, str(name), sliding, window)


_STATE_KINDS = ("linear_attention", "mamba", "mamba2", "conv", "short_conv", "recurrent")


def _sliding_layers(cfg: dict[str, Any], layers: int, p: Path) -> tuple[int, int]:
    """(sliding-window layers, their window) from ``layer_types`` or ``sliding_window_pattern``."""
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(types, list) and types:
        if len(types) != layers or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"{p}: layer_types: expected {layers} layer kinds (num_hidden_layers), "
                              f"got {str(types)[:100]}")
        state = [t for t in types if t in _STATE_KINDS]
        if state:
            raise ConfigError(f"{p}: {len(state)} of its {layers} layers keep a state ({state[0]}): vLLM sizes "
                              "their pages from the state shapes, which kvstrata plan does not model; plan its "
                              f"{layers - len(state)} attention layers with --layers")
        sliding = sum(1 for t in types if "sliding" in t or "local" in t)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        sliding = layers - layers // pattern  # every pattern-th layer is global
    else:
        return 0, 0
    window = cfg.get("sliding_window")
    if not sliding or not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return 0, 0
    return sliding, window


def kv_pool_bytes(*, kv_pool_gib: float | None = None, gpu_mem_gib: float | None = None,
                  weights_gib: float | None = None, util: float = 0.9) -> int:
    """The KV pool: given directly, or ``gpu_mem x util - weights`` (activations and overheads ignored)."""
    if kv_pool_gib is not None:
        if kv_pool_gib <= 0:
            raise ConfigError(f"--kv-pool-gib: must be positive, got {kv_pool_gib}")
        return int(kv_pool_gib * GIB)
    if gpu_mem_gib is None or weights_gib is None:
        raise ConfigError("--kv-pool-gib: give it, or --gpu-mem-gib and --weights-gib")
    if not 0 < util <= 1:
        raise ConfigError(f"--util: expected a fraction in (0, 1], got {util}")
    pool = gpu_mem_gib * util - weights_gib
    if pool <= 0:
        raise ConfigError(f"--weights-gib: {weights_gib} GiB leaves no KV pool in {gpu_mem_gib} GiB x {util}")
    return int(pool * GIB)


def make_plan(shape: ModelShape, pool_bytes: int, max_model_len: int, block_size: int = 16,
              max_num_batched_tokens: int = 8192) -> Plan:
    """Pool tokens and worst-case concurrency for ``shape``, and the same with an FP8 KV cache
    (``max_num_batched_tokens``: the tokens a sliding window's group holds beyond its window)."""
    _positive(max_model_len, "--max-model-len")
    _positive(block_size, "--block-size")

    def tokens(bpt: int) -> tuple[int, int]:
        blocks = pool_bytes // (bpt * block_size)
        return blocks, blocks * block_size

    bpt, fp8 = shape.bytes_per_token(), shape.bytes_per_token("fp8")
    if shape.sliding_layers:
        return _hybrid_plan(shape, pool_bytes, max_model_len, block_size, _positive(max_num_batched_tokens,
                                                                                     "--max-num-batched-tokens"))
    blocks, toks = tokens(bpt)
    _, fp8_toks = tokens(fp8)
    return Plan(shape.name, shape.dtype, shape.layers, shape.kv_heads, shape.head_dim, block_size, max_model_len,
                pool_bytes, bpt, blocks, toks, toks / max_model_len, fp8, fp8_toks, fp8_toks / max_model_len)


def _hybrid_plan(shape: ModelShape, pool_bytes: int, max_model_len: int, block_size: int, in_flight: int) -> Plan:
    """A sliding-window hybrid under vLLM's hybrid allocator (see the module docstring)."""
    size, full, sliding = shape.groups()
    window = min(shape.window - 1 + in_flight, max_model_len)
    per_request = full * -(-max_model_len // block_size) + sliding * (-(-window // block_size) + 1)

    def pool(dtype: str) -> tuple[int, int, float]:
        row = 2 * size * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype] * block_size
        blocks = pool_bytes // row
        per_token = row * (full + sliding) // block_size  # a block of every group
        return per_token, blocks, blocks / per_request

    bpt, blocks, conc = pool(shape.dtype)
    fp8, fp8_blocks, fp8_conc = pool("fp8")
    groups = f"full x{full}, sliding:{shape.window} x{sliding} ({size} layer{'s' if size > 1 else ''} each)"
    # vLLM's own "KV cache size" of a hybrid: the tokens of the requests it holds at once
    return Plan(shape.name, shape.dtype, shape.layers, shape.kv_heads, shape.head_dim, block_size, max_model_len,
                pool_bytes, bpt, blocks, int(conc * max_model_len), conc, fp8, int(fp8_conc * max_model_len),
                fp8_conc, groups, per_request)


def _advice(concurrency: float) -> str:
    if concurrency < 10:
        return ("memory is badly short: try, in order, an FP8 KV cache, a lower max_model_len, FP8/AWQ weights, "
                "more tensor parallelism, a GQA model")
    if concurrency < 50:
        return ("fair, but traffic peaks will preempt: an FP8 KV cache, gpu_memory_utilization 0.93-0.95, "
                "watch the preemption metrics")
    return ("memory is plentiful: the bottleneck is elsewhere (CPU cores, tokenization, "
            "max_num_batched_tokens)")


def render_plan(plan: Plan) -> str:
    """The plan as vLLM-style start-up lines plus the seed's decision."""
    p = plan
    hybrid = [f"INFO Hybrid KV-cache groups (vLLM's hybrid allocator, kept on with kvstrata): {p.groups}; "
              f"a {p.max_model_len:,}-token request holds {p.blocks_per_request:,} blocks, its windows only "
              f"the last window's; the pool's {p.pool_blocks:,} blocks are shared by every group"] if p.groups else []
    return "\n".join([
        f"INFO KV cache layout: {p.layers} layers x {p.kv_heads} KV heads x {p.head_dim} head dim x 2 (K, V) x "
        f"{DTYPE_BYTES[p.dtype]} bytes ({p.dtype}) = {p.bytes_per_token:,} bytes per token"
        + (" (every group's block, padding layers included)" if p.groups else ""), *hybrid,
        f"INFO Available KV cache memory: {p.kv_pool_bytes / GIB:.2f} GiB",
        f"INFO GPU KV cache size: {p.pool_tokens:,} tokens ({p.pool_blocks:,} blocks of {p.block_size})",
        f"INFO Maximum concurrency for {p.max_model_len:,} tokens per request: {p.max_concurrency:.2f}x",
        f"INFO With --kv-cache-dtype fp8: {p.fp8_bytes_per_token:,} bytes per token, {p.fp8_pool_tokens:,} tokens, "
        f"maximum concurrency {p.fp8_max_concurrency:.2f}x",
        f"Plan: {_advice(p.max_concurrency)}.",
    ]) + "\n"
