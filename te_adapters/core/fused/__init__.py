"""A norm and the MLP block around quantized GEMMs, fused into TE's kernels or composed."""

from te_adapters.core.fused._fused_mlp import (
  KERNEL_ACTIVATIONS,
  FusedPathFallbackWarning,
  act_amax,
  act_block_cast,
  act_cast,
  activation_f32,
  applies,
  dact_amax,
  dact_block_cast,
  dact_cast,
  dact_f32,
  dbias_block_cast,
  dbias_cast,
  format_fuses,
  fused_mlp,
  norm_block_cast,
  norm_cast,
)
from te_adapters.core.fused._mlp import dropout, layernorm_mlp
from te_adapters.core.fused._norm_dense import layernorm_dense

__all__ = [
  "KERNEL_ACTIVATIONS",
  "FusedPathFallbackWarning",
  "act_amax",
  "act_block_cast",
  "act_cast",
  "activation_f32",
  "applies",
  "dact_amax",
  "dact_block_cast",
  "dact_cast",
  "dact_f32",
  "dbias_block_cast",
  "dbias_cast",
  "dropout",
  "format_fuses",
  "fused_mlp",
  "layernorm_dense",
  "layernorm_mlp",
  "norm_block_cast",
  "norm_cast",
]
