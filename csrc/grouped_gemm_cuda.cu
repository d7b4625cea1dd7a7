// XLA FFI handler of the grouped GEMM, FP8 or bfloat16 operands (see grouped_gemm.h): checks the
// buffers, picks the instantiation for the operand and output types and the accumulation mode,
// and runs it on XLA's stream. Group sizes are read on the device only.
#include <map>
#include <mutex>
#include <string>

#include "ffi_cuda.h"
#include "grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_adapters {
namespace grouped {

// 64x64-byte tiles: each thread loads 4 bytes of a source row and stores 4 bytes of an output
// row, through a padded shared-memory tile.
__global__ void PaddedTransposeKernel(const uint8_t* q, const int32_t* src, uint8_t* out,
                                      int64_t rows, int64_t f, int64_t p) {
  __shared__ uint8_t tile[64][68];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 64;  // output columns (source rows)
  const int64_t f0 = static_cast<int64_t>(blockIdx.y) * 64;  // features (output rows)
  const int tx = threadIdx.x, ty = threadIdx.y;               // 16 x 16 threads
  for (int i = ty; i < 64; i += 16) {
    const int64_t c = c0 + i, ff = f0 + 4 * tx;
    const int32_t r = c < p ? src[c] : -1;
    uint32_t v = 0;
    if (r >= 0 && r < rows && ff < f) v = *reinterpret_cast<const uint32_t*>(q + r * f + ff);
    *reinterpret_cast<uint32_t*>(&tile[i][4 * tx]) = v;
  }
  __syncthreads();
  for (int i = ty; i < 64; i += 16) {
    const int64_t ff = f0 + i, c = c0 + 4 * tx;
    if (ff >= f || c >= p) continue;
    const uint32_t v = static_cast<uint32_t>(tile[4 * tx][i]) |
                       static_cast<uint32_t>(tile[4 * tx + 1][i]) << 8 |
                       static_cast<uint32_t>(tile[4 * tx + 2][i]) << 16 |
                       static_cast<uint32_t>(tile[4 * tx + 3][i]) << 24;
    *reinterpret_cast<uint32_t*>(out + ff * p + c) = v;
  }
}

// Launches a padded-transpose kernel over 64x64 tiles of out (F, P).
template <typename T>
std::string launch_padded(void (*kernel)(const T*, const int32_t*, T*, int64_t, int64_t, int64_t),
                          dim3 block, const T* q, const int32_t* src, T* out, int64_t rows,
                          int64_t f, int64_t p, cudaStream_t stream) {
  if (f == 0 || p == 0) return "";
  const dim3 grid(static_cast<unsigned>((p + 63) / 64), static_cast<unsigned>((f + 63) / 64));
  kernel<<<grid, block, 0, stream>>>(q, src, out, rows, f, p);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? "" : std::string("padded transpose: ") + cudaGetErrorString(err);
}

std::string PaddedTranspose(const uint8_t* q, const int32_t* src, uint8_t* out, int64_t rows,
                            int64_t f, int64_t p, cudaStream_t stream) {
  return launch_padded(PaddedTransposeKernel, dim3(16, 16), q, src, out, rows, f, p, stream);
}

// The same for two-byte elements: 64x64-element tiles, one element per access (consecutive
// threads read consecutive features of a source row and write consecutive output columns).
__global__ void PaddedTranspose16Kernel(const uint16_t* q, const int32_t* src, uint16_t* out,
                                        int64_t rows, int64_t f, int64_t p) {
  __shared__ uint16_t tile[64][65];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 64;  // output columns (source rows)
  const int64_t f0 = static_cast<int64_t>(blockIdx.y) * 64;  // features (output rows)
  const int tx = threadIdx.x, ty = threadIdx.y;               // 64 x 4 threads
  for (int i = ty; i < 64; i += 4) {
    const int64_t c = c0 + i, ff = f0 + tx;
    const int32_t r = c < p ? src[c] : -1;
    tile[i][tx] = (r >= 0 && r < rows && ff < f) ? q[r * f + ff] : uint16_t{0};
  }
  __syncthreads();
  for (int i = ty; i < 64; i += 4) {
    const int64_t ff = f0 + i, c = c0 + tx;
    if (ff < f && c < p) out[ff * p + c] = tile[tx][i];
  }
}

std::string PaddedTranspose16(const uint16_t* q, const int32_t* src, uint16_t* out, int64_t rows,
                              int64_t f, int64_t p, cudaStream_t stream) {
  return launch_padded(PaddedTranspose16Kernel, dim3(64, 4), q, src, out, rows, f, p, stream);
}

}  // namespace grouped

namespace {

using grouped::Problem;

int sm_count_of(int device) {
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

int fp8_code(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return 0;
  if (t == ffi::DataType::F8E5M2) return 1;
  return -1;
}

// The operand codes of grouped_gemm.h: the FP8 types, and bfloat16.
int in_code(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return grouped::kBf16Code;
  return fp8_code(t);
}

int out_code(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return 0;
  if (t == ffi::DataType::F32) return 1;
  return -1;
}

// The instantiations built (grouped_gemm_inst_*.cu): operand pairs (e4m3, e4m3), (e5m2, e4m3),
// (e4m3, e5m2), each with both outputs and both accumulation modes, and (bf16, bf16) with both
// outputs (float32 sums), in both tile configurations.
std::string dispatch(int a, int b, int d, int fast, int cfg, const Problem& p,
                     cudaStream_t stream) {
#define TE_GG_CASE(A, B, D, F)                                 \
  if (a == A && b == B && d == D && fast == F) {               \
    return cfg == 1 ? grouped::Run<A, B, D, F, 1>(p, stream)   \
                    : grouped::Run<A, B, D, F, 0>(p, stream);  \
  }
#define TE_GG_OUTS(A, B) \
  TE_GG_CASE(A, B, 0, 0) TE_GG_CASE(A, B, 0, 1) TE_GG_CASE(A, B, 1, 0) TE_GG_CASE(A, B, 1, 1)
  TE_GG_OUTS(0, 0)
  TE_GG_OUTS(1, 0)
  TE_GG_OUTS(0, 1)
  // bfloat16 (code 2): float32 sums only (the handler passes fast = 0 for it).
  TE_GG_CASE(2, 2, 0, 0) TE_GG_CASE(2, 2, 1, 0)
#undef TE_GG_OUTS
#undef TE_GG_CASE
  return "no kernel for this pair of operand types (both float8_e5m2 is not built, and bfloat16 "
         "pairs only with bfloat16)";
}

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> alpha,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                           int32_t mode, int32_t fast_accum, int32_t config) {
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t groups = group_sizes.element_count();
  if (alpha.element_count() != static_cast<size_t>(groups)) {
    return ffi::Error::InvalidArgument("grouped GEMM: alpha needs one value per group");
  }
  const int ca = in_code(a.element_type()), cb = in_code(b.element_type());
  const int cd = out_code(out->element_type());
  if (ca < 0 || cb < 0 || (ca == grouped::kBf16Code) != (cb == grouped::kBf16Code)) {
    return ffi::Error::InvalidArgument(
        "grouped GEMM operands must be float8_e4m3fn or float8_e5m2, or both bfloat16");
  }
  if (cd < 0) return ffi::Error::InvalidArgument("grouped GEMM output must be bfloat16 or float32");
  Problem p{};
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.d = out->untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.alpha = alpha.typed_data();
  p.groups = static_cast<int32_t>(groups);
  p.mode = mode;
  if (mode == grouped::kRows) {
    // a (M, K), b (G, N, K), out (M, N)
    if (ad.size() != 2 || bd.size() != 3 || od.size() != 2 || bd[0] != groups ||
        bd[2] != ad[1] || od[0] != ad[0] || od[1] != bd[1]) {
      return ffi::Error::InvalidArgument(
          "grouped GEMM (rows): shapes must be a (M, K), b (G, N, K), out (M, N)");
    }
    p.m = ad[0];
    p.n = bd[1];
    p.k = ad[1];
    p.rows = ad[0];
  } else if (mode == grouped::kWgrad) {
    // a (M, P), b (N, P), out (G, M, N)
    if (ad.size() != 2 || bd.size() != 2 || od.size() != 3 || bd[1] != ad[1] ||
        od[0] != groups || od[1] != ad[0] || od[2] != bd[0]) {
      return ffi::Error::InvalidArgument(
          "grouped GEMM (wgrad): shapes must be a (M, P), b (N, P), out (G, M, N)");
    }
    p.m = ad[0];
    p.n = bd[0];
    p.k = ad[1];
    // The padded columns hold at most P - 16 G rows of the groups.
    p.rows = ad[1] - 16 * groups;
    if (p.rows < 0) return ffi::Error::InvalidArgument("grouped GEMM (wgrad): P < 16 G");
  } else {
    return ffi::Error::InvalidArgument("grouped GEMM: unknown mode");
  }
  if (p.k % 16 != 0 || p.n % 16 != 0 || (mode == grouped::kWgrad && p.m % 16 != 0)) {
    return ffi::Error::InvalidArgument(
        "grouped GEMM: the contracting and output feature sizes must be multiples of 16");
  }
  if (groups == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  cudaGetDevice(&p.device);
  p.sm_count = sm_count_of(p.device);
  if (p.sm_count <= 0) return ffi::Error::Internal("grouped GEMM: no multiprocessor count");
  // bfloat16 operands sum in float32 whatever fast_accum says.
  const int fast = fast_accum != 0 && ca != grouped::kBf16Code ? 1 : 0;
  const std::string error = dispatch(ca, cb, cd, fast, config == 1 ? 1 : 0, p, stream);
  if (!error.empty()) return ffi::Error::Internal("te_adapters grouped GEMM: " + error);
  return ffi::Error::Success();
}

ffi::Error PaddedTransposeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> src,
                               ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions(), od = out->dimensions();
  if (qd.size() != 2 || od.size() != 2 || od[0] != qd[1] ||
      static_cast<int64_t>(src.element_count()) != od[1]) {
    return ffi::Error::InvalidArgument(
        "padded transpose: shapes must be q (R, F), src (P,), out (F, P)");
  }
  const int code = in_code(q.element_type());
  if (code < 0 || q.element_type() != out->element_type()) {
    return ffi::Error::InvalidArgument(
        "padded transpose: q and out must be the same FP8 type, or both bfloat16");
  }
  if (qd[1] % 16 != 0 || od[1] % 16 != 0) {
    return ffi::Error::InvalidArgument("padded transpose: F and P must be multiples of 16");
  }
  const std::string error =
      code == grouped::kBf16Code
          ? grouped::PaddedTranspose16(static_cast<const uint16_t*>(q.untyped_data()),
                                       src.typed_data(),
                                       static_cast<uint16_t*>(out->untyped_data()), qd[0], qd[1],
                                       od[1], stream)
          : grouped::PaddedTranspose(static_cast<const uint8_t*>(q.untyped_data()),
                                     src.typed_data(), static_cast<uint8_t*>(out->untyped_data()),
                                     qd[0], qd[1], od[1], stream);
  if (!error.empty()) return ffi::Error::Internal("te_adapters " + error);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaddedTransposeCuda, PaddedTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCuda, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("fast_accum")
                                  .Attr<int32_t>("config"),
                              TE_ADAPTERS_CMD_BUFFER_COMPATIBLE);

}  // namespace te_adapters
