// Host-side helpers shared by the CUDA FFI handlers (the casts, and the grouped GEMMs' traits):
// the error after a launch, the FP8 output dtype of a result buffer, the amax
// result zeroed before the kernels max into it, and the traits of a handler that XLA may record
// into a command buffer.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "fp8_convert.h"
#include "xla/ffi/api/ffi.h"

// The traits of a handler that only enqueues kernels and memsets on XLA's stream (no host
// synchronization, no allocation, no host branch on device data): XLA may then record it into a
// command buffer (a CUDA graph) with the fusions and GEMMs around it, instead of launching it and
// its neighbours one by one from the host every step.
#define TE_ADAPTERS_CMD_BUFFER_COMPATIBLE \
  { xla::ffi::Traits::kCmdBufferCompatible }

namespace te_adapters {
namespace cuda {

// The last CUDA error as an FFI error naming `what` (Success when there is none).
inline xla::ffi::Error cuda_error(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// `t` as an OutType; an InvalidArgument error with `message` unless it is E4M3 or E5M2.
inline xla::ffi::Error out_type(
    xla::ffi::DataType t, OutType* ot,
    const char* message = "output dtype must be float8_e4m3fn or float8_e5m2") {
  if (t == xla::ffi::DataType::F8E4M3FN) {
    *ot = OutType::kE4M3;
  } else if (t == xla::ffi::DataType::F8E5M2) {
    *ot = OutType::kE5M2;
  } else {
    return xla::ffi::Error::InvalidArgument(message);
  }
  return xla::ffi::Error::Success();
}

// The amax result (`count` elements, 1 unless a caller keeps one per batch index) as the float
// bits the kernels max into (atomicMax on uint32), zeroed on `stream` first; nullptr when
// `compute` is false.
inline xla::ffi::Error zeroed_amax(xla::ffi::Result<xla::ffi::Buffer<xla::ffi::F32>>& amax,
                                   bool compute, cudaStream_t stream, uint32_t** out,
                                   int64_t count = 1) {
  *out = nullptr;
  if (!compute) return xla::ffi::Error::Success();
  if (static_cast<int64_t>(amax->element_count()) != count) {
    return xla::ffi::Error::InvalidArgument(
        count == 1 ? "amax must have 1 element" : "amax must have one element per batch index");
  }
  *out = reinterpret_cast<uint32_t*>(amax->typed_data());
  cudaMemsetAsync(*out, 0, sizeof(uint32_t) * count, stream);
  return xla::ffi::Error::Success();
}

}  // namespace cuda
}  // namespace te_adapters
