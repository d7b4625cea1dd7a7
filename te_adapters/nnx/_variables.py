"""The NNX variable type that holds recipe state, and how a module holds one GEMM's typed state."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from te_adapters import core

__all__ = [
  "HoldsRecipeState",
  "OptionalGemms",
  "RecipeState",
  "hold_state",
  "state_value",
  "te_name_aliases",
]


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


class HoldsRecipeState:
  """Mixin (before ``nnx.Module``) of a module whose recipe state is ``self.state``
  (``hold_state``), set in ``__init__`` only where the recipe keeps state.

  Where it keeps none (a stateless recipe, or no recipe), ``state`` is no attribute of the graph
  and reads as the recipe's empty state (``EmptyState``, None without a recipe). A state that
  holds recipe entries for such a module, another recipe's model's given to ``nnx.update``,
  then reaches ``_graph_node_set_key``, which refuses it naming the layer (``_state_owner``),
  instead of Flax's "cannot set key on immutable node".
  """

  recipe: Any

  if not TYPE_CHECKING:

    def __getattr__(self, name):
      # Called only for attributes not found: the state of a module whose recipe keeps none.
      if name == "state" and "recipe" in vars(self):
        return None if self.recipe is None else core.typed_state(self.recipe, {})
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def _state_owner(self) -> str:
    """How the refusal names the layer: its class and shapes (its path where known)."""
    return f"{type(self).__name__} layer"

  def _graph_node_set_key(self, key, value) -> None:
    if key == "state" and "state" not in vars(self) and "recipe" in vars(self):
      raise ValueError(foreign_state_message(self._state_owner(), self.recipe, value))
    super()._graph_node_set_key(key, value)  # type: ignore[misc]


class OptionalGemms:
  """Mixin (before the NNX layer) of a layer whose GEMM slots (``_gemm_slots``: ``dot_general``,
  ``einsum_op``, ``dot_general_0``, ...) hold a quantized op (``_ops.DotGeneral``, which keeps
  the recipe state) only where it has a recipe.

  Without a recipe a slot holds what the NNX layer would (``lax.dot_general``), or is no
  attribute of the graph and reads as None. Recipe state given to such a layer (``nnx.update``
  with a quantized model's state, a restored checkpoint) then reaches ``_graph_node_set_key``,
  which refuses it naming the layer, where Flax said "Found data on value of type State assigned
  to static attribute" or "Cannot set key 'state' on immutable node of type NoneType".
  """

  _gemm_slots: tuple[str, ...] = ()
  _kernel_name: str = "kernel"
  recipe: Any

  if not TYPE_CHECKING:

    def __getattr__(self, name):
      # Called only for attributes not found: a GEMM slot of a layer without a recipe.
      if name in type(self)._gemm_slots and vars(self).get("recipe", ...) is None:
        return None
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def _layer_name(self) -> str:
    """The layer's class and its kernel's shape (NNX gives a layer no path)."""
    kernel = vars(self).get(self._kernel_name)
    shape = "" if kernel is None else f" ({self._kernel_name} {tuple(np.shape(kernel))})"
    return f"{type(self).__name__} layer{shape}"

  def _graph_node_set_key(self, key, value) -> None:
    if (
      key in self._gemm_slots
      and vars(self).get("recipe", ...) is None
      and isinstance(value, Mapping)
    ):
      given = value.get("state", value)
      raise ValueError(foreign_state_message(self._layer_name(), None, given))
    super()._graph_node_set_key(key, value)  # type: ignore[misc]


def foreign_state_message(layer: str, recipe, given) -> str:
  """The error for recipe state ``given`` (``nnx.update``'s entries for one module) that
  ``layer``, whose ``recipe`` keeps none, cannot take: which state was found and was expected,
  and the two ways out."""
  entries = dict(given) if isinstance(given, Mapping) else {}
  names = sorted(map(str, entries))
  stateful = core.DelayedScaling()
  found = "recipe state"
  if set(names) == set(core.state_names(stateful)):
    history = np.shape(_raw(entries["x_amax_history"]))
    found = f"DelayedScaling's recipe state (amax history length {history[-1] if history else '?'})"
  if recipe is None:
    keeps, go_on = "it has no recipe (high precision)", "without a recipe"
  else:
    keeps, go_on = f"its recipe {type(recipe).__name__} keeps none", f"with {type(recipe).__name__}"
  return (
    f"{layer}: the state given to it (nnx.update, or a checkpoint restored into this model) "
    f"holds {found}, entries {names}, but {keeps}, so the layer cannot take it: the state "
    "comes from a model built with another recipe. Build this model "
    "with that recipe to load it, or leave the recipe state out of what you load "
    f"(nnx.state(other, nnx.Not(te_adapters.nnx.RecipeState))) to go on {go_on}."
  )


def _raw(entry):
  """The array of one ``nnx.update`` entry (a variable, a state leaf, an array, or Orbax's
  ``{"value": array}`` of a variable restored without a target)."""
  if isinstance(entry, Mapping) and "value" in entry:
    entry = entry["value"]
  return entry.get_value() if isinstance(entry, nnx.Variable) else entry


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
