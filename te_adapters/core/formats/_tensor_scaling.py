"""The per-tensor FP8 scalings behind one interface: delayed (stateful) and current (stateless).

A scaling is a few pure functions, as a block format is (``_format.BlockFormat``): the state it
keeps for one GEMM, the scale it knows before an operand is cast, and the scale and state that
follow from the operand's amax. ``_tensor_format.tensor_format`` makes a per-tensor recipe's
``Format`` from one, and the registry maps the recipe to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_adapters.core import sharding
from te_adapters.core import state as core_state
from te_adapters.core.formats import _scaling
from te_adapters.core.state import ROLES, DelayedScalingState, EmptyState, RoleState

__all__ = ["CURRENT", "DELAYED", "TensorScaling"]


class TensorScaling(NamedTuple):
  """The functions of one per-tensor scaling.

  Attributes:
    init_state: ``recipe -> state``: one GEMM's initial state (a ``DelayedScalingState``, or
      ``{}`` for a stateless scaling).
    state_shapes: ``recipe -> {name: shape}``: the state one GEMM keeps, with TE's names
      (empty for a stateless scaling).
    stored_scale: ``(state, role) -> scale or None``: the float32 scale known before ``role``'s
      operand is read (delayed scaling's stored one), or None when its amax decides it.
    state_varying: ``(state, role) -> mesh axes``: the manual mesh axes ``role``'s state varies
      over inside ``shard_map`` (None when there is no state).
    next_scale: ``(recipe, amax, state, role, fp8_max) -> (scale, RoleState or None)``: the
      scale ``role``'s operand is cast with, and the role's state for the next step.
    next_state: ``(state, {role: RoleState or None}) -> state``: the GEMM's next state from the
      roles' new states.

  Example:
    Current scaling with one bit of headroom, as the format of a new recipe class:

    >>> import dataclasses, jax.numpy as jnp, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class HeadroomScaling(ta.Float8CurrentScaling):
    ...   pass
    >>> def next_scale(recipe, amax, state, role, fp8_max):
    ...   return ta.core.compute_scale(amax, fp8_max / 2, 1.0), None
    >>> current = ta.core.format_of(ta.Float8CurrentScaling()).scaling
    >>> scaling = current._replace(next_scale=next_scale)
    >>> ta.core.register_format(ta.core.tensor_format(HeadroomScaling, scaling))
    >>> request = ta.core.QuantizeRequest(jnp.array([[1.0, 2.0]]), "x", HeadroomScaling())
    >>> ta.core.format_of(HeadroomScaling()).quantize(request).rows.data.tolist()  # max 224
    [[112.0, 224.0]]
    >>> ta.core.unregister_format(HeadroomScaling)
  """

  init_state: Callable[..., DelayedScalingState | EmptyState | dict]
  state_shapes: Callable[..., dict[str, tuple[int, ...]]]
  stored_scale: Callable[..., jax.Array | None]
  state_varying: Callable[..., frozenset | None]
  next_scale: Callable[..., tuple[jax.Array, RoleState | None]]
  next_state: Callable[..., DelayedScalingState | EmptyState | dict]


def _delayed_shapes(recipe) -> dict[str, tuple[int, ...]]:
  shapes: dict[str, tuple[int, ...]] = {}
  for role in ROLES:
    shapes[f"{role}_scale"] = (1,)
    shapes[f"{role}_amax_history"] = (recipe.amax_history_len,)
  return shapes


def _delayed_init(recipe) -> DelayedScalingState:
  """Scales 1 and empty amax histories (TE's initial values)."""
  return DelayedScalingState.from_roles(
    {
      role: RoleState(
        scale=jnp.ones((1,), jnp.float32),
        amax_history=jnp.zeros((recipe.amax_history_len,), jnp.float32),
      )
      for role in ROLES
    }
  )


def _delayed_stored_scale(state, role):
  return core_state.to_float32(state.role(role).scale)


def _delayed_varying(state, role):
  own = state.role(role)
  return sharding.varying_axes(own.scale) | sharding.varying_axes(own.amax_history)


def _delayed_next(recipe, amax, state, role, fp8_max):
  """TE's rule: the stored scale casts this step; the history and scale roll for the next."""
  own = state.role(role)
  scale = core_state.to_float32(own.scale)
  history = core_state.to_float32(own.amax_history)
  new_scale, new_history, updated = _scaling.delayed_update_and_flag(
    amax, scale, history, fp8_max, recipe.margin, recipe.amax_compute_algo
  )
  new = RoleState(
    scale=core_state.encode_scale(new_scale, updated, scale, own.scale),
    amax_history=core_state.cast_like(new_history, own.amax_history),
  )
  return scale, new


def _delayed_next_state(state, roles):
  return state.with_roles(roles)


def _current_next(recipe, amax, state, role, fp8_max):
  del recipe, state, role
  return _scaling.compute_scale(amax, fp8_max, 1.0), None


DELAYED = TensorScaling(
  init_state=_delayed_init,
  state_shapes=_delayed_shapes,
  stored_scale=_delayed_stored_scale,
  state_varying=_delayed_varying,
  next_scale=_delayed_next,
  next_state=_delayed_next_state,
)
CURRENT = TensorScaling(
  init_state=lambda recipe: EmptyState(),
  state_shapes=lambda recipe: {},
  stored_scale=lambda state, role: None,
  state_varying=lambda state, role: None,
  next_scale=_current_next,
  next_state=lambda state, roles: EmptyState(),
)
