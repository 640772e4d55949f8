// Host build of the kernels' pure device helpers (the TKV_HD functions of
// cuda/tierkv_types.cuh and cuda/layout.cuh), for tests/test_kernels_helpers.py.
// nvcc compiles the very functions the kernels call, for the host.
//
//   helpers_host decode    256 float32 bit patterns per FP8 format (E4M3, E5M2) on stdout
//   helpers_host encode    float32 values on stdin -> their E4M3 codes, then their E5M2 codes
//   helpers_host offsets   lines "block heads head head_size block_size x offset d" on stdin
//                          -> lines "k_offset v_offset"
#include <cstdio>
#include <cstring>
#include <vector>

#include "layout.cuh"
#include "tierkv_types.cuh"

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

int main(int argc, char** argv) {
  if (argc == 2 && !strcmp(argv[1], "decode")) return decode();
  if (argc == 2 && !strcmp(argv[1], "encode")) return encode();
  if (argc == 2 && !strcmp(argv[1], "offsets")) return offsets();
  fprintf(stderr, "usage: %s decode|encode|offsets\n", argv[0]);
  return 2;
}
