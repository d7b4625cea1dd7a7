"""Quantization formats: per-tensor scalings and block formats, quantize and dequantize."""

from te_adapters.core.formats._block import (
    block_amax,
    block_shape_of,
    check_divisible,
    emulated_gemm,
    emulation_dtype,
    exp2,
    expand_scales,
    f32_max,
    global_amax,
    native_gemm_available,
    repeat,
    scale_by_pow2,
    scaled_matmul,
    use_native_gemm,
)
from te_adapters.core.formats._block_scaled import (
    BLOCK_MODES,
    block_format,
    block_of,
    operand_spec,
    quantize_trailing,
    transpose_tiles,
)
from te_adapters.core.formats._cast_transpose import (
    backend,
    cast_transpose,
    cast_transpose_per_batch,
)
from te_adapters.core.formats._format import (
    BlockFormat,
    GroupedFormat,
    GroupedRequest,
    OperandSpec,
    Producer,
    QuantizationFormat,
    Quantized,
    QuantizeRequest,
)
from te_adapters.core.formats._grouping import (
    PER_GROUP_WGRAD_DIMS,
    ROWS_TIMES_GROUP_KERNEL_DIMS,
    GroupPadding,
    group_padding,
    padded_rows,
    row_groups,
)
from te_adapters.core.formats._mxfp8 import e8m0_from_scale
from te_adapters.core.formats._nvfp4 import (
    E2M1_VALUES,
    RHT_SIGNS,
    apply_rht,
    global_factor,
    invert_rht,
    random_seed,
    rht_matrix,
    round_e2m1,
    stochastic_round_e2m1,
)
from te_adapters.core.formats._quantize import dequantize, quantize
from te_adapters.core.formats._registry import (
    check_state,
    format_of,
    formats,
    init_state,
    register_format,
    state_names,
    typed_state,
    unregister_format,
)
from te_adapters.core.formats._scaled_tensor import (
    ScaledTensor,
    cast_with_scale,
    check_float_operand,
    check_fp8_dtype,
)
from te_adapters.core.formats._scaling import compute_scale, delayed_update, fp8_max, leading_amax
from te_adapters.core.formats._tensor_format import cast_both, tensor, tensor_format
from te_adapters.core.formats._tensor_scaling import CURRENT, DELAYED, TensorScaling

# Not here, defined by several modules (import the module):
# BLOCK (_float8_block, _mxfp8, _nvfp4)
# FORMAT (_float8_block, _mxfp8)
# amax (_cast_transpose, _scaling)
# dequantize_values (_float8_block, _mxfp8, _nvfp4)
# gemm (_block_scaled, _float8_block)

__all__ = [
    "BLOCK_MODES",
    "BlockFormat",
    "CURRENT",
    "DELAYED",
    "E2M1_VALUES",
    "GroupPadding",
    "GroupedFormat",
    "GroupedRequest",
    "OperandSpec",
    "PER_GROUP_WGRAD_DIMS",
    "Producer",
    "QuantizationFormat",
    "QuantizeRequest",
    "Quantized",
    "RHT_SIGNS",
    "ROWS_TIMES_GROUP_KERNEL_DIMS",
    "ScaledTensor",
    "TensorScaling",
    "apply_rht",
    "backend",
    "block_amax",
    "block_format",
    "block_of",
    "block_shape_of",
    "cast_both",
    "cast_transpose",
    "cast_transpose_per_batch",
    "cast_with_scale",
    "check_divisible",
    "check_float_operand",
    "check_fp8_dtype",
    "check_state",
    "compute_scale",
    "delayed_update",
    "dequantize",
    "e8m0_from_scale",
    "emulated_gemm",
    "emulation_dtype",
    "exp2",
    "expand_scales",
    "f32_max",
    "format_of",
    "formats",
    "fp8_max",
    "global_amax",
    "global_factor",
    "group_padding",
    "init_state",
    "invert_rht",
    "leading_amax",
    "native_gemm_available",
    "operand_spec",
    "padded_rows",
    "quantize",
    "quantize_trailing",
    "random_seed",
    "register_format",
    "repeat",
    "rht_matrix",
    "round_e2m1",
    "row_groups",
    "scale_by_pow2",
    "scaled_matmul",
    "state_names",
    "stochastic_round_e2m1",
    "tensor",
    "tensor_format",
    "transpose_tiles",
    "typed_state",
    "unregister_format",
    "use_native_gemm",
]
