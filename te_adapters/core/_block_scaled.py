"""Block-scaled operands of a recipe: their block layout, quantization, dequantization and GEMM.

Each GEMM operand has a role (``x``, ``kernel``, ``grad``); the recipe gives the role its blocks:

============  ===================  ============================  ===========================
recipe        x                    kernel                        grad
============  ===================  ============================  ===========================
MXFP8         1x32, E8M0 scales    1x32                          1x32
NVFP4         1x16, RHT for wgrad  16x16 tiles (1x16 if 2-D off)  1x16, stochastic rounding,
                                                                 RHT for wgrad
FP8 block     1x128 (or 128x128)   128x128 (or 1x128)            1x128 (or 128x128)
============  ===================  ============================  ===========================

Blocks always run along the contracting dimension of the GEMM the copy feeds. The functions here
take operands laid out as ``(..., rows, contracting)``: blocks along the last axis, tiles over
the last two.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import _block, _float8_block, _mxfp8, _nvfp4
from te_adapters.core._block import emulation_dtype, native_gemm_available
from te_adapters.core._format import BlockFormat, OperandSpec
from te_adapters.core._scaled_tensor import ScaledTensor

__all__ = [
  "BLOCK_MODES",
  "FORMATS",
  "OperandSpec",
  "format_of",
  "operand_spec",
  "quantize_trailing",
  "dequantize",
  "transpose_tiles",
  "gemm",
  "native_gemm_available",
  "emulation_dtype",
]

# The block-scaled formats, one module each (see _format.BlockFormat).
FORMATS: tuple[BlockFormat, ...] = (_mxfp8.FORMAT, _nvfp4.FORMAT, _float8_block.FORMAT)
_BY_MODE = {mode: f for f in FORMATS for mode in f.scaling_modes}
BLOCK_MODES = tuple(_BY_MODE)
ROLES = ("x", "kernel", "grad")


def format_of(recipe) -> BlockFormat:
  """The format of a block-scaled recipe; a TypeError for any other recipe."""
  for f in FORMATS:
    if isinstance(recipe, f.recipe_type):
      return f
  raise TypeError(f"{type(recipe).__name__} is not a block-scaled recipe")


def operand_spec(recipe, role: str, *, wgrad: bool = False) -> OperandSpec:
  """The quantization of ``role`` under a block recipe; ``wgrad`` marks the weight-gradient copy."""
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  return format_of(recipe).operand_spec(recipe, role, wgrad)


def quantize_trailing(
  x, spec: OperandSpec, key=None, *, stream: int = 0, what: str = "x", reduce_amax=None
) -> ScaledTensor:
  """Quantizes ``x`` with blocks over its trailing axes (``spec.block_shape``).

  Args:
    x: real floating-point array.
    spec: the operand's quantization.
    key: PRNG key for stochastic rounding; required iff ``spec.stochastic``.
    stream: which random stream of ``key`` to use (copies rounded with one key differ in it).
    what: how to name ``x`` in errors.
    reduce_amax: for NVFP4, maps the amax of ``x`` to that of the whole tensor when ``x`` is a
      shard of it (``shard_map``); the other formats' scales are per block and do not use it.
  """
  if x.ndim < len(spec.block_shape):
    raise ValueError(
      f"{what}: {len(spec.block_shape)}-D blocks need at least {len(spec.block_shape)} axes, "
      f"got shape {x.shape}"
    )
  _block.check_divisible(x.shape, spec.block_shape, what)
  if spec.stochastic and key is None:
    raise ValueError(f"{what}: stochastic rounding needs a PRNG key")
  dq_dtype = np.dtype(x.dtype)
  data, scale_inv, amax, mode = _BY_MODE[spec.mode].quantize(x, spec, key, stream, reduce_amax)
  return ScaledTensor(data, scale_inv, amax, scaling_mode=mode, dq_dtype=dq_dtype)


def dequantize(t: ScaledTensor, dtype) -> jax.Array:
  """The high-precision values of a block-scaled tensor (the RHT undone for ``nvfp4_rht``)."""
  return _BY_MODE[t.scaling_mode].dequantize(t, dtype)


def transpose_tiles(t: ScaledTensor) -> ScaledTensor:
  """Swaps the last two axes of a tiled tensor (data and per-tile scales): exact, no rounding."""
  return dataclasses.replace(
    t, data=jnp.swapaxes(t.data, -1, -2), scale_inv=jnp.swapaxes(t.scale_inv, -1, -2)
  )


def gemm(
  a: ScaledTensor, b: ScaledTensor, out_dtype=jnp.float32, out_sharding=None, choice="auto"
) -> jax.Array:
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` from block-scaled operands, float32 sums.

  The result is float32, or ``out_dtype`` where the GEMM kernel writes that dtype itself (FP8
  block scaling on cuBLASLt writes bfloat16); callers cast it to ``out_dtype``.

  Blocks run along K in both operands. FP8 block scaling runs FP8 GEMMs per 128-wide K slice.
  MXFP8/NVFP4 run ``jax.nn.scaled_matmul`` where the device has it, and otherwise a GEMM of the
  dequantized values (the same quantized values, accumulated in float32). ``out_sharding``: the
  output's ``NamedSharding`` under Explicit mesh axes (needed when K is sharded), else None.
  ``choice``: the ``GemmConfig.block_gemm`` option.
  """
  return _BY_MODE[a.scaling_mode].gemm(a, b, out_dtype, out_sharding, choice)
