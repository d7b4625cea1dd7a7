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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core import _accumulate, _batching, _dimension_numbers, _quantize, _remat, _scaling
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
):
  """``jax.lax.dot_general`` with FP8 operands, per ``recipe``.

  Drops into anything that takes a ``dot_general``, for example
  ``functools.partial(dot_general, recipe=r, state=s)``.

  Args:
    lhs: the activation ``x`` (real floating point).
    rhs: the ``kernel`` (real floating point).
    dimension_numbers: as for ``lax.dot_general``: any contracting and batch dimensions.
    precision: passed to the FP8 ``lax.dot_general`` (FP8 GEMMs accumulate in float32 whatever it
      says).
    preferred_element_type: output dtype; default as ``lax.dot_general`` would give.
    recipe: a recipe (``DelayedScaling``, ``Float8CurrentScaling``), or ``None`` for a plain
      ``lax.dot_general``.
    state: this GEMM's recipe state (``init_state(recipe)``); ``None`` for stateless recipes.

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
    return lax.dot_general(lhs, rhs, dn, precision, preferred_element_type)
  recipe = check_recipe(recipe)
  state = check_state(recipe, state)
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
  operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  return _fp8_dot_general(
      lhs, rhs, state, dn, precision, np.dtype(out_dtype), operand_dtypes, recipe
  )


def _scaled_dot(a, b, dims, scale_inv, out_dtype, precision):
  out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
  return (out * scale_inv.reshape(())).astype(out_dtype)


def _quantize_role(x, role, q_dtype, recipe, state):
  """Quantizes one operand; returns (data, scale_inv, new state entries for the role)."""
  limit = _scaling.fp8_max(q_dtype)
  a = _scaling.amax(x)
  if isinstance(recipe, DelayedScaling):
    scale = _accumulate.to_float32(state[f"{role}_scale"])
    history = _accumulate.to_float32(state[f"{role}_amax_history"])
    new_scale, new_history = _scaling.delayed_update(
        a, scale, history, limit, recipe.margin, recipe.amax_compute_algo
    )
    new = {
        f"{role}_scale": _accumulate.like(new_scale, state[f"{role}_scale"]),
        f"{role}_amax_history": _accumulate.like(
            new_history, state[f"{role}_amax_history"]
        ),
    }
  else:
    scale = _scaling.compute_scale(a, limit, 1.0)
    new = {}
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
  # Under vmap with unmapped state, reduce the per-example states (max/min) instead of summing.
  new_state = _batching.combine_over_batch({**new_fwd_state, **new_g}, state)
  return dx, dw, new_state


_fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)

# For tests and tools: roles in the order the state dict lists them.
STATE_ROLES = ROLES
