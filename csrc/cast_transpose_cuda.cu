// CUDA XLA FFI handlers (Hopper): per-tensor FP8 cast that reads the input once and writes, as
// asked, the FP8 copy, the FP8 copy with the last two dims swapped, and the amax; and a separate
// amax pass (current scaling).
//
// The input is viewed as (batch, rows, cols). The scale has one element, or one per batch index
// (the grouped GEMM's kernels, one scale per expert); the amax likewise. Each block owns a 64x64
// tile: 16-byte loads along the row, the FP8 codes staged in shared memory, then 16-byte stores
// of the transposed tile.
// Float32 -> FP8 as in fp8_cuda.cuh (the hardware conversion after XLA's clip).
//
// Rowwise scaling (Float8RowwiseScaling) uses the same cast with one scale per row of the FP8 copy
// and one per row of the transposed copy (a column of the input), after a pass that reads the
// input once for both orientations' amaxes (max |x| over each row and over each column).

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi_cuda.h"
#include "fp8_cuda.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_adapters {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kSmemStride = kTile + 1;  // odd stride: column reads hit distinct banks

using cuda::abs_bits;
using cuda::cuda_error;
using cuda::Half;
using cuda::to_float;
using cuda::to_fp8;
using cuda::zeroed_amax;

__device__ __forceinline__ void block_amax(uint32_t acc, uint32_t* out) {
  cuda::block_amax<kThreads>(acc, out);
}

struct Shape {
  int64_t batch, rows, cols, tiles_r, tiles_c;
  int64_t scale_stride, amax_stride;  // 1: one scale (amax) per batch index; 0: one in all
};

// kVec: rows % 16 == 0 and cols * sizeof(In) % 16 == 0, so every full tile takes the vector path.
// kRowScales: `scale_ptr` holds one scale per (batch, row), the FP8 copy's, and `col_scale_ptr`
// one per (batch, column), the transposed copy's (rowwise scaling; each nullptr when its copy is
// not asked for); otherwise both copies take scale_ptr[b * scale_stride].
template <typename In, OutType kOut, bool kVec, bool kRowScales>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const In* __restrict__ x, const float* __restrict__ scale_ptr,
                          const float* __restrict__ col_scale_ptr, uint8_t* __restrict__ q,
                          uint8_t* __restrict__ qt, uint32_t* __restrict__ amax, Shape s) {
  __shared__ uint8_t tile[kTile * kSmemStride];
  const int64_t t = blockIdx.x;
  const int64_t tiles_per_batch = s.tiles_r * s.tiles_c;
  const int64_t b = t / tiles_per_batch;
  const int64_t r0 = (t % tiles_per_batch) / s.tiles_c * kTile;
  const int64_t c0 = (t % tiles_per_batch) % s.tiles_c * kTile;
  const In* xb = x + b * s.rows * s.cols;
  const float scale = kRowScales ? 0.0f : scale_ptr[b * s.scale_stride];
  // The scale of the FP8 copy's row r and of the transposed copy's row c (input column c).
  const float* row_scales = kRowScales && q != nullptr ? scale_ptr + b * s.rows : nullptr;
  const float* col_scales = kRowScales && qt != nullptr ? col_scale_ptr + b * s.cols : nullptr;
  const bool full = r0 + kTile <= s.rows && c0 + kTile <= s.cols;
  uint32_t acc = 0;

  if (kVec && full) {
    constexpr int kV = 16 / sizeof(In);  // elements per 16-byte load
    constexpr int kPerRow = kTile / kV;
    constexpr int kIters = kTile * kPerRow / kThreads;
    uint4 raw[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {  // issue every load before using any
      const int l = i * kThreads + threadIdx.x;
      const int r = l / kPerRow, cv = l % kPerRow;
      raw[i] = __ldg(reinterpret_cast<const uint4*>(xb + (r0 + r) * s.cols + c0 + cv * kV));
    }
    // kThreads is a multiple of kPerRow: each thread keeps its kV columns in every iteration.
    float tscale[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      tscale[k] = col_scales != nullptr ? col_scales[c0 + (threadIdx.x % kPerRow) * kV + k] : scale;
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int l = i * kThreads + threadIdx.x;
      const int r = l / kPerRow, cv = l % kPerRow;
      const In* vals = reinterpret_cast<const In*>(&raw[i]);
      const float rscale = row_scales != nullptr ? row_scales[r0 + r] : scale;
      uint8_t codes[kV];
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        const float v = to_float<In>(vals[k]);
        acc = max(acc, abs_bits(v));
        codes[k] = to_fp8<kOut>(v, rscale);
        tile[r * kSmemStride + cv * kV + k] = kRowScales ? to_fp8<kOut>(v, tscale[k]) : codes[k];
      }
      if (q != nullptr) {
        uint8_t* dst = q + (b * s.rows + r0 + r) * s.cols + c0 + cv * kV;
        if constexpr (kV == 8) {
          uint2 w;
          memcpy(&w, codes, 8);
          *reinterpret_cast<uint2*>(dst) = w;
        } else {
          uint32_t w;
          memcpy(&w, codes, 4);
          *reinterpret_cast<uint32_t*>(dst) = w;
        }
      }
    }
    if (qt != nullptr) {
      __syncthreads();
      // Transposed tile: 64 output rows (one per input column) of 64 bytes, 16 bytes a thread.
      const int c = threadIdx.x / 4, rs = (threadIdx.x % 4) * 16;
      uint8_t out[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) out[k] = tile[(rs + k) * kSmemStride + c];
      uint4 w;
      memcpy(&w, out, 16);
      *reinterpret_cast<uint4*>(qt + (b * s.cols + c0 + c) * s.rows + r0 + rs) = w;
    }
  } else {
    for (int l = threadIdx.x; l < kTile * kTile; l += kThreads) {
      const int r = l / kTile, c = l % kTile;
      if (r0 + r < s.rows && c0 + c < s.cols) {
        const float v = to_float<In>(xb[(r0 + r) * s.cols + c0 + c]);
        acc = max(acc, abs_bits(v));
        const uint8_t code = to_fp8<kOut>(v, row_scales != nullptr ? row_scales[r0 + r] : scale);
        tile[r * kSmemStride + c] =
            col_scales != nullptr ? to_fp8<kOut>(v, col_scales[c0 + c]) : code;
        if (q != nullptr) q[(b * s.rows + r0 + r) * s.cols + c0 + c] = code;
      }
    }
    if (qt != nullptr) {
      __syncthreads();
      for (int l = threadIdx.x; l < kTile * kTile; l += kThreads) {
        const int c = l / kTile, r = l % kTile;
        if (r0 + r < s.rows && c0 + c < s.cols) {
          qt[(b * s.cols + c0 + c) * s.rows + r0 + r] = tile[r * kSmemStride + c];
        }
      }
    }
  }
  if (amax != nullptr) block_amax(acc, amax + b * s.amax_stride);
}

template <typename In>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const In* __restrict__ x, int64_t n, bool vec, uint32_t* __restrict__ amax) {
  constexpr int kV = 16 / sizeof(In);
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t start = 0;
  if (vec) {
    const int64_t nv = n / kV;
    for (int64_t i = blockIdx.x * kThreads + threadIdx.x; i < nv; i += stride) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x) + i);
      const In* vals = reinterpret_cast<const In*>(&raw);
#pragma unroll
      for (int k = 0; k < kV; ++k) acc = max(acc, abs_bits(to_float<In>(vals[k])));
    }
    start = nv * kV;
  }
  for (int64_t i = start + blockIdx.x * kThreads + threadIdx.x; i < n; i += stride) {
    acc = max(acc, abs_bits(to_float<In>(x[i])));
  }
  block_amax(acc, amax);
}

template <typename In, OutType kOut, bool kRowScales>
void launch_cast(cudaStream_t stream, const void* x, const float* scale, const float* col_scale,
                 uint8_t* q, uint8_t* qt, uint32_t* amax, const Shape& s) {
  const bool vec = s.rows % 16 == 0 && (s.cols * sizeof(In)) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   (q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0) &&
                   (qt == nullptr || reinterpret_cast<uintptr_t>(qt) % 16 == 0);
  const int64_t blocks = s.batch * s.tiles_r * s.tiles_c;
  if (blocks == 0) return;
  const In* xi = static_cast<const In*>(x);
  if (vec) {
    cast_transpose_kernel<In, kOut, true, kRowScales>
        <<<blocks, kThreads, 0, stream>>>(xi, scale, col_scale, q, qt, amax, s);
  } else {
    cast_transpose_kernel<In, kOut, false, kRowScales>
        <<<blocks, kThreads, 0, stream>>>(xi, scale, col_scale, q, qt, amax, s);
  }
}

template <typename In, bool kRowScales = false>
void launch_cast_in(cudaStream_t stream, OutType ot, const void* x, const float* scale, uint8_t* q,
                    uint8_t* qt, uint32_t* amax, const Shape& s, const float* col_scale = nullptr) {
  if (ot == OutType::kE4M3) {
    launch_cast<In, OutType::kE4M3, kRowScales>(stream, x, scale, col_scale, q, qt, amax, s);
  } else {
    launch_cast<In, OutType::kE5M2, kRowScales>(stream, x, scale, col_scale, q, qt, amax, s);
  }
}

ffi::Error CastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, bool rowwise, bool colwise,
                             bool compute_amax) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("input must have rank >= 1");
  if (colwise && dims.size() < 2) {
    return ffi::Error::InvalidArgument("the transposed copy needs rank >= 2");
  }
  Shape s{1, 1, dims.back(), 0, 0, 0, 0};
  if (dims.size() >= 2) s.rows = dims[dims.size() - 2];
  for (size_t i = 0; i + 2 < dims.size(); ++i) s.batch *= dims[i];
  s.tiles_r = (s.rows + kTile - 1) / kTile;
  s.tiles_c = (s.cols + kTile - 1) / kTile;
  const ffi::DataType qtype = rowwise ? q->element_type() : qt->element_type();
  OutType ot;
  if (auto e = cuda::out_type(qtype, &ot); e.failure()) return e;
  const size_t n = x.element_count();
  if ((rowwise && q->element_count() != n) || (colwise && qt->element_count() != n)) {
    return ffi::Error::InvalidArgument("output sizes do not match the input");
  }
  const int64_t n_scale = static_cast<int64_t>(scale.element_count());
  if (n_scale != 1 && n_scale != s.batch) {
    return ffi::Error::InvalidArgument("scale must have 1 element or one per batch index");
  }
  s.scale_stride = n_scale == 1 ? 0 : 1;
  const int64_t n_amax = compute_amax ? static_cast<int64_t>(amax->element_count()) : 1;
  if (n_amax != 1 && n_amax != s.batch) {
    return ffi::Error::InvalidArgument("amax must have 1 element or one per batch index");
  }
  s.amax_stride = n_amax == 1 ? 0 : 1;
  uint8_t* qp = rowwise ? static_cast<uint8_t*>(q->untyped_data()) : nullptr;
  uint8_t* qtp = colwise ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr;
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, compute_amax, stream, &ap, n_amax); e.failure()) return e;
  const float* sp = scale.typed_data();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch_cast_in<float>(stream, ot, x.untyped_data(), sp, qp, qtp, ap, s);
      break;
    case ffi::DataType::BF16:
      launch_cast_in<uint16_t>(stream, ot, x.untyped_data(), sp, qp, qtp, ap, s);
      break;
    case ffi::DataType::F16:
      launch_cast_in<Half>(stream, ot, x.untyped_data(), sp, qp, qtp, ap, s);
      break;
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
  return cuda_error("te_adapters cast_transpose kernel");
}

template <typename In>
void launch_amax(cudaStream_t stream, const void* x, int64_t n, uint32_t* amax) {
  const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t want = (n / (16 / sizeof(In)) + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 1 ? 1 : (want > 2048 ? 2048 : want));
  amax_kernel<In><<<blocks, kThreads, 0, stream>>>(static_cast<const In*>(x), n, vec, amax);
}

ffi::Error AmaxImpl(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  uint32_t* ap;
  if (auto e = zeroed_amax(amax, true, stream, &ap); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return cuda_error("te_adapters amax memset");
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch_amax<float>(stream, x.untyped_data(), n, ap);
      break;
    case ffi::DataType::BF16:
      launch_amax<uint16_t>(stream, x.untyped_data(), n, ap);
      break;
    case ffi::DataType::F16:
      launch_amax<Half>(stream, x.untyped_data(), n, ap);
      break;
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
  return cuda_error("te_adapters amax kernel");
}

// --- Rowwise scaling: the amaxes of both orientations in one read, then the cast ---------------

constexpr int kWarps = kThreads / 32;
constexpr int kAmaxRows = 256;  // rows per block of the row/column amax pass
constexpr int kAmaxUnroll = 4;  // rows each warp loads before reducing any

// One block reads a strip of 32 * kV columns (one 16-byte vector per lane) over kAmaxRows rows of
// one batch index: each warp takes every kWarps-th row, reduces the row's strip over its lanes and
// max-es it into `row_amax` (float bits); each thread keeps its kV columns' maxima, which the
// block reduces and max-es into `col_amax`. Either may be nullptr. kVec: cols % kV == 0 and x
// 16-byte aligned. |v|'s bits with NaN clamped to +inf, as the pure-JAX row_amax.
template <typename In, bool kVec>
__global__ void __launch_bounds__(kThreads)
    row_col_amax_kernel(const In* __restrict__ x, uint32_t* __restrict__ row_amax,
                        uint32_t* __restrict__ col_amax, int64_t batch, int64_t rows,
                        int64_t cols) {
  constexpr int kV = 16 / sizeof(In);
  constexpr int kWidth = 32 * kV;
  __shared__ uint32_t part[kWarps][kWidth];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * static_cast<int64_t>(kWidth) + lane * kV;
  const int64_t r_begin = blockIdx.y * static_cast<int64_t>(kAmaxRows);
  const int64_t r_end = min(rows, r_begin + kAmaxRows);
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const In* xb = x + b * rows * cols;
    uint32_t cmax[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) cmax[k] = 0;
    for (int64_t r0 = r_begin + warp; r0 < r_end; r0 += kWarps * kAmaxUnroll) {
      uint4 raw[kAmaxUnroll];
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) {
        const int64_t r = r0 + u * kWarps;
        raw[u] = make_uint4(0, 0, 0, 0);
        if (kVec && r < r_end && c < cols) {
          raw[u] = __ldg(reinterpret_cast<const uint4*>(xb + r * cols + c));
        }
      }
#pragma unroll
      for (int u = 0; u < kAmaxUnroll; ++u) {
        const int64_t r = r0 + u * kWarps;
        if (r >= r_end) break;  // the same for every lane of the warp
        uint32_t rmax = 0;
        const In* vals = reinterpret_cast<const In*>(&raw[u]);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          uint32_t a = 0;
          if (kVec) {
            a = abs_bits(to_float<In>(vals[k]));
          } else if (c + k < cols) {
            a = abs_bits(to_float<In>(xb[r * cols + c + k]));
          }
          rmax = max(rmax, a);
          cmax[k] = max(cmax[k], a);
        }
        if (row_amax != nullptr) {
          rmax = __reduce_max_sync(0xffffffffu, rmax);
          if (lane == 0 && rmax != 0) atomicMax(row_amax + b * rows + r, rmax);
        }
      }
    }
    if (col_amax != nullptr) {
#pragma unroll
      for (int k = 0; k < kV; ++k) part[warp][lane * kV + k] = cmax[k];
      __syncthreads();
      for (int i = threadIdx.x; i < kWidth; i += kThreads) {
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = max(m, part[w][i]);
        const int64_t col = blockIdx.x * static_cast<int64_t>(kWidth) + i;
        if (col < cols && m != 0) atomicMax(col_amax + b * cols + col, m);
      }
      __syncthreads();
    }
  }
}

template <typename In>
ffi::Error launch_row_col_amax(cudaStream_t stream, const void* x, uint32_t* row_amax,
                               uint32_t* col_amax, int64_t batch, int64_t rows, int64_t cols) {
  constexpr int kV = 16 / sizeof(In);
  const int64_t strips = (cols + 32 * kV - 1) / (32 * kV);
  const int64_t row_blocks = (rows + kAmaxRows - 1) / kAmaxRows;
  if (batch == 0 || strips == 0 || row_blocks == 0) return ffi::Error::Success();
  if (strips > 0x7fffffff || row_blocks > 65535) {
    return ffi::Error::InvalidArgument("rowwise amax: the input has too many rows or columns");
  }
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(batch < 65535 ? batch : 65535));
  const In* xi = static_cast<const In*>(x);
  const bool vec = cols % kV == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (vec) {
    row_col_amax_kernel<In, true>
        <<<grid, kThreads, 0, stream>>>(xi, row_amax, col_amax, batch, rows, cols);
  } else {
    row_col_amax_kernel<In, false>
        <<<grid, kThreads, 0, stream>>>(xi, row_amax, col_amax, batch, rows, cols);
  }
  return ffi::Error::Success();
}

// The input viewed as (batch, rows, cols) from its dims (rank >= 2).
ffi::Error batch_rows_cols(const ffi::AnyBuffer& x, Shape* s) {
  const auto dims = x.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("rowwise: the input needs rank >= 2");
  *s = Shape{1, dims[dims.size() - 2], dims.back(), 0, 0, 0, 0};
  for (size_t i = 0; i + 2 < dims.size(); ++i) s->batch *= dims[i];
  s->tiles_r = (s->rows + kTile - 1) / kTile;
  s->tiles_c = (s->cols + kTile - 1) / kTile;
  return ffi::Error::Success();
}

// max |x| over each row (row_amax, batch * rows) and over each column (col_amax, batch * cols),
// float32, inf where a NaN or inf is; an output not asked for is empty.
ffi::Error RowColAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Result<ffi::Buffer<ffi::F32>> row_amax,
                          ffi::Result<ffi::Buffer<ffi::F32>> col_amax, bool rows, bool cols) {
  Shape s;
  if (auto e = batch_rows_cols(x, &s); e.failure()) return e;
  uint32_t *rp = nullptr, *cp = nullptr;
  if (rows) {
    if (auto e = zeroed_amax(row_amax, true, stream, &rp, s.batch * s.rows); e.failure()) return e;
  }
  if (cols) {
    if (auto e = zeroed_amax(col_amax, true, stream, &cp, s.batch * s.cols); e.failure()) return e;
  }
  if (rp == nullptr && cp == nullptr) return cuda_error("te_adapters row/column amax memset");
  ffi::Error e = ffi::Error::Success();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      e = launch_row_col_amax<float>(stream, x.untyped_data(), rp, cp, s.batch, s.rows, s.cols);
      break;
    case ffi::DataType::BF16:
      e = launch_row_col_amax<uint16_t>(stream, x.untyped_data(), rp, cp, s.batch, s.rows, s.cols);
      break;
    case ffi::DataType::F16:
      e = launch_row_col_amax<Half>(stream, x.untyped_data(), rp, cp, s.batch, s.rows, s.cols);
      break;
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
  if (e.failure()) return e;
  return cuda_error("te_adapters row/column amax kernel");
}

// The FP8 copy of x with one scale per row (row_scale, batch * rows) and the copy with the last
// two dims swapped with one scale per column of x (col_scale, batch * cols), in one read of x.
ffi::Error RowwiseCastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> row_scale,
                           ffi::Buffer<ffi::F32> col_scale, ffi::Result<ffi::AnyBuffer> q,
                           ffi::Result<ffi::AnyBuffer> qt, bool rowwise, bool colwise) {
  Shape s;
  if (auto e = batch_rows_cols(x, &s); e.failure()) return e;
  if (!rowwise && !colwise) return ffi::Error::Success();
  const ffi::DataType qtype = rowwise ? q->element_type() : qt->element_type();
  OutType ot;
  if (auto e = cuda::out_type(qtype, &ot); e.failure()) return e;
  const size_t n = x.element_count();
  if ((rowwise && q->element_count() != n) || (colwise && qt->element_count() != n)) {
    return ffi::Error::InvalidArgument("output sizes do not match the input");
  }
  if ((rowwise && static_cast<int64_t>(row_scale.element_count()) != s.batch * s.rows) ||
      (colwise && static_cast<int64_t>(col_scale.element_count()) != s.batch * s.cols)) {
    return ffi::Error::InvalidArgument("rowwise cast: one scale per row and per column is needed");
  }
  uint8_t* qp = rowwise ? static_cast<uint8_t*>(q->untyped_data()) : nullptr;
  uint8_t* qtp = colwise ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr;
  const float* rs = rowwise ? row_scale.typed_data() : nullptr;
  const float* cs = colwise ? col_scale.typed_data() : nullptr;
  switch (x.element_type()) {
    case ffi::DataType::F32:
      launch_cast_in<float, true>(stream, ot, x.untyped_data(), rs, qp, qtp, nullptr, s, cs);
      break;
    case ffi::DataType::BF16:
      launch_cast_in<uint16_t, true>(stream, ot, x.untyped_data(), rs, qp, qtp, nullptr, s, cs);
      break;
    case ffi::DataType::F16:
      launch_cast_in<Half, true>(stream, ot, x.untyped_data(), rs, qp, qtp, nullptr, s, cs);
      break;
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
  return cuda_error("te_adapters rowwise cast kernel");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeCuda, CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise")
                                  .Attr<bool>("compute_amax"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmaxCuda, AmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowColAmaxCuda, RowColAmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rows")
                                  .Attr<bool>("cols"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseCastCuda, RowwiseCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
