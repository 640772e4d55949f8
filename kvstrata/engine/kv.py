"""The engine's paged KV cache: one K and one V tensor per layer in the kernels'
layout, written by ``reshape_and_cache`` and read by attention through the
block table.

* :class:`StepBatch`: the attention metadata of one forward step (the new
  tokens of every sequence, flattened: their slots, each sequence's block
  table and length).
* :class:`PagedKV`: the caches. ``caches`` lists them as kvstrata sees a block
  (layer 0 K, layer 0 V, layer 1 K, ...): :class:`~kvstrata.TieredKVCache`
  moves a block's pages in every one of them between the tiers.

Decode (one new token per sequence) runs ``paged_attention`` over the whole
batch; prefill reads each sequence's K/V back from its pages (the cached
prefix and the tokens just written alike) and runs causal attention over it,
so a block loaded from a lower tier is read exactly like one computed here.
Both dispatch by device: torch references on CPU, the CUDA kernels for CUDA
tensors (prefill's gather and softmax are torch ops on either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvstrata.errors import ConfigError
from kvstrata.kernels import kv_cache_shapes, paged_attention, reshape_and_cache
from kvstrata.kernels.attention import check_scales
from kvstrata.kernels.layout import FP8_DTYPES, dequantize, k_tokens_view, v_tokens_view

__all__ = ["KV_DTYPES", "PagedKV", "StepBatch", "cache_dtype"]

#: KV cache dtype names (``model.kv_dtype``, vLLM's ``--kv-cache-dtype``) -> torch dtype
KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def cache_dtype(name: str, activation: torch.dtype, key: str = "kv_cache_dtype") -> torch.dtype:
    """The cache dtype ``name`` selects for ``activation``: ``auto`` is the activation
    dtype; the kernels store K/V either in the activation dtype or in FP8."""
    if name == "auto":
        return activation
    dtype = KV_DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"{key}: {name!r} is not one of auto, {', '.join(KV_DTYPES)}")
    if dtype not in FP8_DTYPES and dtype != activation:
        raise ConfigError(f"{key}: {name} cannot hold the model's {str(activation).removeprefix('torch.')} "
                          f"activations: the cache is stored in the activation dtype or in FP8")
    return dtype


@dataclass
class StepBatch:
    """One forward step: sequence ``s`` adds ``query_lens[s]`` tokens after the
    ``context_lens[s]`` it has in the cache."""

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor      # [num_seqs] int32: context + query
    last: torch.Tensor          # [num_seqs] int64: each sequence's last token in the flat batch
    max_seq_len: int

    @property
    def decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def build(cls, block_size: int, tables: Sequence[Sequence[int]], context_lens: Sequence[int],
              query_lens: Sequence[int], device: torch.device) -> "StepBatch":
        slots: list[int] = []
        for table, ctx, n in zip(tables, context_lens, query_lens):
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n))
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        width = max(len(t) for t in tables)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]
        ends = torch.tensor(query_lens, dtype=torch.int64).cumsum(0) - 1
        return cls(list(query_lens), list(context_lens),
                   torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor(padded, dtype=torch.int32, device=device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   ends.to(device), max(seq_lens))


class PagedKV:
    """Per-layer K/V caches of ``num_blocks`` blocks; FP8 caches store ``x / scale``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, *, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        try:
            check_scales(1.0, k_scale, v_scale)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        k_shape, v_shape = kv_cache_shapes(num_blocks, num_kv_heads, head_size, block_size, dtype)
        self.key_caches = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.dtype = dtype
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)

    @property
    def caches(self) -> list[torch.Tensor]:
        """Every cache in block order: layer 0 K, layer 0 V, layer 1 K, ..."""
        return [c for pair in zip(self.key_caches, self.value_caches) for c in pair]

    def block_nbytes(self) -> int:
        return sum(c[0].numel() * c.element_size() for c in self.caches)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: StepBatch) -> None:
        """Store the step's new K/V ([num_tokens, num_kv_heads, head_size]) in their slots."""
        reshape_and_cache(key, value, self.key_caches[layer], self.value_caches[layer], step.slot_mapping,
                          k_scale=self.k_scale, v_scale=self.v_scale, check_indices=False)

    def attend(self, layer: int, query: torch.Tensor, step: StepBatch, scale: float) -> torch.Tensor:
        """Attention of the step's queries ([num_tokens, num_heads, head_size]) over
        the cache, causal within each sequence; the output has the query's shape."""
        kc, vc = self.key_caches[layer], self.value_caches[layer]
        if step.decode:
            return paged_attention(query, kc, vc, step.block_tables, step.seq_lens, scale, k_scale=self.k_scale,
                                   v_scale=self.v_scale, max_seq_len=step.max_seq_len, check_indices=False)
        out = torch.empty_like(query)
        start = 0
        for s, (ctx, n) in enumerate(zip(step.context_lens, step.query_lens)):
            k, v = self._sequence_kv(kc, vc, step.block_tables[s], ctx + n)
            out[start:start + n] = causal_attention(query[start:start + n], k, v, ctx, scale)
            start += n
        return out

    def _sequence_kv(self, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                     length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' K and V of one sequence, float32 [length, heads, head_size]."""
        blocks = table[:math.ceil(length / self.block_size)].long()
        heads, head_size = kc.shape[1], vc.shape[2]
        k = k_tokens_view(kc)[blocks].reshape(-1, heads, head_size)[:length]
        v = v_tokens_view(vc)[blocks].reshape(-1, heads, head_size)[:length]
        return dequantize(k, self.k_scale), dequantize(v, self.v_scale)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: int,
                     scale: float) -> torch.Tensor:
    """Softmax attention in float32 of ``n`` queries at positions ``context ..
    context + n - 1`` over keys ``0 .. context + n - 1`` (query i sees keys up to its
    own position); GQA: query head h reads KV head ``h // (heads / kv_heads)``."""
    n, heads, head_size = query.shape
    kv_heads = key.shape[1]
    q = query.float().view(n, kv_heads, heads // kv_heads, head_size)
    scores = torch.einsum("nkgd,lkd->kgnl", q, key) * scale
    future = torch.arange(key.shape[0], device=key.device)[None, :] > (
        context + torch.arange(n, device=key.device))[:, None]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("kgnl,lkd->nkgd", probs, value).reshape(n, heads, head_size).to(query.dtype)
