// reshape_and_cache: write new tokens' K/V [num_tokens, num_kv_heads, head_size]
// into the paged cache at slot_mapping[token] = block * block_size + offset
// (int64; a negative slot means "skip this token").
//   K cache [num_blocks, num_kv_heads, head_size / X, block_size, X]
//   V cache [num_blocks, num_kv_heads, head_size, block_size]
// When the cache is FP8 each element is stored as fp8(saturate(x * inv_scale)),
// rounded to nearest even; otherwise it is copied bit for bit.
// Grid: one thread block per token. All offsets are 64-bit.
#include "layout.cuh"

namespace tkv {

template <typename scalar_t, typename cache_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, long long key_stride, long long value_stride,
    int num_kv_heads, int head_size, int block_size, float inv_k_scale, float inv_v_scale) {
  constexpr int X = 16 / sizeof(cache_t);
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const long long offset = slot % block_size;
  const int n = num_kv_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const long long k_idx = k_offset(block, num_kv_heads, h, head_size, block_size, X, offset, d);
    const long long v_idx = v_offset(block, num_kv_heads, h, head_size, block_size, offset, d);
    k_cache[k_idx] = CacheStore<scalar_t, cache_t>::apply(key[token * key_stride + i], inv_k_scale);
    v_cache[v_idx] = CacheStore<scalar_t, cache_t>::apply(value[token * value_stride + i], inv_v_scale);
  }
}

}  // namespace tkv
