// Host build of the kernels' pure device helpers (the TKV_HD functions of
// cuda/kvstrata_types.cuh and cuda/layout.cuh), for tests/test_kernels_helpers.py.
// nvcc compiles the very functions the kernels call, for the host.
//
//   helpers_host decode    256 float32 bit patterns per FP8 format (E4M3, E5M2) on stdout
//   helpers_host encode    float32 values on stdin -> their E4M3 codes, then their E5M2 codes
//   helpers_host offsets   lines "block heads head head_size block_size x offset d" on stdin
//                          -> lines "k_offset v_offset"
//   helpers_host combine   "parts dim" then per partition its max logit, its sum of
//                          exponentials and its dim outputs, on stdin -> the dim
//                          combined outputs (v2's reduce, serially)
#include <cstdio>
#include <cstring>
#include <vector>

#include <cmath>

#include "layout.cuh"
#include "reduce.cuh"
#include "kvstrata_types.cuh"

static int decode() {
  unsigned int out[512];
  for (unsigned int c = 0; c < 256; ++c) {
    out[c] = tkv::float_to_bits(tkv::decode_e4m3(c));
    out[256 + c] = tkv::float_to_bits(tkv::decode_e5m2(c));
  }
  return fwrite(out, sizeof out, 1, stdout) == 1 ? 0 : 1;
}

static int encode() {
  std::vector<float> in;
  float buf[4096];
  size_t n;
  while ((n = fread(buf, sizeof(float), 4096, stdin)) > 0) in.insert(in.end(), buf, buf + n);
  std::vector<unsigned char> out(2 * in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    out[i] = tkv::encode_e4m3(in[i]);
    out[in.size() + i] = tkv::encode_e5m2(in[i]);
  }
  return fwrite(out.data(), 1, out.size(), stdout) == out.size() ? 0 : 1;
}

static int offsets() {
  long long block, offset;
  int heads, head, head_size, block_size, x, d;
  while (scanf("%lld %d %d %d %d %d %lld %d", &block, &heads, &head, &head_size, &block_size, &x,
               &offset, &d) == 8) {
    printf("%lld %lld\n", tkv::k_offset(block, heads, head, head_size, block_size, x, offset, d),
           tkv::v_offset(block, heads, head, head_size, block_size, offset, d));
  }
  return 0;
}

static int combine() {
  int parts, dim;
  if (scanf("%d %d", &parts, &dim) != 2 || parts < 1 || dim < 1) return 2;
  std::vector<float> max_logits(parts), exp_sums(parts), outs((size_t)parts * dim), weights(parts);
  for (int p = 0; p < parts; ++p) {
    if (scanf("%f %f", &max_logits[p], &exp_sums[p]) != 2) return 2;
    for (int d = 0; d < dim; ++d)
      if (scanf("%f", &outs[(size_t)p * dim + d]) != 1) return 2;
  }
  float m = max_logits[0], total = 0.0f;
  for (int p = 1; p < parts; ++p) m = std::fmax(m, max_logits[p]);
  for (int p = 0; p < parts; ++p) total += weights[p] = tkv::partition_weight(exp_sums[p], max_logits[p], m);
  for (int d = 0; d < dim; ++d)
    printf("%.9g\n", tkv::combine_outputs(weights.data(), outs.data() + d, dim, parts, 1.0f / total));
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && !strcmp(argv[1], "decode")) return decode();
  if (argc == 2 && !strcmp(argv[1], "encode")) return encode();
  if (argc == 2 && !strcmp(argv[1], "offsets")) return offsets();
  if (argc == 2 && !strcmp(argv[1], "combine")) return combine();
  fprintf(stderr, "usage: %s decode|encode|offsets|combine\n", argv[0]);
  return 2;
}
