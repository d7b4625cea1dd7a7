"""TE's ``LayerNormDenseGeneral`` after its parameters exist: the norm (or none), the GEMM, the
output bias and the depth scaling, the same in every adapter."""

from __future__ import annotations

from collections.abc import Callable

from te_adapters import core

__all__ = ["layernorm_dense_general"]


def layernorm_dense_general(
  inputs,
  scale,
  ln_bias,
  kernel,
  bias=None,
  *,
  enable_layernorm: bool = True,
  layernorm_type: str = "layernorm",
  zero_centered_gamma: bool = False,
  epsilon: float = 1e-6,
  return_layernorm_output: bool = True,
  depth_scaling: float | None = None,
  layernorm_input_constraint: Callable | None = None,
  dot_input_constraint: Callable | None = None,
  recipe,
  state=None,
  rng=None,
  threshold=core.DEFAULT_THRESHOLD,
  config=None,
  kernel_all_gather=None,
  layer: str | None = None,
  framework: str | None = None,
):
  """``(z, ln_out)`` of TE's ``LayerNormDenseGeneral`` from its parameters.

  With ``enable_layernorm``, ``core.layernorm_dense`` (the norm over the last axis, then the
  quantized GEMM with ``kernel`` ``(K, *features)``); without, ``core.dot_general`` on the
  inputs themselves, which are then ``ln_out``. ``bias`` is added to ``z`` and ``z`` divided by
  ``depth_scaling`` when given. ``ln_out`` is None unless ``return_layernorm_output``.

  Args:
    inputs: ``(..., K)``.
    scale, ln_bias: the norm's parameters (unused without ``enable_layernorm``).
    kernel: ``(K, *features)``.
    bias: the output bias ``features``, or None.
    enable_layernorm, layernorm_type, zero_centered_gamma, epsilon, return_layernorm_output,
      depth_scaling: TE's fields of the same names.
    layernorm_input_constraint: applied to the inputs before the norm (TE's
      ``layernorm_input_axes``); not used without the norm.
    dot_input_constraint: applied to the GEMM's input (TE's ``dot_input_axes``): the norm's
      output, or the inputs without the norm.
    recipe, state, rng, threshold, config, kernel_all_gather, layer, framework: the GEMM's,
      as ``core.dot_general`` (and ``core.layernorm_dense``) take them.

  Returns:
    ``(z, ln_out or None)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters._kit import layernorm_dense_general
    >>> x, kernel = jnp.ones((4, 16)), jnp.ones((16, 32))
    >>> z, ln_out = layernorm_dense_general(x, None, None, kernel, enable_layernorm=False,
    ...                                     depth_scaling=2.0, recipe=None)
    >>> float(z[0, 0]), ln_out is x
    (8.0, True)
  """
  gemm = {
    "recipe": recipe,
    "state": state,
    "rng": rng,
    "threshold": threshold,
    "config": config,
    "kernel_all_gather": kernel_all_gather,
    "layer": layer,
    "framework": framework,
  }
  if enable_layernorm:
    if layernorm_input_constraint is not None:
      inputs = layernorm_input_constraint(inputs)
    z, ln_out = core.layernorm_dense(
      inputs,
      scale,
      ln_bias,
      kernel,
      layernorm_type=layernorm_type,
      zero_centered_gamma=zero_centered_gamma,
      epsilon=epsilon,
      return_layernorm_output=return_layernorm_output,
      dot_input_constraint=dot_input_constraint,
      dense_bias=bias,
      **gemm,
    )
  else:
    if dot_input_constraint is not None:
      inputs = dot_input_constraint(inputs)
    dims = (((inputs.ndim - 1,), (0,)), ((), ()))
    z = core.dot_general(inputs, kernel, dims, preferred_element_type=inputs.dtype, **gemm)
    ln_out = inputs if return_layernorm_output else None
    if bias is not None:
      z = z + bias.astype(z.dtype)
  if depth_scaling is not None:
    z = z / depth_scaling
  return z, ln_out
