"""A warning when a training step would leave DelayedScaling state silently frozen.

The new state leaves a step as the gradient with respect to the state. A loop that differentiates
the parameters only (``jax.grad`` over params, ``nnx.value_and_grad`` with its default
``wrt=nnx.Param``) runs without error, but the amax histories stay zero and the scales at their
initial values for the whole run. ``watch_state`` is an identity whose forward rule, run only
under differentiation, sees which operands are being differentiated and warns once per GEMM at
trace time when the operands are and the state is not.
"""

from __future__ import annotations

import warnings

import jax

__all__ = ["FrozenStateWarning", "watch_state"]

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


@jax.custom_vjp
def _watch(lhs, rhs, state):
  return lhs, rhs, state


def _watch_fwd(lhs, rhs, state):
  operands = lhs.perturbed or rhs.perturbed
  leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda v: hasattr(v, "perturbed"))
  if operands and leaves and not all(v.perturbed for v in leaves):
    lhs_v, rhs_v = lhs.value, rhs.value
    warnings.warn(
        FrozenStateWarning(
            f"te_adapters: the DelayedScaling state of the GEMM {_describe(lhs_v, rhs_v)} is not "
            "differentiated while its operands are, so its amax histories and scales never "
            f"update (the scales stay as initialised). {HOW_TO_FIX}"
        ),
        stacklevel=2,
    )
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
