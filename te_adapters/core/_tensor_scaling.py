"""The per-tensor FP8 scalings behind one interface: delayed (stateful) and current (stateless).

A scaling is a few pure functions, as a block format is (``_format.BlockFormat``): the state it
keeps for one GEMM, the scale it knows before an operand is cast, and the scale and state that
follow from the operand's amax. ``of(recipe)`` picks one; the per-tensor GEMM
(``_gemm``) calls its functions and never names a recipe class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_adapters.core import _accumulate, _scaling, _sharding
from te_adapters.core._recipes import DelayedScaling

__all__ = ["CURRENT", "DELAYED", "TensorScaling", "of"]

ROLES = ("x", "kernel", "grad")


class TensorScaling(NamedTuple):
  """The functions of one per-tensor scaling.

  Attributes:
    init_state: ``recipe -> {name: array}``: one GEMM's initial state.
    state_shapes: ``recipe -> {name: shape}``: the state one GEMM keeps, with TE's names
      (empty for a stateless scaling).
    stored_scale: ``(state, role) -> scale or None``: the float32 scale known before ``role``'s
      operand is read (delayed scaling's stored one), or None when its amax decides it.
    state_varying: ``(state, role) -> mesh axes``: the manual mesh axes ``role``'s state varies
      over inside ``shard_map`` (None when there is no state).
    next_scale: ``(recipe, amax, state, role, fp8_max) -> (scale, new state entries)``: the
      scale ``role``'s operand is cast with, and the role's state for the next step.
  """

  init_state: Callable[..., dict[str, jax.Array]]
  state_shapes: Callable[..., dict[str, tuple[int, ...]]]
  stored_scale: Callable[..., jax.Array | None]
  state_varying: Callable[..., frozenset | None]
  next_scale: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def _delayed_shapes(recipe) -> dict[str, tuple[int, ...]]:
  shapes = {}
  for role in ROLES:
    shapes[f"{role}_scale"] = (1,)
    shapes[f"{role}_amax_history"] = (recipe.amax_history_len,)
  return shapes


def _delayed_init(recipe) -> dict[str, jax.Array]:
  """Scales 1 and empty amax histories (TE's initial values)."""
  state = {}
  for role in ROLES:
    state[f"{role}_scale"] = jnp.ones((1,), jnp.float32)
    state[f"{role}_amax_history"] = jnp.zeros((recipe.amax_history_len,), jnp.float32)
  return state


def _delayed_stored_scale(state, role):
  return _accumulate.to_float32(state[f"{role}_scale"])


def _delayed_varying(state, role):
  return _sharding.varying_axes(state[f"{role}_scale"]) | _sharding.varying_axes(
      state[f"{role}_amax_history"]
  )


def _delayed_next(recipe, amax, state, role, fp8_max):
  """TE's rule: the stored scale casts this step; the history and scale roll for the next."""
  scale = _accumulate.to_float32(state[f"{role}_scale"])
  history = _accumulate.to_float32(state[f"{role}_amax_history"])
  new_scale, new_history, updated = _scaling.delayed_update_and_flag(
      amax, scale, history, fp8_max, recipe.margin, recipe.amax_compute_algo
  )
  new = {
      f"{role}_scale": _accumulate.encode_scale(
          new_scale, updated, scale, state[f"{role}_scale"]
      ),
      f"{role}_amax_history": _accumulate.like(new_history, state[f"{role}_amax_history"]),
  }
  return scale, new


def _current_next(recipe, amax, state, role, fp8_max):
  del recipe, state, role
  return _scaling.compute_scale(amax, fp8_max, 1.0), {}


DELAYED = TensorScaling(
    init_state=_delayed_init,
    state_shapes=_delayed_shapes,
    stored_scale=_delayed_stored_scale,
    state_varying=_delayed_varying,
    next_scale=_delayed_next,
)
CURRENT = TensorScaling(
    init_state=lambda recipe: {},
    state_shapes=lambda recipe: {},
    stored_scale=lambda state, role: None,
    state_varying=lambda state, role: None,
    next_scale=_current_next,
)


def of(recipe) -> TensorScaling:
  """The scaling of a recipe: delayed for ``DelayedScaling``, current (stateless) otherwise."""
  return DELAYED if isinstance(recipe, DelayedScaling) else CURRENT
