"""TE's ``LayerNormMLP`` as a Haiku module over ``core.layernorm_mlp``."""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku._linear import recipe_state, rounding_key
from te_adapters.haiku._norm import _norm_params

__all__ = ["LayerNormMLP"]


class _GemmState(hk.Module):
  """Holds one GEMM's recipe state (Haiku keeps one GEMM's TE names per module)."""

  def __init__(self, recipe, name: str):
    super().__init__(name=name)
    self.recipe = recipe

  def __call__(self):
    return recipe_state(self, self.recipe), rounding_key(self, self.recipe)


class LayerNormMLP(kit.GemmOptionAttributes, hk.Module):
  """TE's ``LayerNormMLP`` in Haiku: norm, GEMM, activation, dropout, GEMM.

  Sizes come from the input. Parameters with TE's names and shapes: ``scale`` and ``ln_bias``
  ``(K,)``, ``wi_kernel`` ``(K, n_act, intermediate_dim)``, ``wo_kernel``
  ``(intermediate_dim, K)``, and with ``use_bias`` ``wi_bias`` ``(n_act, intermediate_dim)`` and
  ``wo_bias`` ``(K,)``. A stateful recipe keeps each GEMM's state with ``hk.get_state`` in the
  submodules ``gemm_0`` and ``gemm_1`` (TE's postfixes; TE's names inside), so the function is
  transformed with ``hk.transform_with_state``. Returns ``(out, ln_out or None)`` as TE's.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> f = hk.transform_with_state(lambda x: ta_hk.LayerNormMLP(
    ...     64, activations=("gelu", "linear"), recipe=ta.DelayedScaling())(x))
    >>> params, state = f.init(jax.random.key(0), jnp.ones((4, 32)))
    >>> params["layer_norm_mlp"]["wi_kernel"].shape, sorted(state)
    ((32, 2, 64), ['layer_norm_mlp/gemm_0', 'layer_norm_mlp/gemm_1'])
  """

  def __init__(
    self,
    intermediate_dim: int,
    *,
    activations=("gelu",),
    enable_layernorm: bool = True,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    scale_init=None,
    ln_bias_init=jnp.zeros,
    kernel_init=None,
    use_bias: bool = False,
    bias_init=jnp.zeros,
    return_layernorm_output: bool = True,
    intermediate_dropout_rate: float = 0.0,
    intermediate_hidden_dropout_dims=(),
    param_dtype=jnp.float32,
    axis=-1,
    recipe: Any = kit.DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    config=None,
    kernel_all_gather=None,
    name: str | None = None,
  ):
    """Constructs the block.

    Args:
      intermediate_dim: F.
      activations: names for ``core.activation``; several make a gated product.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init: the norm (as
        for ``LayerNorm``).
      ln_bias_init: beta's initializer.
      kernel_init: default ``VarianceScaling(1.0, "fan_in", "truncated_normal")`` (TE's);
        ``wi_kernel`` draws ``n_act`` kernels with it.
      use_bias, bias_init: the GEMMs' biases (off by default, as TE's).
      return_layernorm_output: also return the norm's output (TE's default: True).
      intermediate_dropout_rate: dropout after the activation (default 0: off); its key comes
        from ``hk.next_rng_key()`` unless the call is ``deterministic``.
      intermediate_hidden_dropout_dims: axes sharing one dropout mask.
      param_dtype: the parameters' dtype.
      axis: the normalized and contracted axis: -1 (TE's ``LayerNormMLP`` accepts no other).
      recipe: a te_adapters recipe for both GEMMs (default ``core.DEFAULT_RECIPE``), or None.
      threshold, config: passed to ``core.dot_general``.
      kernel_all_gather: FSDP: the kernels' sharding, one ``PartitionSpec`` for both (e.g.
        ``P("fsdp")``: each kernel's first dim), gathered as FP8 (``core.layernorm_mlp``);
        needs a recipe.
      name: the module's name (default ``"layer_norm_mlp"``).
    """
    super().__init__(name=name)
    kit.check_last_axis(axis, None, "LayerNormMLP", "LayerNormMLP")
    kit.check_layernorm_type(layernorm_type, "LayerNormMLP")
    self.intermediate_dim = intermediate_dim
    self.activations = core.normalize_activations(activations)
    self.enable_layernorm = enable_layernorm
    self.layernorm_type = layernorm_type
    self.epsilon = epsilon
    self.zero_centered_gamma = zero_centered_gamma
    self.scale_init = scale_init
    self.bias_init = ln_bias_init
    self.kernel_init = kernel_init or hk.initializers.VarianceScaling(
      1.0, "fan_in", "truncated_normal"
    )
    self.use_bias = use_bias
    self.gemm_bias_init = bias_init
    self.return_layernorm_output = return_layernorm_output
    self.intermediate_dropout_rate = intermediate_dropout_rate
    self.intermediate_hidden_dropout_dims = tuple(intermediate_hidden_dropout_dims)
    self.param_dtype = param_dtype
    self.recipe = kit.check_recipe_or_none(recipe)
    kit.check_needs_recipe(self.recipe, self.module_name, kernel_all_gather=kernel_all_gather)
    self.options = kit.GemmOptions(threshold, kernel_all_gather=kernel_all_gather, config=config)

  def __call__(self, inputs, *, deterministic: bool = False):
    """Norm, first GEMM, activation, dropout, second GEMM: TE's ``LayerNormMLP``.

    Args:
      inputs: a floating-point array ``[..., K]``; the parameters get size K.
      deterministic: turn dropout off (evaluation).

    Returns:
      ``(out, ln_out)``: ``out`` of ``inputs``'s shape; ``ln_out`` the norm's output, or None unless
      ``return_layernorm_output``.
    """
    n_act, f, k = len(self.activations), self.intermediate_dim, inputs.shape[-1]
    dims = (((0,), (0,)), ((), ()))
    kit.check_kernel_gemm_dims(self.recipe, (k, n_act, f), dims, f"{self.module_name} wi_kernel")
    kit.check_kernel_gemm_dims(self.recipe, (f, k), dims, f"{self.module_name} wo_kernel")
    scale = ln_bias = None
    if self.enable_layernorm:
      scale, ln_bias = _norm_params(self, k)

    def wi_init(shape, dtype):
      kernels = [self.kernel_init((shape[0], shape[2]), dtype) for _ in range(shape[1])]
      return jnp.stack(kernels, axis=1)

    wi = hk.get_parameter("wi_kernel", (k, n_act, f), self.param_dtype, init=wi_init)
    wo = hk.get_parameter("wo_kernel", (f, k), self.param_dtype, init=self.kernel_init)
    wi_bias = wo_bias = None
    if self.use_bias:
      wi_bias = hk.get_parameter("wi_bias", (n_act, f), self.param_dtype, init=self.gemm_bias_init)
      wo_bias = hk.get_parameter("wo_bias", (k,), self.param_dtype, init=self.gemm_bias_init)
    if self.recipe is None:
      wi, wo = wi.astype(inputs.dtype), wo.astype(inputs.dtype)
    (state_0, rng_0), (state_1, rng_1) = (
      _GemmState(self.recipe, "gemm_0")(),
      _GemmState(self.recipe, "gemm_1")(),
    )
    dropping = self.intermediate_dropout_rate > 0 and not deterministic
    return core.layernorm_mlp(
      inputs,
      scale,
      ln_bias,
      wi,
      wo,
      wi_bias,
      wo_bias,
      activations=self.activations,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
      enable_layernorm=self.enable_layernorm,
      dropout_rate=self.intermediate_dropout_rate,
      dropout_rng=hk.next_rng_key() if dropping else None,
      dropout_broadcast_dims=self.intermediate_hidden_dropout_dims,
      deterministic=deterministic,
      recipe=self.recipe,
      states=(state_0, state_1),
      rngs=(rng_0, rng_1),
      **self.options.fused_keywords(),
      return_layernorm_output=self.return_layernorm_output,
      layer=f"layer {self.module_name!r}",
      framework="haiku",
    )
