"""copy_blocks / gather_blocks / scatter_blocks (reference path) against plain indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.kernels import copy_blocks, gather_blocks, scatter_blocks


def _layers(nb: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(nb, 2, 4, 8, generator=g)  # K and V halves: rows strided
    return [
        torch.randn(nb, 2, 3, 8, generator=g).to(torch.bfloat16),
        fused[:, 0],
        fused[:, 1],
        torch.randint(0, 256, (nb, 48), generator=g, dtype=torch.uint8),
        torch.randn(nb, 16, generator=g).to(torch.float8_e4m3fn),
    ]


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def test_gather_concatenates_layer_pages_in_order() -> None:
    layers = _layers()
    ids = torch.tensor([4, 0, 4, 8])
    total = sum(c[0].numel() * c.element_size() for c in layers)
    out = torch.empty(len(ids), total, dtype=torch.uint8)
    assert gather_blocks(layers, ids, out) is out
    for i, b in enumerate(ids.tolist()):
        expected = torch.cat([_row_bytes(c[b]) for c in layers])
        assert torch.equal(out[i], expected)


def test_scatter_inverts_gather_and_touches_nothing_else() -> None:
    src, dst = _layers(), [torch.zeros_like(c) for c in _layers()]
    ids = [7, 1, 3]
    total = sum(c[0].numel() * c.element_size() for c in src)
    staging = torch.empty(3, total, dtype=torch.uint8)
    gather_blocks(src, ids, staging)
    scatter_blocks(staging, dst, ids)
    for s, d in zip(src, dst):
        sb, db = s.view(torch.uint8) if s.dim() > 1 else s, d.view(torch.uint8)
        assert torch.equal(sb[ids], db[ids])
        others = [b for b in range(s.shape[0]) if b not in ids]
        assert not db[others].any()


def test_uint8_pool_is_the_one_layer_case() -> None:
    pool = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    ids = torch.tensor([15, 2])
    out = gather_blocks([pool], ids, torch.empty(2, 4096, dtype=torch.uint8))
    assert torch.equal(out, pool[ids])
    scatter_blocks(out.flip(0), [pool], ids)
    assert torch.equal(pool[15], out[1]) and torch.equal(pool[2], out[0])


def test_copy_blocks_all_layers() -> None:
    layers = _layers()
    before = [c.clone() for c in layers]
    copy_blocks(layers, [(1, 5), (1, 6), (2, 0)])
    for b, a in zip(before, layers):
        bb, ab = b.view(torch.uint8), a.view(torch.uint8)
        assert torch.equal(ab[5], bb[1]) and torch.equal(ab[6], bb[1]) and torch.equal(ab[0], bb[2])
        assert torch.equal(ab[[1, 2, 3, 4, 7, 8]], bb[[1, 2, 3, 4, 7, 8]])


def test_empty_lists_are_no_ops() -> None:
    layers = _layers()
    copy_blocks(layers, [])
    total = sum(c[0].numel() * c.element_size() for c in layers)
    gather_blocks(layers, [], torch.empty(0, total, dtype=torch.uint8))
    scatter_blocks(torch.empty(0, total, dtype=torch.uint8), layers, torch.empty(0, dtype=torch.int64))


# ---------------------------------------------------------------------- staging rows and thread-block caps

def _total(layers: list[torch.Tensor]) -> int:
    return sum(c[0].numel() * c.element_size() for c in layers)


def _page_row(layers: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.cat([_row_bytes(c[b]) for c in layers])


def test_gather_into_chosen_rows_of_a_larger_buffer() -> None:
    layers = _layers()
    ids, rows = torch.tensor([4, 0, 4, 8]), torch.tensor([9, 2, 0, 5])
    out = torch.full((11, _total(layers)), 7, dtype=torch.uint8)
    expected = out.clone()
    for i, r in zip(ids.tolist(), rows.tolist()):
        expected[r] = _page_row(layers, i)
    assert gather_blocks(layers, ids, out, out_rows=rows) is out
    assert torch.equal(out, expected)  # every other row untouched


def test_scatter_from_chosen_rows_which_may_repeat() -> None:
    src = _layers()
    staging = torch.randint(0, 256, (6, _total(src)), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    ids, rows = [7, 1, 3, 0], [5, 0, 5, 2]
    dst = [c.clone() for c in src]
    scatter_blocks(staging, dst, ids, staging_rows=rows)
    for b in range(src[0].shape[0]):
        got = _page_row(dst, b)
        want = staging[rows[ids.index(b)]] if b in ids else _page_row(src, b)
        assert torch.equal(got, want), b


def test_round_trip_through_slab_slots_with_thread_caps() -> None:
    """Store pages into scattered slots of a slab, load them back into other blocks
    of fresh caches: bytes equal whatever cap is asked for (caps only shape CUDA launches)."""
    src = _layers()
    slots = torch.tensor([6, 1, 3])
    slab = torch.zeros(8, _total(src), dtype=torch.uint8)
    for cap in (None, 1, 7):
        gather_blocks(src, [2, 8, 5], slab, out_rows=slots, max_thread_blocks=cap)
        dst = [torch.zeros_like(c) for c in src]
        scatter_blocks(slab, dst, [0, 1, 2], staging_rows=slots, max_thread_blocks=cap)
        for s, d in zip(src, dst):
            assert torch.equal(_row_bytes(d[[0, 1, 2]]), _row_bytes(s[[2, 8, 5]]))
        assert not slab[[0, 2, 4, 5, 7]].any()


def test_rows_on_a_wide_and_a_narrow_path_agree() -> None:
    """Pages of 48 bytes (int64 words) and of 100 bytes (bytes only) give plain indexing."""
    for page in (48, 100):
        pool = torch.randint(0, 256, (10, page), dtype=torch.uint8)
        out = torch.zeros(5, page, dtype=torch.uint8)
        gather_blocks([pool], [9, 3], out, out_rows=[4, 1])
        assert torch.equal(out[[4, 1]], pool[[9, 3]]) and not out[[0, 2, 3]].any()
        scatter_blocks(out, [pool], [0, 2], staging_rows=[1, 1])
        assert torch.equal(pool[0], pool[3]) and torch.equal(pool[2], pool[3])


@pytest.mark.parametrize("call,name", [
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=[0, 4]), "^out_rows: value 4 out of range"),
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=[-1, 0]), "^out_rows: value -1"),
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=[3, 3]), "^out_rows: values must be distinct"),
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=[3]), r"^out_rows: expected shape \(2,\)"),
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=torch.tensor([0, 1], dtype=torch.int32)), "^out_rows: expected dtype"),
    (lambda p, o: gather_blocks([p], [1, 2], o, out_rows=torch.tensor([[0, 1]])), r"^out_rows: expected shape \(2,\)"),
    (lambda p, o: gather_blocks([p], [1, 2], torch.empty(4, 65, dtype=torch.uint8), out_rows=[0, 1]),
     r"^out: expected shape \[rows, 64\]"),
    (lambda p, o: gather_blocks([p], [1, 9], o, out_rows=[0, 1]), "^block_ids"),
    (lambda p, o: gather_blocks([p], [1, 2], o), r"^out: expected shape \(2, 64\)"),  # no rows: n rows exactly
    (lambda p, o: scatter_blocks(o, [p], [1, 2], staging_rows=[0, 4]), "^staging_rows: value 4 out of range"),
    (lambda p, o: scatter_blocks(o, [p], [1, 1], staging_rows=[0, 1]), "^block_ids: values must be distinct"),
    (lambda p, o: scatter_blocks(o, [p], [1, 2], staging_rows=[0, 1, 2]), "^staging_rows: expected shape"),
])
def test_row_arguments_are_validated(call, name) -> None:
    pool, out = torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=name):
        call(pool, out)
    assert not out.any() and not pool.any()


@pytest.mark.parametrize("cap", [0, -3, True, 2.0, "8", 2**31])
def test_thread_block_cap_is_validated(cap) -> None:
    pool, out = torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(2, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^max_thread_blocks"):
        gather_blocks([pool], [1, 2], out, max_thread_blocks=cap)
    with pytest.raises(ValueError, match="^max_thread_blocks"):
        scatter_blocks(out, [pool], [1, 2], max_thread_blocks=cap)


def test_rows_must_live_on_the_cpu_for_cpu_caches() -> None:
    pool, out = torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(2, 64, dtype=torch.uint8)
    rows = torch.tensor([0, 1], device="meta")
    with pytest.raises(ValueError, match="^out: CPU caches need CPU staging, block_ids and out_rows"):
        gather_blocks([pool], [1, 2], out, out_rows=rows, check_indices=False)


# ---------------------------------------------------------------------- the CUDA launcher, recorded (no GPU here)

@pytest.fixture
def launches(monkeypatch):
    """launch() and arg() replaced by recorders: CUDA cannot run on this machine."""
    from kvstrata.kernels import cuda_block_ops

    calls = []
    monkeypatch.setattr(cuda_block_ops, "arg", lambda t: t)
    monkeypatch.setattr(cuda_block_ops, "launch", lambda spec, device, grid, block, args, smem=0: calls.append((spec, grid, args)))
    monkeypatch.setattr(cuda_block_ops, "_table", lambda device, rows: torch.tensor(rows, dtype=torch.int64))
    return calls


def _kernel_params() -> list[str]:
    import re

    from kvstrata.kernels.sources import read_source

    src = read_source("gather_scatter.cu")
    body = re.search(r"gather_scatter_kernel\(([^)]*)\)", src).group(1)
    plain = [p.replace("__restrict__", "").replace("const ", "").strip() for p in body.split(",")]
    return [re.sub(r"\s+\w+$", "", p).strip() for p in plain]


def test_launch_covers_every_item_within_the_cap(launches) -> None:
    from kvstrata.kernels import cuda_block_ops as ops

    # Two layers: 40 KiB pages (3 chunks of 16 KiB, the last partial) and 16 bytes.
    pools = [torch.zeros(6, 40 * 1024, dtype=torch.uint8), torch.zeros(6, 16, dtype=torch.uint8)]
    staging = torch.zeros(9, 40 * 1024 + 16, dtype=torch.uint8)
    ids, rows = torch.tensor([5, 0, 3]), torch.tensor([8, 1, 4])
    jobs, chunks = 3 * 2, 3
    for cap, want in ((None, ops.HOST_STAGING_THREAD_BLOCKS), (1, 1), (7, 7), (1000, jobs * chunks)):
        ops.gather_scatter_cuda(pools, ids, staging, True, rows, cap)
        spec, grid, args = launches[-1]
        assert grid == (min(want, jobs * chunks), 1, 1), cap
        assert [int(a) for a in args[-2:]] == [jobs, chunks]
        assert int(args[6]) == rows.data_ptr() and int(args[7]) == staging.data_ptr()
        assert torch.equal(args[5], ids)
    ops.gather_scatter_cuda(pools, ids, staging[:3], False)
    spec, grid, args = launches[-1]
    assert int(args[6]) == 0  # no rows: row i
    assert spec.name.endswith("false>") and "uint4" in spec.name
    assert len(args) == len(_kernel_params())
    for ctype, a in zip(_kernel_params(), args):
        if ctype.endswith("*"):
            assert isinstance(a, torch.Tensor), ctype
        else:
            scalar = {"int": np.int32, "long long": np.int64, "unsigned long long": np.uint64}
            assert type(a) is scalar[ctype], (ctype, type(a))


def test_default_cap_applies_to_host_staging_only() -> None:
    from kvstrata.kernels.cuda_block_ops import HOST_STAGING_THREAD_BLOCKS, MAX_GRID_X, thread_blocks

    assert thread_blocks(10**6, None, host_staging=True) == HOST_STAGING_THREAD_BLOCKS
    assert thread_blocks(10**6, None, host_staging=False) == 10**6  # one block per item, as before the cap
    assert thread_blocks(10**12, None, host_staging=False) == MAX_GRID_X
    assert thread_blocks(5, 7, host_staging=False) == 5 and thread_blocks(50, 7, host_staging=False) == 7


# ---------------------------------------------------------------------- the kernel itself, run on the host

# CUDA cannot run here, so the real gather_scatter.cu is compiled by the host C++
# compiler with the CUDA built-ins (blockIdx, threadIdx, gridDim, blockDim, uint4)
# defined as plain globals, and every (thread block, thread) of the launch runs in
# turn. The kernel uses no barriers or shared memory, so this serial order is one
# legal schedule of the same program: it checks the work-item walk, the row
# indirection and the byte windows of the code that the GPU runs.
EMULATOR = r"""
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
struct dim3_ { unsigned int x, y, z; };
static dim3_ blockIdx, threadIdx, gridDim, blockDim;
struct alignas(16) uint4 { unsigned int x, y, z, w; };
using std::min;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#include "gather_scatter.cu"

static long long next() { long long v; if (fread(&v, 8, 1, stdin) != 1) exit(2); return v; }
static unsigned char* buffer(long long n) {
  unsigned char* p = static_cast<unsigned char*>(aligned_alloc(16, (n + 15) / 16 * 16));
  if (n && fread(p, 1, n, stdin) != (size_t)n) exit(3);
  return p;
}

int main() {
  const long long gather = next(), vec = next(), layers = next(), n = next(), m = next(), row_bytes = next();
  const long long grid = next(), threads = next(), jobs = next(), chunks = next(), has_rows = next();
  std::vector<unsigned long long> ptrs(layers);
  std::vector<long long> strides(layers), pages(layers), offsets(layers), sizes(layers), ids(n), rows(n);
  for (long long l = 0; l < layers; ++l) {
    strides[l] = next(); pages[l] = next(); offsets[l] = next(); sizes[l] = next();
    ptrs[l] = reinterpret_cast<unsigned long long>(buffer(sizes[l]));
  }
  for (auto& v : ids) v = next();
  if (has_rows) for (auto& v : rows) v = next();
  unsigned char* staging = buffer(m * row_bytes);
  const unsigned long long rows_ptr = has_rows ? reinterpret_cast<unsigned long long>(rows.data()) : 0;
  const unsigned long long stage_ptr = reinterpret_cast<unsigned long long>(staging);
  gridDim = {(unsigned int)grid, 1, 1};
  blockDim = {(unsigned int)threads, 1, 1};
  for (long long b = grid - 1; b >= 0; --b) {  // any order of thread blocks is legal
    for (unsigned int t = 0; t < threads; ++t) {
      blockIdx = {(unsigned int)b, 0, 0};
      threadIdx = {t, 0, 0};
      auto run = gather ? (vec ? tkv::gather_scatter_kernel<uint4, true> : tkv::gather_scatter_kernel<unsigned char, true>)
                        : (vec ? tkv::gather_scatter_kernel<uint4, false> : tkv::gather_scatter_kernel<unsigned char, false>);
      run(ptrs.data(), strides.data(), pages.data(), offsets.data(), (int)layers, ids.data(), rows_ptr,
          stage_ptr, row_bytes, jobs, chunks);
    }
  }
  for (long long l = 0; l < layers; ++l) fwrite(reinterpret_cast<void*>(ptrs[l]), 1, sizes[l], stdout);
  fwrite(staging, 1, m * row_bytes, stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory):
    import shutil
    import subprocess

    from kvstrata.kernels.sources import cuda_dir

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler: the kernel cannot be emulated")
    work = tmp_path_factory.mktemp("emulator")
    (work / "emulate.cpp").write_text(EMULATOR)
    exe = work / "emulate"
    proc = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-I", str(cuda_dir()),
                           "-x", "c++", str(work / "emulate.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


def _regions(pages: list[int], strides: list[int], nb: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: its whole backing bytes, and the [nb, page] view of its pages in them (the
    bytes between pages belong to no page and must survive)."""
    g = torch.Generator().manual_seed(seed)
    regions = [torch.randint(0, 256, ((nb - 1) * s + p,), dtype=torch.uint8, generator=g) for p, s in zip(pages, strides)]
    return regions, [r.as_strided((nb, p), (s, 1)) for r, p, s in zip(regions, pages, strides)]


def _emulate(exe, launches, gather: bool, regions, layers, ids, staging, rows, cap) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Launch through the real launcher (recorded), then run the recorded launch in the emulator."""
    import subprocess

    from kvstrata.kernels import cuda_block_ops as ops

    ops.gather_scatter_cuda(layers, ids, staging, gather, rows, cap)
    spec, grid, args = launches[-1]
    table = args[:4]
    num_layers, row_bytes, jobs, chunks = int(args[4]), int(args[8]), int(args[9]), int(args[10])
    header = [int(gather), int("uint4" in spec.name), num_layers, ids.numel(), staging.shape[0], row_bytes,
              grid[0], ops.THREADS, jobs, chunks, int(rows is not None)]
    parts = [np.array(header, dtype=np.int64).tobytes()]
    for layer in range(num_layers):
        stride, page, offset = (int(table[i][layer]) for i in (1, 2, 3))
        parts += [np.array([stride, page, offset, regions[layer].numel()], dtype=np.int64).tobytes(),
                  regions[layer].numpy().tobytes()]
    parts.append(ids.numpy().astype(np.int64).tobytes())
    if rows is not None:
        parts.append(rows.numpy().astype(np.int64).tobytes())
    parts.append(staging.numpy().tobytes())
    out = subprocess.run([str(exe)], input=b"".join(parts), capture_output=True, check=True).stdout
    got, at = [], 0
    for r in regions:
        got.append(torch.frombuffer(bytearray(out[at : at + r.numel()]), dtype=torch.uint8))
        at += r.numel()
    assert at + staging.numel() == len(out)
    return got, torch.frombuffer(bytearray(out[at:]), dtype=torch.uint8).reshape(staging.shape)


@pytest.mark.parametrize("cap", [None, 1, 7, 10_000])
@pytest.mark.parametrize("pages,strides", [
    ([40 * 1024, 16, 20 * 1024], [40 * 1024 + 32, 48, 40 * 1024]),  # 16-byte accesses, strided rows, 3 chunks
    ([100, 33 * 1024 + 5, 7], [100, 33 * 1024 + 5, 13]),  # byte accesses, a partial third chunk
])
def test_the_kernel_source_walks_every_item_within_the_cap(emulator, launches, cap, pages, strides) -> None:
    nb, total = 7, sum(pages)
    regions, layers = _regions(pages, strides, nb, seed=len(pages) + sum(pages))
    ids, rows = torch.tensor([6, 0, 3, 3]), torch.tensor([2, 8, 0, 5])
    staging = torch.randint(0, 256, (9, total), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    want_staging = staging.clone()
    gather_blocks(layers, ids, want_staging, out_rows=rows)
    got_regions, got_staging = _emulate(emulator, launches, True, regions, layers, ids, staging, rows, cap)
    assert torch.equal(got_staging, want_staging)
    assert all(torch.equal(g, r) for g, r in zip(got_regions, regions))  # a gather reads pages only
    assert launches[-1][1][0] == (32 if cap is None else min(cap, 4 * 3 * 3))

    blocks, back = torch.tensor([1, 5, 4, 2]), torch.tensor([8, 8, 3, 0])
    want_regions = [r.clone() for r in regions]
    want_layers = [r.as_strided((nb, p), (s, 1)) for r, p, s in zip(want_regions, pages, strides)]
    scatter_blocks(staging, want_layers, blocks, staging_rows=back)
    got_regions, got_staging = _emulate(emulator, launches, False, regions, layers, blocks, staging, back, cap)
    assert torch.equal(got_staging, staging)
    for g, w in zip(got_regions, want_regions):
        assert torch.equal(g, w)  # pages written, the bytes between them untouched

    got_regions, got_staging = _emulate(emulator, launches, True, regions, layers, ids, staging[:4], None, cap)
    want = torch.empty(4, total, dtype=torch.uint8)
    gather_blocks(layers, ids, want)
    assert torch.equal(got_staging, want)  # no rows: row i
