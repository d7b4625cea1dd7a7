"""A warning when a training step would leave DelayedScaling state silently frozen.

The new state leaves a step as the gradient with respect to the state. A loop that differentiates
the parameters only (``jax.grad`` over params, ``nnx.value_and_grad`` with its default
``wrt=nnx.Param``) runs without error, but the amax histories stay zero and the scales at their
initial values for the whole run. ``watch_state`` is an identity whose forward rule, run only
under differentiation, sees which operands are being differentiated and warns once per GEMM at
trace time when the operands are and the state is not.

A layer with low-rank adaptation trained alone (its frozen base kernel and the input not
differentiated, only the LoRA factors) never differentiates its base GEMM's operands, so that
GEMM cannot see the step. ``watch_lora_state`` watches the factors against the base GEMM's state
in the same way.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from te_adapters.core.gemm import _threshold

__all__ = ["FrozenStateWarning", "watch_lora_state", "watch_state"]

HOW_TO_FIX = (
    "Differentiate the state too (its gradient is the new state): Flax NNX "
    "te_adapters.nnx.value_and_grad (or nnx.grad with argnums=nnx.DiffState(0, "
    "nnx.Any(nnx.Param, te_adapters.nnx.RecipeState))); Haiku te_adapters.haiku."
    "value_grad_and_state (or jax.grad over params and state); Flax Linen te_adapters.linen."
    "TrainState.value_and_grad (or jax.grad over the '_overwrite_with_gradient' collection); "
    "plain JAX jax.grad with respect to the state."
)


class FrozenStateWarning(UserWarning):
  """A DelayedScaling GEMM is differentiated without its state: the state will not update."""


def _describe(lhs, rhs) -> str:
  return f"x {tuple(lhs.shape)} {lhs.dtype} . kernel {tuple(rhs.shape)} {rhs.dtype}"


def _message(kind: str, lhs, rhs) -> str:
  if kind == "lora":
    return (
        f"te_adapters: the low-rank adaptation factors {tuple(lhs.shape)} and "
        f"{tuple(rhs.shape)} are differentiated while the DelayedScaling state of their layer's "
        "base GEMM is not, so its amax histories and scales never update (the scales stay as "
        f"initialised). {HOW_TO_FIX}"
    )
  return (
      f"te_adapters: the DelayedScaling state of the GEMM {_describe(lhs, rhs)} is not "
      "differentiated while its operands are, so its amax histories and scales never "
      f"update (the scales stay as initialised). {HOW_TO_FIX}"
  )


@jax.custom_vjp
def _watch(lhs, rhs, state):
  return lhs, rhs, state


def _watch_fwd(lhs, rhs, state):
  operands = lhs.perturbed or rhs.perturbed
  leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda v: hasattr(v, "perturbed"))
  if operands and leaves and not all(v.perturbed for v in leaves):
    warnings.warn(FrozenStateWarning(_message("gemm", lhs.value, rhs.value)), stacklevel=2)
  values = jax.tree_util.tree_map(
      lambda v: v.value, (lhs, rhs, state), is_leaf=lambda v: hasattr(v, "perturbed")
  )
  return values, None


def _watch_bwd(_, cts):
  return jax.tree_util.tree_map(
      lambda c: None if isinstance(c, jax.custom_derivatives.SymbolicZero) else c,
      cts,
      is_leaf=lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero),
  )


_watch.defvjp(_watch_fwd, _watch_bwd, symbolic_zeros=True)


def watch_state(lhs, rhs, state):
  """``(lhs, rhs, state)`` unchanged; under differentiation, warns with ``FrozenStateWarning``
  when ``lhs`` or ``rhs`` is differentiated and some leaf of ``state`` is not."""
  return _watch(lhs, rhs, state)


@jax.custom_jvp
def _watch_factors(lhs, rhs, state):
  return lhs, rhs


def _watch_factors_jvp(primals, tangents):
  # A custom JVP, not a VJP: forward-mode differentiation through the factors keeps working.
  # Tangents of what is not differentiated arrive as symbolic zeros.
  lhs, rhs, state = primals
  t_lhs, t_rhs, t_state = tangents
  zero = lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)  # noqa: E731
  leaves = jax.tree_util.tree_leaves(t_state, is_leaf=zero)
  if (not zero(t_lhs) or not zero(t_rhs)) and leaves and any(zero(t) for t in leaves):
    warnings.warn(FrozenStateWarning(_message("lora", lhs, rhs)), stacklevel=2)
  tangents = tuple(jnp.zeros_like(p) if zero(t) else t
                   for p, t in ((lhs, t_lhs), (rhs, t_rhs)))
  return (lhs, rhs), tangents


_watch_factors.defjvp(_watch_factors_jvp, symbolic_zeros=True)


def watch_lora_state(lora_a, lora_b, state, *, x_shape, kernel_shape, axis=-1,
                     threshold=_threshold.DEFAULT_SIZE_THRESHOLD):
  """``(lora_a, lora_b)`` unchanged; under differentiation, warns with ``FrozenStateWarning``
  when a LoRA factor is differentiated and some leaf of ``state`` is not, where the base GEMM
  runs in FP8.

  Args:
    lora_a, lora_b: the layer's LoRA factors.
    state: the recipe state of the layer's base GEMM; ``None`` or empty (no recipe, or a
      stateless one): nothing to watch.
    x_shape, kernel_shape, axis, threshold: the base GEMM, ``x`` contracting ``axis`` with the
      kernel's leading axes (as ``low_rank_adaptation``), under ``dot_general``'s ``threshold``.
      Below the threshold it runs in high precision and its state does not move, so nothing is
      frozen.

  A custom JVP: forward-mode differentiation through the factors works, and warns in the same
  case.
  """
  if not state:
    return lora_a, lora_b
  axes = tuple(a % len(x_shape) for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
  dims = ((axes, tuple(range(len(axes)))), ((), ()))
  if not _threshold.runs_in_fp8(tuple(x_shape), tuple(kernel_shape), dims, threshold):
    return lora_a, lora_b
  return _watch_factors(lora_a, lora_b, state)
