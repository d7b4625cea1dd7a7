"""TE's ``LayerNorm``, ``LayerNormDenseGeneral`` and ``Softmax`` as Haiku modules over the core.

Sizes are inferred from the input, as Haiku does; the parameters have TE's names (``scale``,
``ln_bias``, ``kernel``, ``bias``) and shapes, and the recipe state of the GEMM is kept with
``hk.get_state`` under the module's name, as ``te_adapters.haiku.Linear`` keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import haiku as hk
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku._linear import recipe_state, rounding_key

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "Softmax"]


def _norm_params(module, features):
  scale_init = module.scale_init
  if scale_init is None:
    scale_init = jnp.zeros if module.zero_centered_gamma else jnp.ones
  scale = hk.get_parameter("scale", (features,), module.param_dtype, init=scale_init)
  bias = None
  if module.layernorm_type == "layernorm":
    bias = hk.get_parameter("ln_bias", (features,), module.param_dtype, init=module.bias_init)
  return scale, bias


class LayerNorm(hk.Module):
  """TE's ``LayerNorm`` in Haiku: LayerNorm or RMSNorm over the last axis (``core.layernorm``).

  Parameters ``scale`` and (for ``"layernorm"``) ``ln_bias``, of shape ``(features,)`` taken
  from the input; computed in float32, returned in the input's dtype.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> from te_adapters import haiku as ta_hk
    >>> f = hk.transform(lambda x: ta_hk.LayerNorm()(x))
    >>> params = f.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> sorted(params["layer_norm"])
    ['ln_bias', 'scale']
  """

  def __init__(
    self,
    *,
    epsilon: float = 1e-6,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    scale_init=None,
    bias_init=jnp.zeros,
    param_dtype=jnp.float32,
    name: str | None = None,
  ):
    """Constructs the norm.

    Args:
      epsilon: added to the variance.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: the factor is ``1 + scale`` (and ``scale`` starts at zeros).
      scale_init: gamma's initializer; default ones (zeros with ``zero_centered_gamma``).
      bias_init: beta's initializer.
      param_dtype: the parameters' dtype.
      name: the module's name (default ``"layer_norm"``).
    """
    super().__init__(name=name)
    kit.check_layernorm_type(layernorm_type, "LayerNorm")
    self.epsilon = epsilon
    self.layernorm_type = layernorm_type
    self.zero_centered_gamma = zero_centered_gamma
    self.scale_init = scale_init
    self.bias_init = bias_init
    self.param_dtype = param_dtype

  def __call__(self, x):
    """Normalizes ``x`` over its last axis.

    Args:
      x: a floating-point array ``[..., K]``; the parameters get size K.

    Returns:
      The normalized array, of ``x``'s shape and dtype.
    """
    scale, bias = _norm_params(self, x.shape[-1])
    return core.layernorm(
      x,
      scale,
      bias,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
    )


class LayerNormDenseGeneral(kit.GemmOptionAttributes, hk.Module):
  """TE's ``LayerNormDenseGeneral`` in Haiku: the norm, then a quantized GEMM.

  Returns ``(z, ln_out)`` as TE's (``ln_out`` is ``None`` unless ``return_layernorm_output``).
  Parameters ``scale``, ``ln_bias`` ``(K,)``, ``kernel`` ``(K, *features)`` and ``bias``
  ``features`` (with ``use_bias``), K the input's last axis. A stateful recipe keeps its state
  with ``hk.get_state`` (TE's names), so the function is transformed with
  ``hk.transform_with_state`` and trained with ``te_adapters.haiku.value_and_grad`` (or a plain
  ``jax.grad`` over the state, whose gradient is the new state).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> f = hk.transform_with_state(
    ...     lambda x: ta_hk.LayerNormDenseGeneral(32, recipe=ta.DelayedScaling())(x))
    >>> params, state = f.init(jax.random.key(0), jnp.ones((4, 16)))
    >>> params["layer_norm_dense_general"]["kernel"].shape
    (16, 32)
  """

  def __init__(
    self,
    features: int | Iterable[int],
    *,
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
    axis=-1,
    param_dtype=jnp.float32,
    depth_scaling: float | None = None,
    recipe: Any = kit.DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    config=None,
    kernel_all_gather=None,
    name: str | None = None,
  ):
    """Constructs the layer.

    Args:
      features: int or tuple of output features.
      enable_layernorm: ``False`` skips the norm.
      layernorm_type, epsilon, zero_centered_gamma, scale_init: as for ``LayerNorm``.
      ln_bias_init: beta's initializer.
      kernel_init: default ``VarianceScaling(1.0, "fan_in", "truncated_normal")`` (TE's).
      use_bias, bias_init: the output bias (off by default, as TE's).
      return_layernorm_output: also return the norm's output (TE's default: True).
      axis: the contracting axis of the input: -1 (TE accepts no other).
      param_dtype: the parameters' dtype.
      depth_scaling: the output is divided by it when given.
      recipe: a te_adapters recipe (default ``core.DEFAULT_RECIPE``), or ``None``; one that
        rounds stochastically draws a key with ``hk.next_rng_key()``.
      threshold, config: passed to ``core.dot_general``.
      kernel_all_gather: FSDP: the kernel's sharding (a ``PartitionSpec`` per kernel dim, e.g.
        ``P("fsdp", None)``), gathered as FP8 (``core.layernorm_dense``); needs a recipe.
      name: the module's name (default ``"layer_norm_dense_general"``).
    """
    super().__init__(name=name)
    kit.check_last_axis(axis, None, "LayerNormDenseGeneral", "LayerNormDenseGeneral")
    kit.check_layernorm_type(layernorm_type, "LayerNormDenseGeneral")
    self.features = tuple(features) if isinstance(features, Iterable) else (features,)
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
    self.out_bias_init = bias_init
    self.return_layernorm_output = return_layernorm_output
    self.param_dtype = param_dtype
    self.depth_scaling = depth_scaling
    self.recipe = kit.check_recipe_or_none(recipe)
    kit.check_needs_recipe(self.recipe, self.module_name, kernel_all_gather=kernel_all_gather)
    self.options = kit.GemmOptions(threshold, kernel_all_gather=kernel_all_gather, config=config)

  def __call__(self, inputs):
    """The norm of ``inputs`` over its last axis, then the quantized GEMM with the kernel.

    Args:
      inputs: a floating-point array ``[..., K]``; the parameters get size K.

    Returns:
      ``(z, ln_out)``: ``z`` of shape ``[..., *features]``; ``ln_out`` the norm's output, or None
      unless ``return_layernorm_output``.
    """
    k = inputs.shape[-1]
    kernel_shape = (k, *self.features)
    kit.check_kernel_gemm_dims(
      self.recipe, kernel_shape, (((0,), (0,)), ((), ())), self.module_name
    )
    scale = ln_bias = None
    if self.enable_layernorm:
      scale, ln_bias = _norm_params(self, k)
    kernel = hk.get_parameter("kernel", kernel_shape, self.param_dtype, init=self.kernel_init)
    state, rng = recipe_state(self, self.recipe), rounding_key(self, self.recipe)
    bias = None
    if self.use_bias:
      bias = hk.get_parameter("bias", self.features, self.param_dtype, init=self.out_bias_init)
    return kit.layernorm_dense_general(
      inputs,
      scale,
      ln_bias,
      kernel,
      bias,
      enable_layernorm=self.enable_layernorm,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
      return_layernorm_output=self.return_layernorm_output,
      depth_scaling=self.depth_scaling,
      recipe=self.recipe,
      state=state,
      rng=rng,
      **self.options.fused_keywords(),
      layer=f"layer {self.module_name!r}",
      framework="haiku",
    )


class Softmax(hk.Module):
  """TE's ``Softmax`` in Haiku (``core.softmax``): no parameters.

  Example:
    >>> import haiku as hk, jax.numpy as jnp
    >>> from te_adapters import haiku as ta_hk
    >>> f = hk.transform(lambda x: ta_hk.Softmax(scale_factor=0.5)(x))
    >>> float(f.apply({}, None, jnp.zeros((1, 2, 4, 4)))[0, 0, 0, 0])
    0.25
  """

  def __init__(
    self,
    *,
    scale_factor: float = 1.0,
    softmax_fusion_type=core.SoftmaxFusionType.SCALED,
    softmax_type: str = "vanilla",
    name: str | None = None,
  ):
    """Constructs the softmax.

    Args:
      scale_factor: multiplies the scores.
      softmax_fusion_type: a ``core.SoftmaxFusionType`` (or its name).
      softmax_type: ``"vanilla"``, ``"off_by_one"`` or ``"learnable"`` (pass
        ``softmax_offset``).
      name: the module's name.
    """
    super().__init__(name=name)
    self.scale_factor = scale_factor
    self.softmax_fusion_type = softmax_fusion_type
    self.softmax_type = softmax_type

  def __call__(self, inputs, mask=None, bias=None, softmax_offset=None):
    """``core.softmax`` of ``inputs`` with the layer's scale factor, fusion type and softmax type.

    Args:
      inputs: the attention scores, ``[..., q, k]``.
      mask: nonzero where a score is masked out, broadcastable to ``inputs``; or None.
      bias: added to the scores before the scaling, broadcastable to ``inputs``; or None.
      softmax_offset: the extra logit of each row for ``softmax_type="learnable"``, else None.

    Returns:
      The probabilities, of ``inputs``'s shape and dtype.
    """
    return core.softmax(
      inputs,
      mask,
      bias,
      softmax_offset,
      scale_factor=self.scale_factor,
      softmax_fusion_type=self.softmax_fusion_type,
      softmax_type=self.softmax_type,
    )
