"""The paged KV-cache layout (vLLM's legacy paged-attention layout) and its
element types.

    K cache [num_blocks, num_kv_heads, head_size // x, block_size, x]
    V cache [num_blocks, num_kv_heads, head_size, block_size]
    x = 16 bytes // element size   (fp32: 4, fp16/bf16: 8, fp8: 16)

Element d of the key of token slot ``offset`` in ``block`` for KV head ``h``
lives at ``K[block, h, d // x, offset, d % x]``: the 16-byte chunks of one
token's key are contiguous, so a thread reads each with one vector load; V
keeps the token dimension innermost because P.V reduces over tokens.
"""

from __future__ import annotations

import torch

from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES

ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names used in specs)."""
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def x_of(cache_dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk of the K cache's innermost dimension."""
    return 16 // torch.empty((), dtype=cache_dtype).element_size()


def kv_cache_shapes(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, cache_dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K shape, V shape) of one layer's cache."""
    x = x_of(cache_dtype)
    if head_size % x:
        raise ValueError(f"head_size: {head_size} is not a multiple of x={x} for {cache_dtype}")
    k = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    v = (num_blocks, num_kv_heads, head_size, block_size)
    return k, v


def k_offset(block: int, head: int, d: int, offset: int, *, num_kv_heads: int, head_size: int, block_size: int, x: int) -> int:
    """Flat element index of K[block, head, d // x, offset, d % x] in a contiguous K cache."""
    slab = block * num_kv_heads + head
    return ((slab * (head_size // x) + d // x) * block_size + offset) * x + d % x


def v_offset(block: int, head: int, d: int, offset: int, *, num_kv_heads: int, head_size: int, block_size: int) -> int:
    """Flat element index of V[block, head, d, offset] in a contiguous V cache."""
    return ((block * num_kv_heads + head) * head_size + d) * block_size + offset


def k_tokens_view(key_cache: torch.Tensor) -> torch.Tensor:
    """View of a K cache as [num_blocks, block_size, num_kv_heads, head_size // x, x]
    (token-major; a view, writes go to the cache)."""
    return key_cache.permute(0, 3, 1, 2, 4)


def v_tokens_view(value_cache: torch.Tensor) -> torch.Tensor:
    """View of a V cache as [num_blocks, block_size, num_kv_heads, head_size]."""
    return value_cache.permute(0, 3, 1, 2)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8(saturate(x * float32(1 / scale))), rounded to nearest even: the
    kernels' contract, bit for bit."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32).item()  # rounded to float32 like the kernel's argument
    y = x.float() * inv
    return y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of cache elements (times ``scale`` for FP8)."""
    y = x.float()
    return y * scale if is_fp8(x.dtype) else y


def fp8_relative_bound(dtype: torch.dtype) -> float:
    """Worst relative error of round-to-nearest for normal values: 2^-(mantissa bits + 1)."""
    return {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}[dtype]


def fp8_min_normal(dtype: torch.dtype) -> float:
    return {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}[dtype]


SUPPORTED = {"head_size": HEAD_SIZES, "block_size": BLOCK_SIZES}
