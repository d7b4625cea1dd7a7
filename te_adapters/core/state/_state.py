"""Recipe state: explicit pytrees, one per GEMM, with TE's variable names.

``DelayedScaling`` state is a ``DelayedScalingState`` (``_recipe_state``); stateless recipes keep
an ``EmptyState``. The core types the state once, where a call enters it (``check_state``); a
dict of TE's six names (an old checkpoint, a Linen collection) converts there, and a user's call
that passes one warns that the dict spelling is deprecated.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core.recipes import caller_stacklevel
from te_adapters.core.state import _accumulate
from te_adapters.core.state._recipe_state import (
  DelayedScalingState,
  EmptyState,
  is_state_mapping,
  leaf_kind,
)

__all__ = [
  "check_leaves",
  "shared_max_grad",
  "updated_state",
  "warn_dict_state",
  "with_max_grad",
]

State = DelayedScalingState | EmptyState
# A recipe's initial state and its checks (init_state, check_state) come from its format: they
# live with the format registry (formats._registry), above this module.


def check_leaves(state, expected, *, mismatch: str, bad_shape, layer: str | None = None) -> State:
  """Checks a state's names, shapes (against ``expected``) and float32 leaves.

  ``mismatch`` starts the message for wrong names; ``bad_shape(name, got, shape)`` gives the
  message for a wrong shape; ``layer`` (where the caller knows it) starts every message. Returns
  ``state`` unchanged (the format's ``typed_state`` types it).
  """
  lead = f"{layer}: " if layer else ""
  if not isinstance(state, Mapping):
    raise TypeError(
      f"{lead}state must be a DelayedScalingState or a dict of arrays, got {type(state).__name__}"
    )
  missing = sorted(set(expected) - set(state))
  extra = sorted(set(state) - set(expected))
  if missing or extra:
    raise ValueError(f"{lead}{mismatch}: missing {missing}, unexpected {extra}")
  for name, shape in expected.items():
    leaf = state[name]
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(
        f"{lead}state[{name!r}] is a jax.ShapeDtypeStruct, not an array: the recipe state was "
        "never loaded (an abstract model restored from a checkpoint that has no recipe state "
        "for this layer, such as one made with a recipe that keeps none, keeps its abstract "
        "entries). Restore a checkpoint of this recipe, or start from the initial state "
        "(te_adapters.core.init_state(recipe))"
      )
    if tuple(np.shape(leaf)) != shape:
      raise ValueError(lead + bad_shape(name, tuple(np.shape(leaf)), shape))
    dtype = getattr(leaf, "dtype", None)
    if not (_accumulate.is_accumulating(leaf) or dtype == np.float32):
      raise TypeError(f"{lead}state[{name!r}] must be float32, got {dtype}")
  return cast(State, state)


def warn_dict_state(state, fix: str) -> None:
  """Warns (``DeprecationWarning``, at the user's call) when ``state`` is recipe state spelled
  as a plain dict of TE's names rather than the typed state; ``fix`` names the typed spelling.
  An empty dict for a stateless recipe passes silently: it equals the ``EmptyState``."""
  if isinstance(state, Mapping) and not isinstance(state, (DelayedScalingState, EmptyState)):
    if len(state):
      warnings.warn(
        "recipe state as a dict of TE's names is deprecated and will be refused in the next "
        f"release; pass the typed state: {fix}",
        DeprecationWarning,
        stacklevel=caller_stacklevel(),
      )


# Any pytree of recipe states: the helpers below return the same structure.
T = TypeVar("T")


def with_max_grad(state: T) -> T:
  """Marks recipe state so that several uses in one step combine by max, not by sum.

  Call it on the state *inside* the differentiated function, before the state reaches any GEMM:

    def loss_fn(params, state, batch):
      state = te_adapters.core.with_max_grad(state)
      ...

  Amax histories then combine by max, and scales take the value of the use with the largest
  amax (a use that kept its old scale, for a zero or non-finite amax, gives way to one that
  updated it). The values are unchanged, and the gradient with respect to the float32 state stays
  float32. ``dot_general`` marks the state it is given in the same way (once per traced array,
  shared by all its uses), so a plain ``jax.grad`` already combines uses of one state passed
  around unchanged; calling this first also covers state rebuilt between uses (sliced, stacked,
  copied into a new array). Works on any
  pytree of recipe state (one GEMM's ``DelayedScalingState`` or dict of TE's names, or a nested
  tree of them); the entries TE names as scales (``x_scale``, ``kernel_scale``, ``grad_scale``)
  are treated as scales, everything else by max.

  Args:
    state: a pytree of recipe state.

  Returns:
    The same pytree, its values unchanged, marked for max-combination under differentiation.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> w, dn = jnp.ones((32, 16)), (((1,), (0,)), ((), ()))
    >>> def loss(state):
    ...   state = ta.core.with_max_grad(state)
    ...   gemm = lambda x: ta.core.dot_general(
    ...       x, w, dn, recipe=recipe, state=state, threshold=None).sum()
    ...   return gemm(jnp.full((16, 32), 1.0)) + gemm(jnp.full((16, 32), 3.0))
    >>> state = ta.core.init_state(recipe)
    >>> state = ta.core.updated_state(state, jax.grad(loss)(state))
    >>> float(state["x_amax_history"][-1])  # the larger use's amax, not the sum of both
    3.0
  """

  def convert(path, leaf):
    key = path[-1] if path else None
    kind = leaf_kind(getattr(key, "key", getattr(key, "name", None)))
    return _accumulate.to_accumulating(leaf, kind or "max")

  return jax.tree_util.tree_map_with_path(convert, state)


def shared_max_grad(state: DelayedScalingState) -> DelayedScalingState:
  """One GEMM's state, marked as by ``with_max_grad`` once per traced leaf (see
  ``_accumulate.to_accumulating_shared``): every use of one state in a trace gets the same marked
  arrays, so a plain ``jax.grad`` combines the uses by max."""
  return DelayedScalingState(
    **{
      name: _accumulate.to_accumulating_shared(state[name], leaf_kind(name) or "max")
      for name in state
    }
  )


def updated_state(old_state: T, state_grads: T) -> T:
  """The new state from the gradient with respect to the state.

  The gradient is the new state (see ``dot_general``), except for a GEMM whose output did not
  reach the loss: its state gradient is zero, and that GEMM keeps its old state. A valid scale is
  never zero, so a zero scale marks such a GEMM. Works on any pytree of recipe states (typed, or
  dicts of TE's names as Linen collections and Haiku state hold them); each keeps its type.

  Args:
    old_state: the state the step was computed with.
    state_grads: the gradient of the loss with respect to ``old_state`` (same structure).

  Returns:
    The state for the next step.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> state = ta.core.init_state(recipe)
    >>> x, w = jnp.full((16, 32), 2.0), jnp.ones((32, 16))
    >>> loss = lambda s: ta.core.dot_general(
    ...     x, w, (((1,), (0,)), ((), ())), recipe=recipe, state=s, threshold=None).sum()
    >>> state = ta.core.updated_state(state, jax.grad(loss)(state))
    >>> float(state["x_amax_history"][-1])  # the step's amax of x, recorded
    2.0
  """

  def pick(old, new):
    return jax.tree_util.tree_map(lambda o, n: n.astype(o.dtype), old, new)

  def merge(old, new):
    if is_state_mapping(old):
      new_typed = DelayedScalingState.from_mapping(new)
      used = jnp.all(jnp.stack([jnp.all(s != 0) for s in new_typed.scales()]))
      merged = {
        name: jnp.where(used, new_typed[name], old[name]).astype(old[name].dtype) for name in old
      }
      return DelayedScalingState(**merged) if isinstance(old, DelayedScalingState) else merged
    if isinstance(old, Mapping):
      return {k: merge(old[k], new[k]) for k in old}
    return pick(old, new)

  return merge(old_state, state_grads)
