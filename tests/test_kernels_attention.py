"""The CPU reference paged attention against dense SDPA over the kernel grid."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstrata.kernels import paged_attention
from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES
from kvstrata.kernels.testing import dense_attention, make_paged_case

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHES = ("same", torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# Every (activation, cache) pair meets every head size and every block size,
# and every (head size, block size) pair is met: 27 of the 81 grid points.
GRID = [
    (dtype, cache, HEAD_SIZES[j], BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)])
    for i, (dtype, cache) in enumerate(itertools.product(DTYPES, CACHES))
    for j in range(len(HEAD_SIZES))
]


@pytest.mark.parametrize("dtype,cache,head_size,block_size", GRID)
def test_reference_matches_sdpa(dtype: torch.dtype, cache, head_size: int, block_size: int) -> None:
    cache_dtype = dtype if cache == "same" else cache
    # lengths: a single token, a partial last block, exactly full blocks, longer
    lens = [1, block_size + 3, 2 * block_size, 75]
    case = make_paged_case(lens, 8, 2, head_size, block_size, dtype, cache_dtype, seed=head_size + block_size)
    out = paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )
    assert out.dtype == dtype and out.shape == case.query.shape
    assert not out.isnan().any(), "NaN from unused cache slots leaked into the output"
    torch.testing.assert_close(out.float(), dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 1), (12, 4)])
def test_gqa_groups(num_heads: int, num_kv_heads: int) -> None:
    case = make_paged_case([5, 40], num_heads, num_kv_heads, 64, 16, torch.float32, torch.float32, seed=7)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_writes_into_out_and_long_context() -> None:
    case = make_paged_case([1500, 9], 4, 2, 128, 32, torch.bfloat16, torch.bfloat16, seed=3)
    out = torch.empty_like(case.query)
    ret = paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale, out=out)
    assert ret is out
    torch.testing.assert_close(out.float(), dense_attention(case), atol=1.6e-2, rtol=1.6e-2)


def test_single_token_returns_its_value() -> None:
    case = make_paged_case([1], 2, 2, 64, 8, torch.float32, torch.float32)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    torch.testing.assert_close(out[0], case.values[0][0], atol=0, rtol=0)


@pytest.mark.parametrize("lens", [[0, 20], [20, 0, 7], [0, 0]])
def test_sequences_of_length_zero_get_zeros(lens: list[int]) -> None:
    """Padding rows of a decode batch: a zero row (the kernels used to leave v1's row
    uninitialised and make v2's reduce produce NaN), the other rows as without them."""
    case = make_paged_case([max(n, 1) for n in lens], 4, 2, 64, 8, torch.float32, torch.float32, seed=5)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(case.query, float("nan"))
    paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, seq_lens, case.scale, out=out)
    dense = dense_attention(case)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
        else:
            torch.testing.assert_close(out[i], dense[i], atol=2e-5, rtol=2e-5)
