"""The quantized ``dot_general``: FP8 operands straight into ``lax.dot_general``, with a custom VJP.

Forward: ``y = (q(x) · q(kernel)) * sinv_x * sinv_kernel``. Backward, with the output gradient
quantized once to the recipe's backward dtype: ``dx = q(g) · q(kernel)^T`` and
``dkernel = q(x)^T · q(g)``, each rescaled. The FP8 arrays themselves go into the GEMMs (no
quantize-dequantize pattern for XLA to recognise), so a GPU that has FP8 GEMMs runs them.

Recipe state travels through the gradient channel: the cotangent returned for ``state`` is the
state for the next step ("overwrite with gradient").
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core import (
    _accumulate,
    _batching,
    _block_gemm,
    _cast_transpose,
    _dimension_numbers,
    _quantize,
    _remat,
    _scaling,
)
from te_adapters.core._recipes import DelayedScaling, check_recipe
from te_adapters.core._state import ROLES, check_state

__all__ = ["dot_general"]


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe,
    state=None,
    rng=None,
):
  """``jax.lax.dot_general`` with FP8 (or FP4) operands, per ``recipe``.

  Drops into anything that takes a ``dot_general``, for example
  ``functools.partial(dot_general, recipe=r, state=s)``.

  Args:
    lhs: the activation ``x`` (real floating point).
    rhs: the ``kernel`` (real floating point).
    dimension_numbers: as for ``lax.dot_general``: any contracting and batch dimensions.
    precision: passed to the FP8 ``lax.dot_general`` (FP8 GEMMs accumulate in float32 whatever it
      says); block-scaled recipes always accumulate in float32 and do not use it.
    preferred_element_type: output dtype; default as ``lax.dot_general`` would give.
    recipe: a recipe (``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``,
      ``NVFP4BlockScaling``, ``Float8BlockScaling``), or ``None`` for a plain
      ``lax.dot_general``.
    state: this GEMM's recipe state (``init_state(recipe)``); ``None`` for stateless recipes.
    rng: a PRNG key for the stochastic rounding of the gradient, required when differentiating
      under ``NVFP4BlockScaling`` unless ``disable_stochastic_rounding``; use a fresh key per step
      and per GEMM. Must be ``None`` for recipes that do not use it (``recipe.uses_rng``).

  Returns:
    The product, with the dtype and shape ``lax.dot_general`` gives. Under differentiation, the
    gradient with respect to ``state`` is the state for the next step.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> y = ta.core.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling())
    >>> float(y[0, 0])
    32.0
  """
  _quantize.check_float_operand("lhs", lhs)
  _quantize.check_float_operand("rhs", rhs)
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, rhs.shape)
  if recipe is None:
    if state:
      raise ValueError("state was given but recipe is None")
    if rng is not None:
      raise ValueError("rng was given but recipe is None")
    return lax.dot_general(lhs, rhs, dn, precision, preferred_element_type)
  recipe = check_recipe(recipe)
  state = check_state(recipe, state)
  rng = _block_gemm.check_rng(recipe, rng)
  out_dtype = jax.eval_shape(
      functools.partial(
          lax.dot_general,
          dimension_numbers=dn,
          precision=precision,
          preferred_element_type=preferred_element_type,
      ),
      lhs,
      rhs,
  ).dtype
  if recipe.block_scaled:
    return _block_gemm.block_dot_general(lhs, rhs, dn, out_dtype, recipe, rng)
  operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  if _layout() == "tn":
    return _tn_dot_general(lhs, rhs, state, dn, precision, np.dtype(out_dtype), recipe)
  return _fp8_dot_general(
      lhs, rhs, state, dn, precision, np.dtype(out_dtype), operand_dtypes, recipe
  )


def _layout() -> str:
  # Internal benchmarking knob: "tn" (default) puts every GEMM operand in contracting-last
  # layout inside the VJP; "xla" leaves the operand layouts to XLA.
  value = os.environ.get("TE_ADAPTERS_GEMM_LAYOUT", "tn")
  if value not in ("tn", "xla"):
    raise ValueError(f"TE_ADAPTERS_GEMM_LAYOUT must be 'tn' or 'xla', got {value!r}")
  return value


def _knob(name: str, default: str, allowed: tuple[str, ...]) -> str:
  # Internal benchmarking knobs, read at trace time (see bench/layouts.py).
  value = os.environ.get(name, default)
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
  return value


def _output_mode(gemm: str = "fwd") -> str:
  # "f32": the FP8 GEMM accumulates into float32, rescaled there, then cast.
  # "direct": the GEMM emits the output dtype and is rescaled in it.
  # "mixed": direct for the forward and dgrad GEMMs, f32 for wgrad.
  mode = _knob("TE_ADAPTERS_GEMM_OUTPUT", "mixed", ("f32", "direct", "mixed"))
  if mode == "mixed":
    return "f32" if gemm == "wgrad" else "direct"
  return mode


def _scaled_dot(a, b, dims, scale_inv, out_dtype, precision, gemm="fwd"):
  if _output_mode(gemm) == "direct":
    out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)
    return out * scale_inv.reshape(()).astype(out_dtype)
  out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
  return (out * scale_inv.reshape(())).astype(out_dtype)


def _role_scale(x, role, q_dtype, recipe, state, a=None):
  """The scale one operand is quantized with; returns (scale, new state entries for the role).

  ``a``: the operand's amax when already computed (by a fused cast), else computed here.
  """
  limit = _scaling.fp8_max(q_dtype)
  a = _scaling.amax(x) if a is None else a
  if isinstance(recipe, DelayedScaling):
    scale = _accumulate.to_float32(state[f"{role}_scale"])
    history = _accumulate.to_float32(state[f"{role}_amax_history"])
    new_scale, new_history, updated = _scaling.delayed_update_and_flag(
        a, scale, history, limit, recipe.margin, recipe.amax_compute_algo
    )
    new = {
        f"{role}_scale": _accumulate.encode_scale(
            new_scale, updated, scale, state[f"{role}_scale"]
        ),
        f"{role}_amax_history": _accumulate.like(
            new_history, state[f"{role}_amax_history"]
        ),
    }
  else:
    scale = _scaling.compute_scale(a, limit, 1.0)
    new = {}
  return scale, new


def _quantize_role(x, role, q_dtype, recipe, state):
  """Quantizes one operand; returns (data, scale_inv, new state entries for the role)."""
  scale, new = _role_scale(x, role, q_dtype, recipe, state)
  data = _quantize.cast_with_scale(x, scale, q_dtype)
  return data, _scaling.scale_inverse(scale), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fp8_dot_general(lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe):
  y, _ = _fp8_fwd(lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe)
  return y


def _fp8_fwd(lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe):
  del operand_dtypes
  q_x, sinv_x, new_x = _quantize_role(lhs, "x", recipe.fwd_dtype, recipe, state)
  q_w, sinv_w, new_w = _quantize_role(rhs, "kernel", recipe.fwd_dtype, recipe, state)
  q_x, sinv_x = _remat.name_quantized((q_x, sinv_x), _remat.QUANTIZED_X)
  q_w, sinv_w = _remat.name_quantized((q_w, sinv_w), _remat.QUANTIZED_KERNEL)
  y = _scaled_dot(q_x, q_w, dn, sinv_x * sinv_w, out_dtype, precision)
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  residuals = (q_x, sinv_x, q_w, sinv_w, {**new_x, **new_w}, state)
  return y, residuals


def _fp8_bwd(dn, precision, out_dtype, operand_dtypes, recipe, residuals, g):
  q_x, sinv_x, q_w, sinv_w, new_fwd_state, state = residuals
  lhs_dtype, rhs_dtype = operand_dtypes
  del out_dtype
  grad_state = {k: v for k, v in state.items() if k.startswith("grad_")}
  q_g, sinv_g, new_g = _quantize_role(g, "grad", recipe.bwd_dtype, recipe, grad_state)
  dims, perm = _dimension_numbers.transpose_lhs(dn, q_x.ndim, q_w.ndim)
  dx = jnp.transpose(_scaled_dot(q_g, q_w, dims, sinv_g * sinv_w, lhs_dtype, precision), perm)
  dims, perm = _dimension_numbers.transpose_rhs(dn, q_x.ndim, q_w.ndim)
  dw = jnp.transpose(_scaled_dot(q_g, q_x, dims, sinv_g * sinv_x, rhs_dtype, precision), perm)
  new_state = _batching.combine_over_batch(
      {**new_fwd_state, **new_g}, state, functools.partial(_rescale, recipe))
  return dx, dw, new_state


_fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)

# For tests and tools: roles in the order the state dict lists them.
STATE_ROLES = ROLES


# ---------------------------------------------------------------------------------------------
# Contracting-last ("TN") formulation: cuBLASLt's FP8 GEMMs take both operands with the
# contracting dimension last. The operands are brought to x3 (B, M, K) and w3 (B, N, K) outside
# the VJP (plain JAX transposes/reshapes, which XLA fuses into the casts), and inside it each
# tensor is quantized in the two orientations its GEMMs need, in the pass that reads it:
#   y  (M, N) = q(x3)     . q(w3)^T      contracting K
#   dx (M, K) = q(g)      . q(w3^T)^T    contracting N
#   dw (K, N) = q(x3^T)   . q(g^T)^T     contracting M  (then transposed back to (N, K), which
#                                                       cancels against the caller's transpose)


def _canonical_plan(dn, lhs_shape, rhs_shape):
  (lc, rc), (lb, rb) = dn
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  size = lambda shape, dims: math.prod(shape[d] for d in dims)
  b, m, k, n = size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf)
  lhs_perm, rhs_perm = (*lb, *lf, *lc), (*rb, *rf, *rc)
  batch_shape = tuple(lhs_shape[d] for d in lb)
  out_shape = batch_shape + tuple(lhs_shape[d] for d in lf) + tuple(rhs_shape[d] for d in rf)
  lead = (b,) if lb else ()
  return lhs_perm, rhs_perm, lead + (m, k), lead + (n, k), out_shape


def _tn_dot_general(lhs, rhs, state, dn, precision, out_dtype, recipe):
  lhs_perm, rhs_perm, x3_shape, w3_shape, out_shape = _canonical_plan(dn, lhs.shape, rhs.shape)
  x3 = jnp.transpose(lhs, lhs_perm).reshape(x3_shape)
  w3 = jnp.transpose(rhs, rhs_perm).reshape(w3_shape)
  y3 = _tn_vjp(x3, w3, state, precision, out_dtype, recipe)
  return y3.reshape(out_shape)


def _swap_last(a):
  return jnp.swapaxes(a, -1, -2)


def _tn_dot(a, b, scale_inv, out_dtype, precision, gemm):
  """``a (.., P, C) . b (.., Q, C)^T``: both operands contracting-last."""
  batch = tuple(range(a.ndim - 2))
  dims = (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
  return _scaled_dot(a, b, dims, scale_inv, out_dtype, precision, gemm)


def _cast_both(x, scale, q_dtype, with_amax=False):
  """FP8 copies of ``x`` and of ``x`` with its last two dims swapped (and the amax of ``x``).

  One pass over ``x``: the FFI kernel or XLA's fusion, per ``TE_ADAPTERS_BACKEND``.
  """
  if _knob("TE_ADAPTERS_TRANSPOSE", "cast", ("cast", "fp8")) == "fp8":
    q = _quantize.cast_with_scale(x, scale, q_dtype)
    return q, _swap_last(q), (_scaling.amax(x) if with_amax else None)  # transpose 1-byte copy
  return _cast_transpose.cast_transpose(x, scale, q_dtype, with_amax=with_amax)


def _quantize_both(x, role, q_dtype, recipe, state):
  """Both FP8 orientations of one operand; returns (q, q_t, scale, new state entries)."""
  if isinstance(recipe, DelayedScaling):
    # The stored scale is known before the pass, so the amax comes out of the cast itself.
    scale = _accumulate.to_float32(state[f"{role}_scale"])
    q, q_t, a = _cast_both(x, scale, q_dtype, with_amax=True)
    _, new = _role_scale(x, role, q_dtype, recipe, state, a)
  else:
    # Current scaling: an amax pass, then the cast.
    scale, new = _role_scale(x, role, q_dtype, recipe, state, _cast_transpose.amax(x))
    q, q_t, _ = _cast_both(x, scale, q_dtype)
  return q, q_t, scale, new


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tn_vjp(x3, w3, state, precision, out_dtype, recipe):
  y, _ = _tn_fwd(x3, w3, state, precision, out_dtype, recipe)
  return y


def _tn_fwd(x3, w3, state, precision, out_dtype, recipe):
  fwd = recipe.fwd_dtype
  # Each operand in both orientations: this one for the forward GEMM, the transposed copy
  # (kept for the backward pass) for wgrad (x) and dgrad (kernel).
  q_x, q_xt, scale_x, new_x = _quantize_both(x3, "x", fwd, recipe, state)
  q_w, q_wt, scale_w, new_w = _quantize_both(w3, "kernel", fwd, recipe, state)
  sinv_x, sinv_w = _scaling.scale_inverse(scale_x), _scaling.scale_inverse(scale_w)
  q_xt, sinv_xt = _remat.name_quantized((q_xt, sinv_x), _remat.QUANTIZED_X)
  q_wt, sinv_wt = _remat.name_quantized((q_wt, sinv_w), _remat.QUANTIZED_KERNEL)
  y = _tn_dot(q_x, q_w, sinv_x * sinv_w, out_dtype, precision, "fwd")
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  dtypes = (np.zeros((0,), x3.dtype), np.zeros((0,), w3.dtype))
  residuals = (q_xt, sinv_xt, q_wt, sinv_wt, {**new_x, **new_w}, state, dtypes)
  return y, residuals


def _tn_bwd(precision, out_dtype, recipe, residuals, g):
  q_xt, sinv_x, q_wt, sinv_w, new_fwd_state, state, (x_proto, w_proto) = residuals
  del out_dtype
  grad_state = {k: v for k, v in state.items() if k.startswith("grad_")}
  bwd = recipe.bwd_dtype
  q_g, q_gt, scale_g, new_g = _quantize_both(g, "grad", bwd, recipe, grad_state)
  sinv_g = _scaling.scale_inverse(scale_g)
  dx = _tn_dot(q_g, q_wt, sinv_g * sinv_w, x_proto.dtype, precision, "dgrad")  # (.., M, K)
  dw = _tn_dot(q_xt, q_gt, sinv_g * sinv_x, w_proto.dtype, precision, "wgrad")  # (.., K, N)
  dw = _swap_last(dw)  # (.., N, K); cancels against the caller's transpose
  new_state = _batching.combine_over_batch(
      {**new_fwd_state, **new_g}, state, functools.partial(_rescale, recipe))
  return dx, dw, new_state


def _rescale(recipe, role, history, old_history, old_scale):
  """The scale TE's rule gives after ``old_history`` -> ``history`` (for ``_batching``)."""
  limit = _scaling.fp8_max(recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype)
  current = history[-1:]  # the step's amax sits at the end after the roll
  window = current if recipe.amax_compute_algo == "most_recent" else jnp.maximum(
      current, jnp.max(old_history[1:], initial=0.0, keepdims=True)[:1])
  updated = (window > 0) & jnp.isfinite(window)
  return _scaling.compute_scale(window, limit, old_scale, recipe.margin), updated


_tn_vjp.defvjp(_tn_fwd, _tn_bwd)
