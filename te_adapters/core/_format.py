"""The interface of a block-scaled quantization format: one module per format implements it.

A format is a few pure functions, bundled the way optax bundles a transformation's ``init`` and
``update``: ``_mxfp8.FORMAT``, ``_nvfp4.FORMAT`` and ``_float8_block.FORMAT`` are the three.
``_block_scaled`` picks one by recipe type or by a tensor's ``scaling_mode``, so adding a format
is one module and one registry entry; the block GEMM's VJP (``_block_gemm``) never names one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

__all__ = ["BlockFormat", "OperandSpec"]


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one copy of one GEMM operand is quantized (static)."""

  mode: str  # "mxfp8", "nvfp4" or "float8_block"
  block_shape: tuple[int, ...]
  q_dtype: np.dtype
  rht: bool = False
  stochastic: bool = False
  power_2: bool = True

  @property
  def block_size(self) -> int:
    return self.block_shape[-1]


class BlockFormat(NamedTuple):
  """The functions of one block-scaled format.

  Attributes:
    recipe_type: the recipe class whose GEMMs use this format.
    scaling_modes: the ``ScaledTensor.scaling_mode`` values of its tensors.
    operand_spec: ``(recipe, role, wgrad) -> OperandSpec``: how ``recipe`` quantizes the
      operand ``role`` (``"x"``, ``"kernel"``, ``"grad"``); ``wgrad`` marks the copy that feeds
      the weight-gradient GEMM.
    quantize: ``(x, spec, key, stream, reduce_amax) -> (data, scale_inv, amax, scaling_mode)``:
      blocks of ``spec.block_shape`` over the trailing axes of ``x`` (already checked to divide
      them); ``key`` and its random ``stream`` feed stochastic rounding (``spec.stochastic``),
      ``reduce_amax`` maps a shard's amax to the whole tensor's (or is None).
    dequantize: ``(t, dtype) -> array``: the high-precision values of a ``ScaledTensor``.
    gemm: ``(a, b, out_dtype, out_sharding, choice) -> array``: ``(B, M, K) x (B, N, K) ->
      (B, M, N)`` from two ``ScaledTensor`` operands blocked along K, float32 (or ``out_dtype``
      where the kernel writes it); ``choice`` is ``GemmConfig.block_gemm``.
  """

  recipe_type: type
  scaling_modes: tuple[str, ...]
  operand_spec: Callable[..., OperandSpec]
  quantize: Callable[..., tuple[jax.Array, jax.Array, jax.Array, str]]
  dequantize: Callable[..., jax.Array]
  gemm: Callable[..., jax.Array]
