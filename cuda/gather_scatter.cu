// gather / scatter of whole pages between a paged pool (one or more layers)
// and a contiguous staging buffer [n, total_page_bytes] in device memory or
// pinned host memory (accessed directly through unified addressing).
// Staging row i, bytes [stage_offsets[l], + page_bytes[l]) <-> layer l, page block_ids[i].
// GATHER: pool -> staging; otherwise staging -> pool.
// Grid: x = i * num_layers + layer, y = chunk of kCopyChunkBytes bytes.
#include "block_copy.cuh"

namespace tkv {

template <typename VecT, bool GATHER>
__global__ void __launch_bounds__(kCopyThreads) gather_scatter_kernel(
    const unsigned long long* __restrict__ layer_ptrs, const long long* __restrict__ row_strides,
    const long long* __restrict__ page_bytes, const long long* __restrict__ stage_offsets,
    int num_layers, const long long* __restrict__ block_ids, unsigned long long staging,
    long long staging_row_bytes) {
  const long long job = blockIdx.x;
  const int layer = (int)(job % num_layers);
  const long long i = job / num_layers;
  long long begin, len;
  if (!chunk_window(page_bytes[layer], &begin, &len)) return;
  unsigned char* page =
      reinterpret_cast<unsigned char*>(layer_ptrs[layer]) + block_ids[i] * row_strides[layer] + begin;
  unsigned char* stage =
      reinterpret_cast<unsigned char*>(staging) + i * staging_row_bytes + stage_offsets[layer] + begin;
  if (GATHER) {
    copy_range<VecT>(stage, page, len);
  } else {
    copy_range<VecT>(page, stage, len);
  }
}

}  // namespace tkv
