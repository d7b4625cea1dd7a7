"""Recipe state under ``vmap``: per-example state updates combine by max/min, not by sum.

When a quantized GEMM is vmapped with its state unmapped (``hk.vmap``, ``jax.vmap(in_axes=None)``
for the state), each example computes its own new state, and JAX's batching of the custom VJP
would *sum* those state cotangents over the batch (and cannot sum the accumulating dtypes of
``with_max_grad`` at all). Passing the new state through ``combine_over_batch`` in the backward
pass reduces it over the batch first, with the rule of ``with_max_grad``: amax histories by max,
scales by min. Since every example quantizes with the same stored scale, the result equals the
state of one unbatched GEMM over the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_adapters.core import _accumulate

__all__ = ["combine_over_batch"]


def _reduce(name: str, leaf):
  value = _accumulate.to_float32(leaf)
  value = jnp.min(value, axis=0) if name.endswith("scale") else jnp.max(value, axis=0)
  return _accumulate.like(value, leaf)


@jax.custom_batching.custom_vmap
def _combine(new_state, old_state):
  del old_state
  return new_state


@_combine.def_vmap
def _combine_rule(axis_size, in_batched, new_state, old_state):
  del axis_size
  new_batched, old_batched = in_batched
  out, out_batched = {}, {}
  for name, leaf in new_state.items():
    if new_batched[name] and not old_batched.get(name, False):
      out[name], out_batched[name] = _reduce(name, leaf), False
    else:
      out[name], out_batched[name] = leaf, new_batched[name]
  # Nested vmaps: the next (outer) one reduces its own axis through the same rule.
  return _combine(out, old_state), out_batched


def combine_over_batch(new_state: dict, old_state: dict) -> dict:
  """``new_state`` unchanged, except under ``vmap`` where ``old_state`` is unmapped.

  There the mapped new state is reduced over the batch (histories by max, scales by min), so it
  is unmapped like the state it replaces.
  """
  if not new_state:
    return new_state
  return _combine(new_state, {k: v for k, v in old_state.items() if k in new_state})
