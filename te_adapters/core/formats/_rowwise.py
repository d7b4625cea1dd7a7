"""Rowwise FP8 scaling (``Float8RowwiseScaling``): one scale per row along the contracting dim.

An operand arrives contracting-last, ``(..., P, C)``. Its ``rows`` copy has one float32 scale per
row (the amax over ``C``), for the GEMM it arrives for; its ``cols`` copy is the swapped operand
``(..., C, P)`` with one scale per row ``C`` (the amax over ``P``), recomputed from the
high-precision operand for its backward GEMM (x's and the gradient's for wgrad, the kernel's for
dgrad). A row's scale is a power of two, as torchao's rowwise recipes round theirs: the largest
``2**e`` with ``row_amax * 2**e <= fp8_max / 2**margin``, 1 where the row's amax is zero, a
float32 subnormal or not finite; ``data = cast(clip(x * scale, ±fp8_max))``. The exponent comes
from the amax's float32 bits by integer arithmetic and the scale and its inverse are built from
their bits, so both are exact and the same on every backend (XLA:GPU's float32 division is not
correctly rounded), and ``x * scale`` rounds only in the cast: the quantization is bit for bit
the same on CPU and GPU (float32 subnormal inputs aside, which XLA:CPU flushes to zero). The
``ScaledTensor`` keeps ``scale_inv = 1 / scale`` of shape ``(..., P, 1)`` (scaling mode
``"rowwise"``), so ``data * scale_inv`` broadcasts to the values.

On a GPU with the extension built, an operand's two copies take two passes over it: one reads
it for the amaxes of its rows and of its columns, one casts it into both orientations with those
scales (``quantize_both``; the pure-JAX path's codes and scales bit for bit, where XLA's fusions
read the operand once per amax and once per copy).

The GEMM ``(..., M, K) x (..., N, K)`` is an FP8 GEMM of the data (on Hopper the extension's
cuBLASLt FP8 GEMM with unit scales, where it runs; elsewhere, or with
``GemmConfig(fp8_gemm="xla")``, XLA's FP8 ``dot_general``) whose output, bfloat16 for a bfloat16
result and float32 otherwise, is multiplied by the outer product of the two scale-inverse vectors
(``(..., M, 1) * (..., 1, N)``) in float32 and cast to the output dtype. The factors are powers of
two, so a bfloat16 sum times them is the float32 sum times them rounded once to bfloat16 (for
results in bfloat16's normal range), and the pass fuses into the output's consumers: seed 000's
Dense step ran 1.60-1.62x bf16 on an H100, 5-7% behind current scaling (``bench/RESULTS.md``,
2026-11-27, fourth session). cuBLASLt's outer-vector scale mode, which applies the two vectors in
the GEMM's epilogue, was measured and not kept: that step took 28.0 ms with it against 25.9 ms
with XLA's FP8 dot and a float32 pass in the same run (third session).

With ``weight_grad_high_precision`` (torchao's ``rowwise_with_gw_hp``) the ``cols`` copies of x
and of the gradient, which only the weight-gradient GEMM reads, are the swapped high-precision
operands wrapped as ``ScaledTensor``s of scaling mode ``"high_precision"`` (``data`` in the
operand's dtype, ``scale_inv`` 1): the format's GEMM sees that mode and runs the wgrad GEMM as a
high-precision ``dot_general`` with float32 sums. The kernel's copies, and the gradient's copy for
dgrad, stay rowwise FP8. (torchao casts the kernel for dgrad per tensor in that recipe; here it
keeps one scale per input channel.)

Inside ``shard_map`` each device scales the rows of the shard it holds: a row whose contracting
dimension is split over devices gets one scale per part, as block formats' blocks do. The GEMM
applies them before the partial products are summed over devices, so the products are those of
the quantized values; the quantization differs from one device's only by those finer scales.
``amax_axes`` (one reduction per operand) cannot say which axes split which copy's rows, and is
refused. Under ``jit`` a row's amax is that of the whole row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import kernels
from te_adapters.core.formats import _block, _cast_transpose, _scaling
from te_adapters.core.formats._format import QuantizationFormat, Quantized, QuantizeRequest
from te_adapters.core.formats._scaled_tensor import ScaledTensor, non_finite_scale_inv
from te_adapters.core.formats._tensor_format import (
  _cublas_refusal,
  _cublas_tn_dot,
  _gemm_precision,
)
from te_adapters.core.recipes import Float8RowwiseScaling
from te_adapters.core.state import EmptyState

__all__ = [
  "FORMAT",
  "HIGH_PRECISION",
  "ROWWISE",
  "power_of_two_scale",
  "quantize_both",
  "quantize_rows",
  "row_amax",
]

ROWWISE = "rowwise"
HIGH_PRECISION = "high_precision"


def row_amax(x) -> jax.Array:
  """float32 ``max(|x|)`` over the last axis, shaped ``(..., P, 1)``; inf for a row with a NaN."""
  magnitudes = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
  return jnp.max(magnitudes, axis=-1, keepdims=True, initial=0.0).astype(jnp.float32)


# float32's exponent bias and the field's place; a scale's exponent stays within [-126, 126], so
# both 2**e and 2**-e are normal floats.
_BIAS, _MANT_BITS, _E_MAX = 127, 23, 126


def _pow2(e) -> jax.Array:
  """``2.0**e`` (float32) for int32 ``e`` in [-126, 127], from its bits: exact everywhere."""
  return lax.bitcast_convert_type((e + _BIAS) << _MANT_BITS, jnp.float32)


def power_of_two_scale(amax, limit: float) -> tuple[jax.Array, jax.Array]:
  """``(scale, scale_inv)``, float32 like ``amax``: the largest power of two ``scale`` with
  ``amax * scale <= limit`` (its exponent clamped to [-126, 126]) and ``1 / scale``; both 1
  where ``amax`` is not finite or below float32's smallest normal number (zero, or a subnormal
  that XLA:CPU flushes to zero and a GPU does not).

  Integer arithmetic on the float32 bits: with ``amax = 1.f_a * 2**E_a`` and ``limit = 1.f_l *
  2**E_l``, ``e = E_l - E_a``, less one where ``f_a > f_l``. No division, so no backend's
  rounding of one (XLA:GPU's float32 division is not correctly rounded) enters the scale.
  """
  amax = jnp.asarray(amax, jnp.float32)
  lim_bits = int(np.float32(limit).view(np.int32))
  mant = (1 << _MANT_BITS) - 1
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  exponent = bits >> _MANT_BITS  # amax >= 0: no sign bit
  e = (lim_bits >> _MANT_BITS) - exponent - ((bits & mant) > (lim_bits & mant)).astype(jnp.int32)
  e = jnp.clip(e, -_E_MAX, _E_MAX)
  ok = (amax >= np.finfo(np.float32).tiny) & jnp.isfinite(amax)
  one = jnp.float32(1.0)
  return jnp.where(ok, _pow2(e), one), jnp.where(ok, _pow2(-e), one)


def quantize_rows(x, q_dtype, margin: float = 0.0, non_finite: str = "propagate") -> ScaledTensor:
  """``x (..., P, C)`` in ``q_dtype`` with one power-of-two scale per row (from the amax over
  ``C``); a row holding a NaN or an infinity gets a NaN inverse scale unless
  ``non_finite="saturate"`` (``GemmConfig.non_finite``)."""
  dq = np.dtype(x.dtype)
  if dq.itemsize < 4:
    # Keep a narrow input's rounding (see _tensor_format: XLA may fuse the convert that made x).
    x = _block.keep_narrow(x)
  a = row_amax(x)
  return _scaled(_cast_rows(x, a, q_dtype, margin), a, q_dtype, margin, non_finite, dq)


def _cast_rows(x, a, q_dtype, margin):
  """``cast(clip(x * scale, ±fp8_max))`` with each row's scale from its amax ``a (..., P, 1)``."""
  limit = _scaling.fp8_max(q_dtype)
  scale, _ = power_of_two_scale(a, limit / 2.0**margin)
  return jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(q_dtype)


def _scaled(data, a, q_dtype, margin, non_finite, dq) -> ScaledTensor:
  """The ``ScaledTensor`` of rows ``data`` cast with the scales of their amaxes ``a``."""
  _, sinv = power_of_two_scale(a, _scaling.fp8_max(q_dtype) / 2.0**margin)
  sinv = non_finite_scale_inv(sinv, a, non_finite)
  amax = jnp.max(a, initial=0.0).reshape(1)
  return ScaledTensor(data, sinv, amax, scaling_mode=ROWWISE, dq_dtype=dq)


def _kernels_apply(x, backend) -> bool:
  """Whether the extension's CUDA passes may quantize ``x``: ``backend`` (``GemmConfig.backend``)
  lets them and they are built and registered (in a sharded program they run per shard, through
  their partitioning rules)."""
  return (
    x.ndim >= 2
    and x.size > 0
    and np.dtype(x.dtype) in _cast_transpose.FFI_INPUT_DTYPES
    and _cast_transpose.backend(requested=backend) == "ffi"
    and kernels.registered(kernels.ROWWISE_CAST_TARGET)
    and kernels.registered(kernels.ROW_COL_AMAX_TARGET)
  )


def quantize_both(x, q_dtype, margin: float, non_finite: str, rows: bool, cols: bool, backend=None):
  """``(quantize_rows(x) if rows, quantize_rows(swapaxes(x, -1, -2)) if cols)``.

  On a GPU with the extension built, two passes over ``x``: one that reads it for the amaxes of
  its rows and of its columns, and one that casts it into both orientations, each row of a copy
  with its own scale (``csrc/cast_transpose_cuda.cu``); XLA's fusions would read ``x`` once for
  each amax and once for each copy. The scales come from the same ``power_of_two_scale`` and the
  cast is the same ``cast(clip(x * scale))``, so the codes and scales are those of the pure-JAX
  path bit for bit; a program compiled for another platform takes that path.
  """
  if not (rows or cols):
    return None, None
  dq = np.dtype(x.dtype)
  if not _kernels_apply(x, backend):
    swapped = jnp.swapaxes(x, -1, -2) if cols else None
    return (
      quantize_rows(x, q_dtype, margin, non_finite) if rows else None,
      quantize_rows(swapped, q_dtype, margin, non_finite) if cols else None,
    )
  limit = _scaling.fp8_max(q_dtype) / 2.0**margin

  def on_cuda(x):
    a_rows, a_cols = kernels.row_col_amax_call(x, rows=rows, cols=cols)
    scale_rows = power_of_two_scale(a_rows, limit)[0] if rows else a_rows
    scale_cols = power_of_two_scale(a_cols, limit)[0] if cols else a_cols
    q, q_t = kernels.rowwise_cast_call(
      x, scale_rows, scale_cols, q_dtype, rowwise=rows, colwise=cols
    )
    return (q, a_rows[..., None], q_t, a_cols[..., None])

  def elsewhere(x):
    narrow = _block.keep_narrow(x) if dq.itemsize < 4 else x
    outs = [jnp.zeros((0,), q_dtype), jnp.zeros((0, 1), jnp.float32)] * 2
    if rows:
      a = row_amax(narrow)
      outs[0:2] = [_cast_rows(narrow, a, q_dtype, margin), a]
    if cols:
      swapped = jnp.swapaxes(narrow, -1, -2)
      a = row_amax(swapped)
      outs[2:4] = [_cast_rows(swapped, a, q_dtype, margin), a]
    return tuple(outs)

  q, a_rows, q_t, a_cols = lax.platform_dependent(x, cuda=on_cuda, default=elsewhere)
  return (
    _scaled(q, a_rows, q_dtype, margin, non_finite, dq) if rows else None,
    _scaled(q_t, a_cols, q_dtype, margin, non_finite, dq) if cols else None,
  )


def _high_precision(x) -> ScaledTensor:
  """``x`` unquantized, as the weight-gradient GEMM's operand under
  ``weight_grad_high_precision``."""
  return ScaledTensor(
    x, jnp.ones((1,), jnp.float32), None, scaling_mode=HIGH_PRECISION, dq_dtype=np.dtype(x.dtype)
  )


def _q_dtype(recipe, role):
  return recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype


def _check_plan(recipe, role, plan):
  axes = plan.role_amax_axes(role)
  if axes:
    raise ValueError(
      f"{type(recipe).__name__}: amax_axes={axes!r} for {role!r} is not supported; rowwise "
      "scales are per row of the shard each device holds (leave amax_axes=None)"
    )


def _quantize(req: QuantizeRequest) -> Quantized:
  x, role, recipe = req.x, req.role, req.recipe
  if req.producer is not None:
    # The fused norm and MLP paths: the operand's float32 values, whose formula XLA fuses into
    # the row amaxes and the casts.
    if req.producer.value is None:
      raise NotImplementedError(
        f"{type(recipe).__name__}: rowwise scales need the operand's values; this producer "
        "gives only a per-tensor cast"
      )
    x = req.producer.value()
  _check_plan(recipe, role, req.plan)
  q_dtype = _q_dtype(recipe, role)
  # x's and the gradient's cols feed only wgrad, which may take them unquantized.
  high_precision_cols = req.cols and recipe.weight_grad_high_precision and role != "kernel"
  # The fused paths' values are a formula XLA fuses into the amaxes and casts: no kernel there.
  backend = req.config.backend if req.producer is None else "jax"
  rows, cols = quantize_both(
    x,
    q_dtype,
    recipe.margin,
    req.config.non_finite,
    req.rows,
    req.cols and not high_precision_cols,
    backend,
  )
  if high_precision_cols:
    cols = _high_precision(jnp.swapaxes(x, -1, -2))
  return Quantized(rows, cols, None)


def _gemm(a, b, out_dtype, which, recipe, config, precision=None, out_sharding=None):
  """``(a * sinv_a) . (b * sinv_b)^T``: ``(..., M, K) x (..., N, K) -> (..., M, N)``.

  ``precision``: the recipe's ``MMParams`` for this GEMM decide as for the per-tensor formats
  (a split accumulator: ``HIGHEST``); the high-precision wgrad follows ``fp8_gemm_wgrad`` too.
  """
  precision = _gemm_precision(precision, which, recipe)
  lead = a.data.shape[:-2]
  if lead and all(d == 1 for d in lead) and out_sharding is None:
    # The rule's (1, M, K) layout of a 2-D GEMM: a plain 2-D dot for XLA's FP8 rewrite.
    squeeze = lambda t: t.reshape(t.shape[-2:])  # noqa: E731
    a2 = ScaledTensor(squeeze(a.data), squeeze(a.scale_inv), a.amax, a.scaling_mode, a.dq_dtype)
    b2 = ScaledTensor(squeeze(b.data), squeeze(b.scale_inv), b.amax, b.scaling_mode, b.dq_dtype)
    out = _gemm(a2, b2, out_dtype, which, recipe, config, precision)
    return out.reshape(*lead, *out.shape)
  batch = tuple(range(a.data.ndim - 2))
  dims = (((a.data.ndim - 1,), (b.data.ndim - 1,)), (batch, batch))
  if HIGH_PRECISION in (a.scaling_mode, b.scaling_mode):
    if not (a.scaling_mode == b.scaling_mode == HIGH_PRECISION and which == "wgrad"):
      raise ValueError(
        f"a {which} GEMM of {a.scaling_mode} and {b.scaling_mode} operands: only the wgrad "
        "GEMM takes high-precision operands"
      )
    dtype = jnp.promote_types(a.data.dtype, b.data.dtype)
    out = lax.dot_general(
      a.data.astype(dtype),
      b.data.astype(dtype),
      dims,
      precision=precision,
      preferred_element_type=jnp.float32,
      out_sharding=out_sharding,
    )
    return out.astype(out_dtype)
  # The GEMM's own output dtype: bfloat16 for a bfloat16 output, float32 otherwise. The factors
  # are powers of two, so a bfloat16 sum times them is the float32 sum times them rounded once
  # (bfloat16 has float32's exponent range; float16's would overflow on the unscaled sums).
  gemm_dtype = jnp.bfloat16 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else jnp.float32
  out = None
  if config is None or config.fp8_gemm != "xla":
    # On Hopper, the extension's cuBLASLt FP8 GEMM with unit scales (float32 sums over
    # devices); XLA's FP8 dot where it cannot run (or with fp8_gemm="xla").
    refusal = _cublas_refusal(a.data, b.data, gemm_dtype, out_sharding)
    if refusal is None:
      one = jnp.ones((1,), jnp.float32)
      out = _cublas_tn_dot(
        a.data, b.data, one, one, gemm_dtype, precision, jnp.float32, out_sharding=out_sharding
      )
    elif config is not None and config.fp8_gemm == "native":
      raise RuntimeError(f"fp8_gemm='native', but {refusal}")
  if out is None:
    out = lax.dot_general(
      a.data,
      b.data,
      dims,
      precision=precision,
      preferred_element_type=gemm_dtype,
      out_sharding=out_sharding,
    )
    # Keep the GEMM's rounding, which XLA would drop in some fusions (as _tensor_format's).
    out = _block.keep_narrow(out) if gemm_dtype != jnp.float32 else out
  # (..., M, 1) * (..., 1, N): each output element times its row's and its column's factor, a
  # pass that XLA fuses into the output's consumers.
  scales = a.scale_inv * jnp.swapaxes(b.scale_inv, -1, -2)
  return (out.astype(jnp.float32) * scales).astype(out_dtype)


def _dequantize(t, dtype):
  if t.scaling_mode == HIGH_PRECISION:
    return t.data.astype(dtype)
  return (_block.keep_narrow(t.data).astype(jnp.float32) * t.scale_inv).astype(dtype)


def _check(recipe, layout, backward, lhs=None, rhs=None):
  # One scale per row: any shape. XLA pads an FP8 GEMM whose sizes are not multiples of 16 for
  # cuBLASLt, as for the per-tensor formats.
  del recipe, layout, backward, lhs, rhs


def _next_state(recipe, state, roles):
  del recipe, roles
  return state


FORMAT = QuantizationFormat(
  recipe_type=Float8RowwiseScaling,
  scaling_modes=(ROWWISE, HIGH_PRECISION),
  init_state=lambda recipe: EmptyState(),
  state_shapes=lambda recipe: {},
  quantize=_quantize,
  gemm=_gemm,
  next_state=_next_state,
  dequantize=_dequantize,
  check=_check,
  per_tensor=False,
  takes_producer=True,
)
