// Element types and conversions shared by every kvstrata kernel.
//
// The storage types are plain structs so the kernels need no CUDA headers
// (cuda_fp16.h / cuda_bf16.h / cuda_fp8.h): the same source compiles with
// nvcc and with NVRTC (cupy.RawModule) unchanged. Conversions to float are
// exact; conversions from float round to nearest even, and the FP8 ones
// saturate to the largest finite value (like __NV_SATFINITE); a NaN stays NaN.
//
// The FP8 conversions use integer operations only. cupy compiles with
// -ftz=true (always, after the caller's options), which flushes a denormal
// float operand of a multiply to zero: building a subnormal and rescaling it
// by a power of two would decode the smallest FP8 codes to zero on the GPU.
// Being integer-only, the helpers marked TKV_HD compute the same bits on the
// host, where nvcc also builds them for an exhaustive test against torch
// (tests/cuda/helpers_host.cu).
#pragma once

#if defined(__CUDACC__)
#define TKV_HD __host__ __device__ __forceinline__
#else
#define TKV_HD inline
#endif

namespace tkv {

struct f16 { unsigned short bits; };      // IEEE binary16
struct bf16 { unsigned short bits; };     // bfloat16
struct fp8e4m3 { unsigned char bits; };   // OCP E4M3 "fn": no inf, max 448, NaN S.1111.111
struct fp8e5m2 { unsigned char bits; };   // OCP E5M2: IEEE-like, max finite 57344

TKV_HD float bits_to_float(unsigned int u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

TKV_HD unsigned int float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned int u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// ---- FP8 <-> float, integer only --------------------------------------------
// MANT mantissa bits, BIAS exponent bias; HAS_INF: the all-ones exponent holds
// inf and NaN (E5M2), else only the all-ones code is NaN (E4M3fn).
template <int MANT, int BIAS, bool HAS_INF>
TKV_HD float decode_fp8(unsigned int code) {
  constexpr unsigned int MANT_MASK = (1u << MANT) - 1u, EXP_MAX = (1u << (7 - MANT)) - 1u;
  const unsigned int sign = (code & 0x80u) << 24;
  const unsigned int exp = (code >> MANT) & EXP_MAX, mant = code & MANT_MASK;
  if (exp == EXP_MAX && (HAS_INF || mant == MANT_MASK))
    return bits_to_float(sign | (mant ? 0x7fc00000u : 0x7f800000u));  // NaN, or inf (E5M2)
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);  // +-0
    int e = 1 - BIAS;                           // subnormal: normalise the leading 1
    unsigned int m = mant;
    while (!(m & (1u << MANT))) {
      m <<= 1;
      --e;
    }
    return bits_to_float(sign | (unsigned int)(e + 127) << 23 | (m & MANT_MASK) << (23 - MANT));
  }
  return bits_to_float(sign | (exp + 127u - BIAS) << 23 | mant << (23 - MANT));
}

// float -> FP8, round to nearest even, saturating to MAX_CODE; NaN -> sign | 0x7f (a NaN
// code in both formats).
template <int MANT, int BIAS, unsigned int MAX_CODE>
TKV_HD unsigned char encode_fp8(float f) {
  constexpr int EMIN = 1 - BIAS;  // exponent of the smallest normal
  const unsigned int u = float_to_bits(f);
  const unsigned int sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);
  const int e = static_cast<int>(a >> 23) - 127;
  unsigned int code;
  if (e < EMIN - MANT - 1) {
    code = 0;  // below half the smallest subnormal (float denormals included)
  } else if (e < EMIN) {
    // A subnormal (or the smallest normal, when rounding carries): the significand
    // shifted to units of the smallest subnormal, rounded half to even.
    const unsigned int m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 23 - MANT + (EMIN - e);  // 24 - MANT .. 24
    const unsigned int rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    code = m >> shift;
    code += (rem > half || (rem == half && (code & 1u))) ? 1u : 0u;
  } else {
    constexpr int SHIFT = 23 - MANT;
    const unsigned int r = a + ((1u << (SHIFT - 1)) - 1u) + ((a >> SHIFT) & 1u);
    code = (((r >> 23) - 127u + BIAS) << MANT) | ((r >> SHIFT) & ((1u << MANT) - 1u));
    if (code > MAX_CODE) code = MAX_CODE;  // inf and beyond the largest finite value
  }
  return static_cast<unsigned char>(sign | code);
}

TKV_HD float decode_e4m3(unsigned int code) { return decode_fp8<3, 7, false>(code); }
TKV_HD float decode_e5m2(unsigned int code) { return decode_fp8<2, 15, true>(code); }
TKV_HD unsigned char encode_e4m3(float f) { return encode_fp8<3, 7, 0x7eu>(f); }
TKV_HD unsigned char encode_e5m2(float f) { return encode_fp8<2, 15, 0x7bu>(f); }

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

__device__ __forceinline__ float to_float(fp8e4m3 v) { return decode_e4m3(v.bits); }
__device__ __forceinline__ float to_float(fp8e5m2 v) { return decode_e5m2(v.bits); }

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

template <> __device__ __forceinline__ fp8e4m3 from_float<fp8e4m3>(float f) {
  fp8e4m3 r;
  r.bits = encode_e4m3(f);
  return r;
}

template <> __device__ __forceinline__ fp8e5m2 from_float<fp8e5m2>(float f) {
  fp8e5m2 r;
  r.bits = encode_e5m2(f);
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
