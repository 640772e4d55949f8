// copy_blocks: copy-on-write copies of whole pages, for every (src, dst) pair
// and every layer, in one launch. Layer l is a pool whose page b starts at
// layer_ptrs[l] + b * row_strides[l] and holds page_bytes[l] bytes.
// Grid: x = pair * num_layers + layer, y = chunk of kCopyChunkBytes bytes.
// dst ids must be distinct and disjoint from the src ids (checked by the launcher).
#include "block_copy.cuh"

namespace tkv {

template <typename VecT>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(
    const unsigned long long* __restrict__ layer_ptrs, const long long* __restrict__ row_strides,
    const long long* __restrict__ page_bytes, int num_layers,
    const long long* __restrict__ pairs) {  // [num_pairs, 2] (src, dst)
  const long long job = blockIdx.x;
  const int layer = (int)(job % num_layers);
  const long long pair = job / num_layers;
  long long begin, len;
  if (!chunk_window(page_bytes[layer], &begin, &len)) return;
  unsigned char* base = reinterpret_cast<unsigned char*>(layer_ptrs[layer]);
  const long long stride = row_strides[layer];
  const unsigned char* src = base + pairs[2 * pair] * stride + begin;
  unsigned char* dst = base + pairs[2 * pair + 1] * stride + begin;
  copy_range<VecT>(dst, src, len);
}

}  // namespace tkv
