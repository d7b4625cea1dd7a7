// CUDA XLA FFI handler (Hopper): the FP8 block-scaled cast of Float8BlockScaling in one pass.
//
// The input is viewed as (batch, rows, cols), rows and cols multiples of 128. Each thread block
// owns one 128x128 tile, read once, and writes as asked:
// - 1x128 mode: the FP8 copy with one scale per row and 128 columns (blocks along the rows),
//   and the transposed FP8 copy (batch, cols, rows) with one scale per column and 128 rows
//   (blocks along the input's columns, i.e. along the rows of the transposed copy);
// - tile mode: one scale per 128x128 tile, the FP8 copy and its transpose (the same codes);
// and the amax of the whole input.
// With source rows (an int32 array, one entry per row of the cast's input view), row r of each
// batch entry is read from row src[r] of the input's (batch, in_rows, cols), or is zero where
// src[r] is negative (or not below in_rows): a gather of rows fused into the cast, which the
// grouped GEMMs use for their group-padded layouts instead of writing the gathered copy first.
// The plain cast keeps its tile in registers as stored (62 to 80 registers for 16-bit inputs,
// against 116 when it was held as floats: three or four blocks on a multiprocessor instead of
// two), and each set of copies asked for is its own instantiation.
// The scale rule is _float8_block.compute_scale's (TE's, epsilon 0): fp8_max / amax, the input
// dtype's largest finite value where that overflows, optionally rounded down to a power of two,
// and 1 for a block whose amax is 0, infinite or NaN; scale_inv = 1 / scale. Both divisions are
// IEEE-rounded (no fast math).
//
// The same kernel casts the fused MLP's operands as it computes them (te_adapters/core/fused),
// its tile loader reading their inputs instead of a written float32 tensor:
// - BlockNormCast: the norm's output (x - mean) * rsigma * gamma (+ beta) of x (M, K), with the
//   row statistics given (act_cast_cuda.cu's NormCast, in blocks);
// - BlockActCast: act(h + b) (M, F) of GEMM 1's output h (M, n_act*F) (ActCast's values);
// - BlockDactCast: dh = dz * act'(h + b) (M, n_act*F) (DactCast's values; with one linear
//   activation dz itself, h unread), with the bias gradient sum_rows(dh): per-tile float32
//   column sums in a fixed order, reduced over the tiles by a second kernel.
// Their values are float32, so a block whose scale overflows takes float32's largest value.

#include <cuda_runtime.h>

#include <cstdint>

#include "block_cast.cuh"
#include "xla/ffi/api/ffi.h"

namespace te_adapters {
namespace {

ffi::Error BlockCastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                         ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::Buffer<ffi::F32>> q_sinv,
                         ffi::Result<ffi::AnyBuffer> qt,
                         ffi::Result<ffi::Buffer<ffi::F32>> qt_sinv,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax, bool rowwise, bool colwise,
                         bool tile, bool power_2) {
  const auto dims = x.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("block cast: input rank must be >= 2");
  Shape s{1, dims[dims.size() - 2], dims.back()};
  for (size_t i = 0; i + 2 < dims.size(); ++i) s.batch *= dims[i];
  if (src.element_count() > 0) {  // source rows: the cast's rows are src's
    s.in_rows = s.rows;
    s.rows = static_cast<int64_t>(src.element_count());
    s.src = src.typed_data();
  }
  Outputs o;
  OutType ot;
  if (auto e = make_outputs(s, q, q_sinv, qt, qt_sinv, amax, rowwise, colwise, tile, &o, &ot);
      e.failure()) {
    return e;
  }
  cudaMemsetAsync(o.amax, 0, sizeof(uint32_t), stream);
  return with_input_type(x.element_type(), [&](auto in) {
    using In = decltype(in);
    // The input dtype's largest finite value, for a block whose scale overflows.
    float value_for_inf = bits_float(0x7f7fffffu);
    if constexpr (std::is_same_v<In, uint16_t>) value_for_inf = bits_float(0x7f7f0000u);
    if constexpr (std::is_same_v<In, Half16>) value_for_inf = 65504.0f;
    const PlainLoad<In> load{static_cast<const In*>(x.untyped_data()), s.cols};
    launch_out(stream, ot, load, o, s, tile, power_2, value_for_inf);
    return cuda_error("te_adapters block cast kernel");
  });
}

ffi::Error BlockNormCastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> mean,
                             ffi::Buffer<ffi::F32> rsigma, ffi::Buffer<ffi::F32> gamma,
                             ffi::Buffer<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> q_sinv,
                             ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> qt_sinv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, bool has_beta, bool tile,
                             bool power_2) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("block norm cast: x must be 2-D");
  const Shape s{1, xd[0], xd[1]};
  if (mean.element_count() != static_cast<size_t>(s.rows) ||
      rsigma.element_count() != static_cast<size_t>(s.rows)) {
    return ffi::Error::InvalidArgument("block norm cast: mean and rsigma need one value per row");
  }
  if (gamma.element_count() != static_cast<size_t>(s.cols) ||
      (has_beta && beta.element_count() != static_cast<size_t>(s.cols))) {
    return ffi::Error::InvalidArgument("block norm cast: gamma and beta need one value per column");
  }
  if (auto e = no_tiles(tile, "block norm cast"); e.failure()) return e;
  Outputs o;
  OutType ot;
  if (auto e = make_outputs(s, q, q_sinv, qt, qt_sinv, amax, true, true, tile, &o, &ot);
      e.failure()) {
    return e;
  }
  cudaMemsetAsync(o.amax, 0, sizeof(uint32_t), stream);
  return with_input_type(x.element_type(), [&](auto in) {
    using In = decltype(in);
    NormLoad<In> load{static_cast<const In*>(x.untyped_data()),
                      mean.typed_data(),
                      rsigma.typed_data(),
                      gamma.typed_data(),
                      has_beta ? beta.typed_data() : nullptr,
                      s.cols,
                      {},
                      {}};
    launch_out(stream, ot, load, o, s, tile, power_2, bits_float(kF32MaxBits));
    return cuda_error("te_adapters block norm cast kernel");
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockNormCastCuda, BlockNormCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_beta")
                                  .Attr<bool>("tile")
                                  .Attr<bool>("power_2"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
