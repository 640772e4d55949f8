"""Public paged-attention op: validate, then dispatch by device."""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import torch

from kvstrata.kernels import checks
from kvstrata.kernels.layout import ACTIVATION_DTYPES, FP8_DTYPES, x_of
from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES
from kvstrata.kernels.reference_attention import paged_attention_ref

MAX_SEQS = 65535  # CUDA grid y


def paged_attention(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, scale: float,
                    *, k_scale: float = 1.0, v_scale: float = 1.0, out: Any | None = None,
                    max_seq_len: int | None = None, version: Literal["auto", "v1", "v2"] = "auto",
                    check_indices: bool = True) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache.

    Shapes (legacy vLLM layout, ``x = 16 // cache element size``):
      query        [num_seqs, num_heads, head_size]          fp32 / fp16 / bf16, contiguous
      key_cache    [num_blocks, num_kv_heads, head_size // x, block_size, x]
      value_cache  [num_blocks, num_kv_heads, head_size, block_size]
                   dtype = query's, or float8_e4m3fn / float8_e5m2 (dequantised as
                   ``value * k_scale`` / ``value * v_scale``), contiguous
      block_tables [num_seqs, max_blocks_per_seq] int32: physical block of each
                   logical block; entries past a sequence's last block are ignored
      seq_lens     [num_seqs] int32, each in [0, max_blocks_per_seq * block_size]
                   (a sequence of length 0, the padding of a decode batch, gets zeros)
    ``out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s`` over the first
    ``seq_lens[s]`` tokens, with query head h reading KV head
    ``h // (num_heads // num_kv_heads)`` (GQA/MQA). head_size in {64, 128, 256},
    block_size in {8, 16, 32}. Returns ``out`` (allocated when None).

    CPU tensors run the float32 torch reference; CUDA tensors (torch, or any
    DLPack producer such as cupy) run the v1 kernel, or the split-K v2 kernel
    (512-token partitions + reduce) for long contexts, chosen by ``version="auto"``,
    on torch's current stream. ``max_seq_len`` (an upper bound of seq_lens: it
    sizes shared memory and the v2 partitions) saves a device sync.
    ``check_indices`` verifies seq_lens, the used block-table entries and
    ``max_seq_len >= max(seq_lens)`` (a few device syncs); with False,
    out-of-range values are undefined behaviour. Every other check always runs;
    a failure is a ValueError naming the argument, raised before anything is
    launched.
    """
    q = checks.as_tensor("query", query)
    kc = checks.as_tensor("key_cache", key_cache)
    vc = checks.as_tensor("value_cache", value_cache)
    bt = checks.as_tensor("block_tables", block_tables)
    sl = checks.as_tensor("seq_lens", seq_lens)
    _check_shapes(q, kc, vc, bt, sl)
    check_scales(scale, k_scale, v_scale)
    if version not in ("auto", "v1", "v2"):
        raise ValueError(f"version: {version!r} is not one of 'auto', 'v1', 'v2'")
    o = _output(out, q)
    checks.same_device(["query", "key_cache", "value_cache", "block_tables", "seq_lens", "out"], [q, kc, vc, bt, sl, o])
    if max_seq_len is not None:
        checks.count("max_seq_len", max_seq_len)
    if q.shape[0] == 0:
        return o
    if check_indices:
        _check_indices(bt, sl, kc.shape[0], kc.shape[3], max_seq_len)
    if q.device.type == "cpu":
        return paged_attention_ref(o, q, kc, vc, bt, sl, scale, k_scale, v_scale)
    _launch(o, q, kc, vc, bt, sl, (scale, k_scale, v_scale), max_seq_len, version)
    return o


def _launch(o: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor,
            sl: torch.Tensor, scales: tuple[float, float, float], max_seq_len: int | None, version: str) -> None:
    """Pick v1 or v2 and launch it on the current stream (inputs already validated)."""
    from kvstrata.kernels.cuda_attention import choose_v1, paged_attention_cuda

    if max_seq_len is None:
        max_seq_len = int(sl.max())
    use_v1 = choose_v1(q.shape[0], q.shape[1], max_seq_len) if version == "auto" else version == "v1"
    paged_attention_cuda(o, q, kc, vc, bt, sl, *scales, max_seq_len, use_v1)


def _check_shapes(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor) -> None:
    checks.ndim("query", q, 3)
    checks.dtype_in("query", q, ACTIVATION_DTYPES)
    checks.contiguous("query", q)
    num_seqs, num_heads, head_size = q.shape
    checks.member("head_size", head_size, HEAD_SIZES)
    checks.ndim("key_cache", kc, 5)
    checks.dtype_in("key_cache", kc, (q.dtype, *FP8_DTYPES))
    num_blocks, num_kv_heads, _, block_size, _ = kc.shape
    checks.member("block_size", block_size, BLOCK_SIZES)
    x = x_of(kc.dtype)
    checks.shape("key_cache", kc, (num_blocks, num_kv_heads, head_size // x, block_size, x))
    checks.contiguous("key_cache", kc)
    checks.aligned("key_cache", kc)
    checks.dtype_is("value_cache", vc, kc.dtype)
    checks.shape("value_cache", vc, (num_blocks, num_kv_heads, head_size, block_size))
    checks.contiguous("value_cache", vc)
    checks.aligned("value_cache", vc)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_seqs > MAX_SEQS:
        raise ValueError(f"query: {num_seqs} sequences exceed {MAX_SEQS}")
    checks.dtype_is("block_tables", bt, torch.int32)
    checks.ndim("block_tables", bt, 2)
    if bt.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {bt.shape[0]} rows, expected num_seqs={num_seqs}")
    checks.contiguous("block_tables", bt)
    checks.dtype_is("seq_lens", sl, torch.int32)
    checks.shape("seq_lens", sl, (num_seqs,))
    checks.contiguous("seq_lens", sl)


def check_scales(scale: float, k_scale: float, v_scale: float) -> None:
    for name, value in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a positive finite number, got {value!r}")


def _output(out: Any | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    o = checks.as_tensor("out", out)
    checks.dtype_is("out", o, q.dtype)
    checks.shape("out", o, tuple(q.shape))
    checks.contiguous("out", o)
    return o


def _check_indices(bt: torch.Tensor, sl: torch.Tensor, num_blocks: int, block_size: int,
                   max_seq_len: int | None) -> None:
    longest = checks.in_range("seq_lens", sl, 0, bt.shape[1] * block_size + 1)
    if max_seq_len is not None and longest is not None and max_seq_len < longest:
        raise ValueError(f"max_seq_len: {max_seq_len} is below the longest sequence, "
                         f"seq_lens has {longest}")
    used = torch.arange(bt.shape[1], device=bt.device)[None, :] * block_size < sl[:, None]
    checks.in_range("block_tables", bt[used], 0, num_blocks)
