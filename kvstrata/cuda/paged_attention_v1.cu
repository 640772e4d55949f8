// Paged attention v1: one thread block per (head, sequence) over the whole
// context. Dynamic shared memory: attention_smem_floats(HEAD_SIZE, warps,
// max padded context) floats. See paged_attention.cuh for the layout.
#include "paged_attention.cuh"

namespace tkv {

template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, int num_kv_heads, int max_blocks_per_seq, float scale,
    float k_scale, float v_scale) {
  paged_attention_body<scalar_t, cache_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0>(
      nullptr, nullptr, nullptr, out, q, k_cache, v_cache, block_tables, seq_lens, num_kv_heads,
      max_blocks_per_seq, scale, k_scale, v_scale);
}

}  // namespace tkv
