// CUDA XLA FFI handler (Hopper): BlockActCast, the activation act(h + b) of the MLP's first GEMM's
// output cast into Float8BlockScaling's 1x128 blocks as it is computed (block_cast.cuh's kernel,
// ActLoad; block_cast_cuda.cu describes the cast).

#include <cuda_runtime.h>

#include <cstdint>

#include "block_cast.cuh"
#include "xla/ffi/api/ffi.h"

namespace te_adapters {
namespace {

ffi::Error BlockActCastImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::F32> bias,
                            ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::Buffer<ffi::F32>> q_sinv,
                            ffi::Result<ffi::AnyBuffer> qt,
                            ffi::Result<ffi::Buffer<ffi::F32>> qt_sinv,
                            ffi::Result<ffi::Buffer<ffi::F32>> amax, int32_t act0, int32_t act1,
                            bool has_bias, bool tile, bool power_2) {
  int64_t m, f;
  ActIds ids;
  if (auto e = act_dims(h, act0, act1, "block act cast", &m, &f, &ids.n_act, ids.act);
      e.failure()) {
    return e;
  }
  if (has_bias && bias.element_count() != static_cast<size_t>(ids.n_act * f)) {
    return ffi::Error::InvalidArgument("block act cast: bias must have n_act * F elements");
  }
  const Shape s{1, m, f};
  if (auto e = no_tiles(tile, "block act cast"); e.failure()) return e;
  Outputs o;
  OutType ot;
  if (auto e = make_outputs(s, q, q_sinv, qt, qt_sinv, amax, true, true, tile, &o, &ot);
      e.failure()) {
    return e;
  }
  cudaMemsetAsync(o.amax, 0, sizeof(uint32_t), stream);
  const float* bp = has_bias ? bias.typed_data() : nullptr;
  return with_input_type(h.element_type(), [&](auto in) {
    using In = decltype(in);
    const In* hp = static_cast<const In*>(h.untyped_data());
    act::dispatch_acts(ids, [&](auto n_act, auto a0, auto a1) {
      ActLoad<In, decltype(n_act)::value, decltype(a0)::value, decltype(a1)::value> load{
          hp, bp, f, {ids.act[0], ids.act[1]}, {}};
      launch_out(stream, ot, load, o, s, tile, power_2, bits_float(kF32MaxBits));
    });
    return cuda_error("te_adapters block act cast kernel");
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockActCastCuda, BlockActCastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("act0")
                                  .Attr<int32_t>("act1")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("tile")
                                  .Attr<bool>("power_2"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
