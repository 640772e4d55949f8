"""The CUDA kernels against their CPU references (needs a GPU and cupy).

Copies and FP8 quantisation must be bit-exact; attention within dtype
tolerances of the float32 reference. Run by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tierkv.kernels import copy_blocks, gather_blocks, kv_cache_shapes, paged_attention, reshape_and_cache, scatter_blocks
from tierkv.kernels.specs import BLOCK_SIZES, HEAD_SIZES
from tierkv.kernels.testing import make_paged_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU kernel tests skipped", allow_module_level=True)
cupy = pytest.importorskip("cupy")  # the skip reason carries the import error

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRID = list(itertools.product(DTYPES, ("same", *FP8), HEAD_SIZES, BLOCK_SIZES))


def _attention(case, **kw) -> torch.Tensor:
    return paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                           case.scale, k_scale=case.k_scale, v_scale=case.v_scale, **kw)


@pytest.mark.parametrize("dtype,cache,head_size,block_size", GRID)
def test_attention_kernels_match_reference(dtype, cache, head_size, block_size) -> None:
    cache_dtype = dtype if cache == "same" else cache
    lens = [1, block_size + 3, 2 * block_size, 700]  # 700: two v2 partitions
    cpu = make_paged_case(lens, 8, 2, head_size, block_size, dtype, cache_dtype, seed=head_size * block_size)
    gpu = make_paged_case(lens, 8, 2, head_size, block_size, dtype, cache_dtype, seed=head_size * block_size, device="cuda")
    expected = _attention(cpu).float()
    for version in ("v1", "v2", "auto"):
        got = _attention(gpu, version=version).float().cpu()
        assert not got.isnan().any(), version
        torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m: f"{version}: {m}")


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn)])
def test_attention_long_context_and_many_partitions(dtype, cache_dtype) -> None:
    lens = [9000, 513, 1, 4096]
    cpu = make_paged_case(lens, 32, 8, 128, 16, dtype, cache_dtype, seed=11)
    gpu = make_paged_case(lens, 32, 8, 128, 16, dtype, cache_dtype, seed=11, device="cuda")
    expected = _attention(cpu).float()
    for version in ("v2", "auto"):
        torch.testing.assert_close(_attention(gpu, version=version).float().cpu(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,cache", list(itertools.product(DTYPES, ("same", *FP8))))
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (128, 16), (256, 32)])
def test_reshape_and_cache_bit_exact(dtype, cache, head_size, block_size) -> None:
    cache_dtype = dtype if cache == "same" else cache
    g = torch.Generator().manual_seed(head_size)
    n, h, nb = 50, 4, 16
    key = (torch.randn(n, h, head_size, generator=g) * 30).to(dtype)
    value = (torch.randn(n, h, head_size, generator=g) * 30).to(dtype)
    slots = torch.randperm(nb * block_size, generator=g)[:n]
    slots[::7] = -1
    k_shape, v_shape = kv_cache_shapes(nb, h, head_size, block_size, cache_dtype)
    caches = [torch.zeros(k_shape, dtype=cache_dtype), torch.zeros(v_shape, dtype=cache_dtype)]
    gpu_caches = [c.cuda() for c in caches]
    reshape_and_cache(key, value, *caches, slots, k_scale=0.07, v_scale=0.3)
    reshape_and_cache(key.cuda(), value.cuda(), *gpu_caches, slots.cuda(), k_scale=0.07, v_scale=0.3)
    for c, gc in zip(caches, gpu_caches):
        assert torch.equal(c.view(torch.uint8), gc.cpu().view(torch.uint8))


def _layers(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(40, 2, 16, 8, 64, generator=g).to(torch.bfloat16)  # K/V halves, strided rows
    layers = [fused[:, 0], fused[:, 1], torch.randn(40, 8, 16, 16, generator=g).to(torch.float8_e5m2)]
    return [t.to(device) for t in layers]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("staging_on", ["cuda", "pinned"])
@pytest.mark.parametrize("odd", [False, True])
def test_gather_scatter_bit_exact(staging_on: str, odd: bool) -> None:
    cpu = _layers("cpu") + ([torch.randint(0, 256, (40, 100), dtype=torch.uint8)] if odd else [])
    gpu = [t.cuda() for t in cpu]  # (the odd 100-byte page forces the byte-wise kernel)
    ids = torch.tensor([39, 0, 17, 17, 3])
    total = sum(c[0].numel() * c.element_size() for c in cpu)
    expected = gather_blocks(cpu, ids, torch.empty(len(ids), total, dtype=torch.uint8))
    out = torch.empty(len(ids), total, dtype=torch.uint8, device="cuda" if staging_on == "cuda" else "cpu",
                      pin_memory=staging_on == "pinned")
    gather_blocks(gpu, ids.cuda() if staging_on == "cuda" else ids, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)

    uniq = torch.tensor([5, 30, 1])
    staging = torch.randint(0, 256, (3, total), dtype=torch.uint8)
    staging_dev = staging.cuda() if staging_on == "cuda" else staging.pin_memory()
    scatter_blocks(staging, cpu, uniq)
    scatter_blocks(staging_dev, gpu, uniq)
    torch.cuda.synchronize()
    for c, gc in zip(cpu, gpu):
        assert torch.equal(_bytes(c), _bytes(gc))


def test_copy_blocks_bit_exact_in_one_launch() -> None:
    cpu = _layers("cpu")
    gpu = [t.cuda() for t in cpu]
    mapping = [(1, 20), (1, 21), (7, 0), (39, 38)]
    copy_blocks(cpu, mapping)
    copy_blocks(gpu, torch.tensor(mapping).cuda())
    for c, gc in zip(cpu, gpu):
        assert torch.equal(_bytes(c), _bytes(gc))


def test_cupy_arrays_via_dlpack_and_side_stream() -> None:
    pool = cupy.arange(64 * 256, dtype=cupy.uint8).reshape(64, 256)
    out = cupy.zeros((3, 256), dtype=cupy.uint8)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gather_blocks([pool], [4, 60, 9], out)
    stream.synchronize()
    assert bool((out == pool[cupy.array([4, 60, 9])]).all())


def test_bad_block_id_raises_before_launch() -> None:
    pool = torch.zeros(8, 64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="^block_ids"):
        gather_blocks([pool], torch.tensor([1, 8], device="cuda"), torch.empty(2, 64, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="^out"):
        gather_blocks([pool], [1, 2], torch.empty(2, 64, dtype=torch.uint8))  # host staging not pinned
