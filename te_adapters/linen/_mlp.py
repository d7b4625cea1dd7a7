"""TE's ``LayerNormMLP`` as a Linen module over ``core.layernorm_mlp``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import gemm_state, layer_label, rounding_key
from te_adapters.linen._norm import _constrain, _constraint, _norm_params, _with_axes

__all__ = ["LayerNormMLP"]


class LayerNormMLP(nn.Module):
  """TE's ``LayerNormMLP``: norm, GEMM, activation, dropout, GEMM (``core.layernorm_mlp``).

  Fields, defaults and parameters are TE's: ``scale`` and ``ln_bias`` ``(K,)``, ``wi_kernel``
  ``(K, n_act, intermediate_dim)`` (``n_act`` kernels drawn one by one with ``kernel_init``),
  ``wo_kernel`` ``(intermediate_dim, K)``, and with ``use_bias`` ``wi_bias``
  ``(n_act, intermediate_dim)`` and ``wo_bias`` ``(K,)``, all in ``dtype``. The two GEMMs keep
  their recipe state in ``_overwrite_with_gradient`` with TE's postfixes ``_0`` and ``_1``
  (``x_0_scale``, ``kernel_1_amax_history``, ...). Returns ``(out, ln_out)`` as TE's: ``ln_out``
  is the norm's output when ``return_layernorm_output`` (TE's default), else ``None``.

  Dropout on the intermediate (TE's default rate 0.1) draws from the RNG stream
  ``intermediate_dropout_rng_name`` (``"dropout"``) unless ``deterministic=True``. Only
  ``axis=-1`` is accepted (as TE's). TE's low-rank adaptation fields are not supported here
  (``enable_low_rank_adaptation=True`` is an error); use ``DenseGeneral`` for LoRA.

  Attributes:
    intermediate_dim: F.
    activations: names for ``core.activation``; several make a gated product
      (``("gelu", "linear")``).
    enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, ln_bias_init:
      the norm (as for ``LayerNorm``).
    kernel_init: default ``variance_scaling(1.0, "fan_in", "truncated_normal")``.
    use_bias, bias_init: the two GEMMs' biases (off by default, as TE's).
    return_layernorm_output: also return the norm's output.
    intermediate_dropout_rate, intermediate_dropout_rng_name, intermediate_hidden_dropout_dims:
      the dropout after the activation.
    ffn1_ckpt_name, ffn2_ckpt_name: ``checkpoint_name`` tags for remat policies.
    scale_axes, ln_bias_axes, kernel_axes_1, kernel_axes_2, bias_axes_1, bias_axes_2: TE's
      logical axis names of the parameters; given, the parameters are created with
      ``nn.with_logical_partitioning`` (default: none, plain arrays).
    layernorm_input_axes, dot_1_input_axes, dot_2_input_axes: TE's logical sharding constraints
      on the input, the norm's output and the activation's output
      (``nn.with_logical_constraint``); none by default.
    transpose_batch_sequence: accepted for TE's signature; the block runs over the last axis
      whatever the layout.
    dtype: the parameters' dtype.
    recipe: a te_adapters recipe for both GEMMs (default ``core.DEFAULT_RECIPE``), or ``None``.
    threshold, config: passed to ``core.dot_general`` for both GEMMs.
    kernel_all_gather: FSDP: the kernels' sharding, one ``PartitionSpec`` for both (e.g.
      ``P("fsdp")``: each kernel's first dim), gathered as FP8 (``core.layernorm_mlp``); needs
      a recipe.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> mlp = ta_linen.LayerNormMLP(64, activations=("silu", "linear"), recipe=ta.DelayedScaling())
    >>> variables = mlp.init(jax.random.key(0), jnp.ones((4, 32)), deterministic=True)
    >>> variables["params"]["wi_kernel"].shape, "kernel_1_amax_history" in variables[
    ...     "_overwrite_with_gradient"]
    ((32, 2, 64), True)
  """

  intermediate_dim: int = 2048
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
  activations: Sequence[Any] = ("relu",)
  intermediate_dropout_rng_name: str = "dropout"
  intermediate_dropout_rate: float = 0.1
  intermediate_hidden_dropout_dims: Sequence[int] = ()
  enable_low_rank_adaptation: bool = False
  low_rank_adaptation_dim: int = 32
  low_rank_adaptation_alpha: float | None = None
  axis: int | Iterable[int] = -1
  dtype: Any = jnp.float32
  ffn1_ckpt_name: str = "ffn1"
  ffn2_ckpt_name: str = "ffn2"
  scale_axes: tuple[str, ...] | None = None
  ln_bias_axes: tuple[str, ...] | None = None
  kernel_axes_1: tuple[str, ...] | None = None
  kernel_axes_2: tuple[str, ...] | None = None
  bias_axes_1: tuple[str, ...] | None = None
  bias_axes_2: tuple[str, ...] | None = None
  layernorm_input_axes: tuple[str, ...] | None = None
  dot_1_input_axes: tuple[str, ...] | None = None
  dot_2_input_axes: tuple[str, ...] | None = None
  transpose_batch_sequence: bool = False
  recipe: Any = kit.DEFAULT_RECIPE
  threshold: Any = kit.DEFAULT_THRESHOLD
  config: Any = None
  kernel_all_gather: Any = None

  @nn.compact
  def __call__(self, inputs, deterministic: bool = False):
    """Norm, first GEMM, activation, dropout, second GEMM: TE's ``LayerNormMLP``.

    Args:
      inputs: a floating-point array ``[..., K]``; the parameters get size K.
      deterministic: turn dropout off (evaluation).

    Returns:
      ``(out, ln_out)``: ``out`` of ``inputs``'s shape; ``ln_out`` the norm's output, or None unless
      ``return_layernorm_output``.
    """
    what = self.name or "LayerNormMLP"
    kit.check_last_axis(self.axis, inputs.ndim, what, "LayerNormMLP")
    if self.enable_low_rank_adaptation:
      raise ValueError(
        f"{what}: low-rank adaptation is not supported in LayerNormMLP; use DenseGeneral("
        "enable_low_rank_adaptation=True) layers for LoRA"
      )
    names = core.normalize_activations(self.activations)
    n_act, f, k = len(names), self.intermediate_dim, inputs.shape[-1]
    recipe = kit.check_recipe_or_none(self.recipe)
    kit.check_needs_recipe(recipe, what, kernel_all_gather=self.kernel_all_gather)
    dims = (((0,), (0,)), ((), ()))
    kit.check_kernel_gemm_dims(recipe, (k, n_act, f), dims, f"{what} wi_kernel")
    kit.check_kernel_gemm_dims(recipe, (f, k), dims, f"{what} wo_kernel")
    kernel_init = self.kernel_init or nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal"
    )

    scale = ln_bias = None
    if self.enable_layernorm:
      scale, ln_bias = _norm_params(self, k, self.ln_bias_init, self.ln_bias_axes)

    def wi_init(key, shape, dtype):
      keys = jax.random.split(key, shape[1])
      return jnp.stack([kernel_init(kk, (shape[0], shape[2]), dtype) for kk in keys], axis=1)

    wi = self.param("wi_kernel", _with_axes(wi_init, self.kernel_axes_1), (k, n_act, f), self.dtype)
    wo = self.param("wo_kernel", _with_axes(kernel_init, self.kernel_axes_2), (f, k), self.dtype)
    wi_bias = wo_bias = None
    if self.use_bias:
      wi_bias = self.param(
        "wi_bias", _with_axes(self.bias_init, self.bias_axes_1), (n_act, f), self.dtype
      )
      wo_bias = self.param(
        "wo_bias", _with_axes(self.bias_init, self.bias_axes_2), (k,), self.dtype
      )
    if recipe is None:  # high precision computes in the input's dtype (TE casts too)
      wi, wo = wi.astype(inputs.dtype), wo.astype(inputs.dtype)
    states = (gemm_state(self, recipe, "_0"), gemm_state(self, recipe, "_1"))
    sr_rngs = (rounding_key(self, recipe), rounding_key(self, recipe))
    dropping = self.intermediate_dropout_rate > 0 and not deterministic
    inputs = _constrain(inputs, self.layernorm_input_axes)
    return core.layernorm_mlp(
      inputs,
      scale,
      ln_bias,
      wi,
      wo,
      wi_bias,
      wo_bias,
      activations=names,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
      enable_layernorm=self.enable_layernorm,
      dropout_rate=self.intermediate_dropout_rate,
      dropout_rng=self.make_rng(self.intermediate_dropout_rng_name) if dropping else None,
      dropout_broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
      deterministic=deterministic,
      recipe=recipe,
      states=states,
      rngs=sr_rngs,
      **kit.GemmOptions(
        self.threshold, kernel_all_gather=self.kernel_all_gather, config=self.config
      ).fused_keywords(),
      return_layernorm_output=self.return_layernorm_output,
      ffn1_ckpt_name=self.ffn1_ckpt_name,
      ffn2_ckpt_name=self.ffn2_ckpt_name,
      dot_1_input_constraint=_constraint(self.dot_1_input_axes),
      dot_2_input_constraint=_constraint(self.dot_2_input_axes),
      layer=layer_label(self),
      framework="linen",
    )
