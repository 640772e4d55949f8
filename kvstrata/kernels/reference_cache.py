"""CPU reference of reshape_and_cache."""

from __future__ import annotations

import torch

from kvstrata.kernels.layout import is_fp8, k_tokens_view, quantize_fp8, v_tokens_view

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as the integer type of the same width (a view), so that
    indexing copies bit patterns of any dtype (fp8 included)."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Store token t's K/V at slot ``slot_mapping[t]`` (skip when negative),
    quantised with ``quantize_fp8`` when the cache is FP8, else bit for bit."""
    block_size = key_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, offset = slots // block_size, slots % block_size
    k, v = key[keep], value[keep]
    if is_fp8(key_cache.dtype):
        k = quantize_fp8(k, k_scale, key_cache.dtype)
        v = quantize_fp8(v, v_scale, value_cache.dtype)
    x = key_cache.shape[4]
    k_view = bits(k_tokens_view(key_cache))
    k_view[block, offset] = bits(k).reshape(k.shape[0], k.shape[1], -1, x)
    bits(v_tokens_view(value_cache))[block, offset] = bits(v)
