"""The high-precision operations around the GEMMs: norms, activations, softmax, LoRA."""

from te_adapters.core.ops._activation import ACTIVATIONS, activation, normalize_activations
from te_adapters.core.ops._lora import check_lora_rank, lora_shapes, low_rank_adaptation
from te_adapters.core.ops._norm import LAYERNORM_TYPES, layernorm
from te_adapters.core.ops._softmax import SOFTMAX_TYPES, SoftmaxFusionType, SoftmaxType, softmax

__all__ = [
    "ACTIVATIONS",
    "LAYERNORM_TYPES",
    "SOFTMAX_TYPES",
    "SoftmaxFusionType",
    "SoftmaxType",
    "activation",
    "check_lora_rank",
    "layernorm",
    "lora_shapes",
    "low_rank_adaptation",
    "normalize_activations",
    "softmax",
]
