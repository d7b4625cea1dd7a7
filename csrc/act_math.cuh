// The activations of the MLP's fused casts (act_cast_cuda.cu's per-tensor kernels and
// block_cast_cuda.cu's block-scaled ones), in float32 as te_adapters.core.ACTIVATIONS computes
// them, the dispatch of their ids to compile-time constants, and the bias gradient's sum over
// the row tiles both dact casts end with.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace te_adapters {
namespace act {

// The activation ids of te_adapters/core/_fused_mlp.py (KERNEL_ACTIVATIONS).
enum Act : int { kLinear = 0, kGelu = 1, kRelu = 2, kSilu = 3, kQuickGelu = 4, kSquaredRelu = 5 };

// Rounded float32 operations where the pure-JAX formula is matched exactly (no contraction into
// fused multiply-adds).
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }

// The GPU's approximate 2**x and 1/x (MUFU; a couple of ulp, subnormals flushed).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float kGeluCoeff = 0.044715f;
constexpr float kQuickGeluCoeff = 1.702f;

// 1 / (1 + exp(-t)); 0 and 1 in the tails (2**x overflows to inf, whose reciprocal is 0).
__device__ __forceinline__ float sigmoid(float t) { return rcp(1.0f + ex2(-kLog2e * t)); }

// gelu's tanh form x * 0.5 * (1 + tanh(u)), u = sqrt(2/pi) * (x + 0.044715 x**3), is x * s with
// s = sigmoid(2u); returns s.
__device__ __forceinline__ float gelu_gate(float x, float x2) {
  return sigmoid(kTwoSqrt2OverPi * x * fmaf(kGeluCoeff, x2, 1.0f));
}

// relu as jax.nn.relu (XLA's maximum(x, 0)): a NaN stays NaN. A bare `x > 0 ? x : 0` turns it
// into 0, which dropped the NaN that GemmConfig.non_finite="propagate" sends through the MLP
// (GEMM 1's output is NaN where its operand held a NaN or an inf).
__device__ __forceinline__ float relu(float x) { return x > 0.0f || x != x ? x : 0.0f; }

// The activation, as te_adapters.core.ACTIVATIONS computes it in float32.
__device__ __forceinline__ float act_value(int act, float x) {
  switch (act) {
    case kGelu:
      return x * gelu_gate(x, x * x);
    case kRelu:
      return relu(x);
    case kSilu:
      return x * sigmoid(x);
    case kQuickGelu:
      return x * sigmoid(kQuickGeluCoeff * x);
    case kSquaredRelu: {
      const float r = relu(x);
      return mul(r, r);
    }
    default:
      return x;
  }
}

// The activation's derivative.
__device__ __forceinline__ float act_grad(int act, float x) {
  switch (act) {
    case kGelu: {  // s + x s (1 - s) d(2u)/dx
      const float x2 = x * x;
      const float s = gelu_gate(x, x2);
      return fmaf(x * s * (1.0f - s), kTwoSqrt2OverPi * fmaf(3.0f * kGeluCoeff, x2, 1.0f), s);
    }
    case kRelu:
      return x > 0.0f ? 1.0f : 0.0f;
    case kSilu: {
      const float s = sigmoid(x);
      return fmaf(x * s, 1.0f - s, s);
    }
    case kQuickGelu: {
      const float s = sigmoid(kQuickGeluCoeff * x);
      return fmaf(x * kQuickGeluCoeff * s, 1.0f - s, s);
    }
    case kSquaredRelu:
      return x > 0.0f ? mul(2.0f, x) : 0.0f;
    default:
      return 1.0f;
  }
}

// The activation id of factor i: kAct0/kAct1 where the launch fixed it (its switch then folds
// away at compile time), the runtime id in `d` where they are -1.
template <int kAct0, int kAct1, typename D>
__device__ __forceinline__ int act_of(const D& d, int i) {
  const int fixed = i == 0 ? kAct0 : kAct1;
  return fixed >= 0 ? fixed : d.act[i];
}

// Calls launch(n_act, act0, act1) as integral constants: the common activations fixed at compile
// time (gelu, silu or relu alone; gelu or silu gated by a linear factor), -1 (the id read at run
// time) for the rest.
template <typename D, typename Launch>
void dispatch_acts(const D& d, Launch&& launch) {
  using std::integral_constant;
  using Any = integral_constant<int, -1>;
  using One = integral_constant<int, 1>;
  using Two = integral_constant<int, 2>;
  using Linear = integral_constant<int, kLinear>;
  if (d.n_act == 1) {
    switch (d.act[0]) {
      case kGelu:
        return launch(One{}, integral_constant<int, kGelu>{}, Any{});
      case kSilu:
        return launch(One{}, integral_constant<int, kSilu>{}, Any{});
      case kRelu:
        return launch(One{}, integral_constant<int, kRelu>{}, Any{});
      case kLinear:
        return launch(One{}, Linear{}, Any{});
      default:
        return launch(One{}, Any{}, Any{});
    }
  }
  if (d.act[1] == kLinear && d.act[0] == kGelu) {
    return launch(Two{}, integral_constant<int, kGelu>{}, Linear{});
  }
  if (d.act[1] == kLinear && d.act[0] == kSilu) {
    return launch(Two{}, integral_constant<int, kSilu>{}, Linear{});
  }
  return launch(Two{}, Any{}, Any{});
}

// dbias[col] = sum over the row tiles of partial[tile, col], in tile order (the dact casts write
// one partial sum per row tile and column). A template, so that each unit that launches it may
// instantiate it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    column_sum_kernel(const float* __restrict__ partial, int64_t tiles, int64_t cols,
                      float* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= cols) return;
  float s = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) s = add(s, partial[t * cols + col]);
  out[col] = s;
}

}  // namespace act
}  // namespace te_adapters
