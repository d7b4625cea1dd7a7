"""The NNX variable type that holds recipe state, and how a module holds one GEMM's typed state."""

from __future__ import annotations

import warnings

import jax
from flax import nnx

from te_adapters import core

__all__ = ["RecipeState", "hold_state", "state_value", "te_name_aliases"]


class RecipeState(nnx.Variable):
  """Recipe state of a quantized layer (amax histories and scales, TE's names).

  A separate ``nnx.Variable`` type, so ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never updates
  it; its new value comes from the gradient with respect to it (see ``te_adapters.core``).

  Args:
    value: the entry's array (a float32 scale or amax history), as for ``nnx.Variable``.
    **metadata: as for ``nnx.Variable``.

  Example:
    >>> import jax, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                       rngs=nnx.Rngs(0))
    >>> type(layer.dot_general.state.x_scale).__name__
    'RecipeState'
    >>> sorted(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))  # not among the parameters
    ['bias', 'kernel']
  """


def hold_state(state):
  """One GEMM's typed state (``core.init_state``: a ``DelayedScalingState``, an ``EmptyState``)
  with a ``RecipeState`` variable at each leaf, as a module's data attribute (``self.state``).
  The state type stays; each entry keeps TE's name in the variable's path (``state/x_scale``)."""
  return nnx.data(jax.tree.map(RecipeState, state))


def state_value(held):
  """The typed state of arrays from ``hold_state``'s variables (None stays None)."""
  if held is None:
    return None
  return jax.tree.map(lambda v: v.get_value(), held, is_leaf=lambda v: isinstance(v, RecipeState))


def te_name_aliases(cls):
  """Gives ``cls`` (a module with ``self.state``) read-only ``x_scale``, ``x_amax_history``, ...
  that return the variables of ``self.state`` with a ``DeprecationWarning``: the variables lived
  under those names directly on the module before the state was typed."""

  def alias(name):
    def get(self):
      warnings.warn(
        f"{type(self).__name__}.{name} moved to {type(self).__name__}.state.{name} (the recipe "
        "state is one typed attribute, `state`); the old spelling goes in the next release",
        DeprecationWarning,
        stacklevel=2,
      )
      state = self.state
      if state is None or name not in state:
        raise AttributeError(f"{type(self).__name__} keeps no recipe state entry {name!r}")
      return state[name]

    return property(get, doc=f"Deprecated: ``state.{name}``.")

  for name in core.state_names(core.DelayedScaling()):
    setattr(cls, name, alias(name))
  return cls
