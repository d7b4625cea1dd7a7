"""TE's ``LayerNorm``, ``LayerNormDenseGeneral`` and ``Softmax`` as NNX modules over the core.

Input sizes first and ``rngs=``, as NNX layers take them; the parameters have TE's names
(``scale``, ``ln_bias``, ``kernel``, ``bias``) and shapes, and the recipe state of
``LayerNormDenseGeneral``'s GEMM lives in the ``RecipeState`` variables of its ``dot_general``
submodule, as for ``te_adapters.nnx.Linear``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._ops import DotGeneral
from te_adapters.nnx._variables import OptionalGemms

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "Softmax"]


def _norm_params(module, num_features, scale_init, bias_init, param_dtype, rngs):
  if scale_init is None:
    scale_init = nnx.initializers.zeros if module.zero_centered_gamma else nnx.initializers.ones
  module.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
  module.ln_bias = nnx.data(None)
  if module.layernorm_type == "layernorm":
    module.ln_bias = nnx.Param(bias_init(rngs.params(), (num_features,), param_dtype))


def _value(variable):
  """A variable's value, or None for an absent one."""
  return None if variable is None else variable[...]


def _norm(module, x):
  return core.layernorm(
    x,
    module.scale[...],
    _value(module.ln_bias),
    layernorm_type=module.layernorm_type,
    zero_centered_gamma=module.zero_centered_gamma,
    epsilon=module.epsilon,
  )


class LayerNorm(nnx.Module):
  """TE's ``LayerNorm`` in NNX: LayerNorm or RMSNorm over the last axis (``core.layernorm``).

  Parameters ``scale`` and (for ``"layernorm"``) ``ln_bias``, of shape ``(num_features,)``;
  computed in float32, returned in the input's dtype.

  Args:
    num_features: the size of the last axis.
    epsilon: added to the variance.
    layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
    zero_centered_gamma: the factor is ``1 + scale`` (and ``scale`` starts at zeros).
    scale_init: gamma's initializer; default ones (zeros with ``zero_centered_gamma``).
    bias_init: beta's initializer.
    param_dtype: the parameters' dtype.
    rngs: an ``nnx.Rngs`` for the initializers.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> norm = ta_nnx.LayerNorm(8, layernorm_type="rmsnorm", rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 8))).shape, norm.ln_bias
    ((2, 8), None)
  """

  def __init__(
    self,
    num_features: int,
    *,
    epsilon: float = 1e-6,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    scale_init=None,
    bias_init=nnx.initializers.zeros,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    kit.check_layernorm_type(layernorm_type, "LayerNorm")
    self.epsilon = epsilon
    self.layernorm_type = layernorm_type
    self.zero_centered_gamma = zero_centered_gamma
    _norm_params(self, num_features, scale_init, bias_init, param_dtype, rngs)

  def __call__(self, x):
    """Normalizes ``x`` over its last axis.

    Args:
      x: a floating-point array ``[..., K]``, K the layer's ``num_features``.

    Returns:
      The normalized array, of ``x``'s shape and dtype.
    """
    return _norm(self, x)


class LayerNormDenseGeneral(OptionalGemms, nnx.Module):
  """TE's ``LayerNormDenseGeneral`` in NNX: the norm, then a quantized GEMM.

  Returns ``(z, ln_out)`` as TE's (``ln_out`` is ``None`` unless ``return_layernorm_output``).
  Parameters ``scale``, ``ln_bias`` ``(in_features,)``, ``kernel`` ``(in_features, *features)``
  and ``bias`` ``features`` (with ``use_bias``). With a recipe, its state lives in
  ``layer.dot_general`` (``layer.dot_general.state.x_scale``, ...), ``RecipeState`` variables that
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never touches.

  Args:
    in_features: the size of the input's last axis (normalized and contracted).
    features: int or tuple of output features.
    enable_layernorm: ``False`` skips the norm.
    layernorm_type, epsilon, zero_centered_gamma, scale_init: as for ``LayerNorm``.
    ln_bias_init: beta's initializer.
    kernel_init: default ``variance_scaling(1.0, "fan_in", "truncated_normal")`` (TE's).
    use_bias, bias_init: the output bias (off by default, as TE's).
    return_layernorm_output: also return the norm's output (TE's default: True).
    axis: the contracting axis of the input: -1 (TE accepts no other).
    param_dtype: the parameters' dtype.
    depth_scaling: the output is divided by it when given.
    recipe: a te_adapters recipe (default ``core.DEFAULT_RECIPE``), or ``None``.
    threshold, config: passed to ``core.dot_general``.
    kernel_all_gather: FSDP: the kernel's sharding (a ``PartitionSpec`` per kernel dim, e.g.
      ``P("fsdp", None)``), gathered as FP8 (``core.layernorm_dense``); needs a recipe.
    rngs: an ``nnx.Rngs``; a recipe that rounds stochastically forks its ``"sr_rng"`` (or
      ``"default"``) stream, as ``te_adapters.nnx.Linear`` does.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.LayerNormDenseGeneral(16, 32, recipe=ta.DelayedScaling(),
    ...                                      rngs=nnx.Rngs(0))
    >>> z, ln_out = layer(jnp.ones((4, 16)))
    >>> z.shape, ln_out.shape, layer.dot_general.state.x_scale.shape
    ((4, 32), (4, 16), (1,))
  """

  _gemm_slots = ("dot_general",)

  def __init__(
    self,
    in_features: int,
    features: int | Iterable[int],
    *,
    enable_layernorm: bool = True,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    scale_init=None,
    ln_bias_init=nnx.initializers.zeros,
    kernel_init=None,
    use_bias: bool = False,
    bias_init=nnx.initializers.zeros,
    return_layernorm_output: bool = True,
    axis=-1,
    param_dtype=jnp.float32,
    depth_scaling: float | None = None,
    recipe: Any = kit.DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    config=None,
    kernel_all_gather=None,
    rngs: nnx.Rngs,
  ):
    kit.check_last_axis(axis, None, "LayerNormDenseGeneral", "LayerNormDenseGeneral")
    kit.check_needs_recipe(recipe, "LayerNormDenseGeneral", kernel_all_gather=kernel_all_gather)
    kit.check_layernorm_type(layernorm_type, "LayerNormDenseGeneral")
    features = tuple(features) if isinstance(features, Iterable) else (features,)
    kernel_shape = (in_features, *features)
    kit.check_kernel_gemm_dims(
      recipe,
      kernel_shape,
      (((0,), (0,)), ((), ())),
      f"LayerNormDenseGeneral({in_features}, {features})",
    )
    self.enable_layernorm = enable_layernorm
    self.layernorm_type = layernorm_type
    self.epsilon = epsilon
    self.zero_centered_gamma = zero_centered_gamma
    self.return_layernorm_output = return_layernorm_output
    self.depth_scaling = depth_scaling
    self.recipe = recipe
    self.scale = self.ln_bias = nnx.data(None)
    if enable_layernorm:
      _norm_params(self, in_features, scale_init, ln_bias_init, param_dtype, rngs)
    kernel_init = kernel_init or nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal"
    )
    self.kernel = nnx.Param(kernel_init(rngs.params(), kernel_shape, param_dtype))
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), features, param_dtype))
    # Without a recipe, no GEMM slot (OptionalGemms: it reads as None).
    self.dot_general: DotGeneral | None
    if recipe is not None:
      self.dot_general = DotGeneral(
        recipe, threshold=threshold, kernel_all_gather=kernel_all_gather, config=config, rngs=rngs
      )
      self.dot_general._set_owner(self, self.kernel.shape)
    self.threshold = threshold
    self.config = config

  def __call__(self, inputs, *, rngs=None):
    """The norm of ``inputs`` over its last axis, then the quantized GEMM with the kernel.

    Args:
      inputs: a floating-point array ``[..., K]``, K the layer's ``in_features``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      ``(z, ln_out)``: ``z`` of shape ``[..., *features]``; ``ln_out`` the norm's output, or None
      unless ``return_layernorm_output``.
    """
    if self.dot_general is None:
      gemm = {"recipe": None, "threshold": self.threshold, "config": self.config}
    else:
      gemm = self.dot_general.gemm_arguments(rngs)
    scale = ln_bias = None
    if self.enable_layernorm:
      scale, ln_bias = _value(self.scale), _value(self.ln_bias)
    return kit.layernorm_dense_general(
      inputs,
      scale,
      ln_bias,
      self.kernel[...],
      _value(self.bias),
      enable_layernorm=self.enable_layernorm,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
      return_layernorm_output=self.return_layernorm_output,
      depth_scaling=self.depth_scaling,
      **gemm,
      layer=self._layer_name(),
      framework="nnx",
    )


class Softmax(nnx.Module):
  """TE's ``Softmax`` in NNX (``core.softmax``): no parameters.

  Args:
    scale_factor: multiplies the scores.
    softmax_fusion_type: a ``core.SoftmaxFusionType`` (or its name).
    softmax_type: ``"vanilla"``, ``"off_by_one"`` or ``"learnable"`` (pass ``softmax_offset``).

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters import nnx as ta_nnx
    >>> float(ta_nnx.Softmax(scale_factor=0.5)(jnp.zeros((1, 2, 4, 4)))[0, 0, 0, 0])
    0.25
  """

  def __init__(
    self,
    *,
    scale_factor: float = 1.0,
    softmax_fusion_type=core.SoftmaxFusionType.SCALED,
    softmax_type: str = "vanilla",
  ):
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
