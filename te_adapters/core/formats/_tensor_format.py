"""Per-tensor FP8 formats: one scale per tensor (delayed and current scaling).

``tensor_format(recipe_type, scaling)`` makes the ``QuantizationFormat`` of a per-tensor recipe from
its ``TensorScaling`` (the scale it knows before a cast, and the scale and state that follow from an
amax). Its operands are cast in one pass into both FP8 orientations (the extension's cast kernel or
XLA's fusion), and its GEMMs take both operands contracting-last ("TN"): the extension's cuBLASLt
GEMM on Hopper with both scales in the epilogue, as TE's, or ``lax.dot_general`` on the FP8 arrays,
rescaled in float32 after it.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import kernels, sharding
from te_adapters.core import state as core_state
from te_adapters.core.formats import _block, _cast_transpose, _grouped_tensor, _scaling
from te_adapters.core.formats._format import QuantizationFormat, Quantized, QuantizeRequest
from te_adapters.core.formats._scaled_tensor import (
  ScaledTensor,
  cast_with_scale,
  non_finite_scale_inv,
)
from te_adapters.core.formats._tensor_scaling import TensorScaling

__all__ = ["tensor_format", "tensor", "cast_both"]


def tensor(data, scale_inv, amax=None, dq_dtype=np.float32) -> ScaledTensor:
  """A per-tensor ``ScaledTensor`` from FP8 ``data`` and its float32 (1,) ``scale_inv``."""
  return ScaledTensor(data, scale_inv, amax, scaling_mode="tensor", dq_dtype=np.dtype(dq_dtype))


def _q_dtype(recipe, role):
  return recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype


def _role_scale(scaling, x, role, q_dtype, recipe, state, plan, a):
  """The scale one operand is cast with, the role's new state and the amax they come from:
  ``a`` made global over the mesh first (``_amax_reduction.global_amax``), so that every shard
  sees a non-finite entry of another (``GemmConfig.non_finite``)."""
  a = sharding.global_amax(a, x, role, plan, scaling.state_varying(state, role))
  return *scaling.next_scale(recipe, a, state, role, _scaling.fp8_max(q_dtype)), a


def cast_both(x, scale, q_dtype, config, with_amax=False):
  """FP8 copies of ``x`` and of ``x`` with its last two dims swapped (and the amax of ``x``), in
  one pass over ``x``: the FFI kernel or XLA's fusion, per ``config.backend``."""
  return _cast_transpose.cast_transpose(
    x,
    scale,
    q_dtype,
    with_amax=with_amax,
    backend=config.backend,
    amax_over_mesh=config.fold_amax,
  )


def _quantize(scaling: TensorScaling, req: QuantizeRequest) -> Quantized:
  x, role, recipe, state, plan = req.x, req.role, req.recipe, req.state, req.plan
  q_dtype = _q_dtype(recipe, role)
  dq = np.dtype(x.dtype)
  if not req.cols and req.producer is None:
    # One orientation (inference, or FSDP's kernel shard, transposed in FP8 after its gather).
    # The barrier keeps a narrow input's rounding: XLA would otherwise fuse this cast with the
    # convert that made x (a float32 kernel computed in bfloat16) and drop the rounding, giving
    # the FP8 codes of the float32 values, where the two-orientation cast reads the bfloat16 x.
    if np.dtype(x.dtype).itemsize < 4:
      x = _block.keep_narrow(x)
    a = _scaling.tensor_amax(x)
    scale, new, whole = _role_scale(scaling, x, role, q_dtype, recipe, state, plan, a)
    data = cast_with_scale(x, scale, q_dtype)
    sinv = non_finite_scale_inv(_scaling.scale_inverse(scale), whole, req.config.non_finite)
    return Quantized(tensor(data, sinv, a, dq), None, new)
  if req.producer is None:

    def cast(scale, with_amax):
      return cast_both(x, scale, q_dtype, req.config, with_amax)

    amax = None
  else:
    cast, amax = req.producer.cast, req.producer.amax
  scale = scaling.stored_scale(state, role)
  if scale is not None:
    # Delayed scaling: the stored scale is known before the pass, so the amax comes out of the
    # cast itself.
    q, q_t, a = cast(scale, True)
    _, new, whole = _role_scale(scaling, x, role, q_dtype, recipe, state, plan, a)
  else:
    # Current scaling: an amax pass, then the cast. XLA's reduce ran as fast as the FFI amax
    # kernel and can fuse into the op that produces x.
    a = (
      _cast_transpose.amax(x, backend="jax", over_mesh=req.config.fold_amax)
      if amax is None
      else amax()
    )
    scale, new, whole = _role_scale(scaling, x, role, q_dtype, recipe, state, plan, a)
    q, q_t, _ = cast(scale, False)
  # A NaN or inf in x (a non-finite amax, from the pass that already ran) makes the GEMM's
  # output NaN instead of the saturated cast's finite values (GemmConfig.non_finite).
  sinv = non_finite_scale_inv(_scaling.scale_inverse(scale), whole, req.config.non_finite)
  rows = tensor(q, sinv, a, dq) if req.rows else None
  return Quantized(rows, tensor(q_t, sinv, a, dq), new)


# --- the GEMM ------------------------------------------------------------------------------------


def _gemm_precision(precision, which: str, recipe):
  # XLA runs an FP8 cuBLASLt GEMM with fast accumulation when its precision is DEFAULT, and
  # promotes the sums to float32 with HIGHEST: the recipe's MMParams choose, per GEMM; without a
  # split accumulator the caller's precision decides.
  params = getattr(
    recipe, {"fwd": "fp8_gemm_fprop", "dgrad": "fp8_gemm_dgrad", "wgrad": "fp8_gemm_wgrad"}[which]
  )
  return lax.Precision.HIGHEST if params.use_split_accumulator else precision


_CUBLAS_OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _cublas_refusal(a, b, out_dtype, out_sharding) -> str | None:
  """Why the extension's cuBLASLt GEMM cannot run ``a (.., M, K) . b (.., N, K)^T`` (None: it
  can). XLA runs it then."""
  if not kernels.cublas_gemm_available():
    return "the extension's cuBLASLt GEMM is not built here or the GPU is not a Hopper GPU"
  if np.dtype(out_dtype) not in _CUBLAS_OUT_DTYPES:
    return f"it writes bfloat16, float16 or float32, not {np.dtype(out_dtype)}"
  m, n, k = a.shape[-2], b.shape[-2], a.shape[-1]
  if m % 16 or n % 16 or k % 16:
    return f"it needs M, N and K multiples of 16, got M={m}, N={n}, K={k}"
  if out_sharding is None:
    return None
  # Explicit mesh axes: the rule gives its output the named sharding (a backward GEMM's, its
  # primal's), which Auto axes leave to XLA's partitioner.
  explicit = sharding.explicit_out_sharding(out_sharding)
  if explicit is None:
    return f"the output's sharding {out_sharding} names mesh axes that are not Explicit"
  lead = a.shape[:-2]
  if len(lead) > 1:
    try:  # the batch dims, merged into one for the kernel, keep their shards
      sharding.reshaped_sharding(explicit, (*lead, m, n), (math.prod(lead), m, n))
    except ValueError as e:
      return str(e)
  return None


def _cublas_tn_dot(
  a, b, sinv_a, sinv_b, out_dtype, precision, sum_dtype=None, config=None, out_sharding=None
):
  """``a (.., M, K) . b (.., N, K)^T * sinv_a * sinv_b`` by cuBLASLt: both scales in the
  epilogue, one rounding to ``out_dtype`` (TE's GEMM). ``out_sharding``: the output's sharding on
  Explicit mesh axes (``_cublas_refusal`` refuses others), or None."""
  lead = a.shape[:-2]
  (m, k), n = a.shape[-2:], b.shape[-2]
  # 2-D operands go in as they are: a reshape between the call and a cast of its output (the
  # float32 wgrad cast to bf16 and back to a float32 parameter's dtype) stops XLA from dropping
  # that round trip.
  batch = (math.prod(lead),) if lead else ()
  out_sharding = sharding.explicit_out_sharding(out_sharding)
  kernel_out = sharding.reshaped_sharding(out_sharding, (*lead, m, n), (*batch, m, n))
  # Fast sums where XLA would use them: every operand precision DEFAULT (XLA's rule).
  pair = precision if isinstance(precision, (tuple, list)) else (precision, precision)
  fast = all(p is None or str(p).upper().split(".")[-1] in ("DEFAULT", "FASTEST") for p in pair)
  # Per shard in a sharded program (_partition.py).
  y = kernels.tensor_scaled_gemm(
    kernels.gemm_call,
    a.reshape(*batch, m, k),
    b.reshape(*batch, n, k),
    sinv_a.reshape(1).astype(jnp.float32),
    sinv_b.reshape(1).astype(jnp.float32),
    out_dtype,
    fast,
    sum_dtype,
    sm_margin=None if config is None else config.comm_sm_margin,
    sum_chunks=1 if config is None else config.sum_chunks,
    out_sharding=kernel_out,
    device_sums="collective" if config is None else config.device_sums,
  )
  y = sharding.reshape(y, (*lead, m, n)) if lead else y
  return sharding.match_sharding(y, out_sharding)


def _gemm(a, b, out_dtype, which, recipe, config, precision=None, out_sharding=None):
  """``(a * sinv_a) . (b * sinv_b)^T`` for per-tensor FP8 ``a (.., P, C)``, ``b (.., Q, C)``."""
  precision = _gemm_precision(precision, which, recipe)
  sinv_a, sinv_b = a.scale_inv, b.scale_inv
  a, b = a.data, b.data
  batch = tuple(range(a.ndim - 2))
  dims = (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
  if config.fp8_gemm != "xla":
    refusal = _cublas_refusal(a, b, out_dtype, out_sharding)
    if refusal is None:
      # wgrad: float32, then cast. Where the caller casts the gradient back to a float32
      # parameter (nn.Dense computing in bf16), XLA drops the bf16 round trip, and the
      # parameter's gradient is the GEMM's float32 output, with no pass of its own.
      gemm_dtype = jnp.float32 if which == "wgrad" else out_dtype
      # In a sharded program whose K is split over devices, the partial products are summed in
      # the output dtype (for wgrad too: the kernel's dtype as the caller passes it) or in
      # float32 (GemmConfig.partial_sums).
      sum_dtype = out_dtype if config.partial_sums == "output" else jnp.float32
      y = _cublas_tn_dot(
        a, b, sinv_a, sinv_b, gemm_dtype, precision, sum_dtype, config, out_sharding
      )
      return y.astype(out_dtype)
    if config.fp8_gemm == "native":
      raise RuntimeError(f"fp8_gemm='native', but {refusal}")
  scale_inv = (sinv_a * sinv_b).reshape(())
  if which == "wgrad":
    # float32 sums rescaled, one rounding to the output dtype.
    out = lax.dot_general(
      a,
      b,
      dims,
      precision=precision,
      preferred_element_type=jnp.float32,
      out_sharding=out_sharding,
    )
    return (out * scale_inv).astype(out_dtype)
  # The forward and dgrad GEMMs emit the output dtype, rescaled in float32. The barrier keeps
  # the GEMM's rounding to out_dtype, which XLA would otherwise drop in some fusions and not in
  # others (its "excess precision"), so results would depend on how a program is fused or
  # sharded.
  out = lax.dot_general(
    a,
    b,
    dims,
    precision=precision,
    preferred_element_type=out_dtype,
    out_sharding=out_sharding,
  )
  out = _block.keep_narrow(out) if np.dtype(out_dtype).itemsize < 4 else out
  return (out.astype(jnp.float32) * scale_inv).astype(out_dtype)


# --- state ---------------------------------------------------------------------------------------


def _next_state(scaling: TensorScaling, recipe, state, roles):
  """One GEMM's next recipe state from its roles' new states, combined over a ``vmap``-ped
  batch as TE's rule would have it (``_batching``)."""
  new = scaling.next_state(state, roles)
  return core_state.combine_over_batch(new, state, functools.partial(_rescale, recipe))


def _rescale(recipe, role, history, old_history, old_scale):
  """The scale TE's rule gives after ``old_history`` -> ``history`` (for ``_batching``)."""
  limit = _scaling.fp8_max(_q_dtype(recipe, role))
  current = history[-1:]  # the step's amax sits at the end after the roll
  window = (
    current
    if recipe.amax_compute_algo == "most_recent"
    else jnp.maximum(current, jnp.max(old_history[1:], initial=0.0, keepdims=True)[:1])
  )
  updated = (window > 0) & jnp.isfinite(window)
  return _scaling.compute_scale(window, limit, old_scale, recipe.margin), updated


def _dequantize(t, dtype):
  return (t.data.astype(jnp.float32) * t.scale_inv.reshape(())).astype(dtype)


def _check(recipe, layout, backward, lhs=None, rhs=None):
  del recipe, layout, backward, lhs, rhs  # one scale per tensor: any shape


def tensor_format(recipe_type: type, scaling: TensorScaling) -> QuantizationFormat:
  """The ``QuantizationFormat`` of a per-tensor recipe whose scales follow ``scaling`` (its grouped
  GEMM applies ``scaling`` per group: ``_grouped_tensor``).

  Args:
    recipe_type: the recipe class the format serves (a ``Recipe`` subclass).
    scaling: the ``TensorScaling`` that gives its state and scales.

  Returns:
    A ``QuantizationFormat`` with one scale per tensor, for ``register_format``.

  Example:
    Delayed scaling's state and scale rule under a recipe class of one's own:

    >>> import dataclasses, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class MyDelayedScaling(ta.DelayedScaling):
    ...   pass
    >>> delayed = ta.core.format_of(ta.DelayedScaling()).scaling
    >>> fmt = ta.core.tensor_format(MyDelayedScaling, delayed)
    >>> fmt.per_tensor, fmt.state_shapes(MyDelayedScaling(amax_history_len=2))["x_amax_history"]
    (True, (2,))
  """
  return QuantizationFormat(
    recipe_type=recipe_type,
    scaling_modes=("tensor",),
    init_state=scaling.init_state,
    state_shapes=scaling.state_shapes,
    quantize=functools.partial(_quantize, scaling),
    gemm=_gemm,
    next_state=functools.partial(_next_state, scaling),
    dequantize=_dequantize,
    check=_check,
    per_tensor=True,
    scaling=scaling,
    grouped=_grouped_tensor.grouped_format(scaling),
    takes_producer=True,
  )
