"""The x-split K layout and the V layout: shapes, index math, token views."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels.layout import k_offset, k_tokens_view, kv_cache_shapes, v_offset, v_tokens_view, x_of


@pytest.mark.parametrize(
    "dtype,x", [(torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8), (torch.float8_e4m3fn, 16), (torch.float8_e5m2, 16)]
)
def test_x_is_16_bytes_of_elements(dtype: torch.dtype, x: int) -> None:
    assert x_of(dtype) == x


def test_seed_example_shape() -> None:
    k, v = kv_cache_shapes(7, 2, 128, 16, torch.float16)
    assert k == (7, 2, 16, 16, 8) and v == (7, 2, 128, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_offsets_match_strides_and_views(dtype: torch.dtype) -> None:
    nb, h, d, bs = 3, 2, 64, 8
    x = x_of(dtype)
    k_shape, v_shape = kv_cache_shapes(nb, h, d, bs, dtype)
    k = torch.arange(torch.Size(k_shape).numel()).view(k_shape)
    v = torch.arange(torch.Size(v_shape).numel()).view(v_shape)
    kt, vt = k_tokens_view(k), v_tokens_view(v)
    for blk, head, dim, off in [(0, 0, 0, 0), (2, 1, 63, 7), (1, 0, x - 1, 3), (1, 1, x, 5), (2, 0, 37, 1)]:
        flat_k = k_offset(blk, head, dim, off, num_kv_heads=h, head_size=d, block_size=bs, x=x)
        assert k[blk, head, dim // x, off, dim % x] == flat_k
        assert kt[blk, off, head].reshape(d)[dim] == flat_k
        flat_v = v_offset(blk, head, dim, off, num_kv_heads=h, head_size=d, block_size=bs)
        assert v[blk, head, dim, off] == flat_v == vt[blk, off, head, dim]


def test_one_token_key_is_16_byte_chunks_block_size_apart() -> None:
    # consecutive chunks of one token's key are block_size * 16 bytes apart;
    # the x elements inside a chunk are contiguous
    h, d, bs, x = 1, 64, 16, 8
    kw = dict(num_kv_heads=h, head_size=d, block_size=bs, x=x)
    assert k_offset(0, 0, 1, 5, **kw) - k_offset(0, 0, 0, 5, **kw) == 1
    assert k_offset(0, 0, x, 5, **kw) - k_offset(0, 0, 0, 5, **kw) == bs * x
    assert k_offset(0, 0, 0, 6, **kw) - k_offset(0, 0, 0, 5, **kw) == x


def test_head_size_must_split_into_chunks() -> None:
    with pytest.raises(ValueError, match="head_size"):
        kv_cache_shapes(1, 1, 20, 16, torch.float8_e4m3fn)
