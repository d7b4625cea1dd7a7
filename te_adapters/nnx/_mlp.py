"""TE's ``LayerNormMLP`` as an NNX module over ``core.layernorm_mlp``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._norm import _norm_params, _value
from te_adapters.nnx._ops import DotGeneral
from te_adapters.nnx._variables import OptionalGemms

__all__ = ["LayerNormMLP"]


class LayerNormMLP(OptionalGemms, nnx.Module):
  """TE's ``LayerNormMLP`` in NNX: norm, GEMM, activation, dropout, GEMM.

  Parameters with TE's names and shapes: ``scale`` and ``ln_bias`` ``(in_features,)``,
  ``wi_kernel`` ``(in_features, n_act, intermediate_dim)``, ``wo_kernel``
  ``(intermediate_dim, in_features)``, and with ``use_bias`` ``wi_bias``
  ``(n_act, intermediate_dim)`` and ``wo_bias`` ``(in_features,)``. With a recipe, the two GEMMs'
  state lives in the submodules ``dot_general_0`` and ``dot_general_1`` (TE's postfixes), as
  ``RecipeState`` variables that ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never touches.
  Returns ``(out, ln_out or None)`` as TE's.

  Args:
    in_features: the size of the input's last axis.
    intermediate_dim: F.
    activations: names for ``core.activation``; several make a gated product.
    enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, ln_bias_init:
      the norm (as for ``LayerNorm``).
    kernel_init: default ``variance_scaling(1.0, "fan_in", "truncated_normal")``; ``wi_kernel``
      draws ``n_act`` kernels with it.
    use_bias, bias_init: the GEMMs' biases (off by default, as TE's).
    return_layernorm_output: also return the norm's output (TE's default: True).
    intermediate_dropout_rate: dropout after the activation (default 0: off). Its keys come from
      a stream forked from ``rngs``'s ``"dropout"`` (else ``"default"``) stream, as for
      ``nnx.Dropout``; ``deterministic=True`` (or ``model.eval()``) turns it off.
    intermediate_hidden_dropout_dims: axes sharing one dropout mask.
    param_dtype: the parameters' dtype.
    axis: the normalized and contracted axis: -1 (TE's ``LayerNormMLP`` accepts no other).
    recipe: a te_adapters recipe for both GEMMs (default ``core.DEFAULT_RECIPE``), or ``None``.
    threshold, config: passed to ``core.dot_general``.
    kernel_all_gather: FSDP: the kernels' sharding, one ``PartitionSpec`` for both (e.g.
      ``P("fsdp")``: each kernel's first dim), gathered as FP8 (``core.layernorm_mlp``); needs a
      recipe.
    rngs: an ``nnx.Rngs``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> mlp = ta_nnx.LayerNormMLP(32, 64, activations=("gelu", "linear"),
    ...                           recipe=ta.DelayedScaling(), rngs=nnx.Rngs(0))
    >>> out, ln_out = mlp(jnp.ones((4, 32)))
    >>> out.shape, mlp.wi_kernel.shape, mlp.dot_general_1.state.x_scale.shape
    ((4, 32), (32, 2, 64), (1,))
  """

  _gemm_slots = ("dot_general_0", "dot_general_1")
  _kernel_name = "wi_kernel"

  def __init__(
    self,
    in_features: int,
    intermediate_dim: int,
    *,
    activations=("gelu",),
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
    intermediate_dropout_rate: float = 0.0,
    intermediate_hidden_dropout_dims=(),
    deterministic: bool = False,
    param_dtype=jnp.float32,
    axis=-1,
    recipe: Any = kit.DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    config=None,
    kernel_all_gather=None,
    rngs: nnx.Rngs,
  ):
    kit.check_last_axis(axis, None, "LayerNormMLP", "LayerNormMLP")
    kit.check_needs_recipe(recipe, "LayerNormMLP", kernel_all_gather=kernel_all_gather)
    kit.check_layernorm_type(layernorm_type, "LayerNormMLP")
    names = core.normalize_activations(activations)
    n_act, k, f = len(names), in_features, intermediate_dim
    what = f"LayerNormMLP({in_features}, {intermediate_dim})"
    dims = (((0,), (0,)), ((), ()))
    kit.check_kernel_gemm_dims(recipe, (k, n_act, f), dims, f"{what} wi_kernel")
    kit.check_kernel_gemm_dims(recipe, (f, k), dims, f"{what} wo_kernel")
    self.activations = names
    self.enable_layernorm = enable_layernorm
    self.layernorm_type = layernorm_type
    self.epsilon = epsilon
    self.zero_centered_gamma = zero_centered_gamma
    self.return_layernorm_output = return_layernorm_output
    self.intermediate_dropout_rate = intermediate_dropout_rate
    self.intermediate_hidden_dropout_dims = tuple(intermediate_hidden_dropout_dims)
    self.deterministic = deterministic
    self.recipe = recipe
    self.threshold = threshold
    self.config = config
    self.scale = self.ln_bias = nnx.data(None)
    if enable_layernorm:
      _norm_params(self, k, scale_init, ln_bias_init, param_dtype, rngs)
    kernel_init = kernel_init or nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal"
    )
    keys = jax.random.split(rngs.params(), n_act)
    self.wi_kernel = nnx.Param(
      jnp.stack([kernel_init(key, (k, f), param_dtype) for key in keys], axis=1)
    )
    self.wo_kernel = nnx.Param(kernel_init(rngs.params(), (f, k), param_dtype))
    self.wi_bias = self.wo_bias = nnx.data(None)
    if use_bias:
      self.wi_bias = nnx.Param(bias_init(rngs.params(), (n_act, f), param_dtype))
      self.wo_bias = nnx.Param(bias_init(rngs.params(), (k,), param_dtype))
    # Without a recipe, no GEMM slot (OptionalGemms: each reads as None).
    self.dot_general_0: DotGeneral | None
    self.dot_general_1: DotGeneral | None
    if recipe is not None:
      gemm = dict(threshold=threshold, kernel_all_gather=kernel_all_gather, config=config)
      self.dot_general_0 = DotGeneral(recipe, **gemm, rngs=rngs)
      self.dot_general_1 = DotGeneral(recipe, **gemm, rngs=rngs)
      self.dot_general_0._set_owner(self, self.wi_kernel.shape, "wi_kernel")
      self.dot_general_1._set_owner(self, self.wo_kernel.shape, "wo_kernel")
    self.dropout_rngs: nnx.RngStream | None = nnx.data(None)
    if intermediate_dropout_rate > 0:
      self.dropout_rngs = rngs["dropout"].fork()

  def __call__(self, inputs, *, deterministic: bool | None = None):
    """Norm, first GEMM, activation, dropout, second GEMM: TE's ``LayerNormMLP``.

    Args:
      inputs: a floating-point array ``[..., K]``, K the layer's ``in_features``.
      deterministic: turn dropout off (True) or on (False) for this call; None: the
        layer's ``deterministic``.

    Returns:
      ``(out, ln_out)``: ``out`` of ``inputs``'s shape; ``ln_out`` the norm's output, or None unless
      ``return_layernorm_output``.
    """
    deterministic = self.deterministic if deterministic is None else deterministic
    if self.recipe is None:
      gemm = {"recipe": None, "threshold": self.threshold, "config": self.config}
      states = sr_rngs = None
      wi, wo = self.wi_kernel[...].astype(inputs.dtype), self.wo_kernel[...].astype(inputs.dtype)
    else:
      assert self.dot_general_0 is not None and self.dot_general_1 is not None
      args = (self.dot_general_0.gemm_arguments(), self.dot_general_1.gemm_arguments())
      gemm = {
        "recipe": args[0]["recipe"],
        "threshold": args[0]["threshold"],
        "kernel_all_gather": args[0]["kernel_all_gather"],
        "config": args[0]["config"],
      }
      states = (args[0]["state"], args[1]["state"])
      sr_rngs = (args[0]["rng"], args[1]["rng"])
      wi, wo = self.wi_kernel[...], self.wo_kernel[...]
    dropping = self.intermediate_dropout_rate > 0 and not deterministic
    return core.layernorm_mlp(
      inputs,
      _value(self.scale),
      _value(self.ln_bias),
      wi,
      wo,
      _value(self.wi_bias),
      _value(self.wo_bias),
      activations=self.activations,
      layernorm_type=self.layernorm_type,
      zero_centered_gamma=self.zero_centered_gamma,
      epsilon=self.epsilon,
      enable_layernorm=self.enable_layernorm,
      dropout_rate=self.intermediate_dropout_rate,
      dropout_rng=self.dropout_rngs() if dropping and self.dropout_rngs is not None else None,
      dropout_broadcast_dims=self.intermediate_hidden_dropout_dims,
      deterministic=deterministic,
      states=states,
      rngs=sr_rngs,
      return_layernorm_output=self.return_layernorm_output,
      **gemm,
      layer=self._layer_name(),
      framework="nnx",
    )
