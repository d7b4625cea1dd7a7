// Scalar helpers shared by the CPU and CUDA kernels: widening loads and the float32 -> FP8 cast
// with XLA's numerics (round to nearest even, NaN kept with its sign).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TE_HD __host__ __device__ __forceinline__
#else
#define TE_HD inline
#endif

namespace te_adapters {

enum class InType { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class OutType { kE4M3 = 0, kE5M2 = 1 };

TE_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
#endif
}

TE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, 4);
  return v;
#endif
}

TE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE half to float; exact (every half is a normal or zero float).
TE_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal half: normalise.
  int e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (static_cast<uint32_t>(e) << 23) | ((mant & 0x3ffu) << 13));
}

// Largest finite value: 448 (E4M3) or 57344 (E5M2).
TE_HD float fp8_limit(OutType t) { return t == OutType::kE4M3 ? 448.0f : 57344.0f; }

TE_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// Float32 to FP8 by round to nearest even, for |v| <= the FP8 limit or NaN (the caller clips).
// NaN gives the format's NaN with the input's sign: 0x7f (E4M3) or 0x7e (E5M2), as XLA does.
TE_HD uint8_t float_to_fp8(float v, OutType t) {
  const int mant_bits = t == OutType::kE4M3 ? 3 : 2;
  const int bias = t == OutType::kE4M3 ? 7 : 15;
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | (t == OutType::kE4M3 ? 0x7fu : 0x7eu);
  // Below the smallest normal 2^(1 - bias): a multiple of the subnormal quantum
  // 2^(1 - bias - mant_bits) after rounding; the integer part of a/quantum is the code.
  const uint32_t min_normal_bits = static_cast<uint32_t>(127 + 1 - bias) << 23;
  if (a < min_normal_bits) {
    // Exact power-of-two scaling, then round half to even on the integer.
    const float scaled = bits_float(a) * bits_float(static_cast<uint32_t>(127 + bias - 1 + mant_bits) << 23);
    const uint32_t whole = static_cast<uint32_t>(scaled);
    const float frac = scaled - static_cast<float>(whole);
    uint32_t code = whole;
    if (frac > 0.5f || (frac == 0.5f && (whole & 1u))) ++code;
    return sign | static_cast<uint8_t>(code);
  }
  const int shift = 23 - mant_bits;
  const uint32_t rounded = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
  const uint32_t code = (rounded >> shift) - (static_cast<uint32_t>(127 - bias) << mant_bits);
  return sign | static_cast<uint8_t>(code);
}

// x * scale clipped to +-limit; NaN stays NaN (XLA's min/max propagate it).
TE_HD float scale_and_clip(float x, float scale, float limit) {
  const float p = x * scale;
  if (p != p) return p;
  return p > limit ? limit : (p < -limit ? -limit : p);
}

}  // namespace te_adapters
