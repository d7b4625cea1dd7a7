// The one-pass FP8 block cast of Float8BlockScaling (block_cast_cuda.cu) and its tile loaders:
// the kernel and the FFI handlers' shared checks, for block_cast_cuda.cu (the plain cast and the
// norm's), block_act_cast_cuda.cu and block_dact_cast_cuda.cu (the MLP's activation and its
// gradient; separate files, compiled in parallel). Everything here is in an anonymous namespace:
// each file has its own copy.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "act_math.cuh"
#include "ffi_cuda.h"
#include "fp8_convert.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_adapters {
namespace {

using cuda::cuda_error;

constexpr int kBlock = 128;
constexpr int kThreads = 256;                          // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kBlock / kWarps;          // 16 rows a warp, 4 columns a lane
// Transposed codes in shared memory: an odd row stride, so the byte stores of a warp (32 lanes,
// 4 rows apart) fall in 32 different banks.
constexpr int kTStride = kBlock + 1;

struct Half16 {
  uint16_t bits;
};

// Four consecutive elements as they are stored (8 bytes of 16-bit values, 16 of float32): the
// plain cast keeps its tile in registers so, half the registers for 16-bit inputs.
template <typename In>
struct Raw4 {
  using T = uint2;
};
template <>
struct Raw4<float> {
  using T = float4;
};
template <typename In>
__device__ __forceinline__ void unpack4(const typename Raw4<In>::T& w, float* v);
template <>
__device__ __forceinline__ void unpack4<float>(const float4& w, float* v) {
  v[0] = w.x;
  v[1] = w.y;
  v[2] = w.z;
  v[3] = w.w;
}
template <>
__device__ __forceinline__ void unpack4<uint16_t>(const uint2& w, float* v) {  // bfloat16 bits
  v[0] = __uint_as_float(w.x << 16);
  v[1] = __uint_as_float(w.x & 0xffff0000u);
  v[2] = __uint_as_float(w.y << 16);
  v[3] = __uint_as_float(w.y & 0xffff0000u);
}
template <>
__device__ __forceinline__ void unpack4<Half16>(const uint2& w, float* v) {
  v[0] = __half2float(__ushort_as_half(static_cast<uint16_t>(w.x & 0xffffu)));
  v[1] = __half2float(__ushort_as_half(static_cast<uint16_t>(w.x >> 16)));
  v[2] = __half2float(__ushort_as_half(static_cast<uint16_t>(w.y & 0xffffu)));
  v[3] = __half2float(__ushort_as_half(static_cast<uint16_t>(w.y >> 16)));
}

template <typename In>
__device__ __forceinline__ typename Raw4<In>::T load_raw4(const In* p) {
  return __ldg(reinterpret_cast<const typename Raw4<In>::T*>(p));
}

// Four consecutive elements as floats.
template <typename In>
__device__ __forceinline__ void load4(const In* p, float* v) {
  unpack4<In>(load_raw4(p), v);
}

// |v|'s bits: non-negative floats order like their bit patterns; NaN sorts above +inf.
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ float block_scale(uint32_t amax_bits, float fp8_max,
                                             float value_for_inf, bool power_2) {
  if (amax_bits == 0u || amax_bits >= 0x7f800000u) return 1.0f;  // zero, infinite or NaN
  float scale = __fdiv_rn(fp8_max, __uint_as_float(amax_bits));
  if (isinf(scale)) scale = value_for_inf;
  if (power_2) scale = __uint_as_float(__float_as_uint(scale) & 0xff800000u);
  return scale;
}

// Two products to FP8 in one conversion (cvt.rn.satfinite): round to nearest even, anything
// beyond the largest finite value (infinities included) to it, NaN to NaN. That is the pure-JAX
// cast's clip to +-fp8_max followed by the conversion, without the clip.
template <OutType kOut>
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b) {
  constexpr __nv_fp8_interpretation_t kind = kOut == OutType::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind));
}

template <OutType kOut>
__device__ __forceinline__ uint32_t to_fp8x4(const float* v, float scale) {
  return static_cast<uint32_t>(to_fp8x2<kOut>(v[0] * scale, v[1] * scale)) |
         (static_cast<uint32_t>(to_fp8x2<kOut>(v[2] * scale, v[3] * scale)) << 16);
}

struct Shape {
  int64_t batch, rows, cols;
  // The plain cast's source rows: row r of each batch entry is row src[r] of the input's
  // (batch, in_rows, cols), zeros where src[r] is negative or not below in_rows. src null: none.
  int64_t in_rows = 0;
  const int32_t* src = nullptr;
};

struct Outputs {
  uint8_t* q;         // (batch, rows, cols) or null
  float* q_sinv;      // 1x128: (batch, rows, cols/128); tile: (batch, rows/128, cols/128)
  uint8_t* qt;        // (batch, cols, rows) or null
  float* qt_sinv;     // 1x128: (batch, cols, rows/128); tile: unused (the tiles' scales)
  uint32_t* amax;     // float32 bits, or null
  float* partial;     // (batch * rows/128, cols): each tile's column sums (kSums), or null
};

// Tile loaders: fetch4(row, col, v) puts elements col..col+3 of row `row` (of the (batch * rows,
// cols) view) in v as float32; begin(col) is called once with the thread's first column.
template <typename In>
struct PlainLoad {
  static constexpr bool kTiles = true;  // also cast into 128x128 tiles (the producers: 1x128 only)
  const In* x;
  int64_t cols;
  __device__ __forceinline__ void begin(int64_t) {}
  __device__ __forceinline__ void fetch4(int64_t row, int64_t col, float* v) const {
    load4<In>(x + row * cols + col, v);
  }
};

// The norm's output: (x - mean) * rsigma * gamma (+ beta), act_cast_cuda.cu's operations in
// their order (the pure-JAX formula's).
template <typename In>
struct NormLoad {
  static constexpr bool kTiles = false;
  const In* x;
  const float* mean;
  const float* rsigma;
  const float* gamma;
  const float* beta;  // or null
  int64_t k;
  float g[4], b[4];
  __device__ __forceinline__ void begin(int64_t col) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      g[e] = gamma[col + e];
      b[e] = beta != nullptr ? beta[col + e] : 0.0f;
    }
  }
  __device__ __forceinline__ void fetch4(int64_t row, int64_t col, float* v) const {
    load4<In>(x + row * k + col, v);
    const float mu = mean[row], rs = rsigma[row];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float y = act::mul(act::mul(act::add(v[e], -mu), rs), g[e]);
      if (beta != nullptr) y = act::add(y, b[e]);
      v[e] = y;
    }
  }
};

// The activation: the product over the n_act factors of act_i(h[:, i*F + c] + b[i, c]).
template <typename In, int kNAct, int kAct0, int kAct1>
struct ActLoad {
  static constexpr bool kTiles = false;
  const In* h;
  const float* bias;  // (n_act * F) or null
  int64_t f;
  int act[2];
  float b[kNAct][4];
  __device__ __forceinline__ void begin(int64_t col) {
#pragma unroll
    for (int i = 0; i < kNAct; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) b[i][e] = bias != nullptr ? bias[i * f + col + e] : 0.0f;
    }
  }
  __device__ __forceinline__ void fetch4(int64_t row, int64_t col, float* v) const {
#pragma unroll
    for (int i = 0; i < kNAct; ++i) {
      float x[4];
      load4<In>(h + row * (kNAct * f) + i * f + col, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float t = act::act_value(act::act_of<kAct0, kAct1>(*this, i),
                                       bias != nullptr ? act::add(x[e], b[i][e]) : x[e]);
        v[e] = i == 0 ? t : act::mul(v[e], t);
      }
    }
  }
};

// The activation's gradient dh (M, n_act*F): column c of factor i = c / F is dz[:, c - i*F]
// times the other factors' values times act_i'. With one linear activation, dz itself.
template <typename In, int kNAct, int kAct0, int kAct1>
struct DactLoad {
  static constexpr bool kTiles = false;
  static constexpr bool kGradOnly = kNAct == 1 && kAct0 == act::kLinear;
  const In* dz;
  const In* h;
  const float* bias;  // (n_act * F) or null
  int64_t f;
  int act[2];
  int fi;        // the factor of this thread's columns
  int64_t fc;    // their first column in F
  float b[kNAct][4];
  __device__ __forceinline__ void begin(int64_t col) {
    fi = kNAct == 2 && col >= f ? 1 : 0;
    fc = col - fi * f;
#pragma unroll
    for (int i = 0; i < kNAct; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        b[i][e] = bias != nullptr && !kGradOnly ? bias[i * f + fc + e] : 0.0f;
      }
    }
  }
  __device__ __forceinline__ void fetch4(int64_t row, int64_t, float* v) const {
    load4<In>(dz + row * f + fc, v);
    if constexpr (!kGradOnly) {
      float x[kNAct][4];
#pragma unroll
      for (int i = 0; i < kNAct; ++i) {
        load4<In>(h + row * (kNAct * f) + i * f + fc, x[i]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (bias != nullptr) x[i][e] = act::add(x[i][e], b[i][e]);
        }
      }
      const int i = kNAct == 1 ? 0 : fi;  // this tile's factor (a constant for one activation)
      const int a_i = act::act_of<kAct0, kAct1>(*this, i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // d(a_0 * a_1)/dx_i: the incoming gradient times the other factor, then a_i'.
        float gi = v[e];
        if constexpr (kNAct == 2) {
          const int a_o = act::act_of<kAct0, kAct1>(*this, 1 - i);
          gi = act::mul(gi, act::act_value(a_o, i == 0 ? x[1][e] : x[0][e]));
        }
        v[e] = act::mul(gi, act::act_grad(a_i, i == 0 ? x[0][e] : x[kNAct - 1][e]));
      }
    }
  }
};

// A tile row's four elements as the kernel keeps them in registers: the plain cast's as stored,
// a computing loader's as the float32 values it computes.
template <typename Load>
struct RawOf {
  using T = float4;
  __device__ __forceinline__ static T fetch(const Load& l, int64_t row, int64_t col) {
    float v[4];
    l.fetch4(row, col, v);
    return make_float4(v[0], v[1], v[2], v[3]);
  }
  __device__ __forceinline__ static void unpack(const T& w, float* v) { unpack4<float>(w, v); }
};
template <typename In>
struct RawOf<PlainLoad<In>> {
  using T = typename Raw4<In>::T;
  __device__ __forceinline__ static T fetch(const PlainLoad<In>& l, int64_t row, int64_t col) {
    return load_raw4(l.x + row * l.cols + col);
  }
  __device__ __forceinline__ static void unpack(const T& w, float* v) { unpack4<In>(w, v); }
};

// kQ / kQt: whether the copy along the rows / the transposed copy may be written (each also
// only where its output is not null); an instantiation without one has no code, shared memory
// or registers for it.
template <typename Load, OutType kOut, bool kTile, bool kSums, bool kQ = true, bool kQt = true>
__global__ void __launch_bounds__(kThreads)
    block_cast_kernel(Load load, Outputs o, Shape s, bool power_2, float value_for_inf) {
  static_assert(kQ || kQt, "nothing to write");
  constexpr bool kColScales = kQt && !kTile;  // 1x128 blocks along the input's columns
  __shared__ uint32_t col_part[kColScales ? kWarps : 1][kBlock];
  __shared__ float col_scale[kColScales ? kBlock : 1];
  __shared__ uint32_t warp_max[kWarps];
  __shared__ uint8_t tcodes[kQt ? kBlock * kTStride : 1];
  const float fp8_max = fp8_limit(kOut);
  const int64_t tiles_r = s.rows / kBlock, tiles_c = s.cols / kBlock;
  const int64_t t = blockIdx.x % (tiles_r * tiles_c), b = blockIdx.x / (tiles_r * tiles_c);
  const int64_t tr = t / tiles_c, tc = t % tiles_c;
  const int64_t r0 = tr * kBlock, c0 = tc * kBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rw = warp * kRowsPerWarp, cl = lane * 4;  // this thread's first row and column
  const int64_t row0 = b * s.rows + r0 + rw;  // this thread's first row of (batch * rows, cols)

  // The tile's 16 rows of this warp, as RawOf keeps them. With source rows the warp loads its 16
  // sources once and shuffles them, so that all 16 row loads are in flight before any is used.
  using Raw = RawOf<Load>;
  typename Raw::T raw[kRowsPerWarp];
  load.begin(c0 + cl);
  int32_t my_src = 0;
  if (s.src != nullptr && lane < kRowsPerWarp) my_src = __ldg(s.src + r0 + rw + lane);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    raw[i] = typename Raw::T{};  // zeros (every input dtype's zero is all zero bits)
    if (s.src == nullptr) {
      raw[i] = Raw::fetch(load, row0 + i, c0 + cl);
    } else {
      const int64_t r = __shfl_sync(0xffffffffu, my_src, i);  // uniform branch
      if (r >= 0 && r < s.in_rows) raw[i] = Raw::fetch(load, b * s.in_rows + r, c0 + cl);
    }
  }
  if constexpr (kSums) {
    // The tile's column sums in a fixed order (each thread's 16 rows, then the warps in order):
    // the same bits on every run.
    __shared__ float sum_part[kWarps][kBlock];
    float cs[4];
    Raw::unpack(raw[0], cs);
#pragma unroll
    for (int i = 1; i < kRowsPerWarp; ++i) {
      float v[4];
      Raw::unpack(raw[i], v);
#pragma unroll
      for (int k = 0; k < 4; ++k) cs[k] = act::add(cs[k], v[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) sum_part[warp][cl + k] = cs[k];
    __syncthreads();
    if (threadIdx.x < kBlock) {
      float sum = sum_part[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) sum = act::add(sum, sum_part[w][threadIdx.x]);
      o.partial[(b * tiles_r + tr) * s.cols + c0 + threadIdx.x] = sum;
    }
  }

  uint32_t row_amax[kRowsPerWarp];
  uint32_t col_acc[4] = {0u, 0u, 0u, 0u};
  uint32_t all = 0u;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    float v[4];
    Raw::unpack(raw[i], v);
    uint32_t a = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t ab = abs_bits(v[k]);
      a = max(a, ab);
      if constexpr (kColScales) col_acc[k] = max(col_acc[k], ab);
    }
    row_amax[i] = __reduce_max_sync(0xffffffffu, a);
    all = max(all, row_amax[i]);
  }
  if (lane == 0) warp_max[warp] = all;
  if constexpr (kColScales) {
#pragma unroll
    for (int k = 0; k < 4; ++k) col_part[warp][cl + k] = col_acc[k];
  }
  __syncthreads();
  uint32_t tile_amax = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tile_amax = max(tile_amax, warp_max[w]);
  if (o.amax != nullptr && threadIdx.x == 0) {
    atomicMax(o.amax, min(tile_amax, 0x7fc00000u));  // any NaN as the canonical quiet NaN
  }

  if constexpr (kTile) {
    const float scale = block_scale(tile_amax, fp8_max, value_for_inf, power_2);
    if (threadIdx.x == 0) o.q_sinv[(b * tiles_r + tr) * tiles_c + tc] = __fdiv_rn(1.0f, scale);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      float v[4];
      Raw::unpack(raw[i], v);
      const uint32_t w = to_fp8x4<kOut>(v, scale);
      if constexpr (kQt) {
#pragma unroll
        for (int k = 0; k < 4; ++k) tcodes[(cl + k) * kTStride + rw + i] = (w >> (8 * k)) & 0xffu;
      }
      if (kQ && o.q != nullptr) {
        *reinterpret_cast<uint32_t*>(o.q + (b * s.rows + r0 + rw + i) * s.cols + c0 + cl) = w;
      }
    }
  } else {
    if (kQ && o.q != nullptr) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float v[4];
        Raw::unpack(raw[i], v);
        const float scale = block_scale(row_amax[i], fp8_max, value_for_inf, power_2);
        const uint32_t w = to_fp8x4<kOut>(v, scale);
        const int64_t row = b * s.rows + r0 + rw + i;
        *reinterpret_cast<uint32_t*>(o.q + row * s.cols + c0 + cl) = w;
        if (lane == 0) o.q_sinv[row * tiles_c + tc] = __fdiv_rn(1.0f, scale);
      }
    }
    if constexpr (kColScales) {
      if (o.qt != nullptr) {
        if (threadIdx.x < kBlock) {
          uint32_t a = 0u;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) a = max(a, col_part[w][threadIdx.x]);
          const float scale = block_scale(a, fp8_max, value_for_inf, power_2);
          col_scale[threadIdx.x] = scale;
          o.qt_sinv[(b * s.cols + c0 + threadIdx.x) * tiles_r + tr] = __fdiv_rn(1.0f, scale);
        }
        __syncthreads();
        const float cs[4] = {col_scale[cl], col_scale[cl + 1], col_scale[cl + 2],
                             col_scale[cl + 3]};
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          float v[4];
          Raw::unpack(raw[i], v);
          const uint32_t w =
              static_cast<uint32_t>(to_fp8x2<kOut>(v[0] * cs[0], v[1] * cs[1])) |
              (static_cast<uint32_t>(to_fp8x2<kOut>(v[2] * cs[2], v[3] * cs[3])) << 16);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            tcodes[(cl + k) * kTStride + rw + i] = (w >> (8 * k)) & 0xffu;
          }
        }
      }
    }
  }
  if (kQt && o.qt != nullptr) {
    __syncthreads();
    // 128 output rows (one per input column) of 128 bytes: a warp writes one row at a time, 4
    // bytes a lane.
#pragma unroll 4
    for (int c = warp; c < kBlock; c += kWarps) {
      const uint8_t* src = &tcodes[c * kTStride + cl];
      const uint32_t w = static_cast<uint32_t>(src[0]) | (static_cast<uint32_t>(src[1]) << 8) |
                         (static_cast<uint32_t>(src[2]) << 16) |
                         (static_cast<uint32_t>(src[3]) << 24);
      *reinterpret_cast<uint32_t*>(o.qt + (b * s.cols + c0 + c) * s.rows + r0 + cl) = w;
    }
  }
}

template <OutType kOut, bool kSums, typename Load>
void launch(cudaStream_t stream, const Load& load, const Outputs& o, const Shape& s, bool tile,
            bool power_2, float value_for_inf) {
  const int64_t blocks = s.batch * (s.rows / kBlock) * (s.cols / kBlock);
  if (blocks == 0) return;
  const bool q = o.q != nullptr, qt = o.qt != nullptr;
  if (tile) {
    if constexpr (Load::kTiles) {
      if (qt) {
        block_cast_kernel<Load, kOut, true, kSums, true, true>
            <<<blocks, kThreads, 0, stream>>>(load, o, s, power_2, value_for_inf);
      } else {
        block_cast_kernel<Load, kOut, true, kSums, true, false>
            <<<blocks, kThreads, 0, stream>>>(load, o, s, power_2, value_for_inf);
      }
    }
  } else if (!Load::kTiles || (q && qt)) {
    // The computing loaders (the fused MLP's) write both copies: one instantiation each.
    block_cast_kernel<Load, kOut, false, kSums>
        <<<blocks, kThreads, 0, stream>>>(load, o, s, power_2, value_for_inf);
  } else if (q) {
    block_cast_kernel<Load, kOut, false, kSums, true, false>
        <<<blocks, kThreads, 0, stream>>>(load, o, s, power_2, value_for_inf);
  } else {
    block_cast_kernel<Load, kOut, false, kSums, false, true>
        <<<blocks, kThreads, 0, stream>>>(load, o, s, power_2, value_for_inf);
  }
}

template <bool kSums = false, typename Load>
void launch_out(cudaStream_t stream, OutType ot, const Load& load, const Outputs& o,
                const Shape& s, bool tile, bool power_2, float value_for_inf) {
  if (ot == OutType::kE4M3) {
    launch<OutType::kE4M3, kSums>(stream, load, o, s, tile, power_2, value_for_inf);
  } else {
    launch<OutType::kE5M2, kSums>(stream, load, o, s, tile, power_2, value_for_inf);
  }
}

// The outputs of one (batch, rows, cols) input checked against its shape: both copies (or those
// asked for), their scales and the amax; their FP8 dtype in *ot.
ffi::Error make_outputs(const Shape& s, ffi::Result<ffi::AnyBuffer>& q,
                        ffi::Result<ffi::Buffer<ffi::F32>>& q_sinv, ffi::Result<ffi::AnyBuffer>& qt,
                        ffi::Result<ffi::Buffer<ffi::F32>>& qt_sinv,
                        ffi::Result<ffi::Buffer<ffi::F32>>& amax, bool rowwise, bool colwise,
                        bool tile, Outputs* o, OutType* ot) {
  if (s.rows % kBlock || s.cols % kBlock) {
    return ffi::Error::InvalidArgument(
        "block cast: the rows (the source rows' count, if given) and the last dim must be "
        "multiples of 128");
  }
  if (!rowwise && !colwise) return ffi::Error::InvalidArgument("block cast: nothing asked for");
  if (tile && !rowwise) {
    return ffi::Error::InvalidArgument("block cast: tile mode writes the tiles' scales rowwise");
  }
  const int64_t n = s.batch * s.rows * s.cols;
  const int64_t nb_r = s.batch * s.rows * (s.cols / kBlock);
  const int64_t nb_c = s.batch * s.cols * (s.rows / kBlock);
  const int64_t nb_t = s.batch * (s.rows / kBlock) * (s.cols / kBlock);
  if ((rowwise && static_cast<int64_t>(q->element_count()) != n) ||
      (colwise && static_cast<int64_t>(qt->element_count()) != n)) {
    return ffi::Error::InvalidArgument("block cast: output sizes do not match the input");
  }
  if (rowwise && static_cast<int64_t>(q_sinv->element_count()) != (tile ? nb_t : nb_r)) {
    return ffi::Error::InvalidArgument("block cast: wrong number of row scales");
  }
  if (colwise && !tile && static_cast<int64_t>(qt_sinv->element_count()) != nb_c) {
    return ffi::Error::InvalidArgument("block cast: wrong number of column scales");
  }
  const ffi::DataType qtype = rowwise ? q->element_type() : qt->element_type();
  if (rowwise && colwise && q->element_type() != qt->element_type()) {
    return ffi::Error::InvalidArgument("block cast: both copies must have one FP8 dtype");
  }
  if (auto e = cuda::out_type(qtype, ot, "block cast: output dtype must be float8_e4m3fn or e5m2");
      e.failure()) {
    return e;
  }
  if (amax->element_count() != 1) return ffi::Error::InvalidArgument("amax must have 1 element");
  *o = Outputs{rowwise ? static_cast<uint8_t*>(q->untyped_data()) : nullptr,
               rowwise ? q_sinv->typed_data() : nullptr,
               colwise ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr,
               colwise && !tile ? qt_sinv->typed_data() : nullptr,
               reinterpret_cast<uint32_t*>(amax->typed_data()), nullptr};
  return ffi::Error::Success();
}

// Calls f(In{}) with the element type of `t` (float32, bfloat16 or float16).
template <typename F>
ffi::Error with_input_type(ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F32:
      return f(float{});
    case ffi::DataType::BF16:
      return f(uint16_t{});
    case ffi::DataType::F16:
      return f(Half16{});
    default:
      return ffi::Error::InvalidArgument("block cast: input must be float32, bfloat16 or float16");
  }
}

// M and F of h (M, n_act * F) and the activation ids (act1 < 0: one activation); F must be a
// multiple of 128 (each tile within one factor).
ffi::Error act_dims(const ffi::AnyBuffer& h, int32_t act0, int32_t act1, const char* what,
                    int64_t* m, int64_t* f, int* n_act, int act[2]) {
  const auto hd = h.dimensions();
  if (hd.size() != 2) return ffi::Error::InvalidArgument(std::string(what) + ": h must be 2-D");
  *n_act = act1 < 0 ? 1 : 2;
  act[0] = act0;
  act[1] = act1 < 0 ? act::kLinear : act1;
  for (int i = 0; i < *n_act; ++i) {
    if (act[i] < act::kLinear || act[i] > act::kSquaredRelu) {
      return ffi::Error::InvalidArgument(std::string(what) + ": unknown activation id");
    }
  }
  *m = hd[0];
  *f = hd[1] / *n_act;
  if (hd[1] != *n_act * *f || *f % kBlock) {
    return ffi::Error::InvalidArgument(std::string(what) +
                                       ": h's columns must be n_act * F, F a multiple of 128");
  }
  return ffi::Error::Success();
}

struct ActIds {
  int n_act;
  int act[2];
};

// The produced values are float32: a block whose scale overflows takes float32's largest value.
constexpr uint32_t kF32MaxBits = 0x7f7fffffu;

ffi::Error no_tiles(bool tile, const char* what) {
  if (!tile) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(what) + ": 1x128 blocks only (no 128x128 tiles)");
}

}  // namespace
}  // namespace te_adapters
