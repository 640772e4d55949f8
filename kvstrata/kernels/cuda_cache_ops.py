"""CUDA launcher for reshape_and_cache (arguments already validated)."""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.kernels import specs
from kvstrata.kernels.layout import dtype_name
from kvstrata.kernels.runtime import arg, launch


def reshape_and_cache_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    spec = specs.reshape_and_cache(dtype_name(key.dtype), dtype_name(key_cache.dtype))
    threads = min(512, num_kv_heads * head_size)
    args = (
        arg(key), arg(value), arg(key_cache), arg(value_cache), arg(slot_mapping),
        np.int64(key.stride(0)), np.int64(value.stride(0)),
        np.int32(num_kv_heads), np.int32(head_size), np.int32(key_cache.shape[3]),
        np.float32(1.0 / k_scale), np.float32(1.0 / v_scale),
    )
    launch(spec, key.device, (num_tokens, 1, 1), threads, args)
