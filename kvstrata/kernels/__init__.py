"""KV-cache kernels: CUDA (cupy RawKernels over cuda/*.cu) and CPU references of identical semantics.
May import: errors, system.

Every op validates its arguments first (a ValueError whose message starts with
the argument's name, raised before any launch), then dispatches by device:
CPU tensors run the torch reference, CUDA tensors (torch tensors, or cupy
arrays and other DLPack producers, imported without copies) run the kernels on
torch's current stream. cupy is imported only when a CUDA tensor arrives, so
``import kvstrata.kernels`` needs neither cupy nor a GPU. Kernels are compiled
with NVRTC once per specialisation and device, on first use.

Paged attention layout (vLLM legacy; ``x = 16 // cache element size``):
    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]
    head_size in {64, 128, 256}; block_size in {8, 16, 32};
    activations fp32 / fp16 / bf16; cache = activation dtype, or
    float8_e4m3fn / float8_e5m2 with per-tensor k_scale / v_scale.

paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
                k_scale=1.0, v_scale=1.0, out=None, max_seq_len=None,
                version="auto", check_indices=True) -> Tensor
    query [num_seqs, num_heads, head_size]; block_tables [num_seqs, max_blocks]
    int32; seq_lens [num_seqs] int32. Returns out [num_seqs, num_heads, head_size].

reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *,
                  k_scale=1.0, v_scale=1.0, check_indices=True) -> None
    key/value [num_tokens, num_kv_heads, head_size]; slot_mapping [num_tokens]
    int64, ``block * block_size + offset``, negative = skip; FP8 caches store
    fp8(saturate(x * float32(1 / scale))).

Whole-page copies over generic pools. A cache is one layer's tensor of any
dtype whose dim 0 is the block index (other dims contiguous); its page is
``cache[b]`` (page_bytes = cache[0].numel() * element_size), moved as opaque
bytes. A 2-D uint8 pool [num_blocks, block_nbytes] is the one-layer case.

copy_blocks(caches, block_mapping, *, check_indices=True) -> None
    block_mapping [n, 2] int64 (src, dst) or a list of pairs; every layer, one
    launch; dst ids distinct and disjoint from the src ids.
gather_blocks(caches, block_ids, out, *, out_rows=None, max_thread_blocks=None, check_indices=True) -> Tensor
    out[out_rows[i]] (out[i] without out_rows) = concat over layers of page
    block_ids[i]; out [m, total_page_bytes] uint8 contiguous, on the caches'
    device or pinned host memory (e.g. the CPU tier's slab: no extra staging
    copy); out_rows distinct. One launch for every block and layer of the job;
    max_thread_blocks caps its grid (default: 32 for host staging, so a copy
    limited by the host link leaves the SMs to the forward pass).
scatter_blocks(staging, caches, block_ids, *, staging_rows=None, max_thread_blocks=None, check_indices=True) -> None
    The inverse of gather_blocks, reading staging[staging_rows[i]]; block_ids distinct.

``check_indices=False`` skips the value checks of index tensors (one device
sync each when they live on the GPU); out-of-range values are then undefined.
"""

from __future__ import annotations

from kvstrata.kernels.attention import paged_attention
from kvstrata.kernels.block_ops import copy_blocks, gather_blocks, scatter_blocks
from kvstrata.kernels.cache_ops import reshape_and_cache
from kvstrata.kernels.layout import kv_cache_shapes, quantize_fp8, x_of

__all__ = [
    "paged_attention",
    "reshape_and_cache",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "kv_cache_shapes",
    "quantize_fp8",
    "x_of",
]
