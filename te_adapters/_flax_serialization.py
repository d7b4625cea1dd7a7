"""``flax.serialization`` for the core's typed recipe state (the Flax adapters register it).

A ``DelayedScalingState`` serializes as the dict of TE's names that ``init_state`` returned
before the state was typed, so ``flax.serialization.to_bytes`` writes the same checkpoint as
before, and ``from_bytes(init_state(recipe), old_bytes)`` restores a typed state from an old one;
an ``EmptyState`` serializes as ``{}``.
"""

from __future__ import annotations

from flax import serialization

from te_adapters import core


def _to_state_dict(state: core.DelayedScalingState) -> dict:
  return {name: serialization.to_state_dict(state[name]) for name in state}


def _from_state_dict(target: core.DelayedScalingState, state: dict) -> core.DelayedScalingState:
  restored = core.DelayedScalingState.from_mapping(state)
  return core.DelayedScalingState(
    **{
      name: serialization.from_state_dict(target[name], restored[name], name=name)
      for name in target
    }
  )


def register() -> None:
  """Registers the typed states with ``flax.serialization`` (again is a no-op)."""
  serialization.register_serialization_state(
    core.DelayedScalingState, _to_state_dict, _from_state_dict, override=True
  )
  # A stateless recipe's state writes as the empty dict it was before it was typed.
  serialization.register_serialization_state(
    core.EmptyState, lambda state: {}, lambda target, state: core.EmptyState(), override=True
  )
