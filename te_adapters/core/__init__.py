"""The functional core of te_adapters: pure JAX, no framework imports.

Recipes, recipe state as explicit pytrees, quantize/dequantize, and a quantized ``dot_general``
with a custom VJP whose state gradient is the next step's state. GEMMs too small for FP8 to pay
stay in high precision (``SizeThreshold``, ``DEFAULT_SIZE_THRESHOLD``, ``runs_in_fp8``).
"""

from te_adapters.core._activation import ACTIVATIONS, activation, normalize_activations
from te_adapters.core._collectives import Collective, hlo_collectives
from te_adapters.core._config import GemmConfig, check_config
from te_adapters.core._format import Producer, QuantizationFormat, Quantized, QuantizeRequest
from te_adapters.core._frozen import FrozenStateWarning, watch_lora_state
from te_adapters.core._gemm import dot_general
from te_adapters.core._inspect import (
    count_fp8_cublas_gemms,
    count_fp8_dot_generals,
    count_fp8_gemms,
    dot_general_operand_dtypes,
    hlo_dot_operand_types,
)
from te_adapters.core._layer import (
    DEFAULT_RECIPE,
    DEFAULT_THRESHOLD,
    GEMM_DIM_MULTIPLE,
    QuantizeReport,
    check_gemm_dims,
    check_input_dtype,
    check_kernel_gemm_dims,
    check_last_axis,
    einsum_gemm_dims,
    gemm_dims_refusal,
    input_dtype_refusal,
    kernel_gemm_dims,
)
from te_adapters.core._lora import check_lora_rank, lora_shapes, low_rank_adaptation
from te_adapters.core._mlp import dropout, layernorm_mlp
from te_adapters.core._norm import LAYERNORM_TYPES, layernorm
from te_adapters.core._norm_dense import layernorm_dense
from te_adapters.core._partition import ShardingFallbackWarning
from te_adapters.core._quantize import ScaledTensor, dequantize, quantize
from te_adapters.core._ragged import init_ragged_state, ragged_dot
from te_adapters.core._recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_recipe,
)
from te_adapters.core._registry import format_of
from te_adapters.core._registry import register as register_format
from te_adapters.core._registry import unregister as unregister_format
from te_adapters.core._remat import (
    CHECKPOINT_NAMES,
    GEMM_OUTPUT,
    QUANTIZED_KERNEL,
    QUANTIZED_X,
    checkpoint_dots_and_quantized_gemms,
    checkpoint_dots_with_no_batch_dims_and_quantized_gemms,
    save_quantized_gemms,
    save_quantized_operands,
)
from te_adapters.core._scaling import compute_scale, delayed_update, fp8_max
from te_adapters.core._softmax import SOFTMAX_TYPES, SoftmaxFusionType, SoftmaxType, softmax
from te_adapters.core._state import (
    DelayedScalingState,
    RoleState,
    check_state,
    init_state,
    is_state_mapping,
    state_names,
    updated_state,
    with_max_grad,
)
from te_adapters.core._tensor_format import tensor_format
from te_adapters.core._tensor_scaling import TensorScaling
from te_adapters.core._threshold import (
    DEFAULT_SIZE_THRESHOLD,
    HighPrecisionGemmWarning,
    SizeThreshold,
    check_threshold,
    high_precision_reason,
    runs_in_fp8,
)

__all__ = [
    "Producer",
    "QuantizationFormat",
    "Quantized",
    "QuantizeRequest",
    "TensorScaling",
    "format_of",
    "register_format",
    "tensor_format",
    "unregister_format",
    "ACTIVATIONS",
    "activation",
    "normalize_activations",
    "DEFAULT_RECIPE",
    "DEFAULT_THRESHOLD",
    "GEMM_DIM_MULTIPLE",
    "QuantizeReport",
    "check_gemm_dims",
    "check_input_dtype",
    "check_kernel_gemm_dims",
    "check_last_axis",
    "einsum_gemm_dims",
    "gemm_dims_refusal",
    "input_dtype_refusal",
    "kernel_gemm_dims",
    "layernorm",
    "layernorm_dense",
    "CHECKPOINT_NAMES",
    "Collective",
    "DEFAULT_SIZE_THRESHOLD",
    "DelayedScaling",
    "DelayedScalingState",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "FrozenStateWarning",
    "GEMM_OUTPUT",
    "LAYERNORM_TYPES",
    "GemmConfig",
    "HighPrecisionGemmWarning",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QUANTIZED_KERNEL",
    "QUANTIZED_X",
    "Recipe",
    "RoleState",
    "ScaledTensor",
    "SOFTMAX_TYPES",
    "ShardingFallbackWarning",
    "SoftmaxFusionType",
    "SoftmaxType",
    "SizeThreshold",
    "check_config",
    "check_recipe",
    "check_state",
    "is_state_mapping",
    "check_threshold",
    "checkpoint_dots_and_quantized_gemms",
    "checkpoint_dots_with_no_batch_dims_and_quantized_gemms",
    "compute_scale",
    "count_fp8_cublas_gemms",
    "count_fp8_dot_generals",
    "count_fp8_gemms",
    "delayed_update",
    "dequantize",
    "dot_general",
    "dot_general_operand_dtypes",
    "fp8_max",
    "hlo_collectives",
    "hlo_dot_operand_types",
    "init_ragged_state",
    "check_lora_rank",
    "dropout",
    "init_state",
    "layernorm_mlp",
    "lora_shapes",
    "low_rank_adaptation",
    "quantize",
    "ragged_dot",
    "high_precision_reason",
    "runs_in_fp8",
    "save_quantized_gemms",
    "save_quantized_operands",
    "softmax",
    "state_names",
    "updated_state",
    "watch_lora_state",
    "with_max_grad",
]
