"""Recipe state: explicit pytrees, one per GEMM, with TE's variable names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import _accumulate, _tensor_scaling
from te_adapters.core._recipes import check_recipe

__all__ = ["ROLES", "init_state", "check_state", "with_max_grad", "updated_state"]

ROLES = ("x", "kernel", "grad")

State = dict[str, Any]


def state_names(recipe) -> tuple[str, ...]:
  """The variable names of ``recipe``'s state, in TE's spelling (empty for stateless recipes)."""
  return tuple(_tensor_scaling.of(recipe).state_shapes(recipe))


def init_state(recipe) -> State:
  """The initial state of one GEMM under ``recipe``.

  For ``DelayedScaling`` a dict with ``{x,kernel,grad}_scale`` (float32 (1,), initialised to 1)
  and ``{x,kernel,grad}_amax_history`` (float32 (L,), zeros); for stateless recipes ``{}``.

  Example:
    >>> import te_adapters as ta
    >>> sorted(ta.core.init_state(ta.DelayedScaling(amax_history_len=4)))[:2]
    ['grad_amax_history', 'grad_scale']
  """
  recipe = check_recipe(recipe)
  return _tensor_scaling.of(recipe).init_state(recipe)


def _expected_shapes(recipe) -> dict[str, tuple[int, ...]]:
  return _tensor_scaling.of(recipe).state_shapes(recipe)


def check_state(recipe, state: Mapping[str, Any] | None) -> State:
  """Validates ``state`` against ``recipe``; returns it as a dict. Raises naming the mismatch."""
  expected = _expected_shapes(recipe)
  if state is None:
    if expected:
      raise ValueError(
          f"{type(recipe).__name__} keeps state: pass state=te_adapters.core.init_state(recipe)"
      )
    return {}
  return check_leaves(
      state,
      expected,
      mismatch=f"state does not match {recipe!r}",
      bad_shape=lambda name, got, shape: (
          f"state[{name!r}] has shape {got} but {recipe!r} needs {shape}"
      ),
  )


def check_leaves(state, expected, *, mismatch: str, bad_shape) -> State:
  """Checks a state dict's names, shapes (against ``expected``) and float32 leaves.

  ``mismatch`` starts the message for wrong names; ``bad_shape(name, got, shape)`` gives the
  message for a wrong shape. Returns the state as a dict.
  """
  if not isinstance(state, Mapping):
    raise TypeError(f"state must be a dict of arrays, got {type(state).__name__}")
  missing = sorted(set(expected) - set(state))
  extra = sorted(set(state) - set(expected))
  if missing or extra:
    raise ValueError(f"{mismatch}: missing {missing}, unexpected {extra}")
  for name, shape in expected.items():
    leaf = state[name]
    if tuple(np.shape(leaf)) != shape:
      raise ValueError(bad_shape(name, tuple(np.shape(leaf)), shape))
    dtype = getattr(leaf, "dtype", None)
    if not (_accumulate.is_accumulating(leaf) or dtype == np.float32):
      raise TypeError(f"state[{name!r}] must be float32, got {dtype}")
  return dict(state)


def _is_scale_name(path) -> bool:
  key = path[-1] if path else None
  name = getattr(key, "key", getattr(key, "name", None))
  return isinstance(name, str) and name.endswith("scale")


def with_max_grad(state):
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
  pytree of recipe state (one GEMM's dict, or a nested tree of them); leaves whose name ends in
  ``scale`` are treated as scales.
  """

  def convert(path, leaf):
    return _accumulate.to_accumulating(leaf, "scale" if _is_scale_name(path) else "max")

  return jax.tree_util.tree_map_with_path(convert, state)


def shared_max_grad(state: State) -> State:
  """One GEMM's state dict, marked as by ``with_max_grad`` once per traced leaf (see
  ``_accumulate.to_accumulating_shared``): every use of one state in a trace gets the same marked
  arrays, so a plain ``jax.grad`` combines the uses by max."""
  return {
      name: _accumulate.to_accumulating_shared(leaf, "scale" if name.endswith("scale") else "max")
      for name, leaf in state.items()
  }


def updated_state(old_state, state_grads):
  """The new state from the gradient with respect to the state.

  The gradient is the new state (see ``dot_general``), except for a GEMM whose output did not
  reach the loss: its state gradient is zero, and that GEMM keeps its old state. A valid scale is
  never zero, so a zero scale marks such a GEMM. Works on any pytree of recipe-state dicts.
  """

  def pick(old, new):
    return jax.tree_util.tree_map(lambda o, n: n.astype(o.dtype), old, new)

  def merge(old, new):
    if isinstance(old, Mapping) and any(str(k).endswith("_scale") for k in old):
      used = jnp.all(jnp.stack([jnp.all(v != 0) for k, v in new.items() if k.endswith("_scale")]))
      return jax.tree_util.tree_map(lambda o, n: jnp.where(used, n, o).astype(o.dtype), old, new)
    if isinstance(old, Mapping):
      return {k: merge(old[k], new[k]) for k in old}
    return pick(old, new)

  return merge(old_state, state_grads)
