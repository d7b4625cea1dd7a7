// CPU XLA FFI handlers: per-tensor FP8 cast (row-wise and/or transposed copy, optional amax) and
// amax. Bit-identical to the pure-JAX path on XLA:CPU, which flushes float32 denormals to zero.
// The cast's scale has one element, or one per batch index of the input viewed as
// (batch, rows, cols) (one scale per expert of a grouped GEMM); its amax likewise.

#include <algorithm>
#include <cstdint>

#include "fp8_convert.h"
#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace te_adapters {
namespace {

// XLA:CPU runs with denormals flushed (inputs and results), so the reference does too.
inline float flush_denormal(float v) {
  const uint32_t u = float_bits(v);
  return (u & 0x7f800000u) == 0 ? bits_float(u & 0x80000000u) : v;
}

template <InType kIn>
inline float load(const void* base, int64_t i) {
  if constexpr (kIn == InType::kF32) {
    return flush_denormal(static_cast<const float*>(base)[i]);
  } else if constexpr (kIn == InType::kBF16) {
    return flush_denormal(bf16_to_float(static_cast<const uint16_t*>(base)[i]));
  } else {
    return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// |v| into a running max, NaN counted as +inf like the pure-JAX amax (non-negative floats
// order like their bit patterns).
inline void amax_update(uint32_t& acc, float v) {
  const uint32_t a = std::min(float_bits(v) & 0x7fffffffu, 0x7f800000u);
  acc = std::max(acc, a);
}

struct Plan {
  int64_t batch, rows, cols;  // the input viewed as (batch, rows, cols); cols is the last dim
};

ffi::Error make_plan(ffi::AnyBuffer::Dimensions dims, Plan* p) {
  if (dims.size() == 0) return ffi::Error::InvalidArgument("input must have rank >= 1");
  *p = Plan{1, 1, dims.back()};
  if (dims.size() >= 2) p->rows = dims[dims.size() - 2];
  for (size_t i = 0; i + 2 < dims.size(); ++i) p->batch *= dims[i];
  return ffi::Error::Success();
}

ffi::Error in_type(ffi::DataType t, InType* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = InType::kF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *out = InType::kBF16;
      return ffi::Error::Success();
    case ffi::DataType::F16:
      *out = InType::kF16;
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("input dtype must be float32, bfloat16 or float16");
  }
}

ffi::Error out_type(ffi::DataType t, OutType* out) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
      *out = OutType::kE4M3;
      return ffi::Error::Success();
    case ffi::DataType::F8E5M2:
      *out = OutType::kE5M2;
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("output dtype must be float8_e4m3fn or float8_e5m2");
  }
}

// `scale_stride` / `amax_stride`: 1 for one scale (amax) per batch index, 0 for one in all.
template <InType kIn>
void cast_kernel(const void* x, const Plan& p, const float* scales, int64_t scale_stride,
                 OutType ot, uint8_t* q, uint8_t* qt, uint32_t* amax_bits, int64_t amax_stride) {
  const float limit = fp8_limit(ot);
  uint32_t acc = 0;
  constexpr int64_t kTile = 32;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t off = b * p.rows * p.cols;
    const float scale = flush_denormal(scales[b * scale_stride]);
    if (amax_stride != 0) acc = 0;
    // Tiles keep the transposed writes within a few cache lines.
    for (int64_t r0 = 0; r0 < p.rows; r0 += kTile) {
      const int64_t r1 = std::min(p.rows, r0 + kTile);
      for (int64_t c0 = 0; c0 < p.cols; c0 += kTile) {
        const int64_t c1 = std::min(p.cols, c0 + kTile);
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            const float v = load<kIn>(x, off + r * p.cols + c);
            if (amax_bits) amax_update(acc, v);
            const uint8_t code = float_to_fp8(flush_denormal(scale_and_clip(v, scale, limit)), ot);
            if (q) q[off + r * p.cols + c] = code;
            if (qt) qt[off + c * p.rows + r] = code;
          }
        }
      }
    }
    if (amax_bits && amax_stride != 0) amax_bits[b] = acc;
  }
  if (amax_bits && amax_stride == 0) *amax_bits = acc;
}

ffi::Error CastTransposeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, bool rowwise, bool colwise,
                             bool compute_amax) {
  Plan plan;
  InType it;
  OutType ot;
  if (auto e = make_plan(x.dimensions(), &plan); e.failure()) return e;
  if (auto e = in_type(x.element_type(), &it); e.failure()) return e;
  if (auto e = out_type(rowwise ? q->element_type() : qt->element_type(), &ot); e.failure()) {
    return e;
  }
  const int64_t n_scale = static_cast<int64_t>(scale.element_count());
  if (n_scale != 1 && n_scale != plan.batch) {
    return ffi::Error::InvalidArgument("scale must have 1 element or one per batch index");
  }
  const size_t n = x.element_count();
  if (rowwise && q->element_count() != n) return ffi::Error::InvalidArgument("bad q size");
  if (colwise && qt->element_count() != n) return ffi::Error::InvalidArgument("bad q_t size");
  if (colwise && x.dimensions().size() < 2) {
    return ffi::Error::InvalidArgument("the transposed copy needs rank >= 2");
  }
  const int64_t n_amax = compute_amax ? static_cast<int64_t>(amax->element_count()) : 1;
  if (n_amax != 1 && n_amax != plan.batch) {
    return ffi::Error::InvalidArgument("amax must have 1 element or one per batch index");
  }
  const int64_t scale_stride = n_scale == 1 ? 0 : 1, amax_stride = n_amax == 1 ? 0 : 1;
  uint8_t* qp = rowwise ? static_cast<uint8_t*>(q->untyped_data()) : nullptr;
  uint8_t* qtp = colwise ? static_cast<uint8_t*>(qt->untyped_data()) : nullptr;
  uint32_t* ap = compute_amax ? reinterpret_cast<uint32_t*>(amax->typed_data()) : nullptr;
  const float* sp = scale.typed_data();
  switch (it) {
    case InType::kF32:
      cast_kernel<InType::kF32>(x.untyped_data(), plan, sp, scale_stride, ot, qp, qtp, ap,
                                amax_stride);
      break;
    case InType::kBF16:
      cast_kernel<InType::kBF16>(x.untyped_data(), plan, sp, scale_stride, ot, qp, qtp, ap,
                                 amax_stride);
      break;
    case InType::kF16:
      cast_kernel<InType::kF16>(x.untyped_data(), plan, sp, scale_stride, ot, qp, qtp, ap,
                                amax_stride);
      break;
  }
  return ffi::Error::Success();
}

template <InType kIn>
uint32_t amax_kernel(const void* x, int64_t n) {
  uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) amax_update(acc, load<kIn>(x, i));
  return acc;
}

ffi::Error AmaxImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  InType it;
  if (auto e = in_type(x.element_type(), &it); e.failure()) return e;
  if (amax->element_count() != 1) return ffi::Error::InvalidArgument("amax must have 1 element");
  const int64_t n = static_cast<int64_t>(x.element_count());
  uint32_t bits = 0;
  switch (it) {
    case InType::kF32:
      bits = amax_kernel<InType::kF32>(x.untyped_data(), n);
      break;
    case InType::kBF16:
      bits = amax_kernel<InType::kBF16>(x.untyped_data(), n);
      break;
    case InType::kF16:
      bits = amax_kernel<InType::kF16>(x.untyped_data(), n);
      break;
  }
  *reinterpret_cast<uint32_t*>(amax->typed_data()) = bits;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeCpu, CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise")
                                  .Attr<bool>("compute_amax"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmaxCpu, AmaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());

}  // namespace te_adapters

NB_MODULE(_csrc_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["te_adapters_cast_transpose"] =
        nb::capsule(reinterpret_cast<void*>(te_adapters::CastTransposeCpu));
    d["te_adapters_amax"] = nb::capsule(reinterpret_cast<void*>(te_adapters::AmaxCpu));
    return d;
  });
}
