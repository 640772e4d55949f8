"""Public reshape_and_cache op: validate, then dispatch by device."""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.kernels import checks
from kvstrata.kernels.attention import check_scales
from kvstrata.kernels.layout import ACTIVATION_DTYPES, FP8_DTYPES, x_of
from kvstrata.kernels.reference_cache import reshape_and_cache_ref
from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES


def reshape_and_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check_indices: bool = True,
) -> None:
    """Write new tokens' K/V into the paged cache.

      key, value   [num_tokens, num_kv_heads, head_size]  fp32 / fp16 / bf16; the
                   token dimension may be strided, the other two are contiguous
      key_cache    [num_blocks, num_kv_heads, head_size // x, block_size, x]  contiguous
      value_cache  [num_blocks, num_kv_heads, head_size, block_size]          contiguous
      slot_mapping [num_tokens] int64: ``block * block_size + offset``; negative = skip
    Token t goes to slot ``slot_mapping[t]``. A cache of the key's dtype gets
    the bits unchanged; an FP8 cache (float8_e4m3fn / float8_e5m2) gets
    ``fp8(saturate(x * float32(1 / scale)))`` rounded to nearest even
    (``layout.quantize_fp8``). ``check_indices`` verifies that slots are below
    ``num_blocks * block_size`` and distinct (one device sync); other checks
    always run and raise ValueError naming the argument before any launch.
    """
    k = checks.as_tensor("key", key)
    v = checks.as_tensor("value", value)
    kc = checks.as_tensor("key_cache", key_cache)
    vc = checks.as_tensor("value_cache", value_cache)
    slots = checks.index_tensor("slot_mapping", slot_mapping)
    _check(k, v, kc, vc, slots)
    check_scales(1.0, k_scale, v_scale)
    checks.same_device(["key", "value", "key_cache", "value_cache", "slot_mapping"], [k, v, kc, vc, slots])
    if check_indices:
        checks.in_range("slot_mapping", slots, -(2**63), kc.shape[0] * kc.shape[3])
        checks.distinct("slot_mapping", slots[slots >= 0])
    if k.device.type == "cpu":
        reshape_and_cache_ref(k, v, kc, vc, slots, k_scale, v_scale)
        return
    from kvstrata.kernels.cuda_cache_ops import reshape_and_cache_cuda

    reshape_and_cache_cuda(k, v, kc, vc, slots, k_scale, v_scale)


def _check(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
    checks.ndim("key", k, 3)
    checks.dtype_in("key", k, ACTIVATION_DTYPES)
    num_tokens, num_kv_heads, head_size = k.shape
    checks.member("head_size", head_size, HEAD_SIZES)
    for name, t in (("key", k), ("value", v)):
        checks.dtype_is(name, t, k.dtype)
        checks.shape(name, t, (num_tokens, num_kv_heads, head_size))
        if t.stride(2) != 1 or t.stride(1) != head_size:
            raise ValueError(f"{name}: heads and head dims must be contiguous (strides {t.stride()})")
    checks.ndim("key_cache", kc, 5)
    checks.dtype_in("key_cache", kc, (k.dtype, *FP8_DTYPES))
    num_blocks, _, _, block_size, _ = kc.shape
    checks.member("block_size", block_size, BLOCK_SIZES)
    x = x_of(kc.dtype)
    checks.shape("key_cache", kc, (num_blocks, num_kv_heads, head_size // x, block_size, x))
    checks.contiguous("key_cache", kc)
    checks.dtype_is("value_cache", vc, kc.dtype)
    checks.shape("value_cache", vc, (num_blocks, num_kv_heads, head_size, block_size))
    checks.contiguous("value_cache", vc)
    checks.ndim("slot_mapping", slots, 1)
    checks.shape("slot_mapping", slots, (num_tokens,))
    checks.contiguous("slot_mapping", slots)
