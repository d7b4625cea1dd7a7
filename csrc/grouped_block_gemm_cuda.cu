// XLA FFI handler of Float8BlockScaling's grouped GEMM (see grouped_block_gemm.h): checks the
// buffers, picks the instantiation for the operand and output types, and runs it on XLA's stream.
// Group sizes are read on the device only.
#include <map>
#include <mutex>
#include <string>

#include "ffi_cuda.h"
#include "grouped_block_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_adapters {
namespace {

using grouped_block::kBlock;
using grouped_block::Problem;

int block_sm_count(int device) {
  static std::mutex mu;
  static std::map<int, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = counts.find(device);
  if (it != counts.end()) return it->second;
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  counts[device] = count;
  return count;
}

int block_fp8_code(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return 0;
  if (t == ffi::DataType::F8E5M2) return 1;
  return -1;
}

int block_out_code(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return 0;
  if (t == ffi::DataType::F32) return 1;
  return -1;
}

// The instantiations built (grouped_block_gemm_inst_*.cu): kRows with (e4m3, e4m3) (forward,
// dgrad) and (e5m2, e4m3) (dgrad of HYBRID), kWgrad with (e4m3, e4m3) and (e4m3, e5m2), each
// writing bfloat16 or float32.
std::string block_dispatch(int a, int b, int d, int mode, const Problem& p, cudaStream_t stream) {
#define TE_GBG_CASE(A, B, M)                                                  \
  if (a == A && b == B && mode == M) {                                        \
    return d == 0 ? grouped_block::Run<A, B, 0, M>(p, stream)                 \
                  : grouped_block::Run<A, B, 1, M>(p, stream);                \
  }
  TE_GBG_CASE(0, 0, grouped_block::kRows)
  TE_GBG_CASE(1, 0, grouped_block::kRows)
  TE_GBG_CASE(0, 0, grouped_block::kWgrad)
  TE_GBG_CASE(0, 1, grouped_block::kWgrad)
#undef TE_GBG_CASE
  return "no kernel for this pair of operand types (the kernels are float8_e4m3fn; the other "
         "operand of the dgrad and wgrad GEMMs may be float8_e5m2)";
}

ffi::Error GroupedBlockGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                ffi::Buffer<ffi::F32> sfa, ffi::Buffer<ffi::F32> sfb,
                                ffi::Buffer<ffi::S32> group_sizes,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> workspace, int32_t mode) {
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t groups = group_sizes.element_count();
  const int ca = block_fp8_code(a.element_type()), cb = block_fp8_code(b.element_type());
  const int cd = block_out_code(out->element_type());
  if (ca < 0 || cb < 0) {
    return ffi::Error::InvalidArgument(
        "grouped block-scaled GEMM operands must be float8_e4m3fn or float8_e5m2");
  }
  if (cd < 0) {
    return ffi::Error::InvalidArgument(
        "grouped block-scaled GEMM output must be bfloat16 or float32");
  }
  Problem p{};
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.d = out->untyped_data();
  p.sfa = sfa.typed_data();
  p.sfb = sfb.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.groups = static_cast<int32_t>(groups);
  p.mode = mode;
  int64_t sfa_count = 0, sfb_count = 0;
  if (mode == grouped_block::kRows) {
    // a (M, K), b (G, N, K), out (M, N); K and N multiples of 128
    if (ad.size() != 2 || bd.size() != 3 || od.size() != 2 || bd[0] != groups ||
        bd[2] != ad[1] || od[0] != ad[0] || od[1] != bd[1]) {
      return ffi::Error::InvalidArgument(
          "grouped block-scaled GEMM (rows): shapes must be a (M, K), b (G, N, K), out (M, N)");
    }
    p.m = ad[0];
    p.n = bd[1];
    p.k = ad[1];
    if (p.k % kBlock != 0 || p.n % kBlock != 0) {
      return ffi::Error::InvalidArgument(
          "grouped block-scaled GEMM (rows): K and N must be multiples of 128");
    }
    sfa_count = p.m * (p.k / kBlock);
    sfb_count = groups * (p.n / kBlock) * (p.k / kBlock);
  } else if (mode == grouped_block::kWgrad) {
    // a (M, P), b (N, P), out (G, M, N); P a multiple of 128
    if (ad.size() != 2 || bd.size() != 2 || od.size() != 3 || bd[1] != ad[1] ||
        od[0] != groups || od[1] != ad[0] || od[2] != bd[0]) {
      return ffi::Error::InvalidArgument(
          "grouped block-scaled GEMM (wgrad): shapes must be a (M, P), b (N, P), out (G, M, N)");
    }
    p.m = ad[0];
    p.n = bd[0];
    p.k = ad[1];
    if (p.k % kBlock != 0 || p.m % 16 != 0 || p.n % 16 != 0) {
      return ffi::Error::InvalidArgument(
          "grouped block-scaled GEMM (wgrad): P must be a multiple of 128, M and N of 16");
    }
    sfa_count = (p.k / kBlock) * p.m;
    sfb_count = (p.k / kBlock) * p.n;
  } else {
    return ffi::Error::InvalidArgument("grouped block-scaled GEMM: unknown mode");
  }
  if (static_cast<int64_t>(sfa.element_count()) != sfa_count ||
      static_cast<int64_t>(sfb.element_count()) != sfb_count) {
    return ffi::Error::InvalidArgument(
        "grouped block-scaled GEMM: the scales do not match the operands' blocks");
  }
  if (groups == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  cudaGetDevice(&p.device);
  p.sm_count = block_sm_count(p.device);
  if (p.sm_count <= 0) {
    return ffi::Error::Internal("grouped block-scaled GEMM: no multiprocessor count");
  }
  const std::string error = block_dispatch(ca, cb, cd, mode, p, stream);
  if (!error.empty()) {
    return ffi::Error::Internal("te_adapters grouped block-scaled GEMM: " + error);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockGemmCuda, GroupedBlockGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("mode"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
