// Device helpers shared by the per-tensor FP8 cast kernels (cast_transpose_cuda.cu,
// act_cast_cuda.cu): widening loads, the float32 -> FP8 cast with XLA's numerics and the amax
// reduction of one block.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_convert.h"

namespace te_adapters {
namespace cuda {

template <typename In>
__device__ __forceinline__ float to_float(In v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<uint16_t>(uint16_t v) {  // bfloat16 bits
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}
struct Half {
  uint16_t bits;
};
template <>
__device__ __forceinline__ float to_float<Half>(Half v) {
  return __half2float(__ushort_as_half(v.bits));
}

// Float32 -> FP8 uses the hardware conversion (cvt.rn.satfinite), which is what XLA emits for the
// pure-JAX path on sm_89+; the clip before it keeps NaN like XLA's NaN-propagating min/max.
template <OutType kOut>
__device__ __forceinline__ uint8_t to_fp8(float v, float scale) {
  const float c = scale_and_clip(v, scale, fp8_limit(kOut));
  constexpr __nv_fp8_interpretation_t kind = kOut == OutType::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(c, __NV_SATFINITE, kind));
}

// Eight FP8 codes of v[0..8) * scale packed little-endian (v[0]'s code in the lowest byte), the
// hardware conversion two values at a time. Its saturation (cvt.rn.satfinite) is the clip of the
// pure-JAX path to the format's largest finite value, and it keeps NaN: the codes of to_fp8.
template <OutType kOut>
__device__ __forceinline__ uint2 to_fp8x8(const float* v, float scale) {
  constexpr __nv_fp8_interpretation_t kind = kOut == OutType::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * k] * scale, v[2 * k + 1] * scale),
                                    __NV_SATFINITE, kind);
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// max(a, b) that returns NaN when either is NaN (one instruction, unlike fmaxf's NaN dropping).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Non-negative floats order like their bit patterns, so an unsigned max of |v|'s bits is the
// amax. NaN (bits above +inf) is clamped to +inf, like the pure-JAX amax.
__device__ __forceinline__ uint32_t abs_bits(float v) {
  return min(__float_as_uint(v) & 0x7fffffffu, 0x7f800000u);
}

// Max of every thread's ``acc`` in the block, atomically max-ed into ``*out`` (float bits).
template <int kThreads>
__device__ __forceinline__ void block_amax(uint32_t acc, uint32_t* out) {
  __shared__ uint32_t warp_max[kThreads / 32];
  acc = __reduce_max_sync(0xffffffffu, acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warp_max[lane] : 0u;
    acc = __reduce_max_sync(0xffffffffu, acc);
    if (lane == 0) atomicMax(out, acc);
  }
}

}  // namespace cuda
}  // namespace te_adapters
