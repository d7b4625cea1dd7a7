"""The high-precision operations around the GEMMs: norms, activations, softmax, LoRA."""

from te_adapters.core.ops._activation import (
  ACTIVATIONS,
  Activation,
  activation,
  activation_product,
  normalize_activations,
)
from te_adapters.core.ops._lora import check_lora_rank, lora_shapes, low_rank_adaptation
from te_adapters.core.ops._norm import (
  LAYERNORM_TYPES,
  check_norm_args,
  layernorm,
  norm_bwd,
  norm_gamma,
  norm_stats,
  normalized,
)
from te_adapters.core.ops._softmax import SOFTMAX_TYPES, SoftmaxFusionType, SoftmaxType, softmax

__all__ = [
  "ACTIVATIONS",
  "Activation",
  "LAYERNORM_TYPES",
  "SOFTMAX_TYPES",
  "SoftmaxFusionType",
  "SoftmaxType",
  "activation",
  "activation_product",
  "check_lora_rank",
  "check_norm_args",
  "layernorm",
  "lora_shapes",
  "low_rank_adaptation",
  "norm_bwd",
  "norm_gamma",
  "norm_stats",
  "normalize_activations",
  "normalized",
  "softmax",
]
