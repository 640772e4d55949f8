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
concurrency is pool blocks / the blocks one ``max_model_len`` request holds.

Layers that keep a state instead (Gated DeltaNet linear attention: Qwen3-Next,
Qwen3.5; Mamba2: Granite 4, Bamba) are planned as vLLM keeps them in the
``align`` prefix-caching mode kvstrata needs: a layer's state (a convolution
state and a recurrent state, shapes from the model config, the recurrent one in
``mamba_ssm_dtype`` when the config names one) takes one page; vLLM raises the
block size until an attention page (one layer's block) holds it, in multiples of
the block size (``--block-size``: the attention kernel's block, 16 for
FlashAttention), and pads the state to that page; its groups hold two states of
a request at a time (the last one cached and the running one).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.system.values import clip, short_repr

__all__ = ["DTYPE_BYTES", "ModelShape", "Plan", "shape_from_args", "shape_from_hf_config", "kv_pool_bytes",
           "make_plan", "render_plan", "MAX_LAYERS", "MAX_HEADS", "MAX_DIM", "MAX_TOKENS", "MAX_BLOCK_SIZE",
           "MAX_GIB", "MAX_STATE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
_HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}
GIB = 1024**3

# Bounds on every input, far beyond any real model or machine, so that an absurd value (a
# typo, a forged config) is refused by name instead of planned or overflowing a float.
MAX_LAYERS = 10_000          # the deepest served models have ~126 layers
MAX_HEADS = 10_000           # attention, KV, linear-attention and Mamba heads and groups: real ones <= 128
MAX_DIM = 1 << 20            # hidden sizes, head dims, state dims, kernels: real ones <= 32,768
MAX_TOKENS = 1 << 30         # --max-model-len, --max-num-batched-tokens, a sliding window: contexts <= 10M tokens
MAX_BLOCK_SIZE = 1 << 16     # --block-size: vLLM's blocks are 16 to a few thousand tokens
MAX_GIB = float(1 << 20)     # --kv-pool-gib, --gpu-mem-gib, --weights-gib: 1 PiB
MAX_STATE_BYTES = GIB        # one layer's state: Qwen3-Next's and Granite 4's are ~1 MiB
_MAX_CONFIG_BYTES = 16 << 20  # a model config.json: real ones are a few KiB


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "fp16"
    name: str = "model"
    sliding_layers: int = 0   # of ``layers``, those with a sliding window of ``window`` tokens
    window: int = 0
    state_layers: int = 0     # of ``layers``, those keeping a state of ``state_bytes`` (a ``state_kind`` layer)
    state_bytes: int = 0
    state_kind: str = ""

    def bytes_per_token(self, dtype: str | None = None) -> int:
        """KV bytes of a token over the attention layers."""
        return 2 * (self.layers - self.state_layers) * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype or self.dtype]

    def groups(self) -> tuple[int, int, int, int]:
        """vLLM's hybrid allocator: (layers per group, full-attention groups, sliding groups,
        state groups)."""
        full, sliding, state = self.layers - self.sliding_layers - self.state_layers, self.sliding_layers, \
            self.state_layers
        kinds = [n for n in (full, sliding, state) if n]
        size = min(kinds)
        if max(kinds) < 1.5 * size:
            size = max(kinds)
        return size, -(-full // size), -(-sliding // size), -(-state // size)

    def block_size(self, block_size: int, dtype: str | None = None) -> int:
        """The block size vLLM runs a state hybrid at: the smallest multiple of ``block_size``
        (at least 16, the attention kernel's block) whose attention page (one layer's block)
        holds a state (``_align_hybrid_block_size``); ``block_size`` without state layers."""
        if not self.state_layers:
            return block_size
        align = max(16, block_size)
        per_token = 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype or self.dtype]
        return max(block_size, align * -(-self.state_bytes // (align * per_token)))


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


def _positive(v: Any, what: str, maximum: int = MAX_DIM) -> int:
    """``v``: an integer from 1 to ``maximum``, else a ConfigError naming ``what`` and the bound."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {short_repr(v)}")
    if v > maximum:
        raise ConfigError(f"{what}: expected at most {maximum:,}, got {short_repr(v)}")
    return v


def shape_from_args(layers: int, kv_heads: int, head_dim: int, dtype: str = "fp16") -> ModelShape:
    """The shape ``--layers``, ``--kv-heads`` and ``--head-dim`` give, each within its bound."""
    return ModelShape(_positive(layers, "--layers", MAX_LAYERS), _positive(kv_heads, "--kv-heads", MAX_HEADS),
                      _positive(head_dim, "--head-dim"), dtype, "model")


def _read_config(p: Path) -> Any:
    """The JSON value in model config ``p``: a regular file of at most 16 MiB, nested within
    what Python's parser follows."""
    from kvstrata.system.files import read_named

    data = read_named(p, _MAX_CONFIG_BYTES, "model config", "JSON")
    try:
        return json.loads(data)
    except RecursionError:
        raise ConfigError(f"{p}: JSON nested too deeply; not a model config") from None
    except ValueError as e:  # also text that is not UTF-8
        raise ConfigError(f"{p}: cannot read a JSON model config ({clip(str(e))})") from None


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """Read layers, KV heads, head dim and dtype from a Hugging Face ``config.json``; every
    field within its bound (:data:`MAX_LAYERS`, :data:`MAX_HEADS`, :data:`MAX_DIM`)."""
    p = Path(path)
    cfg = _read_config(p)
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    layers = _positive(cfg.get("num_hidden_layers"), f"{p}: num_hidden_layers", MAX_LAYERS)
    heads = _positive(cfg.get("num_attention_heads"), f"{p}: num_attention_heads", MAX_HEADS)
    kv_heads = _positive(cfg.get("num_key_value_heads") or heads, f"{p}: num_key_value_heads", MAX_HEADS)
    head_dim = cfg.get("head_dim") or _positive(cfg.get("hidden_size"), f"{p}: hidden_size") // heads
    head_dim = _positive(head_dim, f"{p}: head_dim")
    dtype = _HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), "fp16")
    name = cfg.get("_name_or_path") or (cfg.get("architectures") or [p.parent.name])[0]
    state_kind, state_layers = _state_layers(cfg, layers, p)
    sliding, window = _sliding_layers(cfg, layers, p)
    shape = ModelShape(layers, kv_heads, head_dim, dtype, str(name), sliding, window)
    if not state_layers:
        return shape
    return replace(shape, state_layers=state_layers, state_kind=state_kind,
                   state_bytes=_state_bytes(cfg, state_kind, dtype, p))


_STATE_KINDS = ("linear_attention", "mamba", "mamba2", "conv", "short_conv", "recurrent")
_STATE_SHAPES = {  # a layer kind -> the config keys its state shapes come from (vLLM's MambaStateShapeCalculator)
    "linear_attention": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"),
    "mamba": ("hidden_size", "mamba_expand", "mamba_n_groups", "mamba_n_heads", "mamba_d_head", "mamba_d_state",
              "mamba_d_conv"),
}


def _state_layers(cfg: dict[str, Any], layers: int, p: Path) -> tuple[str, int]:
    """(the state layers' kind, how many) from ``layer_types``, or a Qwen3-Next config's
    ``full_attention_interval`` (every n-th layer full attention, the others Gated DeltaNet)."""
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        interval = cfg.get("full_attention_interval")
        if "linear_num_value_heads" not in cfg or not isinstance(interval, int) or isinstance(interval, bool) \
                or interval < 1:
            return "", 0
        return "linear_attention", layers - layers // interval
    state = [t for t in types if t in _STATE_KINDS]
    if not state:
        return "", 0
    kind = "mamba" if state[0] == "mamba2" else state[0]
    if kind not in _STATE_SHAPES or any(("mamba" if t == "mamba2" else t) != kind for t in state):
        raise ConfigError(f"{p}: {len(state)} of its {layers} layers keep a state ({', '.join(sorted(set(state)))}): "
                          f"kvstrata plan knows the state shapes of {' and '.join(_STATE_SHAPES)} layers; plan its "
                          f"{layers - len(state)} attention layers with --layers")
    return kind, len(state)


def _state_bytes(cfg: dict[str, Any], kind: str, dtype: str, p: Path) -> int:
    """One state layer's state, in bytes: a convolution state over the layer's projected
    channels (``kernel - 1`` positions) in the model's dtype, and the recurrent state in
    ``mamba_ssm_dtype`` (``mamba_ssm_cache_dtype``) when the config names one, else the
    model's (vLLM's defaults for these layers, one GPU)."""
    v = {k: _positive(cfg.get(k), f"{p}: {k}", MAX_HEADS if "heads" in k or "groups" in k else MAX_DIM)
         for k in _STATE_SHAPES[kind]}
    if kind == "linear_attention":  # Gated DeltaNet: MambaStateShapeCalculator.gated_delta_net_state_shape
        conv = (v["linear_key_head_dim"] * v["linear_num_key_heads"] * 2
                + v["linear_value_head_dim"] * v["linear_num_value_heads"]) * (v["linear_conv_kernel_dim"] - 1)
        ssm = v["linear_num_value_heads"] * v["linear_value_head_dim"] * v["linear_key_head_dim"]
    else:  # Mamba2: MambaStateShapeCalculator.mamba2_state_shape
        conv = (v["mamba_expand"] * v["hidden_size"] + 2 * v["mamba_n_groups"] * v["mamba_d_state"]) \
            * (v["mamba_d_conv"] - 1)
        ssm = v["mamba_n_heads"] * v["mamba_d_head"] * v["mamba_d_state"]
    named = cfg.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_cache_dtype")
    if named is not None and str(named) not in _HF_DTYPES:
        raise ConfigError(f"{p}: mamba_ssm_dtype: {named!r:.40}: expected one of {', '.join(_HF_DTYPES)}")
    ssm_dtype = _HF_DTYPES[str(named)] if named is not None else dtype
    nbytes = conv * DTYPE_BYTES[dtype] + ssm * DTYPE_BYTES[ssm_dtype]
    if nbytes > MAX_STATE_BYTES:
        raise ConfigError(f"{p}: {', '.join(_STATE_SHAPES[kind])}: a layer's state of {nbytes:,} bytes; expected at "
                          f"most {MAX_STATE_BYTES:,} (1 GiB)")
    return nbytes


def _sliding_layers(cfg: dict[str, Any], layers: int, p: Path) -> tuple[int, int]:
    """(sliding-window layers, their window) from ``layer_types`` or ``sliding_window_pattern``."""
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(types, list) and types:
        if len(types) != layers or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"{p}: layer_types: expected {layers} layer kinds (num_hidden_layers), "
                              f"got {str(types)[:100]}")
        sliding = sum(1 for t in types if "sliding" in t or "local" in t)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        sliding = layers - layers // pattern  # every pattern-th layer is global
    else:
        return 0, 0
    window = cfg.get("sliding_window")
    if not sliding or not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return 0, 0
    return sliding, _positive(window, f"{p}: sliding_window", MAX_TOKENS)


def kv_pool_bytes(*, kv_pool_gib: float | None = None, gpu_mem_gib: float | None = None,
                  weights_gib: float | None = None, util: float = 0.9) -> int:
    """The KV pool: given directly, or ``gpu_mem x util - weights`` (activations and overheads
    ignored); each size finite and at most :data:`MAX_GIB`."""
    if kv_pool_gib is not None:
        return int(_gib(kv_pool_gib, "--kv-pool-gib") * GIB)
    if gpu_mem_gib is None or weights_gib is None:
        raise ConfigError("--kv-pool-gib: give it, or --gpu-mem-gib and --weights-gib")
    _gib(gpu_mem_gib, "--gpu-mem-gib")
    if weights_gib != 0:  # none at all is allowed
        _gib(weights_gib, "--weights-gib")
    if not 0 < util <= 1:
        raise ConfigError(f"--util: expected a fraction in (0, 1], got {util}")
    pool = gpu_mem_gib * util - weights_gib
    if pool <= 0:
        raise ConfigError(f"--weights-gib: {weights_gib} GiB leaves no KV pool in {gpu_mem_gib} GiB x {util}")
    return int(pool * GIB)


def _gib(value: float, what: str) -> float:
    """``value`` GiB: a finite number above 0 and at most :data:`MAX_GIB`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_GIB:
        raise ConfigError(f"{what}: expected a number of GiB above 0 and at most {MAX_GIB:,.0f} (1 PiB), "
                          f"got {short_repr(value)}")
    return float(value)


def make_plan(shape: ModelShape, pool_bytes: int, max_model_len: int, block_size: int = 16,
              max_num_batched_tokens: int = 8192) -> Plan:
    """Pool tokens and worst-case concurrency for ``shape``, and the same with an FP8 KV cache
    (``max_num_batched_tokens``: the tokens a sliding window's group holds beyond its window)."""
    _positive(max_model_len, "--max-model-len", MAX_TOKENS)
    _positive(block_size, "--block-size", MAX_BLOCK_SIZE)
    _positive(max_num_batched_tokens, "--max-num-batched-tokens", MAX_TOKENS)

    def tokens(bpt: int) -> tuple[int, int]:
        blocks = pool_bytes // (bpt * block_size)
        return blocks, blocks * block_size

    bpt, fp8 = shape.bytes_per_token(), shape.bytes_per_token("fp8")
    if shape.sliding_layers or shape.state_layers:
        return _hybrid_plan(shape, pool_bytes, max_model_len, block_size, max_num_batched_tokens)
    blocks, toks = tokens(bpt)
    _, fp8_toks = tokens(fp8)
    return Plan(shape.name, shape.dtype, shape.layers, shape.kv_heads, shape.head_dim, block_size, max_model_len,
                pool_bytes, bpt, blocks, toks, toks / max_model_len, fp8, fp8_toks, fp8_toks / max_model_len)


def _hybrid_plan(shape: ModelShape, pool_bytes: int, max_model_len: int, block_size: int, in_flight: int) -> Plan:
    """A hybrid under vLLM's hybrid allocator (see the module docstring)."""
    size, full, sliding, state = shape.groups()

    def pool(dtype: str) -> tuple[int, int, float, int, int]:
        bs = shape.block_size(block_size, dtype)
        window = min(shape.window - 1 + in_flight, max_model_len)
        per_request = full * -(-max_model_len // bs) + sliding * (-(-window // bs) + 1) + state * 2
        row = 2 * size * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype] * bs
        blocks = pool_bytes // row
        per_token = row * (full + sliding) // bs  # a block of every attention group
        return per_token, blocks, blocks / per_request, bs, per_request

    bpt, blocks, conc, bs, per_request = pool(shape.dtype)
    fp8, _, fp8_conc, _, _ = pool("fp8")
    kinds = [f"full x{full}"] + [f"sliding:{shape.window} x{sliding}"] * bool(sliding) + \
        [f"state ({shape.state_kind}) x{state}"] * bool(state)
    groups = f"{', '.join(kinds)} ({size} layer{'s' if size > 1 else ''} each)"
    if state:
        page = bs * 2 * shape.kv_heads * shape.head_dim * DTYPE_BYTES[shape.dtype]
        groups += (f"; a state of {shape.state_bytes:,} bytes per layer raises the block to {bs} tokens and is "
                   f"padded to its {page:,}-byte page (+{100 * (page - shape.state_bytes) / shape.state_bytes:.1f}%)")
    # vLLM's own "KV cache size" of a hybrid: the tokens of the requests it holds at once
    return Plan(shape.name, shape.dtype, shape.layers, shape.kv_heads, shape.head_dim, bs, max_model_len,
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
              f"a {p.max_model_len:,}-token request holds {p.blocks_per_request:,} blocks (of a window only the "
              f"last window's, of a state group 2 states); the pool's {p.pool_blocks:,} blocks are shared by every "
              "group"] if p.groups else []
    return "\n".join([
        f"INFO KV cache layout: {p.layers} layers x {p.kv_heads} KV heads x {p.head_dim} head dim x 2 (K, V) x "
        f"{DTYPE_BYTES[p.dtype]} bytes ({p.dtype}) = {p.bytes_per_token:,} bytes per token"
        + (" (a block of every attention group, padding layers included)" if p.groups else ""), *hybrid,
        f"INFO Available KV cache memory: {p.kv_pool_bytes / GIB:.2f} GiB",
        f"INFO GPU KV cache size: {p.pool_tokens:,} tokens ({p.pool_blocks:,} blocks of {p.block_size})",
        f"INFO Maximum concurrency for {p.max_model_len:,} tokens per request: {p.max_concurrency:.2f}x",
        f"INFO With --kv-cache-dtype fp8: {p.fp8_bytes_per_token:,} bytes per token, {p.fp8_pool_tokens:,} tokens, "
        f"maximum concurrency {p.fp8_max_concurrency:.2f}x",
        f"Plan: {_advice(p.max_concurrency)}.",
    ]) + "\n"
