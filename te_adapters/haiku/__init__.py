"""Haiku adapter of te_adapters.

* ``Linear``: ``hk.Linear`` with a quantized GEMM; recipe state in ``hk.get_state``.
* ``LayerNorm``, ``LayerNormDenseGeneral``, ``Softmax``: TE's modules, sizes from the input.
* ``quantize(recipe)``: quantizes the ``hk.Linear`` layers of an existing model, unedited.
* ``value_and_grad``: a training step's ``(value, (param_grads, new_state))``, the shape of every
  adapter's helper, with recipe state from the gradient and ordinary state (``hk.BatchNorm``)
  from ``apply``; ``value_grad_and_state`` is the same step returning
  ``(loss, aux, param_grads, new_state)``.
"""

from te_adapters._kit import require

require("haiku", "te_adapters.haiku", "haiku")

from te_adapters._kit import Rule, SkippedLayersWarning
from te_adapters.haiku._experts import GroupedLinear
from te_adapters.haiku._intercept import QuantizeReport, quantize
from te_adapters.haiku._linear import Linear
from te_adapters.haiku._mlp import LayerNormMLP
from te_adapters.haiku._norm import LayerNorm, LayerNormDenseGeneral, Softmax
from te_adapters.haiku._train import (
  RECIPE_STATE_NAMES,
  merge_state,
  split_state,
  value_and_grad,
  value_grad_and_state,
)

__all__ = [
  "GroupedLinear",
  "LayerNorm",
  "LayerNormDenseGeneral",
  "LayerNormMLP",
  "RECIPE_STATE_NAMES",
  "Softmax",
  "Linear",
  "QuantizeReport",
  "Rule",
  "SkippedLayersWarning",
  "merge_state",
  "quantize",
  "split_state",
  "value_and_grad",
  "value_grad_and_state",
]
