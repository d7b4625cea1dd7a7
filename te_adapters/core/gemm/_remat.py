"""Checkpoint names of the quantized GEMM and remat policies that keep them.

JAX's ``checkpoint_dots`` policies look for ``dot_general`` equations whose operands are the
values worth saving; the FP8 GEMM's inputs are produced inside a custom VJP and are found by name
instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

__all__ = [
  "name_quantized",
  "QUANTIZED_X",
  "QUANTIZED_KERNEL",
  "GEMM_OUTPUT",
  "CHECKPOINT_NAMES",
  "save_quantized_operands",
  "save_quantized_gemms",
  "checkpoint_dots_and_quantized_gemms",
  "checkpoint_dots_with_no_batch_dims_and_quantized_gemms",
]

QUANTIZED_X = "te_adapters.quantized_x"
QUANTIZED_KERNEL = "te_adapters.quantized_kernel"
GEMM_OUTPUT = "te_adapters.gemm_output"
CHECKPOINT_NAMES = (QUANTIZED_X, QUANTIZED_KERNEL, GEMM_OUTPUT)

_policies = jax.checkpoint_policies

# Saves the FP8 operands (data and scale_inv), so the backward pass does not re-quantize.
save_quantized_operands = _policies.save_only_these_names(QUANTIZED_X, QUANTIZED_KERNEL)
# Saves the FP8 operands and the GEMM outputs.
save_quantized_gemms = _policies.save_only_these_names(*CHECKPOINT_NAMES)
# The quantized-GEMM counterparts of JAX's dot policies.
checkpoint_dots_and_quantized_gemms = _policies.save_from_both_policies(
  _policies.checkpoint_dots, save_quantized_gemms
)
checkpoint_dots_with_no_batch_dims_and_quantized_gemms = _policies.save_from_both_policies(
  _policies.dots_with_no_batch_dims_saveable, save_quantized_gemms
)


def _is_8bit_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 8


def name_quantized(tree, name: str):
  """``checkpoint_name(tree, name)`` that keeps 8-bit floats intact when a policy saves them.

  JAX (0.10.x) wraps every saved floating-point residual in ``reduce_precision`` with the dtype's
  exponent and mantissa widths, which treats ``float8_e4m3fn`` as an IEEE format with infinities:
  values above 240 become inf, and the step NaN. Saving the raw bits (uint8) avoids that; the
  bitcasts are free.
  """

  def to_bits(x):
    return lax.bitcast_convert_type(x, jnp.uint8) if _is_8bit_float(x) else x

  def from_bits(bits, x):
    return lax.bitcast_convert_type(bits, x.dtype) if _is_8bit_float(x) else bits

  named = checkpoint_name(jax.tree.map(to_bits, tree), name)
  return jax.tree.map(from_bits, named, tree)
