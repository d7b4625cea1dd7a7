"""An identity on recipe state that refuses, at trace time, to be differentiated.

The adapters put it on state that a framework's scan hands unchanged to every iteration (NNX's
``nnx.scan`` with the layer broadcast or carried, Haiku's ``hk.scan``, which carries all state):
there JAX's transpose of the scan would add up the iterations' contributions to the state
gradient, which must combine by max. State already marked for max-combination by the library's
training helpers (an extended dtype) is let through, and so is a pass that does not
differentiate the state (the forward, or a gradient over parameters alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["is_marked", "refuse_state_grad"]


def is_marked(state: dict) -> bool:
  """Whether the state was marked for max-combination before it reached the scan."""
  return any(jnp.issubdtype(v.dtype, jax.dtypes.extended) for v in state.values())


def refuse_state_grad(state: dict, message: str) -> dict:
  """``state`` unchanged; tracing its gradient raises ``ValueError(message)``."""

  @jax.custom_vjp
  def guard(state):
    return state

  def is_primal(v):
    return hasattr(v, "perturbed")

  def fwd(state):
    if any(v.perturbed for v in jax.tree_util.tree_leaves(state, is_leaf=is_primal)):
      raise ValueError(message)
    return jax.tree_util.tree_map(lambda v: v.value, state, is_leaf=is_primal), None

  def is_zero(c):
    return isinstance(c, jax.custom_derivatives.SymbolicZero)

  def bwd(_, cts):
    return (jax.tree_util.tree_map(lambda c: None if is_zero(c) else c, cts, is_leaf=is_zero),)

  guard.defvjp(fwd, bwd, symbolic_zeros=True)
  return guard(state)
