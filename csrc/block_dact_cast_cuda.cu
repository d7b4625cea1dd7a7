// CUDA XLA FFI handler (Hopper): BlockDactCast, the activation's gradient dh = dz * act'(h + b)
// cast into Float8BlockScaling's 1x128 blocks as it is computed, with the bias gradient
// (block_cast.cuh's kernel, DactLoad; block_cast_cuda.cu describes the cast).

#include <cuda_runtime.h>

#include <cstdint>

#include "block_cast.cuh"
#include "xla/ffi/api/ffi.h"

namespace te_adapters {
namespace {

ffi::Error BlockDactCastImpl(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer h,
                             ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> q_sinv,
                             ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> qt_sinv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax,
                             ffi::Result<ffi::Buffer<ffi::F32>> dbias,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial, int32_t act0,
                             int32_t act1, bool has_bias, bool tile, bool power_2) {
  int64_t m, f;
  ActIds ids;
  if (auto e = act_dims(h, act0, act1, "block dact cast", &m, &f, &ids.n_act, ids.act);
      e.failure()) {
    return e;
  }
  const int64_t n = ids.n_act * f;
  if (has_bias && bias.element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument("block dact cast: bias must have n_act * F elements");
  }
  if (dz.element_type() != h.element_type() || dz.element_count() != static_cast<size_t>(m * f)) {
    return ffi::Error::InvalidArgument("block dact cast: dz must be (M, F) in h's dtype");
  }
  const Shape s{1, m, n};
  if (auto e = no_tiles(tile, "block dact cast"); e.failure()) return e;
  Outputs o;
  OutType ot;
  if (auto e = make_outputs(s, q, q_sinv, qt, qt_sinv, amax, true, true, tile, &o, &ot);
      e.failure()) {
    return e;
  }
  const int64_t tiles_r = m / kBlock;
  if (dbias->element_count() != static_cast<size_t>(n) ||
      partial->element_count() != static_cast<size_t>(tiles_r * n)) {
    return ffi::Error::InvalidArgument(
        "block dact cast: dbias must hold n_act * F values and the workspace M/128 * n_act * F");
  }
  o.partial = partial->typed_data();
  cudaMemsetAsync(o.amax, 0, sizeof(uint32_t), stream);
  float* dbp = dbias->typed_data();
  if (m == 0) {
    cudaMemsetAsync(dbp, 0, sizeof(float) * n, stream);
    return cuda_error("te_adapters block dact cast memset");
  }
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  return with_input_type(h.element_type(), [&](auto in) {
    using In = decltype(in);
    const In* dzp = static_cast<const In*>(dz.untyped_data());
    const In* hp = static_cast<const In*>(h.untyped_data());
    act::dispatch_acts(ids, [&](auto n_act, auto a0, auto a1) {
      DactLoad<In, decltype(n_act)::value, decltype(a0)::value, decltype(a1)::value> load{
          dzp, hp, bp, f, {ids.act[0], ids.act[1]}, 0, 0, {}};
      launch_out<true>(stream, ot, load, o, s, tile, power_2, bits_float(kF32MaxBits));
    });
    const int64_t sum_blocks = (n + kThreads - 1) / kThreads;
    act::column_sum_kernel<kThreads>
        <<<sum_blocks, kThreads, 0, stream>>>(o.partial, tiles_r, n, dbp);
    return cuda_error("te_adapters block dact cast kernel");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockDactCastCuda, BlockDactCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("tile")
                                  .Attr<bool>("power_2"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
