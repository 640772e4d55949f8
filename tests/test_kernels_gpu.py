"""The CUDA kernels against their CPU references (needs a GPU and cupy).

Copies and FP8 quantisation must be bit-exact; attention within dtype
tolerances of the float32 reference. Run by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstrata.kernels import copy_blocks, gather_blocks, kv_cache_shapes, paged_attention, reshape_and_cache, scatter_blocks
from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES
from kvstrata.kernels.testing import make_paged_case

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


def _kv_layers(device: str, odd: bool = False) -> list[torch.Tensor]:
    """K and V halves of one fused [blocks, 2, ...] bf16 tensor made on ``device`` (rows
    strided there too), an FP8 layer, and optionally a 100-byte layer (byte accesses)."""
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(40, 2, 16, 8, 64, generator=g).to(torch.bfloat16).to(device)
    layers = [fused[:, 0], fused[:, 1], torch.randn(40, 8, 16, 16, generator=g).to(torch.float8_e5m2).to(device)]
    if odd:
        layers.append(torch.randint(0, 256, (40, 100), dtype=torch.uint8, generator=g).to(device))
    assert not layers[0].is_contiguous()
    return layers


def _page_rows(layers: list[torch.Tensor]) -> torch.Tensor:
    """[blocks, total page bytes]: every block's pages of all layers, as a staging row."""
    return torch.cat([_bytes(c).reshape(c.shape[0], -1) for c in layers], dim=1)


def _staging(rows: int, total: int, on: str, fill: int) -> torch.Tensor:
    t = torch.full((rows, total), fill, dtype=torch.uint8)
    return t.cuda() if on == "cuda" else t.pin_memory()


@pytest.mark.parametrize("staging_on", ["cuda", "pinned"])
@pytest.mark.parametrize("cap", [None, 1, 7])
@pytest.mark.parametrize("odd", [False, True])
def test_gather_scatter_rows_and_thread_caps_bit_exact(staging_on: str, cap, odd: bool) -> None:
    """Strided K/V pages (plus FP8, plus a 100-byte layer forcing byte accesses) into
    chosen rows of a larger staging buffer and back into other blocks, with the grid
    capped at 1 and 7 thread blocks (each block walks many items) and uncapped."""
    pages = _page_rows(_kv_layers("cpu", odd))
    gpu = _kv_layers("cuda", odd)
    ids = torch.tensor([39, 0, 17, 17, 3, 22])
    rows = torch.tensor([10, 2, 7, 0, 13, 5])
    out = _staging(14, pages.shape[1], staging_on, fill=0xA5)
    want = torch.full_like(out.cpu(), 0xA5)
    want[rows] = pages[ids]
    gather_blocks(gpu, ids, out, out_rows=rows.cuda() if staging_on == "cuda" else rows, max_thread_blocks=cap)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)  # rows not named keep their bytes

    uniq, back = torch.tensor([1, 38, 20, 4]), torch.tensor([13, 13, 2, 10])  # row 13 read twice
    scatter_blocks(out, gpu, uniq, staging_rows=back, max_thread_blocks=cap)
    torch.cuda.synchronize()
    expected = pages.clone()
    expected[uniq] = want[back]
    assert torch.equal(_page_rows(gpu), expected)  # other blocks untouched, strided rows included


@pytest.mark.parametrize("cap", [1, 7, None])
def test_large_pages_with_few_thread_blocks(cap) -> None:
    """32 layers of 40 KiB pages (three 16 KiB chunks, the last partial), two of them the
    strided halves of a fused tensor: a capped grid walks every (job, chunk) item, and the
    round trip through scattered rows of pinned memory is bit-exact."""
    g = torch.Generator().manual_seed(9)
    page = 40 * 1024

    def layers() -> list[torch.Tensor]:
        fused = torch.randint(0, 256, (12, 2, 16, page // 16), dtype=torch.uint8, generator=g).cuda()
        rest = [torch.randint(0, 256, (12, page), dtype=torch.uint8, generator=g).cuda() for _ in range(30)]
        return [fused[:, 0].view(torch.bfloat16), fused[:, 1].view(torch.bfloat16), *rest]

    caches, dst = layers(), layers()
    src_pages, dst_pages = _page_rows(caches), _page_rows(dst)
    slab = torch.zeros(20, src_pages.shape[1], dtype=torch.uint8).pin_memory()
    ids, slots = torch.tensor([11, 0, 6, 3]), torch.tensor([19, 4, 0, 12])
    gather_blocks(caches, ids, slab, out_rows=slots, max_thread_blocks=cap)
    torch.cuda.synchronize()
    assert torch.equal(slab[slots], src_pages[ids])
    assert not slab[[s for s in range(20) if s not in slots.tolist()]].any()
    blocks = torch.tensor([1, 2, 5, 7])
    scatter_blocks(slab, dst, blocks, staging_rows=slots, max_thread_blocks=cap)
    torch.cuda.synchronize()
    dst_pages[blocks] = src_pages[ids]
    assert torch.equal(_page_rows(dst), dst_pages)


def test_host_slab_is_registered_in_chunks_and_kernels_address_it(monkeypatch, caplog) -> None:
    """A HostSlab page-locked in 2 MiB chunks (rows straddle chunk boundaries): pinned
    without a warning, seen as pinned by torch, stored into and loaded from directly by
    the kernels, and read back by a plain non_blocking copy_."""
    from kvstrata.tiers import host

    monkeypatch.setattr(host, "PIN_CHUNK_BYTES", 2 << 20)
    caches = _kv_layers("cuda")
    pages = _page_rows(_kv_layers("cpu"))
    with caplog.at_level("WARNING", logger=host.__name__):
        slab = host.HostSlab(128, pages.shape[1], pin_memory=True)
    assert slab.pinned and slab.tensor.is_pinned() and not caplog.records
    assert slab.tensor.numel() > 4 << 20 and slab.tensor[-1].is_pinned()  # three chunks
    ids, slots = torch.tensor([3, 9, 27, 39]), torch.tensor([127, 30, 0, 61])
    gather_blocks(caches, ids, slab.tensor, out_rows=slots, max_thread_blocks=7)
    torch.cuda.synchronize()
    assert torch.equal(slab.tensor[slots], pages[ids])
    blocks = torch.tensor([0, 1, 2, 5])
    scatter_blocks(slab.tensor, caches, blocks, staging_rows=slots)
    torch.cuda.synchronize()
    pages[blocks] = pages[ids]
    assert torch.equal(_page_rows(caches), pages)
    flat = torch.empty(slab.tensor.numel(), dtype=torch.uint8, device="cuda")
    flat.copy_(slab.tensor.view(-1), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(flat.cpu(), slab.tensor.view(-1))
    del slab, flat  # the chunks are unregistered before the memory is unmapped


def test_rows_on_the_device_are_validated_before_launch() -> None:
    pool = torch.zeros(8, 64, dtype=torch.uint8, device="cuda")
    out = torch.zeros(4, 64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="^out_rows: value 4 out of range"):
        gather_blocks([pool], [1, 2], out, out_rows=torch.tensor([0, 4], device="cuda"))
    with pytest.raises(ValueError, match="^out_rows: values must be distinct"):
        gather_blocks([pool], [1, 2], out, out_rows=torch.tensor([3, 3], device="cuda"))
    with pytest.raises(ValueError, match="^staging_rows: value -1"):
        scatter_blocks(out, [pool], [1, 2], staging_rows=torch.tensor([-1, 0], device="cuda"))
    assert not pool.any() and not out.any()


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


# ---------------------------------------------------------------------- what a careful read found

@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_every_fp8_code_decodes_bit_exact_through_attention(fp8, version) -> None:
    """One token, v_scale 1: out[d] is V row d's code, decoded. Subnormal codes used to
    decode to 0 (cupy's -ftz=true), NaN codes to finite values."""
    k_shape, v_shape = kv_cache_shapes(1, 1, 256, 8, fp8)
    key = torch.zeros(k_shape, dtype=torch.uint8).view(fp8)
    value = torch.zeros(v_shape, dtype=torch.uint8)
    value[0, 0, :, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    value = value.view(fp8)
    query = torch.ones(1, 1, 256)
    out = paged_attention(query.cuda(), key.cuda(), value.cuda(), torch.zeros(1, 1, dtype=torch.int32).cuda(),
                          torch.ones(1, dtype=torch.int32).cuda(), 1.0, k_scale=1.0, v_scale=1.0,
                          version=version).cpu()[0, 0]
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("version", ["v1", "v2", "auto"])
def test_max_seq_len_below_the_longest_sequence_raises(version) -> None:
    gpu = make_paged_case([5, 700], 4, 2, 64, 16, torch.float16, torch.float16, device="cuda")
    with pytest.raises(ValueError, match="^max_seq_len"):
        _attention(gpu, version=version, max_seq_len=600)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_sequences_of_length_zero_give_zeros(version) -> None:
    lens = [700, 0, 9, 0]
    gpu = make_paged_case([max(n, 1) for n in lens], 4, 2, 128, 16, torch.bfloat16, torch.bfloat16, device="cuda")
    cpu = make_paged_case([max(n, 1) for n in lens], 4, 2, 128, 16, torch.bfloat16, torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(gpu.query, float("nan"))
    paged_attention(gpu.query, gpu.key_cache, gpu.value_cache, gpu.block_tables, seq_lens.cuda(), gpu.scale,
                    out=out, version=version)
    want = paged_attention(cpu.query, cpu.key_cache, cpu.value_cache, cpu.block_tables, seq_lens, cpu.scale)
    torch.testing.assert_close(out.float().cpu(), want.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())) and not out.isnan().any()


def test_forced_v1_above_48_kib_of_shared_memory_and_its_limit() -> None:
    """20K tokens: 80 KiB of logits (the opt-in path, set on the right device); past the
    device's opt-in limit a ValueError instead of a CUDA error."""
    cpu = make_paged_case([20_000, 3], 8, 8, 128, 16, torch.float16, torch.float16, seed=4)
    gpu = make_paged_case([20_000, 3], 8, 8, 128, 16, torch.float16, torch.float16, seed=4, device="cuda")
    torch.testing.assert_close(_attention(gpu, version="v1").float().cpu(), _attention(cpu).float(),
                               atol=TOL[torch.float16], rtol=TOL[torch.float16])
    with torch.cuda.device(0):
        with pytest.raises(ValueError, match="^max_seq_len: v1 over"):
            _attention(gpu, version="v1", max_seq_len=200_000)


@pytest.mark.parametrize("page_bytes", [32 * 1024, 2 * 1024**2])
def test_copy_gather_scatter_of_large_pages(page_bytes) -> None:
    """Pages above one chunk (16 KiB): every chunk of the grid's y dimension."""
    g = torch.Generator().manual_seed(page_bytes % 1000)
    cpu = [torch.randint(0, 256, (6, page_bytes), dtype=torch.uint8, generator=g)]
    gpu = [cpu[0].cuda()]
    ids = torch.tensor([5, 0, 3])
    out = torch.empty(3, page_bytes, dtype=torch.uint8, device="cuda")
    gather_blocks(gpu, ids.cuda(), out)
    assert torch.equal(out.cpu(), cpu[0][ids])
    staging = torch.randint(0, 256, (2, page_bytes), dtype=torch.uint8, generator=g)
    scatter_blocks(staging.cuda(), gpu, torch.tensor([1, 4]).cuda())
    copy_blocks(gpu, torch.tensor([[1, 2]]).cuda())
    torch.cuda.synchronize()
    want = cpu[0].clone()
    want[[1, 4]] = staging
    want[2] = want[1]
    assert torch.equal(gpu[0].cpu(), want)


def test_a_pool_past_2_gib_gives_the_same_results_at_high_block_ids() -> None:
    """FP8 K and V caches of 2.2 GiB each: offsets past 2^31 elements. The same
    sequences copied to the lowest and the highest block ids attend identically."""
    case = make_paged_case([40, 300], 8, 2, 128, 16, torch.float16, torch.float8_e4m3fn, extra_blocks=0)
    used = case.key_cache.shape[0]
    slab = 2 * 128 * 16  # elements of one block (both KV heads)
    num_blocks = 2**31 // slab + used + 64
    caches = []
    for small in (case.key_cache, case.value_cache):
        big = torch.empty((num_blocks, *small.shape[1:]), dtype=small.dtype, device="cuda")
        big.view(torch.uint8)[:used] = small.view(torch.uint8).cuda()
        big.view(torch.uint8)[-used:] = small.view(torch.uint8).cuda()
        caches.append(big)
    table = case.block_tables.clone()
    valid = table < used
    high = torch.where(valid, table + (num_blocks - used), table)
    low_out = paged_attention(case.query.cuda(), *caches, table.cuda(), case.seq_lens.cuda(), case.scale,
                              k_scale=case.k_scale, v_scale=case.v_scale)
    high_out = paged_attention(case.query.cuda(), *caches, high.cuda(), case.seq_lens.cuda(), case.scale,
                               k_scale=case.k_scale, v_scale=case.v_scale)
    assert torch.equal(low_out, high_out)
    torch.testing.assert_close(low_out.float().cpu(), _attention(case).float(), atol=2e-3, rtol=2e-3)


def test_reshape_and_cache_with_strided_keys() -> None:
    """Keys and values as slices of a fused QKV projection (rows strided, rows contiguous)."""
    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(30, 3, 4, 64, generator=g) * 10).to(torch.float16)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    k_shape, v_shape = kv_cache_shapes(8, 4, 64, 16, torch.float8_e5m2)
    caches = [torch.zeros(k_shape, dtype=torch.float8_e5m2), torch.zeros(v_shape, dtype=torch.float8_e5m2)]
    gpu_caches = [c.cuda() for c in caches]
    slots = torch.randperm(8 * 16, generator=g)[:30]
    reshape_and_cache(key, value, *caches, slots, k_scale=0.5, v_scale=0.25)
    reshape_and_cache(key.cuda(), value.cuda(), *gpu_caches, slots.cuda(), k_scale=0.5, v_scale=0.25)
    for c, gc in zip(caches, gpu_caches):
        assert torch.equal(c.view(torch.uint8), gc.cpu().view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
def test_every_fp16_value_quantises_on_the_gpu_like_the_reference(fp8) -> None:
    """reshape_and_cache of all 65,536 fp16 values (subnormals, ties, inf, NaN) into an FP8
    cache with scale 1: the GPU's bits equal the CPU reference's (a NaN stays a NaN)."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(256, 1, 256)
    k_shape, v_shape = kv_cache_shapes(16, 1, 256, 16, fp8)
    cpu = [torch.zeros(k_shape, dtype=fp8), torch.zeros(v_shape, dtype=fp8)]
    gpu = [c.cuda() for c in cpu]
    slots = torch.arange(256)
    reshape_and_cache(x, x, *cpu, slots, k_scale=1.0, v_scale=1.0)
    reshape_and_cache(x.cuda(), x.cuda(), *gpu, slots.cuda(), k_scale=1.0, v_scale=1.0)
    for c, g in zip(cpu, gpu):
        got, want = g.cpu(), c
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
