// Warp and thread-block reductions used by the attention kernels, and the
// split-K combine.
#pragma once

#include "kvstrata_types.cuh"

namespace tkv {

constexpr int kWarpSize = 32;
constexpr float kNegInf = -3.402823466e+38f;  // -FLT_MAX: a finite "minus infinity"

template <int WIDTH>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask >= 1; mask /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

template <int WIDTH>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask >= 1; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// Every thread of the block gets the result. `red` holds NUM_WARPS floats;
// the caller must not reuse it before the next __syncthreads().
template <int NUM_WARPS>
__device__ __forceinline__ float block_max(float v, float* red) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = warp_max<kWarpSize>(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < NUM_WARPS ? red[lane] : kNegInf;
  v = warp_max<NUM_WARPS>(v);
  return __shfl_sync(0xffffffffu, v, 0);
}

template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = warp_sum<kWarpSize>(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < NUM_WARPS ? red[lane] : 0.0f;
  v = warp_sum<NUM_WARPS>(v);
  return __shfl_sync(0xffffffffu, v, 0);
}

// ---- the split-K combine (v2's reduce), shared with the host test ------------
// Partition p of a sequence saw tokens whose largest logit is max_logits[p] and
// whose exponentials exp(logit - max_logits[p]) sum to exp_sums[p]; its output
// is normalised by that sum. Over all partitions, with m the largest max logit,
// the softmax output is sum_p w_p * out_p / sum_p w_p, w_p = exp_sums[p] * exp(max_logits[p] - m).
TKV_HD float partition_weight(float exp_sum, float max_logit, float global_max) {
  return exp_sum * expf(max_logit - global_max);
}

// sum_p weights[p] * outs[p * stride] / total, in partition order.
TKV_HD float combine_outputs(const float* weights, const float* outs, long long stride, int parts,
                             float inv_total) {
  float acc = 0.0f;
  for (int p = 0; p < parts; ++p) acc += weights[p] * outs[p * stride];
  return acc * inv_total;
}

}  // namespace tkv
