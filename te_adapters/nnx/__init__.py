"""Flax NNX adapter of te_adapters.

Drop-in quantized layers (``Linear``, ``LinearGeneral``, ``Einsum``), TE's ``LayerNorm``,
``LayerNormDenseGeneral`` and ``Softmax``, the quantized operations
they use (``DotGeneral``, ``EinsumOp``, usable in any NNX layer that takes ``dot_general=`` or
``einsum_op=``), ``quantize_model`` to convert an existing model, and training helpers.

A training step::

  loss, (grads, state_grads) = te_adapters.nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  te_adapters.nnx.update_recipe_state(model, state_grads)
"""

from te_adapters._kit import require

require("flax", "te_adapters.nnx", "flax")

from te_adapters import _flax_serialization

_flax_serialization.register()

from te_adapters._kit import Rule, SkippedLayersWarning
from te_adapters.nnx._convert import QuantizeReport, quantize_model
from te_adapters.nnx._experts import GroupedLinear
from te_adapters.nnx._layers import Einsum, Linear, LinearGeneral
from te_adapters.nnx._mlp import LayerNormMLP
from te_adapters.nnx._norm import LayerNorm, LayerNormDenseGeneral, Softmax
from te_adapters.nnx._ops import DotGeneral, EinsumOp
from te_adapters.nnx._train import (
  grad,
  recipe_state,
  update_recipe_state,
  upgrade_state_dict,
  value_and_grad,
)
from te_adapters.nnx._variables import RecipeState

__all__ = [
  "DotGeneral",
  "Einsum",
  "EinsumOp",
  "GroupedLinear",
  "LayerNorm",
  "LayerNormDenseGeneral",
  "LayerNormMLP",
  "Linear",
  "LinearGeneral",
  "QuantizeReport",
  "Rule",
  "SkippedLayersWarning",
  "RecipeState",
  "Softmax",
  "grad",
  "quantize_model",
  "recipe_state",
  "update_recipe_state",
  "upgrade_state_dict",
  "value_and_grad",
]
