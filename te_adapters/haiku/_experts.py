"""Haiku expert layer: one kernel per expert, applied to rows grouped by expert."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku._linear import recipe_state

__all__ = ["GroupedLinear"]


class GroupedLinear(hk.Module):
  """The expert layer of a mixture of experts: ``y[i] = x[i] @ w[group(i)]``.

  ``x`` [M, K] holds the tokens sorted by expert and ``group_sizes`` [G] (on the device) says how
  many rows each expert gets; rows past ``sum(group_sizes)`` give zeros. The GEMM is
  ``te_adapters.core.ragged_dot`` quantized per ``recipe``. The kernel ``w`` [G, K, N] is a
  parameter; recipe state (``DelayedScaling``: one scale and amax history per expert and role,
  TE's names) is created with ``hk.get_state``, so use ``hk.transform_with_state``, differentiate
  the loss with respect to the state too, and take that gradient as the next state.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters.haiku import GroupedLinear
    >>> f = hk.transform_with_state(lambda x, gs: GroupedLinear(
    ...     4, 16, recipe=ta.DelayedScaling(amax_history_len=8))(x, gs))
    >>> gs = jnp.array([8, 0, 8, 8], jnp.int32)
    >>> params, state = f.init(jax.random.key(0), jnp.ones((24, 32)), gs)
    >>> params["grouped_linear"]["w"].shape, state["grouped_linear"]["x_scale"].shape
    ((4, 32, 16), (4, 1))
  """

  def __init__(
    self,
    num_groups: int,
    output_size: int,
    *,
    w_init: hk.initializers.Initializer | None = None,
    recipe: core.Recipe | None = None,
    name: str | None = None,
  ):
    """Constructs the layer.

    Args:
      num_groups: G, the number of experts.
      output_size: N.
      w_init: initializer of the [G, K, N] kernel; by default a truncated normal with stddev
        ``1 / sqrt(K)``, as ``hk.Linear``.
      recipe: a recipe instance, or ``None`` for a high-precision ``jax.lax.ragged_dot``.
      name: name of the module.
    """
    super().__init__(name=name)
    self.num_groups = num_groups
    self.output_size = output_size
    self.w_init = w_init
    self.recipe = kit.check_recipe_or_none(recipe)

  def __call__(
    self, inputs: jax.Array, group_sizes: jax.Array, *, precision: jax.lax.Precision | None = None
  ) -> jax.Array:
    """Applies expert ``g``'s kernel to the ``group_sizes[g]`` rows of group ``g``.

    Args:
      inputs: [M, K], rows grouped by expert.
      group_sizes: [G] integers, ``sum(group_sizes) <= M``.
      precision: passed to the GEMMs.

    Returns:
      [M, N]; rows past ``sum(group_sizes)`` are zero.
    """
    inputs = jnp.asarray(inputs)
    if inputs.ndim != 2:
      raise ValueError(f"inputs must be 2-D [M, K], got shape {inputs.shape}")
    kit.check_input_dtype(self.recipe, inputs.dtype, self.module_name)
    input_size = inputs.shape[-1]
    w_init = self.w_init
    if w_init is None:
      w_init = hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(input_size))
    shape = [self.num_groups, input_size, self.output_size]
    w = hk.get_parameter("w", shape, inputs.dtype, init=w_init)
    state = recipe_state(self, self.recipe, self.num_groups)
    return core.ragged_dot(
      inputs,
      w,
      group_sizes,
      precision=precision,
      recipe=self.recipe,
      state=state,
      layer=f"layer {self.module_name!r}",
      framework="haiku",
    )
