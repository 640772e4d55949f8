"""CUDA launcher for paged attention (arguments already validated)."""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.kernels import specs
from kvstrata.kernels.layout import dtype_name, is_fp8
from kvstrata.kernels.runtime import arg, launch, max_shared_memory

NUM_WARPS = specs.NUM_THREADS // 32
MAX_V1_TOKENS = 8192  # longer contexts always use v2
MAX_GRID_Z = 65535    # v2 partitions per launch


def smem_bytes(head_size: int, tokens: int) -> int:
    """Dynamic shared memory of an attention launch (mirrors attention_smem_floats)."""
    return 4 * (head_size + 2 * NUM_WARPS + NUM_WARPS * head_size + tokens)


def choose_v1(num_seqs: int, num_heads: int, max_seq_len: int) -> bool:
    """v1 when one thread block per (sequence, head) already fills the GPU or
    the context fits one partition; v2 (split-K) for long contexts."""
    parts = -(-max_seq_len // specs.PARTITION_SIZE)
    return max_seq_len <= MAX_V1_TOKENS and (parts == 1 or num_seqs * num_heads > 512)


def paged_attention_cuda(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    max_seq_len: int,
    use_v1: bool,
) -> None:
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, _, block_size, _ = key_cache.shape
    act, cache = dtype_name(query.dtype), dtype_name(key_cache.dtype)
    if not is_fp8(key_cache.dtype):
        k_scale = v_scale = 1.0
    common = (
        arg(query), arg(key_cache), arg(value_cache), arg(block_tables), arg(seq_lens),
        np.int32(num_kv_heads), np.int32(block_tables.shape[1]),
        np.float32(scale), np.float32(k_scale), np.float32(v_scale),
    )
    device = query.device
    if use_v1 or max_seq_len == 0:
        tokens = -(-max_seq_len // block_size) * block_size
        smem = smem_bytes(head_size, tokens)
        limit = max_shared_memory(device)
        if smem > limit:
            raise ValueError(f"max_seq_len: v1 over {max_seq_len} tokens needs {smem} bytes of shared "
                             f"memory, {device} allows {limit}; use version='v2' (or 'auto')")
        spec = specs.attention_v1(act, cache, head_size, block_size)
        launch(spec, device, (num_heads, num_seqs, 1), specs.NUM_THREADS, (arg(out), *common), smem)
        return
    parts = -(-max_seq_len // specs.PARTITION_SIZE)
    if parts > MAX_GRID_Z:
        raise ValueError(f"max_seq_len: {max_seq_len} tokens need {parts} partitions of "
                         f"{specs.PARTITION_SIZE}, more than one launch takes ({MAX_GRID_Z})")
    exp_sums = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty((num_seqs, num_heads, parts, head_size), dtype=torch.float32, device=device)
    spec = specs.attention_v2(act, cache, head_size, block_size)
    launch(
        spec, device, (num_heads, num_seqs, parts), specs.NUM_THREADS,
        (arg(exp_sums), arg(max_logits), arg(tmp_out), *common),
        smem_bytes(head_size, specs.PARTITION_SIZE),
    )
    reduce = specs.attention_v2_reduce(act, head_size)
    launch(
        reduce, device, (num_heads, num_seqs, 1), specs.NUM_THREADS,
        (arg(out), arg(exp_sums), arg(max_logits), arg(tmp_out), arg(seq_lens), np.int32(parts)),
        4 * (2 * NUM_WARPS + parts),
    )
