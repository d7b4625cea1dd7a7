"""Shared helpers of the block-scaled formats: block views, block amaxes, scale broadcasting.

A block shape is a tuple that covers the trailing axes of a tensor: ``(32,)`` is 1x32 blocks along
the last axis, ``(16, 16)`` is 16x16 tiles over the last two axes. Scales of a tensor of shape
``(..., R, C)`` with block shape ``(br, bc)`` have shape ``(..., R // br, C // bc)``: one value per
block, never broadcast (so the row of a tile's scale is always ``row // br``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import sharding

__all__ = [
  "block_shape_of",
  "check_divisible",
  "block_amax",
  "global_amax",
  "expand_scales",
  "repeat",
  "exp2",
  "scale_by_pow2",
  "f32_max",
  "native_gemm_available",
  "use_native_gemm",
  "emulation_dtype",
  "scaled_matmul",
  "emulated_gemm",
]


def check_divisible(shape, block_shape, what: str) -> None:
  """Raises a ValueError naming the axis when a trailing axis is not a multiple of its block."""
  for i, b in enumerate(block_shape):
    axis = len(shape) - len(block_shape) + i
    if shape[axis] % b:
      raise ValueError(
        f"{what}: axis {axis} has size {shape[axis]}, which is not a multiple of the block "
        f"size {b} (block shape {tuple(block_shape)} over the trailing axes of {tuple(shape)})"
      )


def block_shape_of(data_shape, scale_shape) -> tuple[int, ...]:
  """The block shape over the trailing axes, from the data and one-scale-per-block shapes."""
  ratios = [d // s for d, s in zip(data_shape, scale_shape, strict=True)]
  lead = 0
  while lead < len(ratios) - 1 and ratios[lead] == 1:
    lead += 1
  return tuple(ratios[lead:])


def _blocked(x, block_shape):
  """``x`` with each blocked axis split into (blocks, block), and the axes to reduce over."""
  n = len(block_shape)
  lead = x.shape[: x.ndim - n]
  new_shape = list(lead)
  reduce_axes = []
  for i, b in enumerate(block_shape):
    size = x.shape[x.ndim - n + i]
    new_shape += [size // b, b]
    reduce_axes.append(len(new_shape) - 1)
  return sharding.reshape(x, new_shape), tuple(reduce_axes)


def _max_magnitude(a, axis=None) -> jax.Array:
  """float32 ``max`` of non-negative ``a`` (or NaN) over ``axis``, NaN where any is NaN.

  XLA:CPU's vectorised float max drops NaNs in large arrays; the bits of non-negative floats
  order like the floats, with every NaN above +inf, so an integer max of the bits keeps them
  (as the CUDA casts do) in the same single reduction.
  """
  bits = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
  return lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def block_amax(x, block_shape) -> jax.Array:
  """float32 ``max(|x|)`` of each block (NaN when the block holds a NaN); the tests check it."""
  xb, axes = _blocked(jnp.abs(x.astype(jnp.float32)), block_shape)
  return _max_magnitude(xb, axes)


def global_amax(block_amaxes) -> jax.Array:
  """float32 (1,) ``max`` of the block amaxes, i.e. ``max(|x|)``; NaN if any block is NaN."""
  return _max_magnitude(block_amaxes).reshape(1)


def repeat(x, repeats: int, axis: int) -> jax.Array:
  """``jnp.repeat(x, repeats, axis)`` (scalar ``repeats``), sharding-aware under Explicit mesh
  axes: each element is broadcast to ``repeats`` copies beside it, then the two axes merge."""
  axis = axis % x.ndim
  wide = jnp.broadcast_to(
    jnp.expand_dims(x, axis + 1), x.shape[: axis + 1] + (repeats,) + x.shape[axis + 1 :]
  )
  new_shape = x.shape[:axis] + (x.shape[axis] * repeats,) + x.shape[axis + 1 :]
  return sharding.reshape(wide, new_shape)


def expand_scales(scales, block_shape) -> jax.Array:
  """Repeats one-per-block ``scales`` to one per element (tile ``i`` covers rows ``i*b..``)."""
  n = len(block_shape)
  for i, b in enumerate(block_shape):
    scales = repeat(scales, b, scales.ndim - n + i)
  return scales


def keep_narrow(x) -> jax.Array:
  """``x``, a narrow-float array that was just rounded, kept as it is for whatever reads it.

  XLA's GPU compiler drops a narrowing conversion that is converted back (float32 -> float8 ->
  float32 becomes the float32 input: its "excess precision" simplification, on by default), which
  hands the unrounded values to the ops that read them; seen on an H100 with jax 0.11.2 for
  float8_e4m3fn. An optimization barrier between the two conversions keeps the rounding.
  """
  return lax.optimization_barrier(x)


def exp2(k) -> jax.Array:
  """float32 ``2**k`` for integer ``k`` in [-126, 127], built from the exponent bits.

  Powers of two built this way never pass through subnormal arithmetic, which XLA flushes to
  zero on CPU and GPU.
  """
  k = jnp.asarray(k, jnp.int32)
  return lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def scale_by_pow2(x, k, nan=None) -> jax.Array:
  """float32 ``x * 2**k`` for integer ``k`` in [-127, 127]; NaN where ``nan`` is set.

  Below ``2**-126`` the factor is applied in two exact steps, so a product that is a normal
  float32 is computed exactly even though the factor alone is subnormal.
  """
  k = jnp.asarray(k, jnp.int32)
  small = k < -126
  out = (x * exp2(jnp.where(small, k + 64, k))) * exp2(jnp.where(small, -64, 0))
  if nan is not None:
    out = jnp.where(nan, jnp.float32(jnp.nan), out)
  return out


def f32_max() -> float:
  return float(np.finfo(np.float32).max)


def native_gemm_available(mode: str) -> bool:
  """Whether ``jax.nn.scaled_matmul`` runs ``mode`` natively here (Blackwell GPUs, cuDNN)."""
  if mode not in ("mxfp8", "nvfp4", "nvfp4_rht") or jax.default_backend() != "gpu":
    return False
  try:
    capabilities = [float(d.compute_capability) for d in jax.local_devices()]
  except (AttributeError, TypeError, ValueError):
    return False
  return bool(capabilities) and min(capabilities) >= 10.0


def use_native_gemm(mode: str, choice: str) -> bool:
  """Whether ``mode``'s GEMM runs on ``jax.nn.scaled_matmul``, per ``GemmConfig.block_gemm``."""
  if choice not in ("auto", "native", "xla"):
    raise ValueError(f"block_gemm must be 'auto', 'native' or 'xla', got {choice!r}")
  if choice == "xla":
    return False
  available = native_gemm_available(mode)
  if choice == "native" and not available:
    raise RuntimeError(
      f"block_gemm='native', but {mode} has no native GEMM here (jax.nn.scaled_matmul runs it "
      "on Blackwell GPUs only)"
    )
  return available


def emulation_dtype():
  """The dtype emulated block-scaled GEMMs multiply dequantized values in."""
  # Dequantized NVFP4 values (<= 6 significant bits) and MXFP8 values are exact in bfloat16
  # (MXFP8 down to 2**-126), which runs at full speed on GPUs; CPUs are faster in float32.
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def _row_scales(t) -> jax.Array:
  """Block scales as one row per data row (a tile's scale repeated on each of its rows)."""
  bs = block_shape_of(t.data.shape, t.scale_inv.shape)
  scales = t.scale_inv
  if len(bs) == 2:
    scales = repeat(scales, bs[0], axis=-2)
  return scales


def scaled_matmul(a, b) -> jax.Array:
  """``jax.nn.scaled_matmul`` of two block-scaled ``(B, rows, K)`` tensors, float32 sums."""
  return jax.nn.scaled_matmul(
    a.data, b.data, _row_scales(a), _row_scales(b), preferred_element_type=jnp.float32
  )


def emulated_gemm(a_values, b_values, out_sharding=None) -> jax.Array:
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` of dequantized values, float32 sums."""
  dtype = emulation_dtype()
  return lax.dot_general(
    a_values.astype(dtype),
    b_values.astype(dtype),
    (((2,), (2,)), ((0,), (0,))),
    precision=lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
    out_sharding=out_sharding,
  )
