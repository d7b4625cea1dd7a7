"""Flax Linen adapter: ``make_dot_general_cls``, ``Dense``, ``DenseGeneral``, TE's ``LayerNorm``,
``LayerNormDenseGeneral``, ``LayerNormMLP`` and ``Softmax``, ``wrap_function_in_te_state_module``,
``quantize`` (an existing model, no edits) and a train state."""

from te_adapters._kit import require

require("flax", "te_adapters.linen", "flax")

from te_adapters import _flax_serialization

_flax_serialization.register()

from te_adapters._kit import Rule, SkippedLayersWarning
from te_adapters.linen._mlp import LayerNormMLP
from te_adapters.linen._module import (
  OVERWRITE_WITH_GRADIENT,
  SR_RNG,
  Dense,
  DenseGeneral,
  QuantizedDotGeneral,
  make_dot_general_cls,
)
from te_adapters.linen._norm import LayerNorm, LayerNormDenseGeneral, Softmax
from te_adapters.linen._quantize import QuantizeReport, quantize
from te_adapters.linen._ragged import make_ragged_dot_cls
from te_adapters.linen._train_state import TrainState, value_and_grad, with_max_grad
from te_adapters.linen._wrap import wrap_function_in_te_state_module

__all__ = [
  "OVERWRITE_WITH_GRADIENT",
  "Dense",
  "DenseGeneral",
  "LayerNorm",
  "LayerNormDenseGeneral",
  "LayerNormMLP",
  "QuantizeReport",
  "Rule",
  "SkippedLayersWarning",
  "QuantizedDotGeneral",
  "SR_RNG",
  "Softmax",
  "TrainState",
  "make_dot_general_cls",
  "make_ragged_dot_cls",
  "quantize",
  "value_and_grad",
  "with_max_grad",
  "wrap_function_in_te_state_module",
]
