// Paged attention for decode (one query token per sequence) over vLLM's
// legacy cache layout:
//   K cache [num_blocks, num_kv_heads, HEAD_SIZE / X, BLOCK_SIZE, X],
//           X = 16 bytes / sizeof(cache element)
//   V cache [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]
// One thread block handles one (head, sequence[, partition]) and runs
// NUM_THREADS / 32 warps over the sequence's KV blocks round-robin.
//   Q.K: a group of TG = 32 / BLOCK_SIZE lanes handles one key token and reads
//        its HEAD_SIZE / X chunks of 16 bytes (one vector load each).
//   P.V: each lane reads 16 bytes (or BLOCK_SIZE elements) of one V row and
//        accumulates HEAD_SIZE / ROWS_PER_ITER rows in registers.
// PARTITION_SIZE == 0: the whole context (v1). Otherwise the context is split
// into PARTITION_SIZE-token partitions (v2): each writes its max logit, its
// sum of exponentials and its normalised partial output, and the reduce
// kernel combines them.
// Tokens past seq_len are masked: their logits are never used and their V
// values are replaced by zero, so garbage (even NaN) in unused slots of the
// last block cannot leak into the output. A sequence of length 0 (padding)
// gets a zero output row. All cache offsets are 64-bit.
#pragma once

#include "layout.cuh"
#include "reduce.cuh"

namespace tkv {

// Dynamic shared memory (floats) a launch needs for `tokens` logits.
__host__ __device__ constexpr int attention_smem_floats(int head_size, int num_warps, int tokens) {
  return head_size + 2 * num_warps + num_warps * head_size + tokens;
}

template <typename scalar_t, typename cache_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS,
          int PARTITION_SIZE>
__device__ __forceinline__ void paged_attention_body(
    float* __restrict__ exp_sums,          // [num_seqs, num_heads, max_parts]  (v2)
    float* __restrict__ max_logits,        // [num_seqs, num_heads, max_parts]  (v2)
    float* __restrict__ tmp_out,           // [num_seqs, num_heads, max_parts, HEAD_SIZE]  (v2)
    scalar_t* __restrict__ out,            // [num_seqs, num_heads, HEAD_SIZE]  (v1)
    const scalar_t* __restrict__ q,        // [num_seqs, num_heads, HEAD_SIZE]
    const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs]
    int num_kv_heads, int max_blocks_per_seq, float scale, float k_scale, float v_scale) {
  constexpr int NUM_WARPS = NUM_THREADS / kWarpSize;
  constexpr bool PARTITIONED = PARTITION_SIZE > 0;
  constexpr int X = 16 / sizeof(cache_t);
  constexpr int TG = BLOCK_SIZE >= kWarpSize ? 1 : kWarpSize / BLOCK_SIZE;
  constexpr int NUM_CHUNKS = HEAD_SIZE / X;
  constexpr int CHUNKS_PER_THREAD = NUM_CHUNKS / TG;
  constexpr int V_ELEMS = (16 / (int)sizeof(cache_t)) < BLOCK_SIZE ? 16 / (int)sizeof(cache_t) : BLOCK_SIZE;
  constexpr int VECS_PER_ROW = BLOCK_SIZE / V_ELEMS;
  constexpr int ROWS_PER_ITER = kWarpSize / VECS_PER_ROW;
  constexpr int ROWS_PER_THREAD = HEAD_SIZE / ROWS_PER_ITER;
  static_assert(BLOCK_SIZE <= kWarpSize && kWarpSize % BLOCK_SIZE == 0, "block size must divide 32");
  static_assert(HEAD_SIZE % X == 0 && NUM_CHUNKS % TG == 0, "head size must split into 16-byte chunks");
  static_assert(HEAD_SIZE % ROWS_PER_ITER == 0, "head size must be a multiple of the V rows per warp");
  static_assert(!PARTITIONED || PARTITION_SIZE % BLOCK_SIZE == 0, "partition must hold whole blocks");

  const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int seq_len = seq_lens[seq];
  if (!PARTITIONED && seq_len <= 0) {  // a padding row of a decode batch: zeros, not garbage
    for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS)
      out[((long long)seq * num_heads + head) * HEAD_SIZE + d] = from_float<scalar_t>(0.0f);
    return;
  }
  const int num_seq_blocks = (seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int start_block = PARTITIONED ? part * (PARTITION_SIZE / BLOCK_SIZE) : 0;
  if (start_block >= num_seq_blocks) return;  // partition past the end (v2 only)
  const int end_block =
      PARTITIONED ? min(start_block + PARTITION_SIZE / BLOCK_SIZE, num_seq_blocks) : num_seq_blocks;
  const int start_token = start_block * BLOCK_SIZE;
  const int end_token = min(end_block * BLOCK_SIZE, seq_len);
  const int padded_tokens = (end_block - start_block) * BLOCK_SIZE;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* table = block_tables + (long long)seq * max_blocks_per_seq;

  extern __shared__ float smem[];
  float* q_s = smem;                        // [HEAD_SIZE]
  float* red = q_s + HEAD_SIZE;             // [2 * NUM_WARPS]
  float* out_s = red + 2 * NUM_WARPS;       // [NUM_WARPS, HEAD_SIZE]
  float* logits = out_s + NUM_WARPS * HEAD_SIZE;  // [padded_tokens]

  const scalar_t* q_ptr = q + ((long long)seq * num_heads + head) * HEAD_SIZE;
  for (int i = tid; i < HEAD_SIZE; i += NUM_THREADS) q_s[i] = to_float(q_ptr[i]);
  __syncthreads();

  // ---- logits = scale * q . k --------------------------------------------
  const float qk_scale = scale * k_scale;
  const int token_in_block = lane / TG, sub = lane % TG;
  float qk_max = kNegInf;
  for (int b = start_block + warp; b < end_block; b += NUM_WARPS) {
    const long long phys = table[b];
    const cache_t* k_ptr =
        k_cache + slab_offset(phys, num_kv_heads, kv_head, HEAD_SIZE, BLOCK_SIZE) + token_in_block * X;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS_PER_THREAD; ++c) {
      const int chunk = sub + c * TG;
      float kf[X];
      load_as_float<cache_t, X>(k_ptr + (long long)chunk * BLOCK_SIZE * X, kf);
#pragma unroll
      for (int j = 0; j < X; ++j) dot += q_s[chunk * X + j] * kf[j];
    }
    dot = warp_sum<TG>(dot);
    const int token = b * BLOCK_SIZE + token_in_block;
    if (sub == 0 && token < seq_len) {
      const float logit = dot * qk_scale;
      logits[token - start_token] = logit;
      qk_max = fmaxf(qk_max, logit);
    }
  }
  qk_max = block_max<NUM_WARPS>(qk_max, red);

  // ---- softmax over this block's tokens (masked tail -> probability 0) -----
  float exp_sum = 0.0f;
  for (int i = tid; i < padded_tokens; i += NUM_THREADS) {
    const float p = i < end_token - start_token ? expf(logits[i] - qk_max) : 0.0f;
    logits[i] = p;
    exp_sum += p;
  }
  exp_sum = block_sum<NUM_WARPS>(exp_sum, red + NUM_WARPS);
  const float inv_sum = 1.0f / exp_sum;  // exp_sum >= 1: the max term is exp(0)
  for (int i = tid; i < padded_tokens; i += NUM_THREADS) logits[i] *= inv_sum;
  if (PARTITIONED && tid == 0) {
    const long long idx = ((long long)seq * num_heads + head) * gridDim.z + part;
    max_logits[idx] = qk_max;
    exp_sums[idx] = exp_sum;
  }
  __syncthreads();

  // ---- out = P . V ------------------------------------------------------------
  const int vec_idx = lane % VECS_PER_ROW, row0 = lane / VECS_PER_ROW;
  float acc[ROWS_PER_THREAD];
#pragma unroll
  for (int r = 0; r < ROWS_PER_THREAD; ++r) acc[r] = 0.0f;
  for (int b = start_block + warp; b < end_block; b += NUM_WARPS) {
    const long long phys = table[b];
    const int token0 = b * BLOCK_SIZE + vec_idx * V_ELEMS;
    float p[V_ELEMS];
#pragma unroll
    for (int j = 0; j < V_ELEMS; ++j) p[j] = logits[token0 - start_token + j];
    const cache_t* v_ptr =
        v_cache + slab_offset(phys, num_kv_heads, kv_head, HEAD_SIZE, BLOCK_SIZE) + vec_idx * V_ELEMS;
    const bool tail = token0 + V_ELEMS > seq_len;
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
      const int row = row0 + r * ROWS_PER_ITER;
      float vf[V_ELEMS];
      load_as_float<cache_t, V_ELEMS>(v_ptr + (long long)row * BLOCK_SIZE, vf);
      if (tail) {
#pragma unroll
        for (int j = 0; j < V_ELEMS; ++j) vf[j] = token0 + j < seq_len ? vf[j] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < V_ELEMS; ++j) acc[r] += p[j] * vf[j];
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS_PER_THREAD; ++r) {
    acc[r] = warp_sum<VECS_PER_ROW>(acc[r]);
    if (vec_idx == 0) out_s[warp * HEAD_SIZE + row0 + r * ROWS_PER_ITER] = acc[r];
  }
  __syncthreads();

  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) s += out_s[w * HEAD_SIZE + d];
    s *= v_scale;
    if (PARTITIONED) {
      tmp_out[(((long long)seq * num_heads + head) * gridDim.z + part) * HEAD_SIZE + d] = s;
    } else {
      out[((long long)seq * num_heads + head) * HEAD_SIZE + d] = from_float<scalar_t>(s);
    }
  }
}

}  // namespace tkv
