// Paged attention v2: split-K over PARTITION_SIZE-token partitions (grid z)
// plus a reduce kernel that rescales each partition's normalised output by
// exp_sum * exp(max_logit - global max). For long contexts, where one thread
// block per (head, sequence) would leave the GPU idle or overflow shared memory.
#include "paged_attention.cuh"

namespace tkv {

template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS,
          int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_kernel(
    float* __restrict__ exp_sums, float* __restrict__ max_logits, float* __restrict__ tmp_out,
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, int num_kv_heads, int max_blocks_per_seq, float scale,
    float k_scale, float v_scale) {
  paged_attention_body<scalar_t, cache_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE>(
      exp_sums, max_logits, tmp_out, nullptr, q, k_cache, v_cache, block_tables, seq_lens,
      num_kv_heads, max_blocks_per_seq, scale, k_scale, v_scale);
}

// Grid (num_heads, num_seqs). Dynamic shared memory: max_parts + 2 * warps floats.
template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out,               // [num_seqs, num_heads, HEAD_SIZE]
    const float* __restrict__ exp_sums,       // [num_seqs, num_heads, max_parts]
    const float* __restrict__ max_logits,     // [num_seqs, num_heads, max_parts]
    const float* __restrict__ tmp_out,        // [num_seqs, num_heads, max_parts, HEAD_SIZE]
    const int* __restrict__ seq_lens, int max_parts) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x, tid = threadIdx.x;
  // Never more partitions than were launched (and sized in shared memory), whatever seq_lens says.
  const int num_parts = min((seq_lens[seq] + PARTITION_SIZE - 1) / PARTITION_SIZE, max_parts);
  const long long row = (long long)seq * num_heads + head;
  const long long base = row * max_parts;
  if (num_parts <= 0) {  // a padding row: zeros (no partition wrote anything)
    for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) out[row * HEAD_SIZE + d] = from_float<scalar_t>(0.0f);
    return;
  }

  extern __shared__ float smem[];
  float* red = smem;                // [2 * NUM_WARPS]
  float* weights = red + 2 * NUM_WARPS;  // [max_parts]

  float m = kNegInf;
  for (int p = tid; p < num_parts; p += NUM_THREADS) m = fmaxf(m, max_logits[base + p]);
  m = block_max<NUM_WARPS>(m, red);
  float total = 0.0f;
  for (int p = tid; p < num_parts; p += NUM_THREADS) {
    const float w = partition_weight(exp_sums[base + p], max_logits[base + p], m);
    weights[p] = w;
    total += w;
  }
  total = block_sum<NUM_WARPS>(total, red + NUM_WARPS);
  const float inv_total = 1.0f / total;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS)
    out[row * HEAD_SIZE + d] = from_float<scalar_t>(
        combine_outputs(weights, tmp_out + base * HEAD_SIZE + d, HEAD_SIZE, num_parts, inv_total));
}

}  // namespace tkv
