"""The grouped GEMM of rowwise FP8 scaling (``Float8RowwiseScaling`` on ``ragged_dot``).

Each GEMM quantizes both of its operands with one scale per row along the dimension it
contracts, as ``dot_general`` under the recipe does, and no scale crosses a group:

- forward ``y[i] = x[i] . W[g(i)]`` contracts K: one scale per row of x (its K values), one per
  output column of each expert's kernel (its K values);
- dgrad ``dx[i] = dy[i] . W[g(i)]^T`` contracts N: one scale per row of dy, one per input row of
  each expert's kernel (its N values);
- wgrad ``dW[g] = x_g^T . dy_g`` contracts the rows of group g: one scale per column of x and of
  dy **within each group** (the amax over the group's rows), so a group's scales never see
  another group's values. With ``weight_grad_high_precision`` this GEMM takes x and dy
  unquantized.

Each GEMM is ``jax.lax.ragged_dot_general`` on the FP8 data with float32 sums, whose output is
multiplied by the product of the two operands' factors (a row's and a column's, or for wgrad a
group's column's and a group's column's) in float32 and cast once: FP8 GEMMs, as the per-tensor
formats' grouped GEMM on XLA's route. Stateless; every factor is computed on the device from
``group_sizes``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core.formats import _scaling
from te_adapters.core.formats._format import GroupedFormat, GroupedRequest, Quantized
from te_adapters.core.formats._grouping import (
  PER_GROUP_WGRAD_DIMS,
  ROWS_TIMES_GROUP_KERNEL_DIMS,
  row_groups,
)
from te_adapters.core.formats._rowwise import (
  HIGH_PRECISION,
  ROWWISE,
  power_of_two_scale,
  quantize_rows,
)
from te_adapters.core.formats._scaled_tensor import ScaledTensor, non_finite_scale_inv
from te_adapters.core.formats._tensor_format import _gemm_precision

__all__ = ["GROUPED"]


def _check(recipe, k: int, n: int, backward: bool) -> None:
  del recipe, k, n, backward  # one scale per row: any sizes (XLA pads FP8 GEMMs for cuBLASLt)


def _route(lhs, rhs, recipe, out_dtypes):
  del lhs, rhs, recipe, out_dtypes  # one route: XLA's ragged dot on the FP8 data
  return None


def _in_groups(x, ids, num_groups):
  return jnp.where((ids < num_groups)[:, None], x, jnp.zeros((), x.dtype))


def _group_columns(x, ids, num_groups, q_dtype, margin, non_finite="propagate") -> ScaledTensor:
  """``x`` (M, F) with one scale per column within each group (the amax over the group's rows):
  FP8 data (M, F), ``scale_inv`` (G, F), NaN where that amax is not finite unless
  ``non_finite="saturate"``; rows past the groups are zeros."""
  magnitudes = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)).astype(jnp.float32)
  # max |x| over each group's rows, per column; rows past the groups fall in segment G.
  amax = jax.ops.segment_max(magnitudes, ids, num_segments=num_groups + 1)[:num_groups]
  amax = jnp.maximum(amax, 0.0)  # an empty group's -inf
  limit = _scaling.fp8_max(q_dtype)
  # dot_general's rule for a row's scale (a power of two), per group and column: (G, F).
  scale, sinv = power_of_two_scale(amax, limit / 2.0**margin)
  per_row = jnp.concatenate([scale, jnp.ones((1, x.shape[1]), jnp.float32)])[ids]
  data = jnp.clip(x.astype(jnp.float32) * per_row, -limit, limit).astype(q_dtype)
  data = _in_groups(data, ids, num_groups)
  sinv = non_finite_scale_inv(sinv, amax, non_finite)
  return ScaledTensor(
    data,
    sinv,
    jnp.max(amax, initial=0.0).reshape(1),
    scaling_mode=ROWWISE,
    dq_dtype=np.dtype(x.dtype),
  )


def _quantize(req: GroupedRequest) -> Quantized:
  """The kernels (G, K, N): ``rows`` (G, N, K) scaled per column along K, ``cols`` (G, K, N) per
  row along N. x and the gradient (M, F): ``rows`` (M, F) per row along F, ``cols`` (M, F) per
  column within each group (or unquantized with ``weight_grad_high_precision``)."""
  x, role, recipe = req.x, req.role, req.recipe
  q_dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  rows = cols = None
  non_finite = req.non_finite  # NaN inverse scales for a non-finite amax (GemmConfig)
  if role == "kernel":
    if req.rows:
      rows = quantize_rows(jnp.swapaxes(x, 1, 2), q_dtype, recipe.margin, non_finite)
    if req.cols:
      cols = quantize_rows(x, q_dtype, recipe.margin, non_finite)
    return Quantized(rows, cols, None)
  num_groups = req.group_sizes.shape[0]
  ids = row_groups(req.group_sizes, x.shape[0])
  if req.rows:
    rows = quantize_rows(_in_groups(x, ids, num_groups), q_dtype, recipe.margin, non_finite)
  if req.cols:
    if recipe.weight_grad_high_precision:
      cols = ScaledTensor(
        _in_groups(x, ids, num_groups),
        jnp.ones((1,), jnp.float32),
        None,
        scaling_mode=HIGH_PRECISION,
        dq_dtype=np.dtype(x.dtype),
      )
    else:
      cols = _group_columns(x, ids, num_groups, q_dtype, recipe.margin, non_finite)
  return Quantized(rows, cols, None)


def _ragged(a, b, group_sizes, dims, precision):
  return lax.ragged_dot_general(
    a, b, group_sizes, dims, precision=precision, preferred_element_type=jnp.float32
  )


def _gemm(a, b, group_sizes, out_dtype, which, recipe, precision=None, route=None):
  """The FP8 ragged dot of two rowwise copies, its float32 output times both operands'
  factors."""
  del route
  precision = _gemm_precision(precision, which, recipe)
  if which == "wgrad":
    if a.scaling_mode == HIGH_PRECISION:
      dtype = jnp.promote_types(a.data.dtype, b.data.dtype)
      out = _ragged(
        a.data.astype(dtype), b.data.astype(dtype), group_sizes, PER_GROUP_WGRAD_DIMS, precision
      )
      return out.astype(out_dtype)
    out = _ragged(a.data, b.data, group_sizes, PER_GROUP_WGRAD_DIMS, precision)  # (G, K, N)
    return (out * a.scale_inv[:, :, None] * b.scale_inv[:, None, :]).astype(out_dtype)
  # fwd: x rows (M, K) . kernels (G, N, K); dgrad: dy rows (M, N) . kernels (G, K, N).
  out = _ragged(a.data, b.data, group_sizes, ROWS_TIMES_GROUP_KERNEL_DIMS, precision)
  ids = row_groups(group_sizes, a.data.shape[0])
  columns = b.scale_inv[:, :, 0]  # (G, out features): each expert's factor per output column
  per_row = jnp.concatenate([columns, jnp.zeros((1, columns.shape[1]), jnp.float32)])[ids]
  return (out * a.scale_inv * per_row).astype(out_dtype)


def _stateless_next(recipe, state, roles):
  del recipe, roles
  return state


GROUPED = GroupedFormat(
  check=_check,
  route=_route,
  quantize=_quantize,
  gemm=_gemm,
  next_state=_stateless_next,
)
