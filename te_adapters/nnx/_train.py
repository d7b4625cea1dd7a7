"""Training helpers: gradients that carry the new recipe state, and writing it into the model.

The core's state rule: the gradient of the loss with respect to the recipe state is the new state.
``value_and_grad`` / ``grad`` differentiate with respect to the parameters *and* the
``RecipeState`` variables, mark the state so that several uses in one step combine by max (see
``te_adapters.core.with_max_grad``), and hand the two gradients back separately, so the optimizer
only ever sees parameter gradients. ``update_recipe_state`` writes the new state into the model.
"""

from __future__ import annotations

import functools
import typing as tp
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from te_adapters import core
from te_adapters.nnx._variables import RecipeState

__all__ = [
  "value_and_grad",
  "grad",
  "update_recipe_state",
  "recipe_state",
  "upgrade_state_dict",
]


def _argnum_tuple(argnums) -> tuple[int, ...]:
  if isinstance(argnums, int):
    return (argnums,)
  argnums = tuple(argnums)
  if not argnums or not all(isinstance(a, int) for a in argnums):
    raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
  return argnums


def _recipe_state_variables(node) -> list[tuple[tuple, RecipeState]]:
  if not graphlib.is_graph_node(node):
    return []
  return [(path, v) for path, v in nnx.iter_graph(node) if isinstance(v, RecipeState)]


def _with_max_grad_state(f, argnums: tuple[int, ...]):
  """``f`` with the recipe state of its differentiated graph arguments marked for max-combine."""

  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    saved = []
    for i in argnums:
      for path, variable in _recipe_state_variables(args[i]):
        value = variable.get_value()
        marked = core.with_max_grad({str(path[-1]): value})[str(path[-1])]
        saved.append((variable, value))
        variable.set_value(marked)
    try:
      return f(*args, **kwargs)
    finally:
      # Leave the float32 values in place, so nothing of the marked dtype leaves the function.
      for variable, value in reversed(saved):
        variable.set_value(value)

  return wrapped


def _split_grads(grads, wrt):
  if not isinstance(grads, nnx.State):
    return grads, None
  params = nnx.All(wrt, nnx.Not(RecipeState))
  param_grads, state_grads = nnx.split_state(grads, params, RecipeState)
  return param_grads, state_grads


def _grad_general(f, argnums, has_aux, wrt, return_value, **kwargs):
  argnums_t = _argnum_tuple(argnums)
  diff = tuple(nnx.DiffState(i, nnx.Any(wrt, RecipeState)) for i in argnums_t)
  transform = nnx.value_and_grad if return_value else nnx.grad
  inner = transform(
    _with_max_grad_state(f, argnums_t),
    argnums=diff[0] if isinstance(argnums, int) else diff,
    has_aux=has_aux,
    **kwargs,
  )

  def split(grads):
    if isinstance(argnums, int):
      return _split_grads(grads, wrt)
    pairs = [_split_grads(g, wrt) for g in grads]
    return tuple(p for p, _ in pairs), tuple(s for _, s in pairs)

  @functools.wraps(f)
  def grad_fn(*args, **fkwargs):
    out = inner(*args, **fkwargs)
    if return_value:
      value, grads = out
      return value, split(grads)
    if has_aux:
      grads, aux = out
      return split(grads), aux
    return split(out)

  return grad_fn


def value_and_grad(
  f: tp.Callable[..., tp.Any],
  *,
  argnums: int | tp.Sequence[int] = 0,
  has_aux: bool = False,
  wrt: nnx.filterlib.Filter = nnx.Param,
  **kwargs: tp.Any,
) -> tp.Callable[..., tp.Any]:
  """``nnx.value_and_grad`` that also returns the new recipe state.

  The training-helper shape every adapter shares (``te_adapters.linen.value_and_grad``,
  ``te_adapters.haiku.value_and_grad``): ``(value, (param_grads, state))``.

  Differentiates ``f`` with respect to the ``wrt`` variables (default ``nnx.Param``) and the
  ``RecipeState`` variables of the graph arguments in ``argnums``. Several uses of one layer in
  ``f`` (a layer called twice, ``nnx.scan`` over broadcast state) combine into the state one use
  seeing the largest amax would give, never a sum.

  Args:
    f: the loss function, as for ``nnx.value_and_grad``.
    argnums: the argument index, or indices, to differentiate (as ints).
    has_aux: whether ``f`` returns ``(loss, aux)``.
    wrt: filter of the variables to return gradients for (default ``nnx.Param``); recipe state
      is never among them.
    **kwargs: passed to ``nnx.value_and_grad`` (``holomorphic``, ``allow_int``, ...).

  Returns:
    A function returning what ``nnx.value_and_grad`` returns, with each gradient replaced by the
    pair ``(grads, state_grads)``: ``grads`` holds the ``wrt`` gradients only (give it to
    ``nnx.Optimizer.update``); ``state_grads`` holds the new recipe state (give it to
    ``update_recipe_state``). With a tuple ``argnums``, both are tuples.

  Example:
    >>> import jax.numpy as jnp, optax, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                       threshold=None, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
    >>> loss, (grads, state_grads) = ta_nnx.value_and_grad(loss_fn)(model, jnp.ones((4, 32)))
    >>> _ = optimizer.update(model, grads)
    >>> ta_nnx.update_recipe_state(model, state_grads)
    >>> float(model.dot_general.state.x_amax_history[-1])
    1.0
  """
  return _grad_general(f, argnums, has_aux, wrt, return_value=True, **kwargs)


def grad(
  f: tp.Callable[..., tp.Any],
  *,
  argnums: int | tp.Sequence[int] = 0,
  has_aux: bool = False,
  wrt: nnx.filterlib.Filter = nnx.Param,
  **kwargs: tp.Any,
) -> tp.Callable[..., tp.Any]:
  """``nnx.grad`` that also returns the new recipe state; see ``value_and_grad``.

  Args:
    f: the loss function, as for ``nnx.grad``.
    argnums: the argument index, or indices, to differentiate (as ints).
    has_aux: whether ``f`` returns ``(loss, aux)``.
    wrt: filter of the variables to return gradients for (default ``nnx.Param``).
    **kwargs: passed to ``nnx.grad``.

  Returns:
    A function returning ``(grads, state_grads)`` (``((grads, state_grads), aux)`` with
    ``has_aux``).

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                       threshold=None, rngs=nnx.Rngs(0))
    >>> grads, state_grads = ta_nnx.grad(lambda m, x: jnp.mean(m(x) ** 2))(model, jnp.ones((4, 32)))
    >>> sorted(nnx.to_pure_dict(grads))
    ['bias', 'kernel']
    >>> ta_nnx.update_recipe_state(model, state_grads)
    >>> model.dot_general.state.x_amax_history[...].tolist()
    [0.0, 0.0, 0.0, 1.0]
  """
  return _grad_general(f, argnums, has_aux, wrt, return_value=False, **kwargs)


def recipe_state(model) -> nnx.State:
  """The ``RecipeState`` variables of ``model``, as an ``nnx.State`` (``nnx.state(model,
  RecipeState)``); ``nnx.to_pure_dict`` of it is a plain dict for a checkpointer.

  Args:
    model: an NNX module (or graph).

  Returns:
    An ``nnx.State`` of its ``RecipeState`` variables (empty for a model without any).

  Example:
    >>> import te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                       rngs=nnx.Rngs(0))
    >>> saved = nnx.to_pure_dict(ta_nnx.recipe_state(model))  # a plain dict of arrays
    >>> list(saved), sorted(saved["dot_general"]["state"])[-2:]
    (['dot_general'], ['x_amax_history', 'x_scale'])
  """
  return nnx.state(model, RecipeState)


def upgrade_state_dict(saved: Mapping) -> dict:
  """A pure-dict checkpoint of an NNX model (``nnx.to_pure_dict``) written before the recipe
  state was typed, in today's layout.

  Each quantized op held its state entries (``x_scale``, ``x_amax_history``, ...) directly; now
  they are its typed ``state`` (``dot_general/x_scale`` became ``dot_general/state/x_scale``).
  This moves every such group of TE's names under ``state`` and leaves everything else, so
  ``nnx.replace_by_pure_dict(nnx.state(model), upgrade_state_dict(old))`` loads an old checkpoint.
  A checkpoint in today's layout comes back unchanged.

  Args:
    saved: the checkpoint, a nested dict of arrays (``nnx.to_pure_dict``'s form).

  Returns:
    A new nested dict in today's layout.

  Raises:
    TypeError: ``saved`` is not a mapping.

  Example:
    >>> import numpy as np, te_adapters as ta
    >>> from te_adapters.nnx import upgrade_state_dict
    >>> old = {"dense": {"kernel": np.ones((2, 2)), "dot_general": dict(
    ...     ta.core.init_state(ta.DelayedScaling()))}}
    >>> sorted(upgrade_state_dict(old)["dense"]["dot_general"]["state"])[:2]
    ['grad_amax_history', 'grad_scale']
  """
  names = core.state_names(core.DelayedScaling())

  def upgrade(node, key=None):
    if not isinstance(node, Mapping):
      return node
    out = {k: upgrade(v, k) for k, v in node.items()}
    if key != "state" and all(n in node for n in names) and "state" not in node:
      out["state"] = {n: out.pop(n) for n in names}
    return out

  if not isinstance(saved, Mapping):
    raise TypeError(f"saved must be a pure dict (nnx.to_pure_dict), got {type(saved).__name__}")
  return upgrade(saved)


def _gemm_updated(old: dict, new: dict) -> dict:
  """``core.updated_state`` for one GEMM, per layer when the state is stacked (scan, vmap)."""
  stack_dims = np.ndim(core.DelayedScalingState.from_mapping(old).role("x").scale) - 1
  fn = core.updated_state
  for _ in range(stack_dims):
    fn = jax.vmap(fn)
  return fn(old, new)


def _merge(old, new, path=()):
  if not isinstance(old, Mapping):
    raise ValueError(f"recipe state at {'/'.join(map(str, path))} is not a dict of arrays")
  if set(old) != set(new):
    where = "/".join(map(str, path)) or "the model"
    raise ValueError(
      f"state_grads do not match the recipe state of {where}: missing "
      f"{sorted(map(str, set(old) - set(new)))}, unexpected "
      f"{sorted(map(str, set(new) - set(old)))}"
    )
  if core.is_state_mapping(old):
    for k in old:
      if np.shape(old[k]) != np.shape(new[k]):
        raise ValueError(
          f"state_grads at {'/'.join(map(str, (*path, k)))} has shape {np.shape(new[k])}, "
          f"the recipe state {np.shape(old[k])}"
        )
    return _gemm_updated(dict(old), dict(new))
  return {k: _merge(old[k], new[k], (*path, k)) for k in old}


def update_recipe_state(model, state_grads) -> None:
  """Writes the new recipe state, from the gradients with respect to it, into ``model``.

  A layer whose output did not reach the loss (its state gradient is zero) keeps its state.

  Args:
    model: the NNX module (or graph) that was differentiated.
    state_grads: the ``state_grads`` from ``value_and_grad`` / ``grad`` (an ``nnx.State``, or
      ``nnx.to_pure_dict`` of it); ``None`` or an empty state when the model has no recipe state.

  Returns:
    None; ``model``'s ``RecipeState`` variables hold the new state.

  Raises:
    TypeError: ``state_grads`` is neither an ``nnx.State`` nor a mapping.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                       threshold=None, rngs=nnx.Rngs(0))
    >>> step = ta_nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))
    >>> loss, (grads, state_grads) = step(model, jnp.full((4, 32), 2.0))
    >>> ta_nnx.update_recipe_state(model, state_grads)
    >>> model.dot_general.state.x_scale[...].tolist()  # E4M3's 448 / amax 2
    [224.0]
  """
  current = nnx.state(model, RecipeState)
  old = nnx.to_pure_dict(current)
  if state_grads is None:
    state_grads = {}
  if isinstance(state_grads, nnx.State):
    state_grads = nnx.to_pure_dict(state_grads)
  if not isinstance(state_grads, Mapping):
    raise TypeError(
      f"state_grads must be the nnx.State from te_adapters.nnx.value_and_grad, got "
      f"{type(state_grads).__name__}"
    )
  if not old and not state_grads:
    return
  new = _merge(old, state_grads)
  nnx.replace_by_pure_dict(current, new)
  nnx.update(model, current)
