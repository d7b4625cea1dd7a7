"""Recipe state under ``vmap``: one state update for the whole batch, not a sum of per-example ones.

When a quantized GEMM is vmapped with its state unmapped (``hk.vmap``, ``nnx.vmap`` of a
broadcast layer, ``jax.vmap(in_axes=None)`` for the state), each example computes its own new
state, and JAX's batching of the custom VJP would *sum* those state cotangents over the batch (and
cannot sum the accumulating dtypes of ``with_max_grad`` at all). Passing the new state through
``combine_over_batch`` in the backward pass reduces it over the batch first: histories by max,
and each scale recomputed from the combined history with TE's rule, so the result equals the state
of one unbatched GEMM over the whole batch (every example quantized with the same stored scale).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from te_adapters.core.state import _accumulate
from te_adapters.core.state._recipe_state import ROLES, RoleState

__all__ = ["combine_over_batch"]

# rescale(role, combined_history, old_history, old_scale) -> (new_scale, updated), float32.
Rescale = Callable[[str, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _reduce_roles(new_state, old_state, rescale: Rescale, batched):
  roles, roles_batched = {}, {}
  for role in ROLES:
    if not batched.role(role).amax_history:
      continue
    new, old = new_state.role(role), old_state.role(role)
    history = jnp.max(_accumulate.to_float32(new.amax_history), axis=0)
    old_history = _accumulate.to_float32(old.amax_history)
    old_scale = _accumulate.to_float32(old.scale)
    scale, updated = rescale(role, history, old_history, old_scale)
    roles[role] = RoleState(
      scale=_accumulate.encode_scale(scale, updated, old_scale, new.scale),
      amax_history=_accumulate.cast_like(history, new.amax_history),
    )
    roles_batched[role] = RoleState(False, False)
  return new_state.with_roles(roles), batched.with_roles(roles_batched)


def combine_over_batch(new_state, old_state, rescale: Rescale):
  """``new_state`` unchanged, except under ``vmap`` with ``old_state`` unmapped: there the mapped
  new state is reduced over the batch, so it is unmapped like the state it replaces.

  Both are one GEMM's ``DelayedScalingState`` (or ``{}`` for a stateless recipe).
  """
  if not new_state:
    return new_state

  @jax.custom_batching.custom_vmap
  def combine(new, old):
    del old
    return new

  @combine.def_vmap
  def rule(axis_size, in_batched, new, old):
    del axis_size
    new_batched, old_batched = in_batched
    if any(jax.tree_util.tree_leaves(old_batched)):  # mapped state: each example keeps its own
      return combine(new, old), new_batched
    out, out_batched = _reduce_roles(new, old, rescale, new_batched)
    # Nested vmaps: an outer one reduces its own axis through the same rule.
    return combine(out, old), out_batched

  return combine(new_state, old_state)
