// Warp and thread-block reductions used by the attention kernels.
#pragma once

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

}  // namespace tkv
