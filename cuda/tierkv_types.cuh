// Element types and conversions shared by every tierkv kernel.
//
// The storage types are plain structs so the kernels need no CUDA headers
// (cuda_fp16.h / cuda_bf16.h / cuda_fp8.h): the same source compiles with
// nvcc and with NVRTC (cupy.RawModule) unchanged. Conversions to float are
// exact; conversions from float round to nearest even, and the FP8 ones
// saturate to the largest finite value (like __NV_SATFINITE).
#pragma once

namespace tkv {

struct f16 { unsigned short bits; };      // IEEE binary16
struct bf16 { unsigned short bits; };     // bfloat16
struct fp8e4m3 { unsigned char bits; };   // OCP E4M3 "fn": no inf, max 448
struct fp8e5m2 { unsigned char bits; };   // OCP E5M2: max finite 57344

// ---- to float (exact) ------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

__device__ __forceinline__ float to_float(bf16 v) {
  return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

// E4M3 (bias 7) -> float: move exponent+mantissa into place, rescale by 2^120.
// Exact for every finite code including subnormals.
__device__ __forceinline__ float to_float(fp8e4m3 v) {
  const unsigned int b = v.bits;
  const float mag = __uint_as_float((b & 0x7fu) << 20) * 1.329227995784916e+36f;  // 2^120
  return (b & 0x80u) ? -mag : mag;
}

// E5M2 (bias 15) -> float: rescale by 2^112.
__device__ __forceinline__ float to_float(fp8e5m2 v) {
  const unsigned int b = v.bits;
  const float mag = __uint_as_float((b & 0x7fu) << 21) * 5.192296858534828e+33f;  // 2^112
  return (b & 0x80u) ? -mag : mag;
}

// ---- from float (round to nearest even) ------------------------------------
template <typename T> __device__ __forceinline__ T from_float(float f);

template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }

template <> __device__ __forceinline__ f16 from_float<f16>(float f) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}

template <> __device__ __forceinline__ bf16 from_float<bf16>(float f) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}

// Generic saturating FP8 encoder. MANT: mantissa bits, BIAS: exponent bias,
// MAX_CODE: the largest finite magnitude code, MAX_VAL: its value,
// SUB_SCALE: 2^(mantissa bits - min normal exponent) = 1 / subnormal step.
template <int MANT, int BIAS, unsigned int MAX_CODE>
__device__ __forceinline__ unsigned char encode_fp8(float f, float max_val, float min_normal,
                                                    float sub_scale) {
  const unsigned int sign = (__float_as_uint(f) >> 24) & 0x80u;
  const float a = fabsf(f);
  if (a != a) return static_cast<unsigned char>(sign | 0x7fu);  // NaN
  if (a >= max_val) return static_cast<unsigned char>(sign | MAX_CODE);
  if (a < min_normal) {
    // Subnormal: a multiple of the subnormal step; rintf rounds half to even.
    const unsigned int m = static_cast<unsigned int>(rintf(a * sub_scale));
    return static_cast<unsigned char>(sign | m);
  }
  constexpr int SHIFT = 23 - MANT;
  unsigned int u = __float_as_uint(a);
  u += ((1u << (SHIFT - 1)) - 1u) + ((u >> SHIFT) & 1u);  // round to nearest even
  const unsigned int exp = (u >> 23) - 127u + BIAS;
  const unsigned int mant = (u >> SHIFT) & ((1u << MANT) - 1u);
  unsigned int code = (exp << MANT) | mant;
  if (code > MAX_CODE) code = MAX_CODE;
  return static_cast<unsigned char>(sign | code);
}

template <> __device__ __forceinline__ fp8e4m3 from_float<fp8e4m3>(float f) {
  fp8e4m3 r;
  r.bits = encode_fp8<3, 7, 0x7eu>(f, 448.0f, 0.015625f, 512.0f);
  return r;
}

template <> __device__ __forceinline__ fp8e5m2 from_float<fp8e5m2>(float f) {
  fp8e5m2 r;
  r.bits = encode_fp8<2, 15, 0x7bu>(f, 57344.0f, 6.103515625e-05f, 65536.0f);
  return r;
}

// ---- cache element traits -------------------------------------------------
template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<fp8e4m3> { static constexpr bool value = true; };
template <> struct is_fp8<fp8e5m2> { static constexpr bool value = true; };

template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// Storing an activation element into the cache: a plain copy when the cache
// has the activation's type, a scaled saturating quantisation when it is FP8.
template <typename scalar_t, typename cache_t> struct CacheStore {
  static_assert(is_fp8<cache_t>::value, "cache type must equal the activation type or be FP8");
  __device__ __forceinline__ static cache_t apply(scalar_t v, float inv_scale) {
    return from_float<cache_t>(to_float(v) * inv_scale);
  }
};
template <typename T> struct CacheStore<T, T> {
  __device__ __forceinline__ static T apply(T v, float) { return v; }
};

// ---- vector loads -----------------------------------------------------------
template <int BYTES> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = unsigned int; };

// Loads N consecutive elements (N * sizeof(T) in {4, 8, 16} bytes, aligned)
// with one vector instruction and widens them to float.
template <typename T, int N>
__device__ __forceinline__ void load_as_float(const T* __restrict__ p, float (&out)[N]) {
  using R = typename RawVec<N * sizeof(T)>::type;
  union {
    R raw;
    T elem[N];
  } u;
  u.raw = *reinterpret_cast<const R*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(u.elem[i]);
}

}  // namespace tkv
