"""Flax Linen modules around the core's quantized ``dot_general``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from te_adapters import core

__all__ = ["OVERWRITE_WITH_GRADIENT", "make_dot_general_cls", "Dense", "DenseGeneral"]

# The collection that holds recipe state; its gradient is its new value (the name Flax and TE use).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class QuantizedDotGeneral(nn.Module):
  """A ``dot_general`` module: pass an instance as ``nn.Dense(..., dot_general=...)``.

  Holds the recipe state of one GEMM in the ``_overwrite_with_gradient`` collection, with TE's
  variable names (``x_scale``, ``x_amax_history``, ...). Use ``make_dot_general_cls(recipe)``.
  """

  recipe: Any = None
  threshold: Any = core.DEFAULT_SIZE_THRESHOLD

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    state = {}
    initial = {} if self.recipe is None else core.init_state(self.recipe)
    for name, value in initial.items():
      state[name] = self.variable(OVERWRITE_WITH_GRADIENT, name, lambda v=value: v).value
    return core.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision,
        preferred_element_type,
        recipe=self.recipe,
        state=state or None,
        threshold=self.threshold,
    )


def make_dot_general_cls(recipe, *, threshold=core.DEFAULT_SIZE_THRESHOLD) -> type[nn.Module]:
  """A Linen module class whose instances run ``dot_general`` quantized by ``recipe``.

  Used as in TransformerEngine's JAX tutorials:

    cls = make_dot_general_cls(te_adapters.DelayedScaling())
    y = nn.Dense(features, dot_general=cls())(x)

  Args:
    recipe: a te_adapters recipe.
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.

  Returns:
    A subclass of ``nn.Module`` taking no required constructor arguments.
  """
  recipe = core.check_recipe(recipe)
  threshold = core.check_threshold(threshold)
  name = f"{type(recipe).__name__}DotGeneral"
  fields = {"recipe": recipe, "threshold": threshold}
  annotations = dict.fromkeys(fields, Any)
  return type(name, (QuantizedDotGeneral,), {"__annotations__": annotations, **fields})


def _with_recipe_dot_general(module):
  if module.recipe is not None:
    current = module.dot_general_cls
    if isinstance(current, type) and issubclass(current, QuantizedDotGeneral):
      if current.recipe == module.recipe and current.threshold == module.threshold:
        return  # a clone of a module already set up
    if module.dot_general is not None or current is not None:
      raise ValueError(f"{type(module).__name__}: give either recipe or dot_general, not both")
    cls = make_dot_general_cls(module.recipe, threshold=module.threshold)
    object.__setattr__(module, "dot_general_cls", cls)


class Dense(nn.Dense):
  """``flax.linen.Dense`` with a ``recipe``: same parameters, the GEMM quantized by the recipe.

  ``recipe=None`` is exactly ``nn.Dense``. Recipe state lives in ``_overwrite_with_gradient``.
  ``threshold`` goes to ``core.dot_general`` (GEMMs below it stay in high precision).

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> layer = ta_linen.Dense(16, recipe=ta.DelayedScaling(amax_history_len=8))
    >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 32)))
    >>> sorted(variables)
    ['_overwrite_with_gradient', 'params']
  """

  recipe: Any = None
  threshold: Any = core.DEFAULT_SIZE_THRESHOLD

  def __post_init__(self):
    _with_recipe_dot_general(self)
    super().__post_init__()


class DenseGeneral(nn.DenseGeneral):
  """``flax.linen.DenseGeneral`` with a ``recipe`` and a ``threshold`` (same fields and
  parameters plus those two)."""

  recipe: Any = None
  threshold: Any = core.DEFAULT_SIZE_THRESHOLD

  def __post_init__(self):
    _with_recipe_dot_general(self)
    super().__post_init__()
