// FP8 GEMM with 1x128 / 128x128 block scales on Hopper, through cuBLASLt's block-scaling modes
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and _BLK128x128_32F, cuBLAS 12.9 and newer).
//
// out[b] (M x N, row-major) = sum over K of lhs[b] (M x K) * rhs[b] (N x K), both operands with
// K contiguous, each 128-wide K block multiplied by its float32 scales before the sum.
// Scale layouts, one batch entry each (cuBLAS's):
//   1-D (1x128 blocks along K):      [K / 128][R4] float32, R4 = rows rounded up to a multiple of 4
//                                    (rows contiguous);
//   2-D (128x128 tiles):             [rows / 128][K4] float32, K4 = K / 128 rounded up to 4.
// cuBLAS takes 1-D x 1-D, 1-D x 2-D and 2-D x 1-D, not 2-D x 2-D.
//
// cuBLASLt is not linked: the library JAX has already loaded (or, failing that, the one the
// loader finds) is opened with dlopen on first use, so the extension never pins a cuBLAS version
// and still imports where none is installed.
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cublasLt.h"
#include "cuda_runtime_api.h"
#include "xla/ffi/api/ffi.h"

namespace te_adapters {
namespace {

namespace ffi = xla::ffi;

struct LtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string error;  // empty when loaded
};

// cuBLAS 12.9 brought the block-scaling modes for Hopper.
constexpr size_t kMinVersion = 120900;

const LtApi& lt_api() {
  static LtApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
    void* lib = nullptr;
    for (const char* name : names) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) != nullptr) break;
    }
    for (const char* name : names) {
      if (lib == nullptr) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    }
    if (lib == nullptr) {
      api.error = "cuBLASLt (libcublasLt.so) could not be loaded";
      return;
    }
    bool ok = true;
    auto load = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      ok = ok && fn != nullptr;
    };
    load(api.create, "cublasLtCreate");
    load(api.get_version, "cublasLtGetVersion");
    load(api.desc_create, "cublasLtMatmulDescCreate");
    load(api.desc_destroy, "cublasLtMatmulDescDestroy");
    load(api.desc_set, "cublasLtMatmulDescSetAttribute");
    load(api.layout_create, "cublasLtMatrixLayoutCreate");
    load(api.layout_destroy, "cublasLtMatrixLayoutDestroy");
    load(api.pref_create, "cublasLtMatmulPreferenceCreate");
    load(api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    load(api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    load(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    load(api.matmul, "cublasLtMatmul");
    if (!ok) {
      api.error = "cuBLASLt lacks a function the block-scaled GEMM needs";
    } else if (api.get_version() < kMinVersion) {
      api.error = "cuBLASLt " + std::to_string(api.get_version()) +
                  " has no FP8 block scaling (needs 12.9 or newer)";
    }
  });
  return api;
}

// One handle per device (a cuBLASLt handle belongs to the device current at its creation).
cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  if (lt_api().create(&h) != CUBLAS_STATUS_SUCCESS) return nullptr;
  handles[device] = h;
  return h;
}

using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, size_t>;

bool cached_algo(const AlgoKey& key, cublasLtMatmulAlgo_t* algo, bool store) {
  static std::mutex mu;
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
  std::lock_guard<std::mutex> lock(mu);
  if (store) {
    algos[key] = *algo;
    return true;
  }
  auto it = algos.find(key);
  if (it == algos.end()) return false;
  *algo = it->second;
  return true;
}

bool fp8_type(ffi::DataType t, cudaDataType_t* out) {
  if (t == ffi::DataType::F8E4M3FN) {
    *out = CUDA_R_8F_E4M3;
  } else if (t == ffi::DataType::F8E5M2) {
    *out = CUDA_R_8F_E5M2;
  } else {
    return false;
  }
  return true;
}

cublasLtMatmulMatrixScale_t scale_mode(int32_t mode) {
  return mode == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                   : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}

ffi::Error lt_error(const char* what, cublasStatus_t status) {
  return ffi::Error::Internal(std::string("te_adapters block GEMM: ") + what + " failed (cuBLAS status " +
                              std::to_string(static_cast<int>(status)) + ")");
}

// Owns the cuBLASLt descriptors of one call.
struct Descriptors {
  const LtApi& api;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit Descriptors(const LtApi& api) : api(api) {}
  ~Descriptors() {
    if (pref) api.pref_destroy(pref);
    if (d) api.layout_destroy(d);
    if (b) api.layout_destroy(b);
    if (a) api.layout_destroy(a);
    if (op) api.desc_destroy(op);
  }
};

ffi::Error BlockGemmImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::F32> lhs_scale, ffi::Buffer<ffi::F32> rhs_scale,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                         int32_t lhs_mode, int32_t rhs_mode) {
  const LtApi& api = lt_api();
  if (!api.error.empty()) return ffi::Error::Internal("te_adapters block GEMM: " + api.error);
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 3 || rd.size() != 3 || od.size() != 3) {
    return ffi::Error::InvalidArgument("block GEMM operands must be (B, M, K), (B, N, K), (B, M, N)");
  }
  const int64_t batch = ld[0], m = ld[1], k = ld[2], n = rd[1];
  if (rd[0] != batch || rd[2] != k || od[0] != batch || od[1] != m || od[2] != n) {
    return ffi::Error::InvalidArgument("block GEMM operand shapes do not match");
  }
  if (k % 128 != 0) return ffi::Error::InvalidArgument("block GEMM needs K % 128 == 0");
  if (lhs_mode == 2 && rhs_mode == 2) {
    return ffi::Error::InvalidArgument("cuBLAS has no 128x128 x 128x128 block-scaled GEMM");
  }
  cudaDataType_t a_type, b_type, d_type;
  if (!fp8_type(rhs.element_type(), &a_type) || !fp8_type(lhs.element_type(), &b_type)) {
    return ffi::Error::InvalidArgument("block GEMM operands must be float8_e4m3fn or float8_e5m2");
  }
  if (out->element_type() == ffi::DataType::F32) {
    d_type = CUDA_R_32F;
  } else if (out->element_type() == ffi::DataType::BF16) {
    d_type = CUDA_R_16BF;
  } else {
    return ffi::Error::InvalidArgument("block GEMM output must be float32 or bfloat16");
  }
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  const size_t lhs_scale_stride = lhs_scale.element_count() / batch;
  const size_t rhs_scale_stride = rhs_scale.element_count() / batch;
  const size_t out_bytes = d_type == CUDA_R_32F ? 4 : 2;
  const size_t ws_bytes = workspace->size_bytes();

  int device = 0;
  cudaGetDevice(&device);
  cublasLtHandle_t handle = handle_for(device);
  if (handle == nullptr) return ffi::Error::Internal("te_adapters block GEMM: cublasLtCreate failed");

  // cuBLAS is column-major: D^T (N x M) = op(A) (N x K) * op(B) (K x M), with A = rhs stored as
  // K x N (transposed) and B = lhs stored as K x M.
  Descriptors ds(api);
  cublasStatus_t s;
  if ((s = api.desc_create(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) != CUBLAS_STATUS_SUCCESS) {
    return lt_error("cublasLtMatmulDescCreate", s);
  }
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  const int32_t a_mode = scale_mode(rhs_mode), b_mode = scale_mode(lhs_mode);
  api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  if ((s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode))) !=
          CUBLAS_STATUS_SUCCESS ||
      (s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode))) !=
          CUBLAS_STATUS_SUCCESS) {
    return lt_error("setting the block scale modes", s);
  }
  if ((s = api.layout_create(&ds.a, a_type, k, n, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = api.layout_create(&ds.b, b_type, k, m, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = api.layout_create(&ds.d, d_type, n, m, n)) != CUBLAS_STATUS_SUCCESS) {
    return lt_error("cublasLtMatrixLayoutCreate", s);
  }

  const AlgoKey key{device, m, n, k, static_cast<int>(a_type), static_cast<int>(b_type),
                    static_cast<int>(d_type), lhs_mode, rhs_mode, ws_bytes};
  cublasLtMatmulAlgo_t algo;
  if (!cached_algo(key, &algo, false)) {
    if ((s = api.pref_create(&ds.pref)) != CUBLAS_STATUS_SUCCESS) {
      return lt_error("cublasLtMatmulPreferenceCreate", s);
    }
    uint64_t ws = ws_bytes;
    api.pref_set(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    // Scale pointers are read by the heuristic only for their alignment: set them now.
    const void* as = rhs_scale.typed_data();
    const void* bs = lhs_scale.typed_data();
    api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof(as));
    api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof(bs));
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    s = api.heuristic(handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, 1, &result, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
      return ffi::Error::Internal(
          "te_adapters block GEMM: cuBLASLt has no algorithm for this block-scaled FP8 GEMM (M=" +
          std::to_string(m) + ", N=" + std::to_string(n) + ", K=" + std::to_string(k) +
          ", status " + std::to_string(static_cast<int>(s)) + ")");
    }
    algo = result.algo;
    cached_algo(key, &algo, true);
  }

  const float alpha = 1.0f, beta = 0.0f;
  const auto* lp = static_cast<const uint8_t*>(lhs.untyped_data());
  const auto* rp = static_cast<const uint8_t*>(rhs.untyped_data());
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    const float* as = rhs_scale.typed_data() + i * rhs_scale_stride;
    const float* bs = lhs_scale.typed_data() + i * lhs_scale_stride;
    api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof(as));
    api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof(bs));
    void* d = op + i * m * n * out_bytes;
    s = api.matmul(handle, ds.op, &alpha, rp + i * n * k, ds.a, lp + i * m * k, ds.b, &beta, d, ds.d,
                   d, ds.d, &algo, workspace->untyped_data(), ws_bytes, stream);
    if (s != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmul", s);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockGemmCuda, BlockGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("lhs_mode")
                                  .Attr<int32_t>("rhs_mode"));

}  // namespace te_adapters
