// CUDA XLA FFI handlers (Hopper) of the MLP's fused casts (te_adapters/core/_fused_mlp.py).
//
// ActCast: GEMM 1's output h (M, n_act*F) plus its bias, through the activation (the product of
// n_act = 1 or 2 activations, one per F-wide slice), scaled and cast to FP8 in both orientations
// (M, F) and (F, M), with the amax of the activation's output: GEMM 2's operand in one read of h.
//
// DactCast: dh = dz * act'(h + b) (M, n_act*F) from GEMM 2's dgrad output dz (M, F) and h, cast
// to FP8 in both orientations with its amax, and the bias gradient sum_rows(dh) (n_act, F) as
// per-tile float32 column sums reduced by a second kernel (a fixed order: the same bits on every
// run). With one linear activation it never reads h: dh = dz, the cast of an output gradient
// with its bias gradient in one pass (the MLP's output bias; TE's dbias + quantize).
//
// ActAmax, DactAmax: the amax alone of ActCast's and DactCast's values (their kernels with no
// output but the amax): current scaling's pass before the cast, the same float32 values.
//
// NormCast: the norm's output (x - mean) * rsigma * gamma (+ beta) of x (M, K), with the row
// statistics given (XLA's reduction computes them), cast to FP8 in both orientations with its
// amax: GEMM 1's operand in one read of x, the norm's output never written.
//
// Each block owns a 64x64 tile of (M, F) (of (M, K) for NormCast): 256 threads, each reading 8
// consecutive columns of two rows with 16-byte loads (element by element at the edges) and
// converting them to FP8 two at a time. The row-major codes go straight to memory (8 bytes a
// thread); the tile's codes are staged in shared memory, from which each thread reads 4x4 bytes as
// four words, transposes them with byte permutes and writes four 4-byte words of the transposed
// copy. The kernels are bound by their integer and logic instructions more than by memory (Nsight
// Compute on an H100), so each element's work is kept to few of them.
//
// Arithmetic: the bias, the gating product, relu, squared relu and the norm are the pure-JAX
// float32 operations in the same order. The sigmoid-shaped activations use the GPU's approximate
// 2**x and reciprocal (a few ulp of float32): gelu's tanh form as x * sigmoid(2u), since
// 0.5 * (1 + tanh(u)) = sigmoid(2u), silu and quick_gelu as x * sigmoid(a x). A value within those
// few ulp of an FP8 rounding boundary can then round the other way than in pure JAX, one FP8 step
// apart; tests/core/test_fused_mlp_gpu.py bounds how often.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "act_math.cuh"
#include "ffi_cuda.h"
#include "fp8_cuda.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_adapters {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;
// 80 bytes: rows stay 16-byte aligned (the 8-byte row writes and the 4-byte transposed reads).
constexpr int kSmemStride = kTile + 16;
constexpr int kMaxAct = 2;
// Loading: each thread reads kVec consecutive columns of a row with 16-byte loads (two for
// float32) where the tile is full and the rows are 16-byte aligned, element by element otherwise.
constexpr int kVec = 8;
constexpr int kColGroups = kTile / kVec;          // 8 threads cover a row of the tile
constexpr int kRowStep = kThreads / kColGroups;   // 32 rows per pass
constexpr int kPasses = kTile / kRowStep;         // 2 passes

using namespace ::te_adapters::act;  // NOLINT: the activations and their dispatch
using cuda::abs_bits;
using cuda::cuda_error;
using cuda::Half;
using cuda::max_nan;
using cuda::out_type;
using cuda::to_float;
using cuda::to_fp8x8;
using cuda::zeroed_amax;

struct Dims {
  int64_t m, f, tiles_f;
  int n_act;
  int act[kMaxAct];
};

// One thread's 8 codes of a row (columns `mine` and past left alone unless `vec`): an 8-byte store
// into the row-major output at `dst` (8-byte aligned when `vec`), and into the shared-memory tile.
__device__ __forceinline__ void store_row(uint2 codes, uint8_t* dst, uint8_t* tile_row, bool vec,
                                          int mine) {
  *reinterpret_cast<uint2*>(tile_row) = codes;  // 8-byte aligned: kSmemStride and kVec are
  if (vec) {
    *reinterpret_cast<uint2*>(dst) = codes;
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if (k < mine) dst[k] = static_cast<uint8_t>((k < 4 ? codes.x : codes.y) >> (8 * (k % 4)));
  }
}

// The tile's codes (shared memory, row stride kSmemStride) to the transposed output qt (row stride
// ld_t, the tile's (0, 0) element at qt[0]). `vec`: a full tile, qt and ld_t 16-byte aligned. Each
// thread then takes 4 rows x 4 columns of the tile: four 4-byte shared loads (one per row), byte
// permutes into the 4 columns, and four 4-byte stores (a warp writes 64 consecutive bytes of each
// of two rows of qt at a time).
__device__ __forceinline__ void store_transposed(const uint8_t* tile, uint8_t* qt, int64_t ld_t,
                                                 int rows, int cols, bool vec) {
  if (vec) {
    const int rb = threadIdx.x % 16 * 4, cb = threadIdx.x / 16 * 4;
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = *reinterpret_cast<const uint32_t*>(tile + (rb + k) * kSmemStride + cb);
    }
    // w[k]'s byte j is row rb + k, column cb + j; column j's word gathers byte j of each w[k].
    const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
    uint8_t* dst = qt + cb * ld_t + rb;
    *reinterpret_cast<uint32_t*>(dst) = __byte_perm(lo01, lo23, 0x5410);
    *reinterpret_cast<uint32_t*>(dst + ld_t) = __byte_perm(lo01, lo23, 0x7632);
    *reinterpret_cast<uint32_t*>(dst + 2 * ld_t) = __byte_perm(hi01, hi23, 0x5410);
    *reinterpret_cast<uint32_t*>(dst + 3 * ld_t) = __byte_perm(hi01, hi23, 0x7632);
    return;
  }
  for (int l = threadIdx.x; l < kTile * kTile; l += kThreads) {
    const int c = l / kTile, r = l % kTile;
    if (r < rows && c < cols) qt[c * ld_t + r] = tile[r * kSmemStride + c];
  }
}

// Host and device: the handlers choose the 16-byte-load path with it, the kernels the stores.
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Whether a tile's stores may be vectors: a full tile, both outputs 16-byte aligned, and row
// strides (ld of the row-major output, ld_t of the transposed one) that keep every row so.
__device__ __forceinline__ bool vector_stores(bool full, int64_t ld, int64_t ld_t, const void* q,
                                              const void* qt) {
  return full && ld % 16 == 0 && ld_t % 16 == 0 && aligned16(q) && aligned16(qt);
}

template <typename In>
__device__ __forceinline__ float from_bits16(uint16_t b) {
  if constexpr (std::is_same_v<In, uint16_t>) {
    return to_float<uint16_t>(b);
  } else {
    return to_float<Half>(Half{b});
  }
}

// v[0..kVec) = p[0..kVec) as float32; columns at or past `cols` read as 0 (element path only).
template <typename In>
__device__ __forceinline__ void load_vec(const In* p, bool vec, int cols, float* v) {
  if (vec) {
    if constexpr (sizeof(In) == 4) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
      const uint4 w = *reinterpret_cast<const uint4*>(p);
      uint16_t e[kVec];
      memcpy(e, &w, sizeof(w));
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = from_bits16<In>(e[k]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = k < cols ? to_float<In>(p[k]) : 0.0f;
}


// `aligned`: every row of h (and dz) starts 16-byte aligned, and F is a multiple of kVec.
template <typename In, OutType kOut, int kNAct, int kAct0, int kAct1>
__global__ void __launch_bounds__(kThreads)
    act_cast_kernel(const In* __restrict__ h, const float* __restrict__ bias,
                    const float* __restrict__ scale_ptr, uint8_t* __restrict__ q,
                    uint8_t* __restrict__ qt, uint32_t* __restrict__ amax, Dims d,
                    bool aligned) {
  __shared__ __align__(16) uint8_t tile[kTile * kSmemStride];
  const int64_t r0 = blockIdx.x / d.tiles_f * kTile, f0 = blockIdx.x % d.tiles_f * kTile;
  const int c0 = threadIdx.x % kColGroups * kVec, rr = threadIdx.x / kColGroups;
  const int64_t n = kNAct * d.f;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kTile), d.m - r0));
  const int cols = static_cast<int>(min(static_cast<int64_t>(kTile), d.f - f0));
  const int mine = max(0, min(kVec, cols - c0));  // this thread's columns inside the tile
  const bool full = rows == kTile && cols == kTile;
  const bool vec = aligned && full;
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  float b[kNAct][kVec];
#pragma unroll
  for (int i = 0; i < kNAct; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      b[i][k] = bias != nullptr && k < mine ? bias[i * d.f + f0 + c0 + k] : 0.0f;
    }
  }
  const bool store = q != nullptr;  // false: the amax alone (ActAmax)
  const bool vec_store = store && vector_stores(full, d.f, d.m, q, qt);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    const int r = rr + j * kRowStep;
    if (r < rows && mine > 0) {
      const In* row = h + (r0 + r) * n + f0 + c0;
      float z[kVec];
#pragma unroll
      for (int i = 0; i < kNAct; ++i) {
        float v[kVec];
        load_vec<In>(row + i * d.f, vec, mine, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float x = bias != nullptr ? add(v[k], b[i][k]) : v[k];
          const float term = act_value(act_of<kAct0, kAct1>(d, i), x);
          z[k] = i == 0 ? term : mul(z[k], term);
        }
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < mine) acc = max_nan(acc, fabsf(z[k]));
      }
      if (store) {
        store_row(to_fp8x8<kOut>(z, scale), q + (r0 + r) * d.f + f0 + c0,
                  tile + r * kSmemStride + c0, vec_store, mine);
      }
    }
  }
  if (store) {
    __syncthreads();
    store_transposed(tile, qt + f0 * d.m + r0, d.m, rows, cols, vec_store);
  }
  if (amax != nullptr) cuda::block_amax<kThreads>(abs_bits(acc), amax);
}

template <typename In, OutType kOut, int kNAct, int kAct0, int kAct1>
__global__ void __launch_bounds__(kThreads)
    dact_cast_kernel(const In* __restrict__ dz, const In* __restrict__ h,
                     const float* __restrict__ bias, const float* __restrict__ scale_ptr,
                     uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                     uint32_t* __restrict__ amax, float* __restrict__ partial, Dims d,
                     bool aligned) {
  // One linear activation (fixed at compile time): dh = dz, the cast of an output gradient with
  // its bias gradient summed in the same pass (the MLP's second GEMM's dy and its bias).
  constexpr bool kGradOnly = kNAct == 1 && kAct0 == kLinear;
  __shared__ __align__(16) uint8_t tile[kNAct][kTile * kSmemStride];
  __shared__ float sums[kNAct][kRowStep][kTile];
  const int64_t tile_r = blockIdx.x / d.tiles_f;
  const int64_t r0 = tile_r * kTile, f0 = blockIdx.x % d.tiles_f * kTile;
  const int c0 = threadIdx.x % kColGroups * kVec, rr = threadIdx.x / kColGroups;
  const int64_t n = kNAct * d.f;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kTile), d.m - r0));
  const int cols = static_cast<int>(min(static_cast<int64_t>(kTile), d.f - f0));
  const int mine = max(0, min(kVec, cols - c0));
  const bool full = rows == kTile && cols == kTile;
  const bool vec = aligned && full;
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  float b[kNAct][kVec];
#pragma unroll
  for (int i = 0; i < kNAct; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      b[i][k] = bias != nullptr && k < mine ? bias[i * d.f + f0 + c0 + k] : 0.0f;
    }
  }
  float colsum[kNAct][kVec];
#pragma unroll
  for (int i = 0; i < kNAct; ++i) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) colsum[i][k] = 0.0f;
  }
  const bool store = q != nullptr;  // false: the amax alone (DactAmax)
  const bool vec_store = store && vector_stores(full, n, d.m, q, qt);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    const int r = rr + j * kRowStep;
    if (r < rows && mine > 0) {
      float g[kVec];
      load_vec<In>(dz + (r0 + r) * d.f + f0 + c0, vec, mine, g);
      float v[kNAct][kVec];
      if constexpr (kGradOnly) {
        // A linear activation's derivative is 1 whatever h is: h is not read.
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[0][k] = 0.0f;
      } else {
        const In* row = h + (r0 + r) * n + f0 + c0;
#pragma unroll
        for (int i = 0; i < kNAct; ++i) {
          load_vec<In>(row + i * d.f, vec, mine, v[i]);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            if (bias != nullptr) v[i][k] = add(v[i][k], b[i][k]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kNAct; ++i) {
        float dh[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          // d(a_0 * a_1)/dv_i: the incoming gradient times the other factor, then a_i'.
          float gi = g[k];
#pragma unroll
          for (int o = 0; o < kNAct; ++o) {
            if (o != i) gi = mul(gi, act_value(act_of<kAct0, kAct1>(d, o), v[o][k]));
          }
          dh[k] = mul(gi, act_grad(act_of<kAct0, kAct1>(d, i), v[i][k]));
          if (k < mine) {
            acc = max_nan(acc, fabsf(dh[k]));
            colsum[i][k] = add(colsum[i][k], dh[k]);
          }
        }
        if (store) {
          store_row(to_fp8x8<kOut>(dh, scale), q + (r0 + r) * n + i * d.f + f0 + c0,
                    tile[i] + r * kSmemStride + c0, vec_store, mine);
        }
      }
    }
  }
  if (store) {
#pragma unroll
    for (int i = 0; i < kNAct; ++i) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) sums[i][rr][c0 + k] = colsum[i][k];
    }
    __syncthreads();
    // Column sums of the tile in a fixed order (the same bits on every run).
    if (threadIdx.x < cols) {
      const int c = threadIdx.x;
#pragma unroll
      for (int i = 0; i < kNAct; ++i) {
        float s = sums[i][0][c];
        for (int k = 1; k < kRowStep; ++k) s = add(s, sums[i][k][c]);
        partial[tile_r * n + i * d.f + f0 + c] = s;
      }
    }
#pragma unroll
    for (int i = 0; i < kNAct; ++i) {
      const int64_t col0 = i * d.f + f0;  // the tile's first column of dh (M, n_act*F)
      store_transposed(tile[i], qt + col0 * d.m + r0, d.m, rows, cols, vec_store);
    }
  }
  if (amax != nullptr) cuda::block_amax<kThreads>(abs_bits(acc), amax);
}

// The norm's output (x - mean) * rsigma * gamma (+ beta) of x (M, K), with the row statistics
// given, cast to FP8 in both orientations (M, K) and (K, M) with its amax.
template <typename In, OutType kOut>
__global__ void __launch_bounds__(kThreads)
    norm_cast_kernel(const In* __restrict__ x, const float* __restrict__ mean,
                     const float* __restrict__ rsigma, const float* __restrict__ gamma,
                     const float* __restrict__ beta, const float* __restrict__ scale_ptr,
                     uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                     uint32_t* __restrict__ amax, int64_t m, int64_t k, int64_t tiles_k,
                     bool aligned) {
  __shared__ __align__(16) uint8_t tile[kTile * kSmemStride];
  const int64_t r0 = blockIdx.x / tiles_k * kTile, k0 = blockIdx.x % tiles_k * kTile;
  const int c0 = threadIdx.x % kColGroups * kVec, rr = threadIdx.x / kColGroups;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kTile), m - r0));
  const int cols = static_cast<int>(min(static_cast<int64_t>(kTile), k - k0));
  const int mine = max(0, min(kVec, cols - c0));
  const bool vec = aligned && rows == kTile && cols == kTile;
  const float scale = *scale_ptr;
  float g[kVec], b[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    g[e] = e < mine ? gamma[k0 + c0 + e] : 0.0f;
    b[e] = beta != nullptr && e < mine ? beta[k0 + c0 + e] : 0.0f;
  }
  const bool vec_store = vector_stores(rows == kTile && cols == kTile, k, m, q, qt);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    const int r = rr + j * kRowStep;
    if (r < rows && mine > 0) {
      const int64_t row = r0 + r;
      const float mu = mean[row], rs = rsigma[row];
      float v[kVec];
      load_vec<In>(x + row * k + k0 + c0, vec, mine, v);
      float y[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        y[e] = mul(mul(add(v[e], -mu), rs), g[e]);
        if (beta != nullptr) y[e] = add(y[e], b[e]);
        if (e < mine) acc = max_nan(acc, fabsf(y[e]));
      }
      store_row(to_fp8x8<kOut>(y, scale), q + row * k + k0 + c0, tile + r * kSmemStride + c0,
                vec_store, mine);
    }
  }
  __syncthreads();
  store_transposed(tile, qt + k0 * m + r0, m, rows, cols, vec_store);
  if (amax != nullptr) cuda::block_amax<kThreads>(abs_bits(acc), amax);
}

// M, F and n_act from h (M, n_act * F) and the activation ids (act1 < 0: one activation).
ffi::Error make_dims(const ffi::AnyBuffer& h, int32_t act0, int32_t act1, Dims* d) {
  const auto hd = h.dimensions();
  if (hd.size() != 2) return ffi::Error::InvalidArgument("h must be 2-D");
  d->n_act = act1 < 0 ? 1 : 2;
  d->act[0] = act0;
  d->act[1] = act1 < 0 ? kLinear : act1;
  for (int i = 0; i < d->n_act; ++i) {
    if (d->act[i] < kLinear || d->act[i] > kSquaredRelu) {
      return ffi::Error::InvalidArgument("unknown activation id");
    }
  }
  d->m = hd[0];
  d->f = hd[1] / d->n_act;
  if (hd[1] != d->n_act * d->f) return ffi::Error::InvalidArgument("h's columns are not n_act * F");
  d->tiles_f = (d->f + kTile - 1) / kTile;
  return ffi::Error::Success();
}

ffi::Error check_bias(const ffi::Buffer<ffi::F32>& bias, bool has_bias, const Dims& d) {
  if (has_bias && bias.element_count() != static_cast<size_t>(d.n_act * d.f)) {
    return ffi::Error::InvalidArgument("bias must have n_act * F elements");
  }
  return ffi::Error::Success();
}

template <typename In, typename Launch>
ffi::Error dispatch_out(OutType ot, Launch&& launch) {
  if (ot == OutType::kE4M3) return launch(In{}, std::integral_constant<OutType, OutType::kE4M3>{});
  return launch(In{}, std::integral_constant<OutType, OutType::kE5M2>{});
}

template <typename Launch>
ffi::Error dispatch(ffi::DataType in, OutType ot, Launch&& launch) {
  switch (in) {
    case ffi::DataType::F32:
      return dispatch_out<float>(ot, launch);
    case ffi::DataType::BF16:
      return dispatch_out<uint16_t>(ot, launch);
    case ffi::DataType::F16:
      return dispatch_out<Half>(ot, launch);
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
}

ffi::Error ActCastImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::F32> bias,
                       ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                       int32_t act0, int32_t act1, bool has_bias, bool compute_amax) {
  Dims d;
  if (auto e = make_dims(h, act0, act1, &d); e.failure()) return e;
  if (q->dimensions().size() != 2) return ffi::Error::InvalidArgument("q must be 2-D");
  if (auto e = check_bias(bias, has_bias, d); e.failure()) return e;
  OutType ot;
  if (auto e = out_type(q->element_type(), &ot); e.failure()) return e;
  const size_t mf = static_cast<size_t>(d.m * d.f);
  if (q->element_count() != mf || qt->element_count() != mf ||
      qt->element_type() != q->element_type()) {
    return ffi::Error::InvalidArgument("q and q_t must both hold M * F FP8 values");
  }
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("scale must have 1 element");
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, compute_amax, stream, &ap); e.failure()) return e;
  const int64_t blocks = (d.m + kTile - 1) / kTile * d.tiles_f;
  if (blocks == 0) return cuda_error("te_adapters act_cast memset");
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  return dispatch(h.element_type(), ot, [&](auto in, auto out) {
    using In = decltype(in);
    constexpr OutType kOut = decltype(out)::value;
    const In* hp = static_cast<const In*>(h.untyped_data());
    const bool aligned = d.f % kVec == 0 && aligned16(hp);
    dispatch_acts(d, [&](auto n_act, auto act0, auto act1) {
      act_cast_kernel<In, kOut, decltype(n_act)::value, decltype(act0)::value,
                      decltype(act1)::value><<<blocks, kThreads, 0, stream>>>(
          hp, bp, scale.typed_data(), qp, qtp, ap, d, aligned);
    });
    return cuda_error("te_adapters act_cast kernel");
  });
}

ffi::Error DactCastImpl(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer h,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax,
                        ffi::Result<ffi::Buffer<ffi::F32>> dbias,
                        ffi::Result<ffi::Buffer<ffi::F32>> partial, int32_t act0, int32_t act1,
                        bool has_bias, bool compute_amax) {
  Dims d;
  if (auto e = make_dims(h, act0, act1, &d); e.failure()) return e;
  if (q->dimensions().size() != 2) return ffi::Error::InvalidArgument("q must be 2-D");
  if (auto e = check_bias(bias, has_bias, d); e.failure()) return e;
  OutType ot;
  if (auto e = out_type(q->element_type(), &ot); e.failure()) return e;
  const int64_t n = d.n_act * d.f;
  const int64_t tiles_r = (d.m + kTile - 1) / kTile;
  if (dz.element_type() != h.element_type() ||
      dz.element_count() != static_cast<size_t>(d.m * d.f)) {
    return ffi::Error::InvalidArgument("dz must be (M, F) in h's dtype");
  }
  if (q->element_count() != static_cast<size_t>(d.m * n) ||
      qt->element_count() != q->element_count() || qt->element_type() != q->element_type()) {
    return ffi::Error::InvalidArgument("q and q_t must both hold M * n_act * F FP8 values");
  }
  if (dbias->element_count() != static_cast<size_t>(n) ||
      partial->element_count() != static_cast<size_t>(tiles_r * n)) {
    return ffi::Error::InvalidArgument(
        "dbias must hold n_act * F values and the workspace row tiles * n_act * F");
  }
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("scale must have 1 element");
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, compute_amax, stream, &ap); e.failure()) return e;
  const int64_t blocks = tiles_r * d.tiles_f;
  float* dbp = dbias->typed_data();
  if (blocks == 0) {
    cudaMemsetAsync(dbp, 0, sizeof(float) * n, stream);
    return cuda_error("te_adapters dact_cast memset");
  }
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  float* pp = partial->typed_data();
  return dispatch(h.element_type(), ot, [&](auto in, auto out) {
    using In = decltype(in);
    constexpr OutType kOut = decltype(out)::value;
    const In* dzp = static_cast<const In*>(dz.untyped_data());
    const In* hp = static_cast<const In*>(h.untyped_data());
    const bool aligned = d.f % kVec == 0 && aligned16(hp) && aligned16(dzp);
    dispatch_acts(d, [&](auto n_act, auto act0, auto act1) {
      dact_cast_kernel<In, kOut, decltype(n_act)::value, decltype(act0)::value,
                       decltype(act1)::value><<<blocks, kThreads, 0, stream>>>(
          dzp, hp, bp, scale.typed_data(), qp, qtp, ap, pp, d, aligned);
    });
    const int64_t sum_blocks = (n + kThreads - 1) / kThreads;
    column_sum_kernel<kThreads><<<sum_blocks, kThreads, 0, stream>>>(pp, tiles_r, n, dbp);
    return cuda_error("te_adapters dact_cast kernel");
  });
}

// ActAmax and DactAmax: the cast kernels with no FP8 output (q == nullptr), the amax alone.
ffi::Error ActAmaxImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::F32> bias,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax, int32_t act0, int32_t act1,
                       bool has_bias) {
  Dims d;
  if (auto e = make_dims(h, act0, act1, &d); e.failure()) return e;
  if (auto e = check_bias(bias, has_bias, d); e.failure()) return e;
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, true, stream, &ap); e.failure()) return e;
  const int64_t blocks = (d.m + kTile - 1) / kTile * d.tiles_f;
  if (blocks == 0) return cuda_error("te_adapters act_amax memset");
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  return dispatch(h.element_type(), OutType::kE4M3, [&](auto in, auto out) {
    using In = decltype(in);
    constexpr OutType kOut = decltype(out)::value;
    const In* hp = static_cast<const In*>(h.untyped_data());
    const bool aligned = d.f % kVec == 0 && aligned16(hp);
    dispatch_acts(d, [&](auto n_act, auto act0, auto act1) {
      act_cast_kernel<In, kOut, decltype(n_act)::value, decltype(act0)::value,
                      decltype(act1)::value><<<blocks, kThreads, 0, stream>>>(
          hp, bp, nullptr, nullptr, nullptr, ap, d, aligned);
    });
    return cuda_error("te_adapters act_amax kernel");
  });
}

ffi::Error DactAmaxImpl(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer h,
                        ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                        int32_t act0, int32_t act1, bool has_bias) {
  Dims d;
  if (auto e = make_dims(h, act0, act1, &d); e.failure()) return e;
  if (auto e = check_bias(bias, has_bias, d); e.failure()) return e;
  if (dz.element_type() != h.element_type() ||
      dz.element_count() != static_cast<size_t>(d.m * d.f)) {
    return ffi::Error::InvalidArgument("dz must be (M, F) in h's dtype");
  }
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, true, stream, &ap); e.failure()) return e;
  const int64_t blocks = (d.m + kTile - 1) / kTile * d.tiles_f;
  if (blocks == 0) return cuda_error("te_adapters dact_amax memset");
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  return dispatch(h.element_type(), OutType::kE5M2, [&](auto in, auto out) {
    using In = decltype(in);
    constexpr OutType kOut = decltype(out)::value;
    const In* dzp = static_cast<const In*>(dz.untyped_data());
    const In* hp = static_cast<const In*>(h.untyped_data());
    const bool aligned = d.f % kVec == 0 && aligned16(hp) && aligned16(dzp);
    dispatch_acts(d, [&](auto n_act, auto act0, auto act1) {
      dact_cast_kernel<In, kOut, decltype(n_act)::value, decltype(act0)::value,
                       decltype(act1)::value><<<blocks, kThreads, 0, stream>>>(
          dzp, hp, bp, nullptr, nullptr, nullptr, ap, nullptr, d, aligned);
    });
    return cuda_error("te_adapters dact_amax kernel");
  });
}

ffi::Error NormCastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> mean,
                        ffi::Buffer<ffi::F32> rsigma, ffi::Buffer<ffi::F32> gamma,
                        ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax, bool has_beta,
                        bool compute_amax) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  if (mean.element_count() != static_cast<size_t>(m) ||
      rsigma.element_count() != static_cast<size_t>(m)) {
    return ffi::Error::InvalidArgument("mean and rsigma must have one value per row");
  }
  if (gamma.element_count() != static_cast<size_t>(k) ||
      (has_beta && beta.element_count() != static_cast<size_t>(k))) {
    return ffi::Error::InvalidArgument("gamma and beta must have one value per column");
  }
  OutType ot;
  if (auto e = out_type(q->element_type(), &ot); e.failure()) return e;
  if (q->element_count() != x.element_count() || qt->element_count() != x.element_count() ||
      qt->element_type() != q->element_type()) {
    return ffi::Error::InvalidArgument("q and q_t must both hold M * K FP8 values");
  }
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("scale must have 1 element");
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, compute_amax, stream, &ap); e.failure()) return e;
  const int64_t tiles_k = (k + kTile - 1) / kTile;
  const int64_t blocks = (m + kTile - 1) / kTile * tiles_k;
  if (blocks == 0) return cuda_error("te_adapters norm_cast memset");
  const float* bp = has_beta ? beta.typed_data() : nullptr;
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  return dispatch(x.element_type(), ot, [&](auto in, auto out) {
    using In = decltype(in);
    const In* xp = static_cast<const In*>(x.untyped_data());
    const bool aligned = k % kVec == 0 && aligned16(xp);
    norm_cast_kernel<In, decltype(out)::value><<<blocks, kThreads, 0, stream>>>(
        xp, mean.typed_data(), rsigma.typed_data(), gamma.typed_data(), bp, scale.typed_data(),
        qp, qtp, ap, m, k, tiles_k, aligned);
    return cuda_error("te_adapters norm_cast kernel");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormCastCuda, NormCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_beta")
                                  .Attr<bool>("compute_amax"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActCastCuda, ActCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("compute_amax"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(DactCastCuda, DactCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("compute_amax"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActAmaxCuda, ActAmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(DactAmaxCuda, DactAmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
