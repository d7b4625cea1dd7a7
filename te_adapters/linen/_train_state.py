"""A train state that gives parameters to the optimizer and overwrites recipe state."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import optax

from te_adapters import core
from te_adapters.linen._module import OVERWRITE_WITH_GRADIENT

__all__ = ["TrainState", "value_and_grad", "with_max_grad"]


def with_max_grad(variables: Mapping[str, Any]) -> dict[str, Any]:
  """``variables`` with the recipe-state collection marked for max accumulation.

  Call it inside the loss, before ``apply``, when a layer may run more than once per step (a
  shared layer, ``nn.scan`` with broadcast state, micro-batches): the uses then combine like one
  use that saw the largest amax. ``TrainState.value_and_grad`` does it for you.

  Args:
    variables: the model's variables, as ``apply`` takes them.

  Returns:
    A new dict of the same collections, the recipe state's values unchanged (and marked).

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> model = ta_linen.Dense(16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)
    >>> variables = model.init(jax.random.key(0), jnp.ones((8, 32)))
    >>> def loss(variables):  # one layer used twice in a step
    ...   variables = ta_linen.with_max_grad(variables)
    ...   return (model.apply(variables, jnp.full((8, 32), 1.0)).sum()
    ...           + model.apply(variables, jnp.full((8, 32), 3.0)).sum())
    >>> grads = jax.grad(loss)(variables)
    >>> new = ta.core.updated_state(variables["_overwrite_with_gradient"],
    ...                             grads["_overwrite_with_gradient"])
    >>> float(new["DelayedScalingDotGeneral_0"]["x_amax_history"][-1])  # the larger use's
    3.0
  """
  variables = dict(variables)
  if OVERWRITE_WITH_GRADIENT in variables:
    variables[OVERWRITE_WITH_GRADIENT] = core.with_max_grad(variables[OVERWRITE_WITH_GRADIENT])
  return variables


def value_and_grad(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
  """A training step's loss, parameter gradients and new recipe state: the training-helper
  shape every adapter shares (``te_adapters.nnx.value_and_grad``,
  ``te_adapters.haiku.value_and_grad``).

  ``loss_fn(variables, *args, **kwargs)`` returns the loss (``(loss, aux)`` with ``has_aux``),
  calling ``apply`` with ``variables``. The recipe state (the ``_overwrite_with_gradient``
  collection) is marked for max accumulation (see ``with_max_grad``) and differentiated with
  the parameters; its gradient, through ``core.updated_state``, is the new recipe state.

  Args:
    loss_fn: the loss, as described above.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``step(variables, *args, **kwargs) -> (value, (param_grads, recipe_state))``: ``value`` as
    ``jax.value_and_grad`` gives it, ``param_grads`` for the optimizer (``params`` only) and
    ``recipe_state`` the new ``_overwrite_with_gradient`` collection (``{}`` without one).

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> model = ta_linen.Dense(16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)
    >>> x = jnp.ones((8, 32))
    >>> variables = model.init(jax.random.key(0), x)
    >>> loss_fn = lambda variables, x: jnp.mean(model.apply(variables, x) ** 2)
    >>> loss, (grads, recipe_state) = ta_linen.value_and_grad(loss_fn)(variables, x)
    >>> float(recipe_state["DelayedScalingDotGeneral_0"]["x_amax_history"][-1])
    1.0
  """

  def step(variables: Mapping[str, Any], *args, **kwargs):
    variables = dict(variables)
    if "params" not in variables:
      raise ValueError("variables has no 'params' collection")
    params = variables.pop("params")
    recipe_state = variables.pop(OVERWRITE_WITH_GRADIENT, {})

    def wrapped(params, recipe_state):
      full = {"params": params, **variables}
      if recipe_state:
        full[OVERWRITE_WITH_GRADIENT] = core.with_max_grad(recipe_state)
      return loss_fn(full, *args, **kwargs)

    value, (g_params, g_state) = jax.value_and_grad(wrapped, argnums=(0, 1), has_aux=has_aux)(
      params, recipe_state
    )
    if recipe_state:
      recipe_state = core.updated_state(recipe_state, g_state)
    return value, (g_params, recipe_state)

  return step


class TrainState(flax.struct.PyTreeNode):
  """Parameters, recipe state and optimizer state of a Linen model.

  The optimizer sees only ``params``; ``recipe_state`` (the ``_overwrite_with_gradient``
  collection) is replaced by its gradient; other collections (``batch_stats``, ...) are kept in
  ``collections`` and updated by the caller.

  Build it with ``TrainState.create``; its fields:

  Args:
    step: the number of ``apply_gradients`` calls so far.
    apply_fn: the model's ``apply``.
    params: the ``params`` collection.
    recipe_state: the ``_overwrite_with_gradient`` collection (``{}`` without one).
    collections: the other collections.
    tx: the optax optimizer.
    opt_state: its state.

  Raises:
    ValueError: (``create``) variables without ``params``; (``apply_gradients``) grads without
      ``params``, or without the recipe state's gradient where the model keeps recipe state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> model = ta_linen.Dense(16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)
    >>> x = jnp.ones((8, 32))
    >>> state = ta_linen.TrainState.create(apply_fn=model.apply,
    ...                                    variables=model.init(jax.random.key(0), x),
    ...                                    tx=optax.sgd(0.1))
    >>> loss_fn = lambda variables, x: jnp.mean(state.apply_fn(variables, x) ** 2)
    >>> loss, grads = state.value_and_grad(loss_fn, x)
    >>> state = state.apply_gradients(grads=grads)
    >>> state.step, state.recipe_state["DelayedScalingDotGeneral_0"]["x_amax_history"].tolist()
    (1, [0.0, 0.0, 0.0, 1.0])
  """

  step: int
  apply_fn: Callable = flax.struct.field(pytree_node=False)
  params: Any
  recipe_state: Any
  collections: Any
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  opt_state: optax.OptState

  @classmethod
  def create(cls, *, apply_fn: Callable, variables: Mapping[str, Any], tx, **kwargs):
    """Splits ``variables`` into params, recipe state and other collections.

    Args:
      apply_fn: the model's ``apply``.
      variables: what ``init`` returned.
      tx: the optax optimizer (it sees ``params`` only).
      **kwargs: further fields of a subclass.

    Returns:
      A ``TrainState`` at step 0 with the optimizer's initial state.

    Raises:
      ValueError: ``variables`` has no ``params``.
    """
    variables = dict(variables)
    if "params" not in variables:
      raise ValueError("variables has no 'params' collection")
    params = variables.pop("params")
    recipe_state = variables.pop(OVERWRITE_WITH_GRADIENT, {})
    return cls(
      step=0,
      apply_fn=apply_fn,
      params=params,
      recipe_state=recipe_state,
      collections=variables,
      tx=tx,
      opt_state=tx.init(params),
      **kwargs,
    )

  @property
  def variables(self) -> dict[str, Any]:
    """All collections, as ``apply`` takes them."""
    out = {"params": self.params, **self.collections}
    if self.recipe_state:
      out[OVERWRITE_WITH_GRADIENT] = self.recipe_state
    return out

  def value_and_grad(self, loss_fn: Callable, *args, has_aux: bool = False):
    """``jax.value_and_grad`` of ``loss_fn(variables, *args)`` w.r.t. params and recipe state.

    Marks the recipe state for max accumulation first (see ``with_max_grad``).

    Args:
      loss_fn: ``loss_fn(variables, *args)``, calling ``apply_fn`` with ``variables``.
      *args: its other arguments (a batch).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``; ``grads`` has ``params`` and
      ``_overwrite_with_gradient`` entries, as ``apply_gradients`` takes them.
    """

    def wrapped(params, recipe_state):
      variables = {"params": params, **self.collections}
      if recipe_state:
        variables[OVERWRITE_WITH_GRADIENT] = core.with_max_grad(recipe_state)
      return loss_fn(variables, *args)

    value, (g_params, g_state) = jax.value_and_grad(wrapped, argnums=(0, 1), has_aux=has_aux)(
      self.params, self.recipe_state
    )
    return value, {"params": g_params, OVERWRITE_WITH_GRADIENT: g_state}

  def apply_gradients(self, *, grads: Mapping[str, Any], **kwargs) -> TrainState:
    """One optimizer step on ``grads['params']``; recipe state from ``grads`` (see core).

    Args:
      grads: what ``value_and_grad`` returned: ``params`` and ``_overwrite_with_gradient``
        entries.
      **kwargs: other fields to replace.

    Returns:
      The next ``TrainState`` (``step`` + 1, new parameters, optimizer and recipe state).

    Raises:
      ValueError: ``grads`` without ``params``, or without the recipe state's gradient where the
        model keeps recipe state.
    """
    if "params" not in grads:
      raise ValueError("grads has no 'params' entry; pass the gradient w.r.t. all variables")
    updates, opt_state = self.tx.update(grads["params"], self.opt_state, self.params)
    params = optax.apply_updates(self.params, updates)
    recipe_state = self.recipe_state
    if recipe_state:
      if OVERWRITE_WITH_GRADIENT not in grads:
        raise ValueError(
          f"grads has no {OVERWRITE_WITH_GRADIENT!r} entry: differentiate w.r.t. the recipe "
          "state too, or its new values are lost"
        )
      recipe_state = core.updated_state(recipe_state, grads[OVERWRITE_WITH_GRADIENT])
    return self.replace(
      step=self.step + 1,
      params=params,
      recipe_state=recipe_state,
      opt_state=opt_state,
      **kwargs,
    )
