// One instantiation of the grouped GEMM: CUTLASS's Hopper pointer-array grouped GEMM (TMA,
// warp-specialized, FP8 or bfloat16 inputs, float32 accumulation, one alpha per group from device
// memory). A small kernel first turns the group sizes (on the device) into the per-group problem
// shapes, pointers and strides, so the host never waits for them.
#pragma once

#include <algorithm>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm.h"

namespace te_adapters::grouped {

template <int kCode>
using In = cute::conditional_t<
    kCode == 0, cutlass::float_e4m3_t,
    cute::conditional_t<kCode == 1, cutlass::float_e5m2_t, cutlass::bfloat16_t>>;
template <int kCode>
using Out = cute::conditional_t<kCode == 0, cutlass::bfloat16_t, float>;

template <int kA, int kB, int kD, int kFast, int kCfg>
struct Config {
  using ElementA = In<kA>;
  using ElementB = In<kB>;
  using ElementD = Out<kD>;
  static constexpr bool kBf16 = kA == kBf16Code;
  static_assert((kA == kBf16Code) == (kB == kBf16Code), "bfloat16 operands come in pairs");
  static_assert(!kBf16 || kFast == 0, "fast accumulation is an FP8 mode");
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  static constexpr bool kPingpong = kCfg == 0;
  // Promoted sums keep a second set of accumulators in registers: with 128x256 tiles (or a
  // ping-pong warp group's whole 128x128 tile) they spill, and ran 3x slower on an H100.
  // bfloat16 tiles take 64 elements of K (128 bytes a row, as FP8's 128).
  using TileK = cute::conditional_t<kBf16, cute::_64, cute::_128>;
  using TileShape = cute::conditional_t<kPingpong || (kFast == 0 && !kBf16),
                                        cute::Shape<cute::_128, cute::_128, TileK>,
                                        cute::Shape<cute::_128, cute::_256, TileK>>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using KernelSchedule = cute::conditional_t<
      kPingpong,
      cute::conditional_t<kFast != 0,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>,
      cute::conditional_t<kFast != 0,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule =
      cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major: (N, K), K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // (M, N), N contiguous
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 bytes
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// The per-group arguments, carved from the front of the workspace.
template <class C>
struct Arrays {
  typename C::Shape* shapes;
  const typename C::ElementA** a;
  const typename C::ElementB** b;
  typename C::ElementD** d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideD* stride_d;
  const float** alpha;
  int64_t* total;  // kRows: the rows that belong to a group

  static size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }
  // Returns the bytes used, or 0 when ``bytes`` is too small.
  size_t carve(void* base, size_t bytes, int groups) {
    auto* p = static_cast<char*>(base);
    size_t used = 0;
    auto take = [&](auto*& field, size_t size) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p + used);
      used += align(size * groups);
    };
    take(shapes, sizeof(*shapes));
    take(a, sizeof(*a));
    take(b, sizeof(*b));
    take(d, sizeof(*d));
    take(stride_a, sizeof(*stride_a));
    take(stride_b, sizeof(*stride_b));
    take(stride_d, sizeof(*stride_d));
    take(alpha, sizeof(*alpha));
    total = reinterpret_cast<int64_t*>(p + used);
    used += 256;
    return used <= bytes ? used : 0;
  }
};

template <class C>
__global__ void SetupKernel(Problem p, Arrays<C> arr) {
  // One block: thread 0 forms the offsets (G is at most a few thousand), then each thread fills
  // its groups' entries.
  __shared__ int64_t done;
  const int64_t limit = p.mode == kRows ? p.m : p.rows;
  if (threadIdx.x == 0) {
    int64_t offset = 0, padded = 0;
    for (int g = 0; g < p.groups; ++g) {
      int64_t size = p.group_sizes[g];
      size = size < 0 ? 0 : size;
      size = size > limit - offset ? limit - offset : size;
      // Stash the group's (clamped) size and offsets in its shape slot until the threads below
      // replace them.
      const int64_t pad = size < 16 ? 16 : (size + 15) / 16 * 16;
      arr.shapes[g] = typename C::Shape(static_cast<int>(size), static_cast<int>(offset),
                                        static_cast<int>(padded));
      offset += size;
      padded += pad;
    }
    *arr.total = offset;
    done = offset;
  }
  __syncthreads();
  using EA = typename C::ElementA;
  using EB = typename C::ElementB;
  using ED = typename C::ElementD;
  for (int g = threadIdx.x; g < p.groups; g += blockDim.x) {
    const auto stash = arr.shapes[g];
    const int64_t size = cute::get<0>(stash), offset = cute::get<1>(stash),
                  padded = cute::get<2>(stash);
    const int64_t pad = size < 16 ? 16 : (size + 15) / 16 * 16;
    typename C::StrideA sa{};
    typename C::StrideB sb{};
    typename C::StrideD sd{};
    if (p.mode == kRows) {
      arr.shapes[g] = typename C::Shape(static_cast<int>(size), static_cast<int>(p.n),
                                        static_cast<int>(p.k));
      arr.a[g] = static_cast<const EA*>(p.a) + offset * p.k;
      arr.b[g] = static_cast<const EB*>(p.b) + g * p.n * p.k;
      arr.d[g] = static_cast<ED*>(p.d) + offset * p.n;
      cute::get<0>(sa) = p.k;
      cute::get<0>(sb) = p.k;
      cute::get<0>(sd) = p.n;
    } else {
      arr.shapes[g] = typename C::Shape(static_cast<int>(p.m), static_cast<int>(p.n),
                                        static_cast<int>(pad));
      arr.a[g] = static_cast<const EA*>(p.a) + padded;
      arr.b[g] = static_cast<const EB*>(p.b) + padded;
      arr.d[g] = static_cast<ED*>(p.d) + g * p.m * p.n;
      cute::get<0>(sa) = p.k;
      cute::get<0>(sb) = p.k;
      cute::get<0>(sd) = p.n;
    }
    arr.stride_a[g] = sa;
    arr.stride_b[g] = sb;
    arr.stride_d[g] = sd;
    arr.alpha[g] = p.alpha + g;
  }
  (void)done;
}

// Zeroes the output rows past the groups (kRows), 16 bytes per store.
template <class C>
__global__ void ZeroTailKernel(uint4* out, const int64_t* total, int64_t rows, int64_t row_vecs) {
  const int64_t begin = *total * row_vecs, end = rows * row_vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

template <int kA, int kB, int kD, int kFast, int kCfg>
std::string Run(const Problem& p, cudaStream_t stream) {
  using C = Config<kA, kB, kD, kFast, kCfg>;
  using Gemm = typename C::Gemm;
  if (p.groups <= 0) return "";
  Arrays<C> arr;
  const size_t used = arr.carve(p.workspace, p.workspace_bytes, p.groups);
  if (used == 0) return "the workspace is too small for the per-group arguments";
  SetupKernel<C><<<1, 256, 0, stream>>>(p, arr);
  if (p.mode == kRows) {
    const int64_t row_vecs = p.n * static_cast<int64_t>(sizeof(typename C::ElementD)) / 16;
    ZeroTailKernel<C><<<std::max(1, p.sm_count) * 4, 256, 0, stream>>>(
        static_cast<uint4*>(p.d), arr.total, p.m, row_vecs);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("setup kernel: ") + cudaGetErrorString(err);

  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 0.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = arr.alpha;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {p.groups, arr.shapes, nullptr},
      {arr.a, arr.stride_a, arr.b, arr.stride_b},
      {fusion, nullptr, arr.stride_d, arr.d, arr.stride_d},
      hw};
  Gemm gemm;
  void* cutlass_ws = static_cast<char*>(p.workspace) + used;
  const size_t need = Gemm::get_workspace_size(args);
  if (need > p.workspace_bytes - used) {
    return "the workspace is too small for CUTLASS (" + std::to_string(need) + " bytes needed)";
  }
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) {
    return std::string("CUTLASS cannot run this grouped GEMM: ") + cutlassGetStatusString(s);
  }
  s = gemm.initialize(args, cutlass_ws, stream);
  if (s != cutlass::Status::kSuccess) {
    return std::string("CUTLASS initialize: ") + cutlassGetStatusString(s);
  }
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) {
    return std::string("CUTLASS run: ") + cutlassGetStatusString(s);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("grouped GEMM launch: ") + cudaGetErrorString(err);
  return "";
}

}  // namespace te_adapters::grouped
