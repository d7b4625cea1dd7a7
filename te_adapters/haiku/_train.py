"""Training helpers: recipe state apart from ordinary Haiku state, and a gradient step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from te_adapters import core

__all__ = [
  "RECIPE_STATE_NAMES",
  "split_state",
  "merge_state",
  "value_and_grad",
  "value_grad_and_state",
]

# Naming convention: inside a module's Haiku state these names hold recipe state (TE's names).
RECIPE_STATE_NAMES: frozenset[str] = frozenset(core.state_names(core.DelayedScaling()))

State = Mapping[str, Mapping[str, Any]]


def split_state(state: State) -> tuple[dict, dict]:
  """Splits Haiku state into ``(recipe_state, other_state)``.

  Recipe state is every entry named like TE's recipe variables (``RECIPE_STATE_NAMES``:
  ``x_scale``, ``x_amax_history``, ``kernel_*``, ``grad_*``); those names are reserved for it.
  Everything else (``hk.BatchNorm`` averages, counters, ...) is ordinary state. A module holding
  only some of the recipe names is an error, since it cannot be recipe state of one GEMM.

  Args:
    state: Haiku state, ``{module_name: {state_name: array}}``.

  Returns:
    Two dicts of the same form; modules with no entry of a kind are left out of that dict.

  Raises:
    TypeError: ``state`` (or a module's entry) is not a mapping.
    ValueError: a module holds some of the recipe names but not all.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> def f(x):
    ...   x = ta_hk.Linear(16, recipe=ta.DelayedScaling(amax_history_len=4))(x)
    ...   return hk.BatchNorm(True, True, 0.9)(x, is_training=True)
    >>> _, state = hk.transform_with_state(f).init(jax.random.key(0), jnp.ones((4, 32)))
    >>> recipe_state, other_state = ta_hk.split_state(state)
    >>> list(recipe_state), sorted(other_state)[0]
    (['linear'], 'batch_norm/~/mean_ema')
  """
  if not isinstance(state, Mapping):
    raise TypeError(f"state must be a Haiku state mapping, got {type(state).__name__}")
  recipe_state, other_state = {}, {}
  for module_name, entries in state.items():
    if not isinstance(entries, Mapping):
      raise TypeError(
        f"state[{module_name!r}] must map state names to arrays, got {type(entries).__name__}"
      )
    recipe = {k: v for k, v in entries.items() if k in RECIPE_STATE_NAMES}
    other = {k: v for k, v in entries.items() if k not in RECIPE_STATE_NAMES}
    if recipe and len(recipe) != len(RECIPE_STATE_NAMES):
      missing = sorted(RECIPE_STATE_NAMES - set(recipe))
      raise ValueError(
        f"state of {module_name!r} has recipe state names {sorted(recipe)} but lacks "
        f"{missing}; the names {sorted(RECIPE_STATE_NAMES)} are reserved for recipe state"
      )
    if recipe:
      recipe_state[module_name] = recipe
    if other:
      other_state[module_name] = other
  return recipe_state, other_state


def merge_state(recipe_state: State, other_state: State) -> dict:
  """The inverse of ``split_state``: one Haiku state holding both parts.

  Args:
    recipe_state: the recipe state, ``{module_name: {state_name: array}}``.
    other_state: the other state, of the same form.

  Returns:
    One Haiku state with both parts' entries (new dicts; the arguments are not changed).

  Raises:
    ValueError: a module's entry is in both parts.

  Example:
    >>> from te_adapters import haiku as ta_hk
    >>> ta_hk.merge_state({"linear": {"x_scale": 1.0}}, {"linear": {"count": 0}, "bn": {}})
    {'linear': {'count': 0, 'x_scale': 1.0}, 'bn': {}}
  """
  merged = {name: dict(entries) for name, entries in other_state.items()}
  for module_name, entries in recipe_state.items():
    target = merged.setdefault(module_name, {})
    clash = sorted(set(target) & set(entries))
    if clash:
      raise ValueError(f"state of {module_name!r}: {clash} given as both recipe and other state")
    target.update(entries)
  return merged


def value_grad_and_state(
  loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, Any, dict]]:
  """Turns a loss written with ``apply`` into a step giving the loss, grads and the new state.

  ``loss_fn(params, state, *args, **kwargs)`` calls the transformed model's ``apply`` with
  ``state`` and returns ``(loss, new_state)``, or ``(loss, (aux, new_state))`` with
  ``has_aux=True``, where ``new_state`` is the state ``apply`` returned. The returned function
  has the same arguments and returns ``(loss, aux, param_grads, new_state)`` (``aux`` is ``None``
  without ``has_aux``), where ``new_state`` holds

  * recipe state from the gradient with respect to it (the quantized GEMMs' "overwrite with
    gradient" channel), marked with ``core.with_max_grad`` inside the differentiated function, so
    a layer used several times in a step records the largest amax, not a sum; a layer whose
    output did not reach the loss keeps its old state;
  * every other state entry (``hk.BatchNorm`` averages, ...) as ``apply`` returned it.

  Recipe state never enters ``param_grads``, so it never reaches the optimizer.

  Args:
    loss_fn: the loss, as described above.
    has_aux: whether ``loss_fn`` returns auxiliary data.

  Returns:
    ``step(params, state, *args, **kwargs) -> (loss, aux, param_grads, new_state)``.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> model = hk.transform_with_state(
    ...     lambda x: ta_hk.Linear(16, recipe=ta.DelayedScaling(amax_history_len=4),
    ...                            threshold=None)(x))
    >>> x = jnp.ones((8, 32))
    >>> params, state = model.init(jax.random.key(0), x)
    >>> def loss_fn(params, state, x):
    ...   y, state = model.apply(params, state, None, x)
    ...   return jnp.mean(y**2), state
    >>> loss, _, grads, state = jax.jit(ta_hk.value_grad_and_state(loss_fn))(params, state, x)
    >>> float(state["linear"]["x_amax_history"][-1])
    1.0
  """

  def step(params, state, *args, **kwargs):
    recipe_state, other_state = split_state(state)

    def differentiated(params, recipe_state):
      tracked = core.with_max_grad(recipe_state)
      out = loss_fn(params, merge_state(tracked, other_state), *args, **kwargs)
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
          "loss_fn must return (loss, new_state)"
          + (", with new_state replaced by (aux, new_state) for has_aux=True" if has_aux else "")
          + f"; got {type(out).__name__}"
        )
      loss, rest = out
      if has_aux:
        if not (isinstance(rest, tuple) and len(rest) == 2):
          raise TypeError("with has_aux=True, loss_fn must return (loss, (aux, new_state))")
        aux, new_state = rest
      else:
        aux, new_state = None, rest
      # Recipe entries of apply's state are the (unchanged) inputs; their news come from the grads.
      new_recipe, new_other = split_state(new_state)
      created = sorted(set(new_recipe) - set(recipe_state))
      if created:
        raise ValueError(
          f"recipe state of {created} was created inside apply, so it cannot be updated: pass "
          "the state returned by init (or by the previous step) to the step"
        )
      return loss, (aux, new_other)

    grad_fn = jax.value_and_grad(differentiated, argnums=(0, 1), has_aux=True)
    (loss, (aux, new_other)), (param_grads, recipe_grads) = grad_fn(params, recipe_state)
    new_recipe = core.updated_state(recipe_state, recipe_grads)
    return loss, aux, param_grads, merge_state(new_recipe, new_other)

  return step


def value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
  """``value_grad_and_state`` in the training-helper shape every adapter shares
  (``te_adapters.nnx.value_and_grad``, ``te_adapters.linen.value_and_grad``).

  ``loss_fn`` is as for ``value_grad_and_state``: ``loss_fn(params, state, *args, **kwargs)``
  returns ``(loss, new_state)``, or ``(loss, (aux, new_state))`` with ``has_aux``.

  Args:
    loss_fn: the loss, as described above.
    has_aux: whether ``loss_fn`` returns auxiliary data.

  Returns:
    ``step(params, state, *args, **kwargs) -> (value, (param_grads, new_state))``: ``value`` is
    ``loss`` (``(loss, aux)`` with ``has_aux``, as ``jax.value_and_grad`` gives it),
    ``param_grads`` go to the optimizer and ``new_state`` is the next step's Haiku state (recipe
    state from its gradient, the rest as ``apply`` returned it).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> model = hk.transform_with_state(lambda x: ta_hk.Linear(
    ...     16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)(x))
    >>> x = jnp.ones((8, 32))
    >>> params, state = model.init(jax.random.key(0), x)
    >>> def loss_fn(params, state, x):
    ...   y, state = model.apply(params, state, None, x)
    ...   return jnp.mean(y**2), state
    >>> loss, (grads, state) = ta_hk.value_and_grad(loss_fn)(params, state, x)
    >>> float(state["linear"]["x_amax_history"][-1])
    1.0
  """
  inner = value_grad_and_state(loss_fn, has_aux=has_aux)

  def step(params, state, *args, **kwargs):
    loss, aux, param_grads, new_state = inner(params, state, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), (param_grads, new_state)

  return step
