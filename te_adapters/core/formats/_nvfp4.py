"""NVFP4: E2M1 values with an E4M3 scale per 16-element block and a float32 tensor scale.

TE's numerics (``te_jax_reference.md`` §1.6), for a tensor with global amax ``A``::

  S_enc  = min(6 * 448 / A, FLT_MAX), or 1 when A == 0 or S_enc == 0
  sdec_b = e4m3(min(block_amax / 6 * S_enc, FLT_MAX))         (stored block scale)
  enc_b  = min(1 / (f32(sdec_b) * (1 / S_enc)), FLT_MAX)
  q      = e2m1(clip(x * enc_b, -6, 6))                        (nearest-even, or stochastic)
  x     ~= f32(q) * f32(sdec_b) * (A / (6 * 448))

Blocks are 1x16 along the last axis or 16x16 tiles over the last two axes (weights). The tile
scales are kept one per tile, so a tile's rows always use that tile's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import sharding
from te_adapters.core.formats import _block
from te_adapters.core.formats._format import BlockFormat, OperandSpec
from te_adapters.core.recipes import NVFP4BlockScaling

__all__ = [
  "BLOCK",
  "E2M1_VALUES",
  "RHT_SIGNS",
  "apply_rht",
  "dequantize_values",
  "global_factor",
  "invert_rht",
  "quantize",
  "random_seed",
  "rht_matrix",
  "round_e2m1",
  "stochastic_round_e2m1",
]

BLOCK = 16
FP4_MAX = 6.0
SCALE_MAX = 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# TE's fixed sign vector of the random Hadamard transform (bit i of its mask set iff s_i = -1).
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def _encode_scale(global_amax) -> jax.Array:
  """``S_enc`` from the global amax, float32 of shape (1,)."""
  s_enc = jnp.minimum(jnp.float32(FP4_MAX * SCALE_MAX) / global_amax, jnp.float32(_block.f32_max()))
  return jnp.where((global_amax == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def global_factor(global_amax) -> jax.Array:
  """The per-tensor dequantization factor ``A / (6 * 448)``, float32 of shape (1,)."""
  return global_amax.astype(jnp.float32) / jnp.float32(FP4_MAX * SCALE_MAX)


def random_seed(key, stream: int = 0) -> jax.Array:
  """The uint32[4] Philox seed of one stochastic-rounding stream of a PRNG key.

  ``stream`` tells apart the copies rounded with one key (the two gradient copies of a GEMM).
  """
  words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  words = jnp.concatenate([words, jnp.zeros((4,), jnp.uint32)])[:4]
  return words.at[3].set(words[3] ^ jnp.uint32(0x9E3779B9 * (stream + 1) & 0xFFFFFFFF))


def _e2m1_step(a) -> jax.Array:
  """The E2M1 spacing at magnitude ``a``: 0.5 below 2, 1 below 4, 2 up to 6."""
  return jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(jnp.float32)


def round_e2m1(v) -> jax.Array:
  """Rounds float32 ``v`` (|v| <= 6) to the nearest E2M1 value, ties to even; float32 result.

  The rounding is done here in float32 arithmetic (``|v| / step`` is exact, since the step is a
  power of two, and an even multiple of the step is an even E2M1 mantissa), so the values do not
  depend on how a backend converts to ``float4_e2m1fn``; the later cast is exact. (This was
  written while chasing a GPU/CPU mismatch that turned out to be the block scales' dropped
  rounding, ``_block.keep_narrow``; the GPU tests that pass use this path, and the direct
  conversion was not re-checked on a GPU without it.)
  """
  a = jnp.abs(v).astype(jnp.float32)
  step = _e2m1_step(a)
  q = jnp.minimum(jnp.round(a / step) * step, jnp.float32(FP4_MAX))
  return jnp.where(jnp.isnan(v), v, jnp.copysign(q, v))


def stochastic_round_e2m1(v, seed) -> jax.Array:
  """Rounds float32 ``v`` (|v| <= 6) to one of its two neighbouring E2M1 values, unbiasedly.

  ``|v|`` in ``[lo, hi]`` goes up to ``hi`` with probability ``(|v| - lo) / (hi - lo)``; values
  on the grid stay. The uniform numbers come from XLA's Philox generator seeded with ``seed``
  (uint32[4], see ``random_seed``), so a seed always gives the same rounding on a backend.
  Returns float32 values on the E2M1 grid.
  """
  a = jnp.abs(v)
  # E2M1 spacing is 0.5 below 2, 1 below 4 and 2 up to 6.
  step = _e2m1_step(a)
  lo = jnp.minimum(jnp.floor(a / step) * step, jnp.float32(FP4_MAX))
  hi = jnp.minimum(lo + step, jnp.float32(FP4_MAX))
  frac = jnp.where(hi > lo, (a - lo) / step, 0.0)
  _, bits = lax.rng_bit_generator(
    seed, v.shape, dtype=jnp.uint32, algorithm=lax.RandomAlgorithm.RNG_PHILOX
  )
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # uniform on [0, 1)
  return jnp.sign(v) * jnp.where(u < frac, hi, lo)


def quantize(x, block_shape, seed=None, reduce_amax=None):
  """NVFP4 quantization of ``x`` with the given block shape (``(16,)`` or ``(16, 16)``).

  Args:
    x: real floating-point array; its trailing axes must be multiples of the block shape.
    block_shape: ``(16,)`` for 1x16 blocks along the last axis, ``(16, 16)`` for tiles over the
      last two axes.
    seed: uint32[4] seed for stochastic rounding (``random_seed``), or None for
      round-to-nearest-even.
    reduce_amax: maps the amax of ``x`` to that of the tensor ``x`` is a shard of (inside
      ``shard_map``: a max over devices); None when ``x`` is the whole tensor.

  Returns:
    ``(data, scale_inv, amax)``: ``float4_e2m1fn`` data shaped like ``x``, ``float8_e4m3fn``
    block scales (one per block), and the float32 global amax of shape (1,).
  """
  xf = x.astype(jnp.float32)
  block_amax = _block.block_amax(xf, block_shape)
  a = _block.global_amax(block_amax)
  if reduce_amax is not None:
    a = reduce_amax(a)
  s_enc = _encode_scale(a)
  # The JAX reference forces the e4m3 rounding of this product (it must not fuse away).
  sdec = jnp.minimum(block_amax / jnp.float32(FP4_MAX) * s_enc, jnp.float32(_block.f32_max()))
  sdec = jnp.clip(sdec, -SCALE_MAX, SCALE_MAX).astype(jnp.float8_e4m3fn)
  enc = 1.0 / (_block.keep_narrow(sdec).astype(jnp.float32) * (jnp.float32(1.0) / s_enc))
  enc = jnp.minimum(enc, jnp.float32(_block.f32_max()))
  v = jnp.clip(xf * _block.expand_scales(enc, block_shape), -FP4_MAX, FP4_MAX)
  v = round_e2m1(v) if seed is None else stochastic_round_e2m1(v, seed)
  return v.astype(jnp.float4_e2m1fn), sdec, a


def dequantize_values(data, scale_inv, block_shape) -> jax.Array:
  """float32 ``data * block scale`` (without the global factor ``A / (6 * 448)``)."""
  data, scale_inv = _block.keep_narrow((data, scale_inv))
  return data.astype(jnp.float32) * _block.expand_scales(scale_inv.astype(jnp.float32), block_shape)


def rht_matrix() -> jax.Array:
  """The 16x16 transform ``diag(RHT_SIGNS) @ Hadamard16 / 4`` in bfloat16 (orthogonal)."""
  i = np.arange(BLOCK)
  popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
  hadamard = np.where(popcount % 2 == 0, 1.0, -1.0).astype(np.float32)
  return jnp.asarray(RHT_SIGNS[:, None] * hadamard / 4.0, jnp.bfloat16)


def _transform(x, matrix) -> jax.Array:
  """``x`` in 16-element blocks along its last axis, times ``matrix``, in float32.

  The matrix entries are +-1/4, so every product is exact; the 16 products of an output are
  summed in a fixed pairwise order (not by a GEMM, whose order is the backend's), so every
  backend gives the same bits.
  """
  blocked_shape = (*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
  blocks = sharding.reshape(x.astype(jnp.float32), blocked_shape)
  terms = blocks[..., :, None] * matrix.astype(jnp.float32)  # (..., i, j)
  while terms.shape[-2] > 1:
    half = terms.shape[-2] // 2
    terms = terms[..., :half, :] + terms[..., half:, :]
  return sharding.reshape(terms[..., 0, :], x.shape)


def apply_rht(x) -> jax.Array:
  """The random Hadamard transform of 16-element blocks along the last axis, in bfloat16.

  As in TE the input is taken in bfloat16 and each block row is multiplied by ``rht_matrix()``
  (products exact, sums in float32, result rounded to bfloat16). Both bfloat16 roundings are kept
  on GPUs, whose compiler would otherwise skip them (``_block.keep_narrow``).
  """
  x = _block.keep_narrow(x.astype(jnp.bfloat16))
  return _block.keep_narrow(_transform(x, rht_matrix()).astype(jnp.bfloat16))


def invert_rht(y) -> jax.Array:
  """The inverse transform in float32 (the matrix is orthogonal: its inverse is its transpose)."""
  return _transform(y, rht_matrix().T)


def operand_spec(recipe, role: str, wgrad: bool = False) -> OperandSpec:
  """1x16 blocks (16x16 tiles for the kernel unless 2-D quantization is off); the random
  Hadamard transform on the wgrad copies of x and grad; stochastic rounding of grad."""
  dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  two_d = role == "kernel" and not recipe.disable_2d_quantization
  return OperandSpec(
    "nvfp4",
    (BLOCK,) * (2 if two_d else 1),
    dtype,
    rht=wgrad and role != "kernel" and not recipe.disable_rht,
    stochastic=role == "grad" and not recipe.disable_stochastic_rounding,
  )


def quantize_operand(x, spec: OperandSpec, key=None, stream: int = 0, reduce_amax=None):
  """``BlockFormat.quantize``; the transformed tensor's mode is ``"nvfp4_rht"``."""
  mode = "nvfp4"
  if spec.rht:
    x = apply_rht(x)
    mode = "nvfp4_rht"
  seed = random_seed(key, stream) if spec.stochastic else None
  return (*quantize(x, spec.block_shape, seed, reduce_amax), mode)


def _values(t) -> jax.Array:
  return dequantize_values(t.data, t.scale_inv, _block.block_shape_of(t.shape, t.scale_inv.shape))


def dequantize_tensor(t, dtype) -> jax.Array:
  """``BlockFormat.dequantize``: block scales, the tensor factor, and the RHT undone."""
  out = _values(t) * global_factor(t.amax).reshape(())
  if t.scaling_mode == "nvfp4_rht":
    ratios = [d // s for d, s in zip(t.data.shape, t.scale_inv.shape, strict=True)]
    axis = ratios.index(BLOCK)
    out = jnp.moveaxis(invert_rht(jnp.moveaxis(out, axis, -1)), -1, axis)
  return out.astype(dtype)


def tensor_gemm(a, b, out_dtype, out_sharding=None, choice: str = "auto") -> jax.Array:
  """``BlockFormat.gemm``: scaled_matmul or emulated, times both tensor factors."""
  del out_dtype
  if _block.use_native_gemm(a.scaling_mode, choice):
    out = _block.scaled_matmul(a, b)
  else:
    out = _block.emulated_gemm(_values(a), _values(b), out_sharding)
  return out * (global_factor(a.amax).reshape(()) * global_factor(b.amax).reshape(()))


FORMAT = BlockFormat(
  NVFP4BlockScaling,
  ("nvfp4", "nvfp4_rht"),
  operand_spec,
  quantize_operand,
  dequantize_tensor,
  tensor_gemm,
)
