// FP8 GEMMs on Hopper through cuBLASLt, with per-tensor scales or with 1x128 / 128x128 block
// scales (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and _BLK128x128_32F, cuBLAS 12.9 and newer).
//
// out[b] (M x N, row-major) = sum over K of lhs[b] (M x K) * rhs[b] (N x K), both operands with
// K contiguous. Scale mode 0 (per tensor): each operand has one float32 scale, shared by every
// batch entry, and the epilogue multiplies the float32 sums by both before the one rounding to
// the output dtype. Modes 1 and 2 (blocks): each 128-wide K block is multiplied by its float32
// scales before the sum. ``fast_accum`` (mode 0 only) lets the tensor cores keep the running
// sums in their reduced precision instead of promoting them to float32.
// Block scale layouts, one batch entry each (cuBLAS's):
//   1-D (1x128 blocks along K):      [K / 128][R4] float32, R4 = rows rounded up to a multiple of 4
//                                    (rows contiguous);
//   2-D (128x128 tiles):             [rows / 128][K4] float32, K4 = K / 128 rounded up to 4.
// cuBLAS takes 1-D x 1-D, 1-D x 2-D and 2-D x 1-D, not 2-D x 2-D.
//
// ``sm_margin`` (> 0) leaves that many of the GPU's SMs to kernels running beside the GEMM (a
// collective's, in a sharded program): cuBLASLt's SM count target is the device's SMs less it.
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
constexpr size_t kMinBlockVersion = 120900;
// Algorithms the heuristic proposes per shape, each timed over this many runs.
constexpr int kCandidates = 8;
constexpr int kRounds = 3;
constexpr int kTimedRuns = 2;

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
    if (!ok) api.error = "cuBLASLt lacks a function the FP8 GEMM needs";
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

using AlgoKey =
    std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, size_t, int, int>;

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
  return ffi::Error::Internal(std::string("te_adapters FP8 GEMM: ") + what + " failed (cuBLAS status " +
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
                         int32_t lhs_mode, int32_t rhs_mode, int32_t fast_accum,
                         int32_t sm_margin) {
  const LtApi& api = lt_api();
  if (!api.error.empty()) return ffi::Error::Internal("te_adapters FP8 GEMM: " + api.error);
  const bool per_tensor = lhs_mode == 0 && rhs_mode == 0;
  if (!per_tensor && (lhs_mode == 0 || rhs_mode == 0 || fast_accum != 0)) {
    return ffi::Error::InvalidArgument(
        "FP8 GEMM: per-tensor scales (mode 0) go with per-tensor scales, and block scales "
        "without fast accumulation");
  }
  if (sm_margin < 0) {
    return ffi::Error::InvalidArgument("FP8 GEMM: sm_margin must be 0 or more");
  }
  if (!per_tensor && api.get_version() < kMinBlockVersion) {
    return ffi::Error::Internal("te_adapters FP8 GEMM: cuBLASLt " +
                                std::to_string(api.get_version()) +
                                " has no FP8 block scaling (needs 12.9 or newer)");
  }
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  // (B, M, K), (B, N, K) -> (B, M, N), or the same without B (one GEMM, and no reshape around
  // the call for XLA to see).
  const size_t rank = ld.size();
  if ((rank != 2 && rank != 3) || rd.size() != rank || od.size() != rank) {
    return ffi::Error::InvalidArgument(
        "FP8 GEMM operands must be (B, M, K), (B, N, K), (B, M, N), or the same without B");
  }
  const size_t o = rank - 2;
  const int64_t batch = rank == 3 ? ld[0] : 1, m = ld[o], k = ld[o + 1], n = rd[o];
  if ((rank == 3 && (rd[0] != batch || od[0] != batch)) || rd[o + 1] != k || od[o] != m ||
      od[o + 1] != n) {
    return ffi::Error::InvalidArgument("FP8 GEMM operand shapes do not match");
  }
  if (!per_tensor && k % 128 != 0) {
    return ffi::Error::InvalidArgument("block-scaled GEMM needs K % 128 == 0");
  }
  if (per_tensor && (k % 16 != 0 || lhs_scale.element_count() != 1 ||
                     rhs_scale.element_count() != 1)) {
    return ffi::Error::InvalidArgument(
        "per-tensor FP8 GEMM needs K % 16 == 0 and one scale per operand");
  }
  if (lhs_mode == 2 && rhs_mode == 2) {
    return ffi::Error::InvalidArgument("cuBLAS has no 128x128 x 128x128 block-scaled GEMM");
  }
  cudaDataType_t a_type, b_type, d_type;
  if (!fp8_type(rhs.element_type(), &a_type) || !fp8_type(lhs.element_type(), &b_type)) {
    return ffi::Error::InvalidArgument("FP8 GEMM operands must be float8_e4m3fn or float8_e5m2");
  }
  size_t out_bytes = 2;
  if (out->element_type() == ffi::DataType::F32) {
    d_type = CUDA_R_32F;
    out_bytes = 4;
  } else if (out->element_type() == ffi::DataType::BF16) {
    d_type = CUDA_R_16BF;
  } else if (per_tensor && out->element_type() == ffi::DataType::F16) {
    d_type = CUDA_R_16F;
  } else {
    return ffi::Error::InvalidArgument("FP8 GEMM output must be float32 or bfloat16 (or float16 "
                                       "with per-tensor scales)");
  }
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  const size_t lhs_scale_stride = per_tensor ? 0 : lhs_scale.element_count() / batch;
  const size_t rhs_scale_stride = per_tensor ? 0 : rhs_scale.element_count() / batch;
  const size_t ws_bytes = workspace->size_bytes();

  int device = 0;
  cudaGetDevice(&device);
  cublasLtHandle_t handle = handle_for(device);
  if (handle == nullptr) return ffi::Error::Internal("te_adapters FP8 GEMM: cublasLtCreate failed");

  // cuBLAS is column-major: D^T (N x M) = op(A) (N x K) * op(B) (K x M), with A = rhs stored as
  // K x N (transposed) and B = lhs stored as K x M.
  Descriptors ds(api);
  cublasStatus_t s;
  if ((s = api.desc_create(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) != CUBLAS_STATUS_SUCCESS) {
    return lt_error("cublasLtMatmulDescCreate", s);
  }
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  if (per_tensor) {
    // The default scale mode is one float32 scalar per operand.
    const int8_t fast = fast_accum != 0 ? 1 : 0;
    if ((s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast))) !=
        CUBLAS_STATUS_SUCCESS) {
      return lt_error("setting the accumulation mode", s);
    }
  } else {
    const int32_t a_mode = scale_mode(rhs_mode), b_mode = scale_mode(lhs_mode);
    if ((s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode))) !=
            CUBLAS_STATUS_SUCCESS ||
        (s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode))) !=
            CUBLAS_STATUS_SUCCESS) {
      return lt_error("setting the block scale modes", s);
    }
  }
  int32_t sm_target = 0;  // 0: every SM
  if (sm_margin > 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return ffi::Error::Internal("te_adapters FP8 GEMM: the device's SM count is unknown");
    }
    if (sm_margin >= sms) {
      return ffi::Error::InvalidArgument("FP8 GEMM: sm_margin " + std::to_string(sm_margin) +
                                         " leaves none of the device's " + std::to_string(sms) +
                                         " SMs to the GEMM");
    }
    sm_target = sms - sm_margin;
    if ((s = api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target,
                          sizeof(sm_target))) != CUBLAS_STATUS_SUCCESS) {
      return lt_error("setting the SM count target", s);
    }
  }
  if ((s = api.layout_create(&ds.a, a_type, k, n, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = api.layout_create(&ds.b, b_type, k, m, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = api.layout_create(&ds.d, d_type, n, m, n)) != CUBLAS_STATUS_SUCCESS) {
    return lt_error("cublasLtMatrixLayoutCreate", s);
  }

  const AlgoKey key{device, m, n, k, static_cast<int>(a_type), static_cast<int>(b_type),
                    static_cast<int>(d_type), lhs_mode, rhs_mode, ws_bytes, fast_accum, sm_target};
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
    cublasLtMatmulHeuristicResult_t results[kCandidates];
    std::memset(results, 0, sizeof(results));
    int found = 0;
    s = api.heuristic(handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, kCandidates, results, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
      return ffi::Error::Internal(
          "te_adapters FP8 GEMM: cuBLASLt has no algorithm for this FP8 GEMM (M=" +
          std::to_string(m) + ", N=" + std::to_string(n) + ", K=" + std::to_string(k) +
          ", status " + std::to_string(static_cast<int>(s)) + ")");
    }
    algo = results[0].algo;
    if (found > 1) {
      // The heuristic's first choice ran up to 8% slower than the best of its list on an H100
      // (XLA times the list too): time the candidates once per shape, on this call's operands
      // (the output is scratch until the real call below), and keep the fastest.
      const float one = 1.0f, zero = 0.0f;
      const void* as = rhs_scale.typed_data();
      const void* bs = lhs_scale.typed_data();
      api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof(as));
      api.desc_set(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof(bs));
      cudaEvent_t start = nullptr, stop = nullptr;
      if (cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess) {
        // Rounds over the candidates, keeping each one's best time: under a power cap the
        // clock falls as the GPU heats, which would otherwise favour the first candidates.
        float best_ms[kCandidates];
        for (int i = 0; i < found; ++i) best_ms[i] = -1.0f;
        for (int round = 0; round < kRounds; ++round) {
          for (int i = 0; i < found; ++i) {
            if (round > 0 && best_ms[i] < 0.0f) continue;  // it could not run
            auto run = [&]() {
              return api.matmul(handle, ds.op, &one, rhs.untyped_data(), ds.a,
                                lhs.untyped_data(), ds.b, &zero, out->untyped_data(), ds.d,
                                out->untyped_data(), ds.d, &results[i].algo,
                                workspace->untyped_data(), ws_bytes, stream);
            };
            if (round == 0 && run() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up
            cudaEventRecord(start, stream);
            bool ok = true;
            for (int r = 0; r < kTimedRuns; ++r) ok = ok && run() == CUBLAS_STATUS_SUCCESS;
            cudaEventRecord(stop, stream);
            float ms = 0.0f;
            if (!ok || cudaEventSynchronize(stop) != cudaSuccess ||
                cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
              best_ms[i] = -1.0f;
              continue;
            }
            if (best_ms[i] < 0.0f || ms < best_ms[i]) best_ms[i] = ms;
          }
        }
        float best = -1.0f;
        for (int i = 0; i < found; ++i) {
          if (best_ms[i] >= 0.0f && (best < 0.0f || best_ms[i] < best)) {
            best = best_ms[i];
            algo = results[i].algo;
          }
        }
      }
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
      cudaGetLastError();  // clear a failed event call, if any: it does not concern XLA
    }
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
                                  .Attr<int32_t>("rhs_mode")
                                  .Attr<int32_t>("fast_accum")
                                  .Attr<int32_t>("sm_margin"));

}  // namespace te_adapters
