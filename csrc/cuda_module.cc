// nanobind module exposing the CUDA FFI handlers (cast_transpose_cuda.cu, block_cast_cuda.cu,
// act_cast_cuda.cu, ...).
#include <cuda_runtime_api.h>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/c_api.h"

// The GPU targets the kernels were compiled for, as CMake lists them ("sm_90a,sm_100a").
#define TE_ADAPTERS_STRINGIFY(...) #__VA_ARGS__
#define TE_ADAPTERS_XSTRINGIFY(...) TE_ADAPTERS_STRINGIFY(__VA_ARGS__)
#ifndef TE_ADAPTERS_CUDA_ARCHS
#define TE_ADAPTERS_CUDA_ARCHS sm_90a
#endif

namespace nb = nanobind;

namespace te_adapters {
extern "C" XLA_FFI_Error* CastTransposeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AmaxCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RowColAmaxCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* RowwiseCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BlockCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BlockNormCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BlockActCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* BlockDactCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ActCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* DactCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* NormCastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ActAmaxCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* DactAmaxCuda(XLA_FFI_CallFrame* call_frame);
#ifdef TE_ADAPTERS_BLOCK_GEMM
extern "C" XLA_FFI_Error* BlockGemmCuda(XLA_FFI_CallFrame* call_frame);
#endif
#ifdef TE_ADAPTERS_GROUPED_GEMM
extern "C" XLA_FFI_Error* GroupedGemmCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* PaddedTransposeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* GroupedBlockGemmCuda(XLA_FFI_CallFrame* call_frame);
#endif
}  // namespace te_adapters

NB_MODULE(_csrc_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["te_adapters_cast_transpose"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::CastTransposeCuda));
    d["te_adapters_amax"] = nb::capsule(reinterpret_cast<void*>(te_adapters::AmaxCuda));
    d["te_adapters_row_col_amax"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::RowColAmaxCuda));
    d["te_adapters_rowwise_cast"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::RowwiseCastCuda));
    d["te_adapters_block_cast"] = nb::capsule(reinterpret_cast<void*>(te_adapters::BlockCastCuda));
    d["te_adapters_block_norm_cast"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::BlockNormCastCuda));
    d["te_adapters_block_act_cast"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::BlockActCastCuda));
    d["te_adapters_block_dact_cast"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::BlockDactCastCuda));
    d["te_adapters_act_cast"] = nb::capsule(reinterpret_cast<void*>(te_adapters::ActCastCuda));
    d["te_adapters_dact_cast"] = nb::capsule(reinterpret_cast<void*>(te_adapters::DactCastCuda));
    d["te_adapters_norm_cast"] = nb::capsule(reinterpret_cast<void*>(te_adapters::NormCastCuda));
    d["te_adapters_act_amax"] = nb::capsule(reinterpret_cast<void*>(te_adapters::ActAmaxCuda));
    d["te_adapters_dact_amax"] = nb::capsule(reinterpret_cast<void*>(te_adapters::DactAmaxCuda));
#ifdef TE_ADAPTERS_BLOCK_GEMM
    d["te_adapters_block_gemm"] = nb::capsule(reinterpret_cast<void*>(te_adapters::BlockGemmCuda));
#endif
#ifdef TE_ADAPTERS_GROUPED_GEMM
    d["te_adapters_grouped_gemm"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::GroupedGemmCuda));
    d["te_adapters_padded_transpose"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::PaddedTransposeCuda));
    d["te_adapters_grouped_block_gemm"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::GroupedBlockGemmCuda));
#endif
    return d;
  });
  // What was built, and the driver found now (0 when there is none): the CUDA runtime is linked
  // statically, so the kernels run where the driver supports CUDA_VERSION's major release.
  m.def("build_info", []() {
    nb::dict d;
    d["cuda_runtime_version"] = CUDART_VERSION;
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    d["cuda_driver_version"] = driver;
    d["archs"] = std::string(TE_ADAPTERS_XSTRINGIFY(TE_ADAPTERS_CUDA_ARCHS));
#ifdef TE_ADAPTERS_BLOCK_GEMM
    d["cublaslt_gemm"] = true;
#else
    d["cublaslt_gemm"] = false;
#endif
#ifdef TE_ADAPTERS_GROUPED_GEMM
    d["grouped_gemm"] = true;
#else
    d["grouped_gemm"] = false;
#endif
    return d;
  });
}
