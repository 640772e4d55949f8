"""Random paged-attention inputs with a known dense equivalent, for tests and
benchmarks. The cache is filled by plain per-token indexing (independent of
reshape_and_cache), every unused slot holds NaN and every unused block-table
entry is out of range, so a kernel that reads either is caught."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kernels.reference_cache import bits
from kvstrata.kernels.layout import is_fp8, kv_cache_shapes, x_of

UNUSED_TABLE_ENTRY = 2**30  # never a valid block id


@dataclass
class PagedCase:
    query: torch.Tensor        # [S, H, D] activation dtype
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor      # [S] int32
    keys: list[torch.Tensor]    # per sequence [len, KVH, D] float32, as stored (dequantised)
    values: list[torch.Tensor]
    scale: float
    k_scale: float
    v_scale: float


def _nan_fill(t: torch.Tensor) -> None:
    if is_fp8(t.dtype):
        t.view(torch.uint8).fill_(0x7F)  # NaN in both FP8 formats
    else:
        t.fill_(float("nan"))


def make_paged_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    *,
    seed: int = 0,
    extra_blocks: int = 3,
    k_scale: float = 0.05,
    v_scale: float = 0.03,
    device: str | torch.device = "cpu",
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + extra_blocks
    k_shape, v_shape = kv_cache_shapes(num_blocks, num_kv_heads, head_size, block_size, cache_dtype)
    key_cache, value_cache = torch.empty(k_shape, dtype=cache_dtype), torch.empty(v_shape, dtype=cache_dtype)
    _nan_fill(key_cache)
    _nan_fill(value_cache)
    if not is_fp8(cache_dtype):
        k_scale = v_scale = 1.0
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max_blocks), UNUSED_TABLE_ENTRY, dtype=torch.int32)
    x = x_of(cache_dtype)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[s])]
        table[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = _stored(torch.randn(n, num_kv_heads, head_size, generator=g), cache_dtype, k_scale)
        v = _stored(torch.randn(n, num_kv_heads, head_size, generator=g), cache_dtype, v_scale)
        pos = torch.arange(n)
        b, off = torch.tensor(ids, dtype=torch.int64)[pos // block_size], pos % block_size
        # K[b, :, d // x, off, d % x] = k[t, :, d]; V[b, :, d, off] = v[t, :, d]
        bits(key_cache)[b, :, :, off, :] = bits(k).view(n, num_kv_heads, head_size // x, x)
        bits(value_cache)[b, :, :, off] = bits(v)
        keys.append(_dequant(k, k_scale))
        values.append(_dequant(v, v_scale))
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=g).to(dtype)
    return PagedCase(
        query.to(device), key_cache.to(device), value_cache.to(device), table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values,
        head_size**-0.5, k_scale, v_scale,
    )


def _stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    return (x / scale).to(cache_dtype) if is_fp8(cache_dtype) else x.to(cache_dtype)


def _dequant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale if is_fp8(x.dtype) else x.float()


def dense_attention(case: PagedCase) -> torch.Tensor:
    """float32 [S, H, D]: scaled_dot_product_attention over each sequence's
    stored K/V (the GQA groups expanded), independent of the paged layout."""
    outs = []
    num_heads = case.query.shape[1]
    for s, (k, v) in enumerate(zip(case.keys, case.values)):
        group = num_heads // k.shape[1]
        q = case.query[s].float().cpu()[:, None, :]                  # [H, 1, D]
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1)       # [H, T, D]
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, kk, vv, scale=case.scale)[:, 0])
    return torch.stack(outs)
