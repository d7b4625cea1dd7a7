"""The grouped GEMM of a per-tensor format: its ``TensorScaling`` applied per group.

``grouped_format(scaling)`` is the ``GroupedFormat`` that ``_tensor_format.tensor_format`` gives
every per-tensor format. Each group is one GEMM of the scaling: the rows of group g (x, and the
output gradient) share one scale, expert g's kernel has its own, and slice g of the grouped state
is the state ``dot_general`` would keep for expert g. Everything is computed on the device from
``group_sizes`` (the row-to-group map, the per-group amaxes and scales), so nothing waits for
the host. The GEMMs are ``jax.lax.ragged_dot_general`` calls with FP8 operands, rescaled per row
(per group for the weight gradient) in float32; on a Hopper GPU with the extension's CUTLASS
grouped GEMM built (``route`` gives ``NATIVE``), the same FP8 operands and per-group scales run
on it, with the recipe's accumulation per GEMM.

Per-group scales against per-tensor ones, measured on CPU with ``bench/ragged_scales.py``
(current scaling, HYBRID, M=4096, K=N=256, G=8; normwise relative error against float64, per-group
vs per-tensor scales):

- N(0,1) data, random routing: fwd 0.0374 vs 0.0374, dgrad 0.0589 vs 0.0589, wgrad 0.0589 vs
  0.0589. The same, since every group has about the same amax.
- One expert's kernel scaled by 1e-3 or more: the same. By 1e-4: that expert's fwd 0.037 vs
  0.064 and dgrad 0.059 vs 0.079; by 1e-5: 0.037 vs 0.58 and 0.059 vs 0.58.
- x rows of group j scaled by gates spread from 1 down to 1e-3: the same; down to 1e-5: the
  smallest group's fwd 0.037 vs 0.52 and wgrad 0.059 vs 0.52. Output gradients scaled the same
  way stay equal (E5M2's range covers 1e-5).
- Delayed scaling (history 16) over 12 steps with skewed routing (the rarest expert gets 1% of
  the tokens): that expert's fwd 0.0375 vs 0.0374, dgrad 0.0593 vs 0.0590. A per-group history
  does not hurt small groups.

So per-group scales match per-tensor ones on ordinary data and keep a group whose values are
1e4 or more below the others' from falling into FP8's subnormals. They cost no extra pass over
memory (a segment-max over the row amaxes, and a per-row factor on the GEMM output where a
per-tensor scale needs a scalar one), and under expert parallelism a per-expert amax needs no
collective across expert shards. The state of ``DelayedScaling`` therefore holds one scale and one
amax history per group: ``{role}_scale`` (G, 1) and ``{role}_amax_history`` (G, L).
(``GroupedRequest.granularity="tensor"`` gives the per-tensor alternative, for measurements.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import kernels
from te_adapters.core.formats import _cast_transpose, _scaling
from te_adapters.core.formats._format import GroupedFormat, GroupedRequest, Quantized
from te_adapters.core.formats._grouping import (
  PER_GROUP_WGRAD_DIMS,
  ROWS_TIMES_GROUP_KERNEL_DIMS,
  row_groups,
)
from te_adapters.core.formats._scaled_tensor import ScaledTensor, non_finite_scale_inv
from te_adapters.core.formats._tensor_scaling import TensorScaling

__all__ = ["NATIVE", "XLA", "grouped_format"]

# The routes: the extension's CUTLASS grouped GEMM (Hopper), or XLA's ragged dot.
NATIVE, XLA = "native", "xla"

# Row i of lhs (or of the output gradient) times kernel group(i), the kernels as stored (G, K, N).
_FWD_DIMS = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (1,)), ((), ())),
  lhs_ragged_dimensions=(0,),
  rhs_group_dimensions=(0,),
)

# cuBLAS FP8 GEMMs need the contracting and output feature sizes to be multiples of 16.
_FP8_ALIGNMENT = 16


def _check(recipe, k: int, n: int, backward: bool) -> None:
  del recipe, backward  # every GEMM's sizes are K and N
  bad = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % _FP8_ALIGNMENT]
  if bad:
    raise ValueError(
      f"FP8 grouped GEMMs need K and N to be multiples of {_FP8_ALIGNMENT}; got "
      f"{', '.join(bad)}. Pad the features, or pass recipe=None for a high-precision GEMM."
    )


def _route(lhs, rhs, recipe, out_dtypes) -> str:
  """``NATIVE`` on Hopper with the extension's CUTLASS grouped GEMM built, else ``XLA``."""
  return NATIVE if kernels.refusal(lhs, rhs, recipe, out_dtypes) is None else XLA


def _tensor(data, scale_inv, dq_dtype) -> ScaledTensor:
  """A grouped per-tensor copy: FP8 ``data`` and one inverse scale per group, (G,)."""
  return ScaledTensor(data, scale_inv, None, scaling_mode="tensor", dq_dtype=dq_dtype)


def _per_row(values: jax.Array, ids: jax.Array, fill: float) -> jax.Array:
  """``values[ids]`` for per-group ``values`` [G]; ``fill`` for rows past the groups."""
  return jnp.concatenate([values, jnp.full((1,), fill, values.dtype)])[ids]


def _group_amax(x: jax.Array, ids: jax.Array, num_groups: int) -> jax.Array:
  """max |x| over each group's rows, float32 [G]: 0 for an empty group, NaN if a row has NaN."""
  row_amax = jnp.max(jnp.abs(x), axis=1).astype(jnp.float32)
  row_nan = jnp.any(jnp.isnan(x), axis=1)
  # A masked [M, G] reduction rather than a scatter: M rows would contend for G slots.
  member = ids[:, None] == jnp.arange(num_groups, dtype=ids.dtype)[None, :]
  amax = jnp.max(jnp.where(member, row_amax[:, None], 0.0), axis=0)
  has_nan = jnp.any(member & row_nan[:, None], axis=0)
  return jnp.where(has_nan, jnp.float32(jnp.nan), amax)


def _to_tensor_amax(amax: jax.Array) -> jax.Array:
  # One amax for all groups (the per-tensor alternative, kept for measurements).
  total = jnp.where(jnp.any(jnp.isnan(amax)), jnp.float32(jnp.nan), jnp.max(amax))
  return jnp.broadcast_to(total, amax.shape)


def _role_scales(scaling: TensorScaling, amax, role, q_dtype, recipe, state):
  """Per-group scales [G] for one role; returns (scale, the role's new state or None).

  Each group is one GEMM of the scaling, its state slice g.
  """
  next_scale = functools.partial(
    scaling.next_scale, recipe, role=role, fp8_max=_scaling.fp8_max(q_dtype)
  )
  scale, new = jax.vmap(lambda a, s: next_scale(a, s))(amax[:, None], state)
  return scale[:, 0], new


def _quantize_rows(
  scaling, x, ids, num_groups, role, q_dtype, recipe, state, granularity, non_finite="propagate"
):
  """Quantizes [M, F] rows with their group's scale; rows past the groups become 0. A group
  whose amax is not finite gets a NaN inverse scale unless ``non_finite="saturate"``."""
  amax = _group_amax(x, ids, num_groups)
  if granularity == "tensor":
    amax = _to_tensor_amax(amax)
  scale, new = _role_scales(scaling, amax, role, q_dtype, recipe, state)
  limit = _scaling.fp8_max(q_dtype)
  scaled = x.astype(jnp.float32) * _per_row(scale, ids, 1.0)[:, None]
  data = jnp.clip(scaled, -limit, limit).astype(q_dtype)
  data = jnp.where((ids < num_groups)[:, None], data, jnp.zeros((), q_dtype))
  return data, non_finite_scale_inv(_scaling.scale_inverse(scale), amax, non_finite), new


def _quantize_experts(
  scaling, w, role, q_dtype, recipe, state, granularity, native, non_finite="propagate"
):
  """Quantizes the kernels [G, K, N], each with its expert's scale.

  Returns ``(data, data_t, 1/scale [G], the role's new state)``. ``native`` (the native grouped
  GEMM runs): ``data_t`` is the (G, N, K) copy its forward GEMM reads, written by the same pass
  as ``data`` (the extension's per-expert cast on the GPU), and with delayed scaling that pass
  also takes the amax that rolls into the history; otherwise ``data_t`` is None.
  """
  stored = scaling.stored_scale(state, role) if state else None
  # Delayed scaling on the native path casts with the stored scales and takes the amax (an
  # expert's amax is inf where it holds a NaN or inf, as the per-tensor amax) in the same pass.
  one_pass = native and stored is not None
  if native and stored is not None:  # one_pass, spelled out for the type checker
    data, data_t, amax = _cast_transpose.cast_transpose_per_batch(
      w, stored.reshape(w.shape[0]), q_dtype, with_amax=True
    )
  else:
    amax = _scaling.leading_amax(w)
  if granularity == "tensor":
    amax = _to_tensor_amax(amax)
  scale, new = _role_scales(scaling, amax, role, q_dtype, recipe, state)
  if not one_pass:
    # Off the native path the pure-JAX cast, whose transposed copy XLA drops unused.
    data, data_t, _ = _cast_transpose.cast_transpose_per_batch(
      w, scale, q_dtype, backend=None if native else "jax"
    )
  sinv = non_finite_scale_inv(_scaling.scale_inverse(scale), amax, non_finite)
  return data, (data_t if native else None), sinv, new


def _quantize(scaling: TensorScaling, req: GroupedRequest) -> Quantized:
  """x and the gradient: one copy (M, F), rows scaled by their group's scale, for both of their
  GEMMs. The kernels: (G, K, N) for dgrad (and XLA's forward GEMM); on the ``NATIVE`` route the
  (G, N, K) copy its forward GEMM reads, from the same pass."""
  x, role, recipe = req.x, req.role, req.recipe
  q_dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  dq = np.dtype(x.dtype)
  if role == "kernel":
    native = req.route == NATIVE
    data, data_t, sinv, new = _quantize_experts(
      scaling, x, role, q_dtype, recipe, req.state, req.granularity, native, req.non_finite
    )
    along_n = _tensor(data, sinv, dq)
    along_k = _tensor(data_t, sinv, dq) if native else along_n
    return Quantized(along_k if req.rows else None, along_n if req.cols else None, new)
  num_groups = req.group_sizes.shape[0]
  ids = row_groups(req.group_sizes, x.shape[0])
  data, sinv, new = _quantize_rows(
    scaling, x, ids, num_groups, role, q_dtype, recipe, req.state, req.granularity, req.non_finite
  )
  t = _tensor(data, sinv, dq)
  return Quantized(t if req.rows else None, t if req.cols else None, new)


_DIMS = {"fwd": _FWD_DIMS, "dgrad": ROWS_TIMES_GROUP_KERNEL_DIMS, "wgrad": PER_GROUP_WGRAD_DIMS}


def _gemm(a, b, group_sizes, out_dtype, which, recipe, precision=None, route=XLA):
  """``a . b`` per group, times ``a``'s and ``b``'s inverse scales of the group."""
  alpha = a.scale_inv * b.scale_inv
  rows = a.data.shape[0]
  if route == NATIVE:
    sizes = kernels.clamped_sizes(group_sizes, rows)
    fast = kernels.fast_accumulation(precision, which, recipe)
    if which == "wgrad":
      return kernels.wgrad_gemm(a.data, b.data, sizes, alpha, out_dtype, fast)
    return kernels.rows_gemm(a.data, b.data, sizes, alpha, out_dtype, fast)
  out = lax.ragged_dot_general(
    a.data,
    b.data,
    group_sizes,
    _DIMS[which],
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  if which == "wgrad":
    return (out * alpha[:, None, None]).astype(out_dtype)
  ids = row_groups(group_sizes, rows)
  return (out * _per_row(alpha, ids, 0.0)[:, None]).astype(out_dtype)


def _next_state(scaling: TensorScaling, recipe, state, roles):
  del recipe
  return scaling.next_state(state, roles)


def grouped_format(scaling: TensorScaling) -> GroupedFormat:
  """The ``GroupedFormat`` of a per-tensor format whose scales follow ``scaling``."""
  return GroupedFormat(
    check=_check,
    route=_route,
    quantize=functools.partial(_quantize, scaling),
    gemm=_gemm,
    next_state=functools.partial(_next_state, scaling),
  )
