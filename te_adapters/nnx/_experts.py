"""Flax NNX expert layer: one kernel per expert, applied to rows grouped by expert."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._variables import HoldsRecipeState, hold_state, state_value, te_name_aliases

__all__ = ["GroupedLinear"]

# lecun_normal over each expert's [K, N] kernel: fan-in K, the expert axis is a batch axis.
default_kernel_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


@te_name_aliases
class GroupedLinear(HoldsRecipeState, nnx.Module):
  """The expert layer of a mixture of experts: ``y[i] = x[i] @ kernel[group(i)]``.

  ``x`` [M, K] holds the tokens sorted by expert, ``group_sizes`` [G] (on the device, e.g. from a
  router under ``jit``) says how many rows each expert gets, and rows past ``sum(group_sizes)``
  give zeros. The GEMM is ``te_adapters.core.ragged_dot`` quantized per ``recipe``. Recipe state
  (``DelayedScaling``: one scale and amax history per expert and role, TE's names) is
  ``self.state``, the typed state of ``core.init_ragged_state`` with a ``RecipeState`` variable
  at each entry (None without a recipe). ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never
  touches those variables; the gradient of the loss with respect to them is their next value.

  Args:
    num_groups: G, the number of experts.
    in_features: K.
    out_features: N.
    dtype: the dtype of the computation (default: inferred from input and kernel).
    param_dtype: the dtype of the kernel (default float32).
    precision: passed to the GEMMs.
    kernel_init: initializer of the [G, K, N] kernel.
    preferred_element_type: the output dtype of the GEMM.
    recipe: a recipe instance, or ``None`` for a high-precision ``jax.lax.ragged_dot``.
    rngs: rng key.
    kernel_metadata: metadata of the kernel ``nnx.Param``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters.nnx import GroupedLinear
    >>> layer = GroupedLinear(4, 32, 16, recipe=ta.DelayedScaling(amax_history_len=8),
    ...                       rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((24, 32)), jnp.array([8, 0, 8, 8], jnp.int32)).shape
    (24, 16)
    >>> layer.state.x_amax_history[...].shape
    (4, 8)
  """

  def __init__(
    self,
    num_groups: int,
    in_features: int,
    out_features: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: nnx.Initializer = default_kernel_init,
    preferred_element_type: Any = None,
    recipe: core.Recipe | None = None,
    rngs: nnx.Rngs,
    kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    recipe = kit.check_recipe_or_none(recipe)
    if recipe is not None:
      what = f"GroupedLinear({num_groups}, {in_features}, {out_features})"
      kit.check_gemm_dims(in_features, out_features, what)
    self.kernel = nnx.Param(
      kernel_init(rngs.params(), (num_groups, in_features, out_features), param_dtype),
      **kernel_metadata,
    )
    self.state_names: tuple[str, ...] = ()
    # Only where the recipe keeps state (HoldsRecipeState: else `state` reads as EmptyState, or
    # None without a recipe).
    if recipe is not None:
      # Also refuses a recipe the grouped GEMM does not implement, at construction.
      initial = core.init_ragged_state(recipe, num_groups)
      if initial:
        self.state = hold_state(initial)
        self.state_names = tuple(initial)
    self.num_groups = num_groups
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.preferred_element_type = preferred_element_type
    self.recipe = recipe

  def _state_owner(self) -> str:
    """The layer's class and kernel shape, as every message about it names it (NNX gives a
    layer no path)."""
    return f"{type(self).__name__} layer (kernel {tuple(self.kernel.shape)})"

  def __call__(self, inputs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Applies expert ``g``'s kernel to the ``group_sizes[g]`` rows of group ``g``.

    Args:
      inputs: [M, K], rows grouped by expert.
      group_sizes: [G] integers, ``sum(group_sizes) <= M``.

    Returns:
      [M, N]; rows past ``sum(group_sizes)`` are zero.
    """
    inputs, kernel = dtypes.promote_dtype((inputs, self.kernel[...]), dtype=self.dtype)
    kit.check_input_dtype(self.recipe, inputs.dtype, self._state_owner())
    state = state_value(self.state) or None
    return core.ragged_dot(
      inputs,
      kernel,
      group_sizes,
      precision=self.precision,
      preferred_element_type=self.preferred_element_type,
      recipe=self.recipe,
      state=state,
      layer=self._state_owner(),
      framework="nnx",
    )
