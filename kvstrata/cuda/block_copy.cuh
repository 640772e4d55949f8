// Copying one contiguous byte range with vectorised accesses: the building
// block of copy_blocks and gather/scatter. VecT is uint4 (16-byte loads and
// stores; both ends and the length must be 16-byte aligned) or unsigned char.
#pragma once

namespace tkv {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;
// Bytes one thread block copies per grid-y step: every thread issues
// kCopyUnroll independent 16-byte loads before its stores (latency hiding
// matters when one side is pinned host memory across PCIe / C2C).
constexpr long long kCopyChunkBytes = (long long)kCopyThreads * 16 * kCopyUnroll;

template <typename VecT>
__device__ __forceinline__ void copy_range(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src, long long nbytes) {
  const long long n = nbytes / (long long)sizeof(VecT);
  const VecT* s = reinterpret_cast<const VecT*>(src);
  VecT* d = reinterpret_cast<VecT*>(dst);
  const long long stride = (long long)blockDim.x * kCopyUnroll;
  for (long long base = threadIdx.x; base < n; base += stride) {
    VecT r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const long long i = base + (long long)u * blockDim.x;
      if (i < n) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const long long i = base + (long long)u * blockDim.x;
      if (i < n) d[i] = r[u];
    }
  }
}

// The byte window [begin, begin + len) of chunk ``chunk`` of a page; false when
// the page ends before the chunk starts (a smaller page than the largest one).
__device__ __forceinline__ bool chunk_window(long long chunk, long long page_bytes, long long* begin,
                                             long long* len) {
  *begin = chunk * kCopyChunkBytes;
  if (*begin >= page_bytes) return false;
  const long long end = min(*begin + kCopyChunkBytes, page_bytes);
  *len = end - *begin;
  return true;
}

// The byte window of a page that grid row blockIdx.y copies.
__device__ __forceinline__ bool chunk_window(long long page_bytes, long long* begin, long long* len) {
  return chunk_window((long long)blockIdx.y, page_bytes, begin, len);
}

}  // namespace tkv
