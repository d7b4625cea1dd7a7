"""Flax Linen adapter of the quantized grouped GEMM: ``make_ragged_dot_cls``."""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import OVERWRITE_WITH_GRADIENT, gemm_state, layer_label

__all__ = ["make_ragged_dot_cls", "OVERWRITE_WITH_GRADIENT"]


def make_ragged_dot_cls(recipe: core.Recipe | None) -> type[nn.Module]:
  """A Linen module class whose instances replace ``jax.lax.ragged_dot`` with ``recipe``'s.

  An instance is called like ``jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=None,
  preferred_element_type=None, group_offset=None)``: ``lhs`` [M, K] rows grouped contiguously,
  ``rhs`` [G, K, N], ``group_sizes`` [G] integers on the device. It owns no parameters; the recipe
  state (``DelayedScaling`` only) lives in the ``"_overwrite_with_gradient"`` collection under TE's
  names (``x_scale`` (G, 1), ``x_amax_history`` (G, L), ...), and the gradient of the loss with
  respect to that collection is its value for the next step.

  Args:
    recipe: a recipe instance, or ``None`` for a plain ``jax.lax.ragged_dot``.

  Returns:
    A ``flax.linen.Module`` subclass (instantiate it, e.g. ``make_ragged_dot_cls(r)()``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, te_adapters as ta
    >>> from te_adapters.linen import make_ragged_dot_cls
    >>> class Experts(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, group_sizes):
    ...     w = self.param("kernel", nn.initializers.lecun_normal(), (4, 32, 16))
    ...     return make_ragged_dot_cls(ta.DelayedScaling(amax_history_len=8))()(x, w, group_sizes)
    >>> gs = jnp.array([8, 0, 16, 8], jnp.int32)
    >>> variables = Experts().init(jax.random.key(0), jnp.ones((32, 32)), gs)
    >>> variables["_overwrite_with_gradient"]["RaggedDot_0"]["x_amax_history"].shape
    (4, 8)
  """
  recipe = kit.check_recipe_or_none(recipe)

  class RaggedDot(nn.Module):
    """``jax.lax.ragged_dot`` quantized per the recipe given to ``make_ragged_dot_cls``."""

    @nn.compact
    def __call__(
      self,
      lhs: jax.Array,
      rhs: jax.Array,
      group_sizes: jax.Array,
      precision: Any = None,
      preferred_element_type: Any = None,
      group_offset: jax.Array | None = None,
    ) -> jax.Array:
      kit.check_input_dtype(recipe, jax.numpy.result_type(lhs), type(self).__name__)
      state = None
      if recipe is not None and core.state_names(recipe):
        if getattr(rhs, "ndim", None) != 3:
          raise ValueError(f"rhs must be 3-D [G, K, N], got shape {getattr(rhs, 'shape', None)}")
        state = gemm_state(self, recipe, "", n_groups=rhs.shape[0])
      elif recipe is not None:
        gemm_state(self, recipe, "")  # refuses variables holding state the recipe would ignore
      return core.ragged_dot(
        lhs,
        rhs,
        group_sizes,
        precision,
        preferred_element_type,
        group_offset,
        recipe=recipe,
        state=state,
        layer=layer_label(self),
        framework="linen",
      )

  RaggedDot.recipe = recipe  # type: ignore[attr-defined]  # an attribute of the made class
  return RaggedDot
