"""CPU reference of paged decode attention: the oracle for the CUDA kernels."""

from __future__ import annotations

import torch

from kvstrata.kernels.layout import dequantize, k_tokens_view, v_tokens_view


def paged_attention_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Dense softmax attention of each sequence's query over its first
    ``seq_lens[s]`` cached tokens, computed in float32 and written into ``out``.

    Arguments are already validated (see ``paged_attention``). Table entries
    past a sequence's last block are never dereferenced; tokens past seq_len
    get probability 0 and their (possibly garbage) K/V are zeroed; a sequence of
    length 0 gets a zero row.
    """
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, _, block_size, _ = key_cache.shape
    lens = seq_lens.long()
    nblk = -(-int(lens.max()) // block_size)
    tokens = nblk * block_size
    valid = torch.arange(tokens)[None, :] < lens[:, None]  # [S, T]
    block_used = valid.view(num_seqs, nblk, block_size)[:, :, 0]
    table = torch.where(block_used, block_tables[:, :nblk].long(), 0)

    def gather(view: torch.Tensor, cache_scale: float) -> torch.Tensor:
        g = view[table].reshape(num_seqs, tokens, num_kv_heads, head_size)
        return torch.where(valid[:, :, None, None], dequantize(g, cache_scale), 0.0)

    k = gather(k_tokens_view(key_cache), k_scale)  # [S, T, KVH, D]
    v = gather(v_tokens_view(value_cache), v_scale)
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_size)
    scores = torch.einsum("skgd,stkd->skgt", q, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("skgt,stkd->skgd", probs, v).reshape(num_seqs, num_heads, head_size)
    out.copy_(torch.where(lens[:, None, None] > 0, o, 0.0))  # length 0 (padding): zeros
    return out
