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

from te_adapters.core import _accumulate

__all__ = ["combine_over_batch"]

# rescale(role, combined_history, old_history, old_scale) -> (new_scale, updated), float32.
Rescale = Callable[[str, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _reduce_roles(new_state, old_state, rescale: Rescale, batched):
  out, out_batched = dict(new_state), dict(batched)
  roles = {name.rsplit("_", 2)[0] for name in new_state if name.endswith("_amax_history")}
  for role in sorted(roles):
    h_name, s_name = f"{role}_amax_history", f"{role}_scale"
    if not batched[h_name] or h_name not in old_state:
      continue
    history = jnp.max(_accumulate.to_float32(new_state[h_name]), axis=0)
    old_history = _accumulate.to_float32(old_state[h_name])
    old_scale = _accumulate.to_float32(old_state[s_name])
    scale, updated = rescale(role, history, old_history, old_scale)
    out[h_name] = _accumulate.like(history, new_state[h_name])
    out[s_name] = _accumulate.encode_scale(scale, updated, old_scale, new_state[s_name])
    out_batched[h_name] = out_batched[s_name] = False
  return out, out_batched


def combine_over_batch(new_state: dict, old_state: dict, rescale: Rescale) -> dict:
  """``new_state`` unchanged, except under ``vmap`` with ``old_state`` unmapped: there the mapped
  new state is reduced over the batch, so it is unmapped like the state it replaces."""
  if not new_state:
    return new_state
  old_state = {k: v for k, v in old_state.items() if k in new_state}

  @jax.custom_batching.custom_vmap
  def combine(new, old):
    del old
    return new

  @combine.def_vmap
  def rule(axis_size, in_batched, new, old):
    del axis_size
    new_batched, old_batched = in_batched
    if any(old_batched.values()):  # mapped state: each example keeps its own
      return combine(new, old), new_batched
    out, out_batched = _reduce_roles(new, old, rescale, new_batched)
    # Nested vmaps: an outer one reduces its own axis through the same rule.
    return combine(out, old), out_batched

  return combine(new_state, old_state)
