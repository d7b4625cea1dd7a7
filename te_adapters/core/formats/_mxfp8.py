"""MXFP8: 1x32 blocks of FP8 values sharing a power-of-two scale stored as E8M0 (TE's numerics).

Per block: ``s = block_amax / fp8_max`` in float32; its E8M0 exponent ``e`` is the biased float32
exponent of ``s`` rounded up (``2**(e-127) >= s``), saturating at 254; the data are
``cast(clip(x / 2**(e-127), ±fp8_max))`` with round-to-nearest-even; dequantization is
``data * 2**(e-127)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core.formats import _block
from te_adapters.core.formats._format import BlockFormat, OperandSpec
from te_adapters.core.recipes import MXFP8BlockScaling

__all__ = ["BLOCK", "FORMAT", "e8m0_from_scale", "quantize", "dequantize_values"]

BLOCK = 32
_TINY = 2.0**-64


def e8m0_from_scale(s) -> jax.Array:
  """The E8M0 byte (uint8) of a float32 scale ``s >= 0``, with TE's round-up rule.

  ``e`` and ``m`` are the exponent and mantissa fields of ``s``; ``e`` goes up by one when
  ``m > 0``, except at ``e == 254`` (saturation) and for subnormals ``s <= 2**-127``. NaN gives
  0xFF and infinity 0xFE.
  """
  s = jnp.asarray(s, jnp.float32)
  bits = lax.bitcast_convert_type(s, jnp.uint32)
  e = (bits >> 23) & 0xFF
  m = bits & 0x7FFFFF
  up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
  e = e + up.astype(jnp.uint32)
  e = jnp.where(jnp.isinf(s), jnp.uint32(0xFE), e)
  e = jnp.where(jnp.isnan(s), jnp.uint32(0xFF), e)
  return e.astype(jnp.uint8)


def _block_exponent(block_amax, fp8_max: float) -> jax.Array:
  """E8M0 byte of ``block_amax / fp8_max``; exact for tiny amaxes despite flush-to-zero."""
  direct = e8m0_from_scale(block_amax / jnp.float32(fp8_max))
  # block_amax / fp8_max is a subnormal float32 for tiny blocks, which XLA flushes to zero.
  # Compute it 2**64 larger (exactly) and take the rounded-up exponent from that instead.
  tiny = (block_amax > 0) & (block_amax < _TINY)
  safe = jnp.where(tiny, block_amax, jnp.float32(1.0))
  bits = lax.bitcast_convert_type((safe * jnp.float32(2.0**64)) / jnp.float32(fp8_max), jnp.uint32)
  exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) + ((bits & 0x7FFFFF) > 0).astype(jnp.int32)
  scaled = jnp.clip(exponent - 64, 0, 254).astype(jnp.uint8)
  return jnp.where(tiny, scaled, direct)


def dequantize_values(data, scale_inv, block_shape=(BLOCK,)) -> jax.Array:
  """float32 ``data * 2**(e-127)`` per block, from E8M0 ``scale_inv`` (one per block)."""
  e = lax.bitcast_convert_type(scale_inv, jnp.uint8) if scale_inv.dtype != np.uint8 else scale_inv
  k = _block.expand_scales(e.astype(jnp.int32) - 127, block_shape)
  nan = _block.expand_scales(e == 0xFF, block_shape)
  return _block.scale_by_pow2(_block.keep_narrow(data).astype(jnp.float32), k, nan=nan)


def quantize(x, q_dtype):
  """1x32 MXFP8 blocks along the last axis of ``x``.

  Returns:
    ``(data, scale_inv, amax)``: ``data`` in ``q_dtype`` with the shape of ``x``; ``scale_inv``
    in ``float8_e8m0fnu`` with shape ``x.shape[:-1] + (x.shape[-1] // 32,)``; the float32
    ``max(|x|)`` of shape (1,).
  """
  fp8_max = float(jnp.finfo(q_dtype).max)
  block_amax = _block.block_amax(x, (BLOCK,))
  e = _block_exponent(block_amax, fp8_max)
  # Multiplying by 2**(127-e) equals TE's division by 2**(e-127): both are exact scalings.
  k = _block.expand_scales(127 - e.astype(jnp.int32), (BLOCK,))
  nan = _block.expand_scales(e == 0xFF, (BLOCK,))
  scaled = _block.scale_by_pow2(x.astype(jnp.float32), k, nan=nan)
  data = jnp.clip(scaled, -fp8_max, fp8_max).astype(q_dtype)
  scale_inv = lax.bitcast_convert_type(e, jnp.float8_e8m0fnu)
  return data, scale_inv, _block.global_amax(block_amax)


def operand_spec(recipe, role: str, wgrad: bool = False) -> OperandSpec:
  """Every operand in 1x32 blocks along the contracting dimension of its GEMM."""
  del wgrad
  return OperandSpec("mxfp8", (BLOCK,), recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype)


def quantize_operand(x, spec: OperandSpec, key=None, stream: int = 0, reduce_amax=None):
  """``BlockFormat.quantize``: the scales are per block, so no key or amax reduction is used."""
  del key, stream, reduce_amax
  return (*quantize(x, spec.q_dtype), "mxfp8")


def _values(t) -> jax.Array:
  return dequantize_values(t.data, t.scale_inv, _block.block_shape_of(t.shape, t.scale_inv.shape))


def dequantize_tensor(t, dtype) -> jax.Array:
  """``BlockFormat.dequantize``."""
  return _values(t).astype(dtype)


def tensor_gemm(a, b, out_dtype, out_sharding=None, choice: str = "auto") -> jax.Array:
  """``BlockFormat.gemm``: ``jax.nn.scaled_matmul`` where the device has it, else emulated."""
  del out_dtype
  if _block.use_native_gemm("mxfp8", choice):
    return _block.scaled_matmul(a, b)
  return _block.emulated_gemm(_values(a), _values(b), out_sharding)


FORMAT = BlockFormat(
  MXFP8BlockScaling, ("mxfp8",), operand_spec, quantize_operand, dequantize_tensor, tensor_gemm
)
