"""reshape_and_cache (reference path) against plain per-token indexing."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import kv_cache_shapes, reshape_and_cache, x_of
from kvstrata.kernels.layout import quantize_fp8


def _setup(dtype: torch.dtype, cache_dtype: torch.dtype, num_tokens: int = 20, nb: int = 6, h: int = 2, d: int = 64, bs: int = 8):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, h, d, generator=g).to(dtype)
    value = torch.randn(num_tokens, h, d, generator=g).to(dtype)
    k_shape, v_shape = kv_cache_shapes(nb, h, d, bs, cache_dtype)
    kc, vc = torch.zeros(k_shape, dtype=cache_dtype), torch.zeros(v_shape, dtype=cache_dtype)
    slots = torch.randperm(nb * bs, generator=g)[:num_tokens]
    slots[::5] = -1
    return key, value, kc, vc, slots


def _expected_slot(kc: torch.Tensor, vc: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token at ``slot`` read back by plain indexing: K [h, d], V [h, d]."""
    bs = kc.shape[3]
    b, off = divmod(slot, bs)
    return kc[b, :, :, off, :].reshape(kc.shape[1], -1), vc[b, :, :, off]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_same_dtype_is_a_bit_exact_copy(dtype: torch.dtype) -> None:
    key, value, kc, vc, slots = _setup(dtype, dtype)
    reshape_and_cache(key, value, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k, v = _expected_slot(kc, vc, s)
            assert torch.equal(k, key[t]) and torch.equal(v, value[t])
    written = (slots >= 0).sum().item() * key.shape[1] * key.shape[2]
    assert (kc != 0).sum().item() == written and (vc != 0).sum().item() == written, "skipped tokens or other slots were written"


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache_stores_quantised_values(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    key, value, kc, vc, slots = _setup(dtype, cache_dtype)
    reshape_and_cache(key, value, kc, vc, slots, k_scale=0.02, v_scale=0.5)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k, v = _expected_slot(kc, vc, s)
            assert torch.equal(k.view(torch.uint8), quantize_fp8(key[t], 0.02, cache_dtype).view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), quantize_fp8(value[t], 0.5, cache_dtype).view(torch.uint8))


def test_strided_token_dimension() -> None:
    qkv = torch.randn(7, 3, 2, 64)  # e.g. a fused projection: key = qkv[:, 1]
    key, value = qkv[:, 1], qkv[:, 2]
    k_shape, v_shape = kv_cache_shapes(2, 2, 64, 8, torch.float32)
    kc, vc = torch.zeros(k_shape), torch.zeros(v_shape)
    reshape_and_cache(key, value, kc, vc, torch.arange(7))
    for t in range(7):
        k, v = _expected_slot(kc, vc, t)
        assert torch.equal(k, key[t]) and torch.equal(v, value[t])


def test_x_split_places_chunks() -> None:
    key = torch.arange(64, dtype=torch.float16).view(1, 1, 64)
    k_shape, v_shape = kv_cache_shapes(1, 1, 64, 8, torch.float16)
    kc, vc = torch.zeros(k_shape, dtype=torch.float16), torch.zeros(v_shape, dtype=torch.float16)
    reshape_and_cache(key, key, kc, vc, torch.tensor([3]))
    x = x_of(torch.float16)
    assert kc[0, 0, 2, 3].tolist() == list(range(2 * x, 3 * x))
    assert vc[0, 0, :, 3].tolist() == list(range(64))
