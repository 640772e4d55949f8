"""The kernels' pure device helpers, built for the host by nvcc and checked exhaustively
on this CPU machine: every FP8 code through the decoder, every fp16 and bf16 value (and
float32 edge cases) through the encoder, element offsets past 2^31, the split-K combine,
against torch, numpy and kvstrata's CPU references (the kernels' contract). And the device build of the FP8
helpers, with cupy's -ftz=true, holds no float arithmetic that flush-to-zero could
change: the GPU computes the bits the host test checked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.kernels import compile_check
from kvstrata.kernels.layout import k_offset, quantize_fp8, v_offset
from kvstrata.kernels.sources import cuda_dir

NVCC = compile_check.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the host build of the helpers cannot run")
SOURCE = Path(__file__).parent / "cuda" / "helpers_host.cu"
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module")
def helpers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("helpers") / "helpers_host"
    subprocess.run([NVCC, "-std=c++17", "-O2", "--Werror", "all-warnings", "-I", str(cuda_dir()),
                    "-o", str(exe), str(SOURCE)], check=True, capture_output=True, text=True)
    return exe


def run(exe: Path, mode: str, data: bytes = b"") -> bytes:
    return subprocess.run([str(exe), mode], input=data, capture_output=True, check=True).stdout


def test_every_fp8_code_decodes_like_torch(helpers: Path) -> None:
    """Subnormals exactly (they used to become 0 under -ftz=true), NaN as NaN (E4M3 0x7f
    used to decode as 480, E5M2 0x7c-0x7f as 65536-114688), E5M2 infinities as inf."""
    out = np.frombuffer(run(helpers, "decode"), dtype=np.uint32).reshape(2, 256)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for row, fmt in zip(out, FORMATS):
        want = codes.view(fmt).float().numpy()
        got = row.view(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # bit for bit, -0 too
    e4m3 = out[0].view(np.float32)
    assert e4m3[1] == 2.0**-9 and e4m3[0x87] == -7 * 2.0**-9 and np.isnan(e4m3[0x7F]) and np.isnan(e4m3[0xFF])
    e5m2 = out[1].view(np.float32)
    assert e5m2[1] == 2.0**-16 and e5m2[0x7C] == np.inf and e5m2[0xFC] == -np.inf and np.isnan(e5m2[0x7D])


def _float32_inputs() -> np.ndarray:
    """Every fp16 and every bf16 value as float32, and float32 values where rounding and
    saturation turn: float32 denormals, the neighbours of every FP8 value and of the
    midpoints between them, the largest finite values, infinities."""
    all16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    values = [all16.view(torch.float16).float().numpy(), all16.view(torch.bfloat16).float().numpy()]
    tiny = np.array([1, 2, 0x7FFFFF, 0x800000, 0x800001], dtype=np.uint32).view(np.float32)
    values += [tiny, -tiny, np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0], np.float32)]
    for fmt in FORMATS:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float().numpy()
        grid = np.sort(grid[np.isfinite(grid)])
        mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
        for v in (grid, mids):
            bits = v.view(np.uint32)
            values += [v, (bits + 1).view(np.float32), (bits - 1).view(np.float32)]
    return np.concatenate(values).astype(np.float32)


def test_every_fp16_and_bf16_value_encodes_like_the_reference(helpers: Path) -> None:
    """The kernels' FP8 contract (kvstrata.kernels.layout.quantize_fp8: saturate, then round
    to nearest even), bit for bit; a NaN stays a NaN."""
    x = _float32_inputs()
    out = np.frombuffer(run(helpers, "encode", x.tobytes()), dtype=np.uint8).reshape(2, -1)
    nan_in = np.isnan(x)
    for got, fmt in zip(out, FORMATS):
        want = quantize_fp8(torch.from_numpy(x), 1.0, fmt).view(torch.uint8).numpy()
        got_nan = np.isnan(torch.from_numpy(got.copy()).view(fmt).float().numpy())
        assert np.array_equal(got_nan, nan_in), fmt
        bad = np.flatnonzero((got != want) & ~nan_in)
        assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


def test_offsets_hold_past_2_31_elements(helpers: Path) -> None:
    rng = np.random.default_rng(0)
    cases = []
    for head_size, block_size, x in [(64, 8, 16), (128, 16, 8), (256, 32, 4)]:
        for block in (0, 1, 2**31 // (head_size * block_size) + 3, 2**40 // (head_size * block_size * 8)):
            heads = int(rng.integers(1, 9))
            cases.append((block, heads, int(rng.integers(0, heads)), head_size, block_size, x,
                          int(rng.integers(0, block_size)), int(rng.integers(0, head_size))))
    text = "".join(" ".join(map(str, c)) + "\n" for c in cases)
    got = [tuple(map(int, line.split())) for line in run(helpers, "offsets", text.encode()).decode().splitlines()]
    want = [(k_offset(b, h, d, off, num_kv_heads=n, head_size=hs, block_size=bs, x=x),
             v_offset(b, h, d, off, num_kv_heads=n, head_size=hs, block_size=bs))
            for b, n, h, hs, bs, x, off, d in cases]
    assert got == want
    assert max(k for k, _ in got) > 2**39


@pytest.mark.parametrize("sizes,shift", [([7], 0.0), ([512, 512, 100], 0.0), ([512, 3, 512], 80.0),
                                         ([512] * 40, -30.0)])
def test_split_k_combine_equals_one_softmax(helpers: Path, sizes: list[int], shift: float) -> None:
    """v2's reduce over partitions of a context (their max logit, sum of exponentials and
    normalised output) equals the softmax over the whole context; ``shift`` moves the
    middle partition's logits far from the others (exp of the raw logits would overflow
    or vanish in float32: only the rescaling by the global max keeps it exact)."""
    rng = np.random.default_rng(len(sizes))
    dim = 16
    logits = [rng.normal(size=n) * 3 + (shift if i == len(sizes) // 2 else 0.0) for i, n in enumerate(sizes)]
    values = [rng.normal(size=(n, dim)) for n in sizes]
    lines = [f"{len(sizes)} {dim}"]
    for lg, v in zip(logits, values):
        m = np.float32(lg.max())
        e = np.exp(lg - m)
        lines.append(" ".join(f"{float(x):.9g}" for x in [m, e.sum(), *(e @ v / e.sum())]))
    got = np.array(run(helpers, "combine", "\n".join(lines).encode()).split(), dtype=np.float64)
    all_logits, all_values = np.concatenate(logits), np.concatenate(values)
    p = np.exp(all_logits - all_logits.max())
    want = p @ all_values / p.sum()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


_PTX_PROBE = r"""
#include "kvstrata_types.cuh"
extern "C" __global__ void probe(const unsigned char* c, const float* f, float* o, unsigned char* e) {
  const int i = threadIdx.x;
  o[2 * i] = tkv::decode_e4m3(c[i]);
  o[2 * i + 1] = tkv::decode_e5m2(c[i]);
  e[2 * i] = tkv::encode_e4m3(f[i]);
  e[2 * i + 1] = tkv::encode_e5m2(f[i]);
}
"""


def test_fp8_helpers_do_no_float_arithmetic_on_the_device(tmp_path: Path) -> None:
    """Built as cupy builds the kernels (-ftz=true): the PTX of the FP8 conversions has no
    f32 arithmetic, comparison or conversion, only integer operations and bit moves, so
    flush-to-zero cannot change a result (a multiply by 2^120 of a denormal did)."""
    src = tmp_path / "probe.cu"
    src.write_text(_PTX_PROBE, encoding="utf-8")
    ptx = tmp_path / "probe.ptx"
    from kvstrata.kernels.runtime import CUPY_APPENDED_OPTIONS

    subprocess.run([NVCC, "-std=c++17", "-O3", *CUPY_APPENDED_OPTIONS, "-arch=sm_80", "-ptx", "-I", str(cuda_dir()),
                    "-o", str(ptx), str(src)], check=True, capture_output=True, text=True)
    body = ptx.read_text(encoding="utf-8")
    assert ".entry probe" in body and body.count("st.global") == 4
    float_ops = re.findall(r"^\s*(?:add|sub|mul|fma|div|rcp|min|max|abs|neg|setp|cvt)\S*\.f32\b.*$", body, re.M)
    assert float_ops == []
