// One instantiation of Float8BlockScaling's grouped GEMM: CUTLASS's Hopper pointer-array grouped
// GEMM with blockwise scaling (TMA, warp-specialized cooperative, FP8 inputs, float32 sums, each
// 128-wide slice of the contraction multiplied by its scales before it joins the sum). A small
// kernel first turns the group sizes (on the device) into the per-group problem shapes, pointers
// and strides, so the host never waits for them.
#pragma once

#include <algorithm>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_block_gemm.h"

namespace te_adapters::grouped_block {

template <int kCode>
using In = cute::conditional_t<kCode == 0, cutlass::float_e4m3_t, cutlass::float_e5m2_t>;
template <int kCode>
using Out = cute::conditional_t<kCode == 0, cutlass::bfloat16_t, float>;

template <int kA, int kB, int kD, int kMode>
struct Config {
  using ElementA = In<kA>;
  using ElementB = In<kB>;
  using ElementD = Out<kD>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  // a: one scale per row and 128-wide K slice. b: one per 128x128 tile (kRows, the kernels) or
  // per row and K slice (kWgrad, the output gradient). Both stored slice by slice (MN-major).
  static constexpr int kScaleN = kMode == kRows ? 128 : 1;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major: (N, K), K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // (M, N), N contiguous
  static constexpr int kAlignAB = 16;            // 16 bytes of FP8
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, TileShape, ClusterShape,
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
  const float** sfa;
  const float** sfb;
  typename C::LayoutSFA* layout_sfa;
  typename C::LayoutSFB* layout_sfb;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideD* stride_d;
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
    take(sfa, sizeof(*sfa));
    take(sfb, sizeof(*sfb));
    take(layout_sfa, sizeof(*layout_sfa));
    take(layout_sfb, sizeof(*layout_sfb));
    take(stride_a, sizeof(*stride_a));
    take(stride_b, sizeof(*stride_b));
    take(stride_d, sizeof(*stride_d));
    total = reinterpret_cast<int64_t*>(p + used);
    used += 256;
    return used <= bytes ? used : 0;
  }
};

template <class C>
__global__ void SetupKernel(Problem p, Arrays<C> arr) {
  // One block: thread 0 forms the offsets (G is at most a few thousand), then each thread fills
  // its groups' entries.
  const int64_t slices = p.k / kBlock;
  if (threadIdx.x == 0) {
    int64_t offset = 0;
    for (int g = 0; g < p.groups; ++g) {
      int64_t size = p.group_sizes[g];
      size = size < 0 ? 0 : size;
      int64_t extent = size;  // kRows: rows; kWgrad: columns, the size rounded up to 128
      if (p.mode == kWgrad) extent = (size + kBlock - 1) / kBlock * kBlock;
      const int64_t limit = p.mode == kRows ? p.m : p.k;
      extent = extent > limit - offset ? limit - offset : extent;
      // Stash the group's (clamped) extent and offset in its shape slot until the threads below
      // replace them.
      arr.shapes[g] = typename C::Shape(static_cast<int>(extent), static_cast<int>(offset), 0);
      offset += extent;
    }
    *arr.total = offset;
  }
  __syncthreads();
  using EA = typename C::ElementA;
  using EB = typename C::ElementB;
  using ED = typename C::ElementD;
  for (int g = threadIdx.x; g < p.groups; g += blockDim.x) {
    const auto stash = arr.shapes[g];
    const int64_t extent = cute::get<0>(stash), offset = cute::get<1>(stash);
    typename C::StrideA sa{};
    typename C::StrideB sb{};
    typename C::StrideD sd{};
    int m, n, k;
    if (p.mode == kRows) {
      m = static_cast<int>(extent);
      n = static_cast<int>(p.n);
      k = static_cast<int>(p.k);
      arr.a[g] = static_cast<const EA*>(p.a) + offset * p.k;
      arr.b[g] = static_cast<const EB*>(p.b) + g * p.n * p.k;
      arr.d[g] = static_cast<ED*>(p.d) + offset * p.n;
      arr.sfa[g] = p.sfa + offset * slices;
      arr.sfb[g] = p.sfb + g * (p.n / kBlock) * slices;
    } else {
      // A group without columns has no tiles (M = 0); ZeroEmptyKernel writes its zero gradient.
      m = extent > 0 ? static_cast<int>(p.m) : 0;
      n = static_cast<int>(p.n);
      k = extent > 0 ? static_cast<int>(extent) : static_cast<int>(kBlock);
      arr.a[g] = static_cast<const EA*>(p.a) + offset;
      arr.b[g] = static_cast<const EB*>(p.b) + offset;
      arr.d[g] = static_cast<ED*>(p.d) + g * p.m * p.n;
      arr.sfa[g] = p.sfa + offset / kBlock * p.m;
      arr.sfb[g] = p.sfb + offset / kBlock * p.n;
    }
    arr.shapes[g] = typename C::Shape(m, n, k);
    cute::get<0>(sa) = p.k;
    cute::get<0>(sb) = p.k;
    cute::get<0>(sd) = p.n;
    arr.stride_a[g] = sa;
    arr.stride_b[g] = sb;
    arr.stride_d[g] = sd;
    arr.layout_sfa[g] = C::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    arr.layout_sfb[g] = C::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  }
}

// Zeroes the output rows past the groups (kRows), 16 bytes per store.
template <class C>
__global__ void ZeroTailKernel(uint4* out, const int64_t* total, int64_t rows,
                                      int64_t row_vecs) {
  const int64_t begin = *total * row_vecs, end = rows * row_vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// Zeroes d[g] of the groups without columns (kWgrad: empty, or clamped away), 16 bytes per
// store; blockIdx.y is the group. Runs after SetupKernel, whose shapes have M = 0 for them.
template <class C>
__global__ void ZeroEmptyKernel(uint4* out, const typename C::Shape* shapes, int64_t group_vecs) {
  if (cute::get<0>(shapes[blockIdx.y]) > 0) return;
  uint4* d = out + blockIdx.y * group_vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < group_vecs;
       i += step) {
    d[i] = make_uint4(0, 0, 0, 0);
  }
}

template <int kA, int kB, int kD, int kMode>
std::string Run(const Problem& p, cudaStream_t stream) {
  using C = Config<kA, kB, kD, kMode>;
  using Gemm = typename C::Gemm;
  if (p.groups <= 0) return "";
  if (p.mode != kMode) return "the instantiation's mode differs from the problem's";
  Arrays<C> arr;
  const size_t used = arr.carve(p.workspace, p.workspace_bytes, p.groups);
  if (used == 0) return "the workspace is too small for the per-group arguments";
  SetupKernel<C><<<1, 256, 0, stream>>>(p, arr);
  const int blocks = std::max(1, p.sm_count) * 4;
  if (kMode == kRows) {
    const int64_t row_vecs = p.n * static_cast<int64_t>(sizeof(typename C::ElementD)) / 16;
    ZeroTailKernel<C><<<blocks, 256, 0, stream>>>(static_cast<uint4*>(p.d), arr.total, p.m,
                                                row_vecs);
  } else {
    const int64_t group_vecs = p.m * p.n * static_cast<int64_t>(sizeof(typename C::ElementD)) / 16;
    const dim3 grid(static_cast<unsigned>(std::max(1, p.sm_count)), static_cast<unsigned>(p.groups));
    ZeroEmptyKernel<C><<<grid, 256, 0, stream>>>(static_cast<uint4*>(p.d), arr.shapes,
                                                  group_vecs);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("setup kernel: ") + cudaGetErrorString(err);

  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device;
  hw.sm_count = p.sm_count;
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {p.groups, arr.shapes, nullptr},
      {arr.a, arr.stride_a, arr.b, arr.stride_b, arr.sfa, arr.layout_sfa, arr.sfb,
       arr.layout_sfb},
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

}  // namespace te_adapters::grouped_block
