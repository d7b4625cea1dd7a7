"""TE's ``LayerNorm``, ``LayerNormDenseGeneral`` and ``Softmax`` as Linen modules over the core."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import gemm_state, layer_label, rounding_key

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "Softmax"]


def _scale_init(scale_init, zero_centered_gamma):
  """TE's default gamma init: ones, or zeros when the factor is ``1 + gamma``."""
  if scale_init is not None:
    return scale_init
  return nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones


def _with_axes(init, axes):
  """``init``, its parameter annotated with TE's logical axis names when ``axes`` is given."""
  return init if axes is None else nn.with_logical_partitioning(init, tuple(axes))


def _constrain(x, axes):
  """A logical sharding constraint on ``x`` (TE's ``*_input_axes``); none when ``axes`` is None."""
  return x if axes is None else nn.with_logical_constraint(x, tuple(axes))


def _constraint(axes):
  """A function applying TE's logical constraint ``axes``, or None when there is none."""
  return None if axes is None else (lambda y: _constrain(y, axes))


def _norm_params(module, features, bias_init, bias_axes):
  """``scale`` and (for layernorm) ``ln_bias``, of shape ``(features,)`` in ``module.dtype``."""
  kit.check_layernorm_type(module.layernorm_type, type(module).__name__)
  init = _scale_init(module.scale_init, module.zero_centered_gamma)
  scale = module.param("scale", _with_axes(init, module.scale_axes), (features,), module.dtype)
  bias = None
  if module.layernorm_type == "layernorm":
    bias = module.param("ln_bias", _with_axes(bias_init, bias_axes), (features,), module.dtype)
  return scale, bias


class LayerNorm(nn.Module):
  """TE's ``LayerNorm``: LayerNorm or RMSNorm over the last axis (``core.layernorm``).

  Parameters ``scale`` (gamma) and, for ``layernorm_type="layernorm"``, ``bias`` (beta,
  named ``ln_bias`` as TE's), of shape ``(features,)`` and dtype ``dtype``. The norm is
  computed in float32 and returned in the input's dtype.

  Attributes:
    epsilon: added to the variance.
    layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
    zero_centered_gamma: the factor is ``1 + scale`` (and ``scale`` starts at zeros).
    scale_init: gamma's initializer; default ones (zeros with ``zero_centered_gamma``).
    bias_init: beta's initializer (TE's name for the standalone norm).
    scale_axes, bias_axes: TE's logical axis names of the parameters; given, the parameters are
      created with ``nn.with_logical_partitioning`` (default: none, plain arrays).
    dtype: the parameters' dtype.
    transpose_batch_sequence: accepted for TE's signature; the norm runs over the last axis
      either way.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from te_adapters import linen as ta_linen
    >>> variables = ta_linen.LayerNorm().init(jax.random.key(0), jnp.ones((2, 8)))
    >>> sorted(variables["params"])
    ['ln_bias', 'scale']
  """

  epsilon: float = 1e-6
  layernorm_type: str = "layernorm"
  zero_centered_gamma: bool = False
  scale_init: Any = None
  bias_init: Any = nn.initializers.zeros
  scale_axes: tuple[str, ...] | None = None
  bias_axes: tuple[str, ...] | None = None
  dtype: Any = jnp.float32
  transpose_batch_sequence: bool = False

  @nn.compact
  def __call__(self, x):
    """Normalizes ``x`` over its last axis.

    Args:
      x: a floating-point array ``[..., K]``; the parameters get size K.

    Returns:
      The normalized array, of ``x``'s shape and dtype.
    """
    scale, bias = _norm_params(self, x.shape[-1], self.bias_init, self.bias_axes)
    return core.layernorm(
      x,
      scale,
      bias,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
    )


class LayerNormDenseGeneral(nn.Module):
  """TE's ``LayerNormDenseGeneral``: the norm, then a quantized GEMM (``core.layernorm_dense``).

  Returns ``(z, ln_out)`` as TE's: ``ln_out`` is the norm's output when
  ``return_layernorm_output`` (TE's default), else ``None`` (the norm's output then only feeds
  the GEMM's FP8 cast). Parameters as TE's: ``scale`` and ``ln_bias`` ``(K,)``,
  ``kernel`` ``(K, *features)``, ``bias`` ``features`` (with ``use_bias``), in ``dtype``. The
  output has the input's dtype. Recipe state lives in ``_overwrite_with_gradient`` with TE's
  names (``x_scale``, ``x_amax_history``, ...), as for this package's ``DenseGeneral``.

  Attributes:
    features: int or tuple of output features.
    enable_layernorm: ``False`` skips the norm (a quantized ``DenseGeneral`` without bias).
    layernorm_type, epsilon, zero_centered_gamma, scale_init: as for ``LayerNorm``.
    ln_bias_init: beta's initializer.
    kernel_init: default ``variance_scaling(1.0, "fan_in", "truncated_normal")`` (TE's).
    use_bias, bias_init: the output bias (off by default, as TE's).
    return_layernorm_output: also return the norm's output.
    axis: the contracting axis of the input: -1 (the normalized axis; TE accepts no other).
    dtype: the parameters' dtype.
    depth_scaling: the output is divided by it when given.
    scale_axes, ln_bias_axes, kernel_axes, bias_axes: TE's logical axis names of the
      parameters; given, each parameter is created with ``nn.with_logical_partitioning``
      (default: none, plain arrays).
    layernorm_input_axes, dot_input_axes: TE's logical sharding constraints on the input and on
      the norm's output (``nn.with_logical_constraint``); none by default.
    transpose_batch_sequence: accepted for TE's signature (its default, True); the layer
      contracts the last axis either way.
    recipe: a te_adapters recipe (default ``core.DEFAULT_RECIPE``), or ``None`` for high
      precision. A recipe that rounds stochastically draws keys from the RNG stream
      ``"sr_rng"``.
    threshold, config: passed to ``core.dot_general``.
    kernel_all_gather: FSDP: the kernel's sharding (a ``PartitionSpec`` per kernel dim, e.g.
      ``P("fsdp", None)``), gathered as FP8 (``core.layernorm_dense``); needs a recipe.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> layer = ta_linen.LayerNormDenseGeneral(32, recipe=ta.DelayedScaling())
    >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 16)))
    >>> z, ln_out = layer.apply(variables, jnp.ones((4, 16)))
    >>> z.shape, ln_out.shape, variables["params"]["kernel"].shape
    ((4, 32), (4, 16), (16, 32))
  """

  features: int | Iterable[int]
  enable_layernorm: bool = True
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  scale_init: Any = None
  ln_bias_init: Any = nn.initializers.zeros
  kernel_init: Any = None
  use_bias: bool = False
  bias_init: Any = nn.initializers.zeros
  return_layernorm_output: bool = True
  axis: int | Iterable[int] = -1
  dtype: Any = jnp.float32
  depth_scaling: float | None = None
  scale_axes: tuple[str, ...] | None = None
  ln_bias_axes: tuple[str, ...] | None = None
  kernel_axes: tuple[str, ...] | None = None
  bias_axes: tuple[str, ...] | None = None
  layernorm_input_axes: tuple[str, ...] | None = None
  dot_input_axes: tuple[str, ...] | None = None
  transpose_batch_sequence: bool = True
  recipe: Any = kit.DEFAULT_RECIPE
  threshold: Any = kit.DEFAULT_THRESHOLD
  config: Any = None
  kernel_all_gather: Any = None

  @nn.compact
  def __call__(self, inputs):
    """The norm of ``inputs`` over its last axis, then the quantized GEMM with the kernel.

    Args:
      inputs: a floating-point array ``[..., K]``; the parameters get size K.

    Returns:
      ``(z, ln_out)``: ``z`` of shape ``[..., *features]``; ``ln_out`` the norm's output, or None
      unless ``return_layernorm_output``.
    """
    kit.check_last_axis(self.axis, inputs.ndim, "LayerNormDenseGeneral", "LayerNormDenseGeneral")
    features = tuple(self.features) if isinstance(self.features, Iterable) else (self.features,)
    k = inputs.shape[-1]
    recipe = kit.check_recipe_or_none(self.recipe)
    what = self.name or "LayerNormDenseGeneral"
    kit.check_needs_recipe(recipe, what, kernel_all_gather=self.kernel_all_gather)
    options = kit.GemmOptions(
      self.threshold, kernel_all_gather=self.kernel_all_gather, config=self.config
    )
    kernel_shape = (k, *features)
    kit.check_kernel_gemm_dims(recipe, kernel_shape, (((0,), (0,)), ((), ())), what)
    kernel_init = self.kernel_init or nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal"
    )
    scale = ln_bias = None
    if self.enable_layernorm:
      scale, ln_bias = _norm_params(self, k, self.ln_bias_init, self.ln_bias_axes)
    kernel = self.param(
      "kernel", _with_axes(kernel_init, self.kernel_axes), kernel_shape, self.dtype
    )
    state, rng = gemm_state(self, recipe, ""), rounding_key(self, recipe)
    bias = None
    if self.use_bias:
      bias = self.param("bias", _with_axes(self.bias_init, self.bias_axes), features, self.dtype)
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
      layernorm_input_constraint=_constraint(self.layernorm_input_axes),
      dot_input_constraint=_constraint(self.dot_input_axes),
      recipe=recipe,
      state=state,
      rng=rng,
      **options.fused_keywords(),
      layer=layer_label(self),
      framework="linen",
    )


class Softmax(nn.Module):
  """TE's ``Softmax`` over the last axis of ``[batch, heads, q, k]`` scores (``core.softmax``).

  ``softmax((inputs + bias) * scale_factor)`` with masked scores removed (``mask`` nonzero, or
  causal for ``SCALED_UPPER_TRIANG_MASKED``), in float32, returned in the inputs' dtype.

  Attributes:
    scale_factor: multiplies the scores.
    softmax_fusion_type: a ``core.SoftmaxFusionType`` (or its name).
    softmax_type: ``"vanilla"``, ``"off_by_one"`` or ``"learnable"`` (pass ``softmax_offset``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from te_adapters import linen as ta_linen
    >>> p = ta_linen.Softmax(scale_factor=0.5).apply({}, jnp.zeros((1, 2, 4, 4)))
    >>> float(p[0, 0, 0, 0])
    0.25
  """

  scale_factor: float = 1.0
  softmax_fusion_type: Any = core.SoftmaxFusionType.SCALED
  softmax_type: str = "vanilla"

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
