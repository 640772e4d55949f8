// gather / scatter of whole pages between a paged pool (one or more layers)
// and a staging buffer of rows [m, total_page_bytes] in device memory or
// pinned host memory (accessed directly through unified addressing).
// Job j = i * num_layers + layer moves layer l's page block_ids[i] <-> bytes
// [stage_offsets[l], + page_bytes[l]) of staging row r(i), where
// r(i) = staging_rows[i] when staging_rows (a device address of int64s) is
// not 0, else i. GATHER: pool -> staging; otherwise staging -> pool.
//
// Work item = (job, chunk of kCopyChunkBytes bytes), item = job * chunks_per_page
// + chunk, so neighbouring items touch neighbouring bytes. The grid is 1-D and
// may be smaller than the number of items: each thread block walks items
// blockIdx.x, + gridDim.x, ... (the launcher caps the grid so that a long copy
// occupies only a few SMs next to the forward pass).
#include "block_copy.cuh"

namespace tkv {

template <typename VecT, bool GATHER>
__global__ void __launch_bounds__(kCopyThreads) gather_scatter_kernel(
    const unsigned long long* __restrict__ layer_ptrs, const long long* __restrict__ row_strides,
    const long long* __restrict__ page_bytes, const long long* __restrict__ stage_offsets,
    int num_layers, const long long* __restrict__ block_ids, unsigned long long staging_rows,
    unsigned long long staging, long long staging_row_bytes, long long num_jobs,
    long long chunks_per_page) {
  const long long* rows = reinterpret_cast<const long long*>(staging_rows);
  const long long num_items = num_jobs * chunks_per_page;
  for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {
    const long long job = item / chunks_per_page;
    const long long chunk = item - job * chunks_per_page;
    const int layer = (int)(job % num_layers);
    const long long i = job / num_layers;
    long long begin, len;
    if (!chunk_window(chunk, page_bytes[layer], &begin, &len)) continue;
    const long long row = rows != nullptr ? rows[i] : i;
    unsigned char* page =
        reinterpret_cast<unsigned char*>(layer_ptrs[layer]) + block_ids[i] * row_strides[layer] + begin;
    unsigned char* stage =
        reinterpret_cast<unsigned char*>(staging) + row * staging_row_bytes + stage_offsets[layer] + begin;
    if (GATHER) {
      copy_range<VecT>(stage, page, len);
    } else {
      copy_range<VecT>(page, stage, len);
    }
  }
}

}  // namespace tkv
