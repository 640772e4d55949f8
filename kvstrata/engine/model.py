"""A Hugging Face Llama-family checkpoint, run over a paged KV cache.

transformers' own modules do everything but attention (embedding, RMSNorm,
the q/k/v/o projections, rotary embedding, MLP, LM head), with the
checkpoint's weights: the engine's numbers differ from transformers' only in
how attention reads K/V, which is kvstrata's paged cache
(:class:`~kvstrata.engine.kv.PagedKV`). Supported: ``llama``, ``mistral``,
``qwen2`` and ``qwen3`` (its per-head q/k norms), full attention only.

:func:`read_model_shape` reads ``config.json`` alone, so a checkpoint of
another family, or a head size the kernels lack, is refused before any
weight is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.engine.kv import PagedKV, StepBatch

__all__ = ["FAMILIES", "ModelShape", "PagedModel", "read_model_shape"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the scheduler need to know of a checkpoint."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_positions: int
    dtype: str              # the checkpoint's own dtype (torch name)
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]


def read_model_shape(path: str | Path) -> ModelShape:
    """The shape of the checkpoint in directory ``path`` from its ``config.json``.
    Raises :class:`ConfigError` naming the file when it is missing, unreadable or
    not a Llama-family model."""
    root = Path(path).expanduser()
    cfg_path = root / "config.json"
    if not root.is_dir():
        raise ConfigError(f"model: {root} is not a directory (a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except OSError as exc:
        raise ConfigError(f"model: {cfg_path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"model: {cfg_path}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model: {cfg_path}: expected a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model: {cfg_path}: model_type {model_type!r} is not a Llama-family model "
                          f"(supported: {', '.join(FAMILIES)})")
    def field(name: str, default: Any = None) -> int:
        value = cfg.get(name)
        value = default if value is None else value
        if value is None:
            raise ConfigError(f"model: {cfg_path}: missing field {name!r}")
        if type(value) is not int or value < 1:
            raise ConfigError(f"model: {cfg_path}: {name} must be a positive integer, got {str(value)[:40]!r}")
        return value

    heads, hidden = field("num_attention_heads"), field("hidden_size")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"model: {cfg_path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    try:
        shape = ModelShape(
            model_type=model_type, num_layers=field("num_hidden_layers"), num_heads=heads,
            num_kv_heads=field("num_key_value_heads", heads), head_size=field("head_dim", hidden // heads),
            vocab_size=field("vocab_size"), max_positions=field("max_position_embeddings", 2048),
            dtype=DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), "float32"),
            sliding_window=_sliding_window(cfg), eos_token_ids=_eos_ids(root, cfg))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model: {cfg_path}: missing or invalid field {exc}") from None
    if shape.num_kv_heads < 1 or shape.num_heads % shape.num_kv_heads:
        raise ConfigError(f"model: {cfg_path}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {shape.num_kv_heads}")
    return shape


def _tied(model: Any, key: str) -> bool:
    """Is ``key`` the output embedding tied to the input one (absent from the files by design)?"""
    return key.startswith("lm_head") and bool(getattr(model.config, "tie_word_embeddings", False))


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window in force, or None for full attention."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _eos_ids(root: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's (as transformers' generate)."""
    value = cfg.get("eos_token_id")
    try:
        gen = json.loads((root / "generation_config.json").read_text())
        if isinstance(gen, dict) and "eos_token_id" in gen:
            value = gen["eos_token_id"]
    except (OSError, ValueError):
        pass
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


class PagedModel:
    """The checkpoint's modules; :meth:`forward` runs one step of flattened tokens."""

    def __init__(self, path: str | Path, shape: ModelShape, dtype: "torch.dtype", device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        root = Path(path).expanduser()
        try:
            hf, info = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, output_loading_info=True)
        except Exception as exc:  # a damaged weights file (SafetensorError), a tensor of the wrong shape, ...
            raise ConfigError(f"model: {root}: cannot load the weights: {str(exc).splitlines()[0][:300]}") from None
        missing = [k for k in info.get("missing_keys", ()) if not _tied(hf, k)]
        if missing:  # transformers would run them with random values
            raise ConfigError(f"model: {root}: the weight files lack {len(missing)} tensor(s) the config names, "
                              f"first {missing[0]!r}")
        if info.get("mismatched_keys"):
            raise ConfigError(f"model: {root}: tensor {info['mismatched_keys'][0]!r} has the wrong shape")
        self.hf = hf.to(device=device, dtype=dtype).eval()
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self.body = self.hf.model
        self.scale = float(getattr(self.body.layers[0].self_attn, "scaling", shape.head_size ** -0.5))

    def forward(self, tokens: "torch.Tensor", positions: "torch.Tensor", step: "StepBatch",
                kv: "PagedKV") -> "torch.Tensor":
        """Logits (float32) of each sequence's last token in ``step``; every token's K/V
        is written into ``kv`` first, and attention reads it back from there."""
        import torch

        s = self.shape
        with torch.inference_mode():
            x = self.body.embed_tokens(tokens)
            cos, sin = self.body.rotary_emb(x[None], positions[None])
            cos, sin = cos[0][:, None, :], sin[0][:, None, :]
            n = tokens.shape[0]
            for i, layer in enumerate(self.body.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(n, s.num_heads, s.head_size)
                k = attn.k_proj(h).view(n, s.num_kv_heads, s.head_size)
                v = attn.v_proj(h).view(n, s.num_kv_heads, s.head_size)
                if hasattr(attn, "q_norm"):  # qwen3
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
                kv.write(i, k, v.contiguous(), step)
                o = kv.attend(i, q, step, self.scale)
                x = x + attn.o_proj(o.reshape(n, s.num_heads * s.head_size))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            last = self.body.norm(x[step.last])
            return self.hf.lm_head(last).float()


def _rotate(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotary embedding as transformers' ``apply_rotary_pos_emb`` (halves, not pairs)."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()
