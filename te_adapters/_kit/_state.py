"""One GEMM's recipe state as an adapter creates it: TE's names, the core's initial values."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from te_adapters import core

__all__ = ["initial_state", "recipe_state"]


def initial_state(recipe, n_groups: int | None = None) -> Mapping[str, Any]:
  """The initial recipe state of one GEMM by TE's names (``x_scale``, ``x_amax_history``, ...).

  Empty for ``recipe=None`` and for stateless recipes. With ``n_groups``, the state of a grouped
  GEMM (``core.ragged_dot``) of that many groups.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters._kit import initial_state
    >>> state = initial_state(ta.DelayedScaling(amax_history_len=4), n_groups=2)
    >>> state["x_amax_history"].shape, dict(initial_state(ta.Float8CurrentScaling()))
    ((2, 4), {})
  """
  if recipe is None:
    return {}
  if n_groups is None:
    return core.init_state(recipe)
  # A stateless recipe has no grouped state to make (the grouped GEMM refuses what it cannot run).
  return core.init_ragged_state(recipe, n_groups) if core.state_names(recipe) else {}


def recipe_state(
  recipe, variable: Callable[[str, Any], Any], n_groups: int | None = None
) -> core.DelayedScalingState | core.EmptyState | None:
  """The typed state (``core.typed_state``) of ``{name: variable(name, initial value)}`` over
  ``initial_state(recipe, n_groups)``, or None where the recipe keeps no state.

  ``variable`` is the framework's way of declaring one state entry and reading its current value
  (a Linen variable, ``hk.get_state``); it is called once per entry, in the state's order.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters._kit import recipe_state
    >>> store = {}
    >>> state = recipe_state(ta.DelayedScaling(), lambda name, v: store.setdefault(name, v))
    >>> type(state).__name__, sorted(state) == sorted(store) and len(store)
    ('DelayedScalingState', 6)
    >>> recipe_state(ta.Float8CurrentScaling(), lambda name, v: v) is None
    True
  """
  state = {name: variable(name, value) for name, value in initial_state(recipe, n_groups).items()}
  # Typed here, where the framework's variables (TE's names) meet the core.
  return core.typed_state(recipe, state) if state else None
