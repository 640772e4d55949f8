// Element offsets in the paged KV cache (vLLM's legacy layout), 64-bit:
//   K cache [num_blocks, num_kv_heads, head_size / X, block_size, X]
//   V cache [num_blocks, num_kv_heads, head_size, block_size]
// Shared by the kernels and the host test (tests/cuda/helpers_host.cu), which
// checks them against kvstrata.kernels.layout past 2^31 elements.
#pragma once

#include "kvstrata_types.cuh"

namespace tkv {

// First element of one (block, KV head) slab: head_size * block_size elements, in K and V alike.
TKV_HD long long slab_offset(long long block, int num_kv_heads, int kv_head, int head_size,
                             int block_size) {
  return (block * num_kv_heads + kv_head) * (long long)head_size * block_size;
}

// K[block, kv_head, d / x, offset, d % x]
TKV_HD long long k_offset(long long block, int num_kv_heads, int kv_head, int head_size,
                          int block_size, int x, long long offset, int d) {
  return slab_offset(block, num_kv_heads, kv_head, head_size, block_size) +
         ((long long)(d / x) * block_size + offset) * x + d % x;
}

// V[block, kv_head, d, offset]
TKV_HD long long v_offset(long long block, int num_kv_heads, int kv_head, int head_size,
                          int block_size, long long offset, int d) {
  return slab_offset(block, num_kv_heads, kv_head, head_size, block_size) +
         (long long)d * block_size + offset;
}

}  // namespace tkv
