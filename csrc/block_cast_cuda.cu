// CUDA XLA FFI handler (Hopper): the FP8 block-scaled cast of Float8BlockScaling in one pass.
//
// The input is viewed as (batch, rows, cols), rows and cols multiples of 128. Each thread block
// owns one 128x128 tile, read once, and writes as asked:
// - 1x128 mode: the FP8 copy with one scale per row and 128 columns (blocks along the rows),
//   and the transposed FP8 copy (batch, cols, rows) with one scale per column and 128 rows
//   (blocks along the input's columns, i.e. along the rows of the transposed copy);
// - tile mode: one scale per 128x128 tile, the FP8 copy and its transpose (the same codes);
// and the amax of the whole input. The tile stays in registers as stored (8 bytes a row per
// thread for 16-bit inputs: 62 to 80 registers, against 116 when it was held as floats, so
// three or four blocks fit on a multiprocessor instead of two), and each set of copies asked for
// is its own instantiation, so a copy not asked for costs no shared memory or registers.
// With source rows (an int32 array, one entry per row of the cast's input view), row r of each
// batch entry is read from row src[r] of the input's (batch, in_rows, cols), or is zero where
// src[r] is negative (or not below in_rows): a gather of rows fused into the cast, which the
// grouped GEMMs use for their group-padded layouts instead of writing the gathered copy first.
// Each warp loads its 16 source rows once and shuffles them, so its 16 row loads are all in
// flight before any is used.
// The scale rule is _float8_block.compute_scale's (TE's, epsilon 0): fp8_max / amax, the input
// dtype's largest finite value where that overflows, optionally rounded down to a power of two,
// and 1 for a block whose amax is 0, infinite or NaN; scale_inv = 1 / scale. Both divisions are
// IEEE-rounded (no fast math).

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

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

// Four consecutive elements as they are stored (8 bytes of 16-bit values, 16 of float32), and
// as floats: the tile is kept in registers as stored, half the registers for 16-bit inputs.
template <typename In>
struct Raw4 {
  using T = uint2;
};
template <>
struct Raw4<float> {
  using T = float4;
};
template <typename In>
__device__ __forceinline__ typename Raw4<In>::T load_raw4(const In* p) {
  return __ldg(reinterpret_cast<const typename Raw4<In>::T*>(p));
}
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
  int64_t in_rows;     // the input's rows per batch entry (rows, without source rows)
  const int32_t* src;  // [rows] source row of each row, or null (row r reads row r)
};

struct Outputs {
  uint8_t* q;         // (batch, rows, cols) or null
  float* q_sinv;      // 1x128: (batch, rows, cols/128); tile: (batch, rows/128, cols/128)
  uint8_t* qt;        // (batch, cols, rows) or null
  float* qt_sinv;     // 1x128: (batch, cols, rows/128); tile: unused (the tiles' scales)
  uint32_t* amax;     // float32 bits, or null
};

// kQ / kQt: whether the copy along the rows / the transposed copy is written (tile mode: kQ).
template <typename In, OutType kOut, bool kTile, bool kQ, bool kQt>
__global__ void __launch_bounds__(kThreads)
    block_cast_kernel(const In* __restrict__ x, Outputs o, Shape s, bool power_2,
                      float value_for_inf) {
  static_assert(kQ || kQt, "nothing to write");
  static_assert(!kTile || kQ, "tile mode writes the tiles' scales with the rows' copy");
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
  const In* xb = x + b * s.in_rows * s.cols;

  // The warp's 16 source rows: one load by the first 16 lanes, then shuffled to every lane, so
  // that all 16 row loads are issued before any is used.
  int32_t my_src = 0;
  if (s.src != nullptr && lane < kRowsPerWarp) my_src = __ldg(s.src + r0 + rw + lane);
  using R = typename Raw4<In>::T;
  R raw[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    int64_t r = r0 + rw + i;
    if (s.src != nullptr) r = __shfl_sync(0xffffffffu, my_src, i);  // uniform branch
    raw[i] = R{};  // zeros (every input dtype's zero is all zero bits)
    if (r >= 0 && r < s.in_rows) raw[i] = load_raw4<In>(xb + r * s.cols + c0 + cl);
  }

  uint32_t row_amax[kRowsPerWarp];
  uint32_t col_acc[4] = {0u, 0u, 0u, 0u};
  uint32_t all = 0u;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    float v[4];
    unpack4<In>(raw[i], v);
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
      unpack4<In>(raw[i], v);
      const uint32_t w = to_fp8x4<kOut>(v, scale);
      if constexpr (kQt) {
#pragma unroll
        for (int k = 0; k < 4; ++k) tcodes[(cl + k) * kTStride + rw + i] = (w >> (8 * k)) & 0xffu;
      }
      *reinterpret_cast<uint32_t*>(o.q + (b * s.rows + r0 + rw + i) * s.cols + c0 + cl) = w;
    }
  } else {
    if constexpr (kQ) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float v[4];
        unpack4<In>(raw[i], v);
        const float scale = block_scale(row_amax[i], fp8_max, value_for_inf, power_2);
        const uint32_t w = to_fp8x4<kOut>(v, scale);
        const int64_t row = b * s.rows + r0 + rw + i;
        *reinterpret_cast<uint32_t*>(o.q + row * s.cols + c0 + cl) = w;
        if (lane == 0) o.q_sinv[row * tiles_c + tc] = __fdiv_rn(1.0f, scale);
      }
    }
    if constexpr (kQt) {
      if (threadIdx.x < kBlock) {
        uint32_t a = 0u;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) a = max(a, col_part[w][threadIdx.x]);
        const float scale = block_scale(a, fp8_max, value_for_inf, power_2);
        col_scale[threadIdx.x] = scale;
        o.qt_sinv[(b * s.cols + c0 + threadIdx.x) * tiles_r + tr] = __fdiv_rn(1.0f, scale);
      }
      __syncthreads();
      const float cs[4] = {col_scale[cl], col_scale[cl + 1], col_scale[cl + 2], col_scale[cl + 3]};
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float v[4];
        unpack4<In>(raw[i], v);
        const uint32_t w = static_cast<uint32_t>(to_fp8x2<kOut>(v[0] * cs[0], v[1] * cs[1])) |
                           (static_cast<uint32_t>(to_fp8x2<kOut>(v[2] * cs[2], v[3] * cs[3]))
                            << 16);
#pragma unroll
        for (int k = 0; k < 4; ++k) tcodes[(cl + k) * kTStride + rw + i] = (w >> (8 * k)) & 0xffu;
      }
    }
  }
  if constexpr (kQt) {
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

template <typename In, OutType kOut, bool kTile, bool kQ, bool kQt>
void launch_one(cudaStream_t stream, const In* x, const Outputs& o, const Shape& s, int64_t blocks,
                bool power_2, float value_for_inf) {
  block_cast_kernel<In, kOut, kTile, kQ, kQt>
      <<<blocks, kThreads, 0, stream>>>(x, o, s, power_2, value_for_inf);
}

template <typename In, OutType kOut>
void launch(cudaStream_t stream, const void* x, const Outputs& o, const Shape& s, bool tile,
            bool power_2, float value_for_inf) {
  const int64_t blocks = s.batch * (s.rows / kBlock) * (s.cols / kBlock);
  if (blocks == 0) return;
  const In* xi = static_cast<const In*>(x);
  const bool q = o.q != nullptr, qt = o.qt != nullptr;
  if (tile) {
    if (qt) {
      launch_one<In, kOut, true, true, true>(stream, xi, o, s, blocks, power_2, value_for_inf);
    } else {
      launch_one<In, kOut, true, true, false>(stream, xi, o, s, blocks, power_2, value_for_inf);
    }
  } else if (q && qt) {
    launch_one<In, kOut, false, true, true>(stream, xi, o, s, blocks, power_2, value_for_inf);
  } else if (q) {
    launch_one<In, kOut, false, true, false>(stream, xi, o, s, blocks, power_2, value_for_inf);
  } else {
    launch_one<In, kOut, false, false, true>(stream, xi, o, s, blocks, power_2, value_for_inf);
  }
}

template <typename In>
void launch_in(cudaStream_t stream, OutType ot, const void* x, const Outputs& o, const Shape& s,
               bool tile, bool power_2, float value_for_inf) {
  if (ot == OutType::kE4M3) {
    launch<In, OutType::kE4M3>(stream, x, o, s, tile, power_2, value_for_inf);
  } else {
    launch<In, OutType::kE5M2>(stream, x, o, s, tile, power_2, value_for_inf);
  }
}

ffi::Error BlockCastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                         ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::Buffer<ffi::F32>> q_sinv,
                         ffi::Result<ffi::AnyBuffer> qt,
                         ffi::Result<ffi::Buffer<ffi::F32>> qt_sinv,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax, bool rowwise, bool colwise,
                         bool tile, bool power_2) {
  const auto dims = x.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("block cast: input rank must be >= 2");
  Shape s{1, dims[dims.size() - 2], dims.back(), dims[dims.size() - 2], nullptr};
  for (size_t i = 0; i + 2 < dims.size(); ++i) s.batch *= dims[i];
  if (src.element_count() > 0) {  // source rows: the cast's rows are src's
    s.rows = static_cast<int64_t>(src.element_count());
    s.src = src.typed_data();
  }
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
  OutType ot;
  if (auto e = cuda::out_type(qtype, &ot,
                              "block cast: output dtype must be float8_e4m3fn or e5m2");
      e.failure()) {
    return e;
  }
  if (amax->element_count() != 1) return ffi::Error::InvalidArgument("amax must have 1 element");
  Outputs o{rowwise ? static_cast<uint8_t*>(q->untyped_data()) : nullptr,
            rowwise ? q_sinv->typed_data() : nullptr,
            colwise ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr,
            colwise && !tile ? qt_sinv->typed_data() : nullptr,
            reinterpret_cast<uint32_t*>(amax->typed_data())};
  cudaMemsetAsync(o.amax, 0, sizeof(uint32_t), stream);
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch_in<float>(stream, ot, x.untyped_data(), o, s, tile, power_2, bits_float(0x7f7fffffu));
      break;
    case ffi::DataType::BF16:
      launch_in<uint16_t>(stream, ot, x.untyped_data(), o, s, tile, power_2,
                          bits_float(0x7f7f0000u));
      break;
    case ffi::DataType::F16:
      launch_in<Half16>(stream, ot, x.untyped_data(), o, s, tile, power_2, 65504.0f);
      break;
    default:
      return ffi::Error::InvalidArgument("block cast: input must be float32, bfloat16 or float16");
  }
  return cuda_error("te_adapters block cast kernel");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockCastCuda, BlockCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise")
                                  .Attr<bool>("tile")
                                  .Attr<bool>("power_2"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
