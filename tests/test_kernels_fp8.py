"""FP8 quantisation: the reference's error bound and saturation, and a numpy
port of the CUDA encoder/decoder (cuda/kvstrata_types.cuh) checked bit for bit
against torch's conversions, so the device code's arithmetic is verified here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.kernels.layout import FP8_MAX, dequantize, fp8_min_normal, fp8_relative_bound, quantize_fp8

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# (mantissa bits, bias, max code, max value, min normal, 1 / subnormal step, decode shift, decode scale)
PARAMS = {
    torch.float8_e4m3fn: (3, 7, 0x7E, 448.0, 2.0**-6, 512.0, 20, 2.0**120),
    torch.float8_e5m2: (2, 15, 0x7B, 57344.0, 2.0**-14, 65536.0, 21, 2.0**112),
}


def encode_like_kernel(f: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """encode_fp8<MANT, BIAS, MAX_CODE> from kvstrata_types.cuh, vectorised."""
    mant, bias, max_code, max_val, min_normal, sub_scale, _, _ = PARAMS[dtype]
    f = f.astype(np.float32)
    u = f.view(np.uint32)
    sign = (u >> 24) & 0x80
    a = np.abs(f)
    sub = np.rint(np.minimum(a, np.float32(min_normal)) * np.float32(sub_scale)).astype(np.uint32)  # rintf: half to even
    shift = 23 - mant
    ua = a.view(np.uint32).astype(np.uint64)
    ua = ua + ((1 << (shift - 1)) - 1) + ((ua >> shift) & 1)
    exp = (ua >> 23).astype(np.int64) - 127 + bias
    normal = np.minimum((exp << mant) | ((ua >> shift) & ((1 << mant) - 1)).astype(np.int64), max_code)
    code = np.where(a >= max_val, max_code, np.where(a < min_normal, sub, normal))
    return (sign | code.astype(np.uint32)).astype(np.uint8)


def decode_like_kernel(codes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """to_float(fp8e4m3 / fp8e5m2) from kvstrata_types.cuh."""
    *_, shift, scale = PARAMS[dtype]
    b = codes.astype(np.uint32)
    mag = ((b & 0x7F) << shift).view(np.float32) * np.float32(scale)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


@pytest.mark.parametrize("dtype", FP8)
def test_kernel_decoder_matches_torch_on_every_finite_code(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = codes.view(dtype).float()
    finite = expected.isfinite()
    got = torch.from_numpy(decode_like_kernel(codes.numpy(), dtype))
    assert torch.equal(got[finite], expected[finite])


def _probe_values(dtype: torch.dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    codes = np.arange(256, dtype=np.uint8)
    grid = torch.from_numpy(codes).view(dtype).float().numpy()
    grid = grid[np.isfinite(grid)]
    mids = (np.sort(grid)[:-1] + np.sort(grid)[1:]) / 2  # exact ties: round half to even
    spread = rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-8, 6, 20000)
    big = np.array([FP8_MAX[dtype] * 1.02, FP8_MAX[dtype] * 50, 1e30, -1e30], dtype=np.float32)
    return np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), spread, big]).astype(np.float32)


@pytest.mark.parametrize("dtype", FP8)
def test_kernel_encoder_matches_reference_bit_for_bit(dtype: torch.dtype) -> None:
    f = _probe_values(dtype)
    ref = quantize_fp8(torch.from_numpy(f), 1.0, dtype).view(torch.uint8).numpy()
    got = encode_like_kernel(f, dtype)
    bad = np.nonzero(ref != got)[0]
    assert bad.size == 0, f"first mismatch: {f[bad[0]]!r} -> kernel {got[bad[0]]:#x}, reference {ref[bad[0]]:#x}"


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_round_trip_error_within_format_bound(dtype: torch.dtype, scale: float) -> None:
    x = torch.randn(50000, generator=torch.Generator().manual_seed(1)) * 20 * scale
    x = x.clamp(-FP8_MAX[dtype] * scale, FP8_MAX[dtype] * scale)
    y = dequantize(quantize_fp8(x, scale, dtype), scale)
    # relative bound for normals, half a subnormal step below the normal range
    min_normal = fp8_min_normal(dtype) * scale
    sub_step = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[dtype] * scale
    bound = torch.maximum(x.abs() * fp8_relative_bound(dtype) * 1.0001, torch.full_like(x, sub_step / 2 * 1.0001))
    err = (y - x).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert (x.abs() >= min_normal).any()


@pytest.mark.parametrize("dtype", FP8)
def test_saturates_instead_of_overflowing(dtype: torch.dtype) -> None:
    x = torch.tensor([1e9, -1e9, FP8_MAX[dtype] * 1.1])
    y = quantize_fp8(x, 1.0, dtype).float()
    assert y.tolist() == [FP8_MAX[dtype], -FP8_MAX[dtype], FP8_MAX[dtype]]
