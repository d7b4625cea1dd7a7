"""FP8 block scaling (DeepSeek-style 1x128 / 128x128), with TE's common scale rule.

Per block: ``scale = fp8_max / block_amax`` (float32, round to nearest); 1 when the amax is 0,
infinite or NaN; the largest finite value of the input dtype when the division overflows; with
power-of-two scales the mantissa bits of the scale are cleared (rounding it down, so the block
never saturates). ``data = cast(clip(x * scale, ±fp8_max))``, ``scale_inv = 1 / scale``.

The GEMM is the formulation of Hopper kernels for this recipe: one FP8 GEMM per 128-wide slice of
the contracting dimension, whose float32 partial sum is multiplied by the two operands' scales
for that slice and accumulated in float32. On a Hopper GPU with the extension's CUDA part built,
cuBLASLt's block-scaled FP8 GEMM (cuBLAS 12.9+) runs it as one kernel (``csrc/block_gemm_cuda.cc``);
elsewhere, and where cuBLAS cannot take the operands, XLA runs the formulation above.
``GemmConfig(block_gemm="xla")`` forces the XLA formulation, ``"native"`` requires cuBLASLt (an
error where it cannot run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters.core import kernels, sharding
from te_adapters.core.formats import _block
from te_adapters.core.formats._format import BlockFormat, OperandSpec
from te_adapters.core.recipes import Float8BlockScaling

__all__ = [
  "BLOCK",
  "FORMAT",
  "compute_scale",
  "quantize",
  "dequantize_values",
  "gemm",
]

BLOCK = 128
# Partial sums of several K slices are formed at once up to this many float32 elements.
_PARTIALS_BUDGET = 1 << 26


def compute_scale(block_amax, fp8_max: float, power_2: bool, value_for_inf: float) -> jax.Array:
  """TE's ``compute_scale_from_amax`` for block scaling (epsilon 0), elementwise in float32."""
  block_amax = jnp.asarray(block_amax, jnp.float32)
  scale = jnp.float32(fp8_max) / block_amax
  scale = jnp.where(jnp.isinf(scale), jnp.float32(value_for_inf), scale)
  if power_2:
    bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
    scale = lax.bitcast_convert_type(bits, jnp.float32)
  bad = (block_amax == 0) | jnp.isinf(block_amax) | jnp.isnan(block_amax)
  return jnp.where(bad, jnp.float32(1.0), scale)


def quantize(x, block_shape, q_dtype, power_2: bool):
  """FP8 blocks of ``block_shape`` (``(128,)`` or ``(128, 128)``) over the trailing axes of ``x``.

  Returns:
    ``(data, scale_inv, amax)``: ``q_dtype`` data shaped like ``x``, float32 ``1 / scale`` per
    block, and the float32 ``max(|x|)`` of shape (1,).
  """
  fp8_max = float(jnp.finfo(q_dtype).max)
  value_for_inf = float(jnp.finfo(x.dtype).max)
  block_amax = _block.block_amax(x, block_shape)
  scale = compute_scale(block_amax, fp8_max, power_2, value_for_inf)
  scaled = x.astype(jnp.float32) * _block.expand_scales(scale, block_shape)
  data = jnp.clip(scaled, -fp8_max, fp8_max).astype(q_dtype)
  scale_inv = (jnp.float32(1.0) / scale).astype(jnp.float32)
  return data, scale_inv, _block.global_amax(block_amax)


def dequantize_values(data, scale_inv, block_shape) -> jax.Array:
  """float32 ``data * scale_inv`` per block."""
  return _block.keep_narrow(data).astype(jnp.float32) * _block.expand_scales(scale_inv, block_shape)


def _row_scales(scale_inv, block_shape, rows: int) -> jax.Array:
  """Scales as (B, rows, K // 128): one per row and K slice (a tile's scale on each of its rows)."""
  if len(block_shape) == 2:
    scale_inv = _block.repeat(scale_inv, block_shape[0], axis=1)
  assert scale_inv.shape[1] == rows
  return scale_inv


def _largest_divisor_at_most(n: int, limit: int) -> int:
  limit = max(1, min(n, limit))
  return max(d for d in range(1, limit + 1) if n % d == 0)


def _cublas_refusal(a_data, a_block, b_data, b_block) -> str | None:
  """Why cuBLASLt cannot run this GEMM (None: it can)."""
  if not kernels.cublas_gemm_available():
    return "cuBLASLt's block-scaled GEMM is not built here or the GPU is not a Hopper GPU"
  if len(a_block) == 2 and len(b_block) == 2:
    return "cuBLAS has no GEMM with 128x128 tiles on both operands"
  m, n = a_data.shape[1], b_data.shape[1]
  if m % 16 or n % 16:
    return f"cuBLAS needs M and N multiples of 16, got M={m}, N={n}"
  return None


def _cublas_scales(scale_inv, block, rows: int) -> jax.Array:
  """Block scales in cuBLAS's layout (see ``csrc/block_gemm_cuda.cc``), one batch entry each:
  scale modes 1 (1x128 blocks) and 2 (128x128 tiles) of ``kernels.gemm_call``."""
  if len(block) == 1:  # (B, rows, K/128) -> (B, K/128, rows rounded up to 4)
    s = jnp.swapaxes(scale_inv, 1, 2)
    return jnp.pad(s, ((0, 0), (0, 0), (0, -rows % 4)))
  # (B, rows/128, K/128) -> K/128 rounded up to 4
  return jnp.pad(scale_inv, ((0, 0), (0, 0), (0, -scale_inv.shape[2] % 4)))


def _cublas_gemm(a_data, a_scale_inv, a_block, b_data, b_scale_inv, b_block, out_dtype):
  m, n = a_data.shape[1], b_data.shape[1]
  # cuBLASLt writes bfloat16 itself (rounding the float32 sums once); other dtypes are cast from
  # its float32 output.
  dtype = jnp.bfloat16 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else jnp.float32
  return kernels.gemm_call(
    a_data,
    b_data,
    _cublas_scales(a_scale_inv.astype(jnp.float32), a_block, m),
    _cublas_scales(b_scale_inv.astype(jnp.float32), b_block, n),
    dtype,
    lhs_mode=len(a_block),
    rhs_mode=len(b_block),
  )


def gemm(
  a_data,
  a_scale_inv,
  a_block,
  b_data,
  b_scale_inv,
  b_block,
  out_dtype=jnp.float32,
  choice: str = "auto",
) -> jax.Array:
  """``(B, M, K) x (B, N, K) -> (B, M, N)`` from block-scaled FP8 operands, float32 sums.

  The result is float32, or bfloat16 when ``out_dtype`` is bfloat16 and cuBLASLt runs the GEMM
  (it writes the rounded output itself).

  Both operands have blocks of 128 along K (``a_block``/``b_block`` are ``(128,)`` or
  ``(128, 128)``). cuBLASLt's block-scaled GEMM where it runs (see the module docstring);
  otherwise the FP8 data go into ``lax.dot_general`` unchanged, one 128-wide K slice per
  partial product, and the scales multiply the float32 partial sums. ``choice``: the
  ``GemmConfig.block_gemm`` option (``"auto"``, ``"native"`` or ``"xla"``).
  """
  if choice not in ("auto", "native", "xla"):
    raise ValueError(f"block_gemm must be 'auto', 'native' or 'xla', got {choice!r}")
  if choice != "xla":
    refusal = _cublas_refusal(a_data, a_block, b_data, b_block)
    if refusal is None:
      return kernels.block_scaled_gemm(  # per shard in a sharded program
        _cublas_gemm,
        _xla_gemm,
        a_data,
        a_scale_inv,
        a_block,
        b_data,
        b_scale_inv,
        b_block,
        out_dtype,
      )
    if choice == "native":
      raise RuntimeError(f"block_gemm='native', but {refusal}")
  return _xla_gemm(a_data, a_scale_inv, a_block, b_data, b_scale_inv, b_block)


def _xla_gemm(a_data, a_scale_inv, a_block, b_data, b_scale_inv, b_block) -> jax.Array:
  batch, m, k = a_data.shape
  n = b_data.shape[1]
  slices = k // BLOCK
  sa = _row_scales(a_scale_inv, a_block, m)  # (B, M, KS)
  sb = _row_scales(b_scale_inv, b_block, n)  # (B, N, KS)
  qa = sharding.reshape(a_data, (batch, m, slices, BLOCK))
  qb = sharding.reshape(b_data, (batch, n, slices, BLOCK))
  dims = (((3,), (3,)), ((0, 2), (0, 2)))

  def partial_sums(qa_c, qb_c, sa_c, sb_c):
    # (B, c, M, N): one FP8 GEMM per K slice, then the slice's scales on the partial sums.
    p = lax.dot_general(qa_c, qb_c, dims, preferred_element_type=jnp.float32)
    scales = (
      jnp.transpose(sa_c, (0, 2, 1))[..., :, None] * jnp.transpose(sb_c, (0, 2, 1))[..., None, :]
    )
    return jnp.sum(p * scales, axis=1)

  chunk = _largest_divisor_at_most(slices, _PARTIALS_BUDGET // max(1, batch * m * n))
  if chunk == slices:
    return partial_sums(qa, qb, sa, sb)
  steps = slices // chunk

  def split(t, axis):
    t = jnp.moveaxis(t, axis, 0)
    return sharding.reshape(t, (steps, chunk, *t.shape[1:]))

  def body(acc, xs):
    qa_c, qb_c, sa_c, sb_c = (jnp.moveaxis(t, 0, 2) for t in xs)
    return acc + partial_sums(qa_c, qb_c, sa_c, sb_c), None

  xs = (split(qa, 2), split(qb, 2), split(sa, 2), split(sb, 2))
  init = jnp.zeros((batch, m, n), jnp.float32)
  out, _ = lax.scan(body, init, xs)
  return out


def operand_spec(recipe, role: str, wgrad: bool = False) -> OperandSpec:
  """1x128 blocks or 128x128 tiles per role, as the recipe's ``*_block_scaling_dim`` say."""
  del wgrad
  dims = {
    "x": recipe.x_block_scaling_dim,
    "kernel": recipe.w_block_scaling_dim,
    "grad": recipe.grad_block_scaling_dim,
  }[role]
  dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  return OperandSpec("float8_block", (BLOCK,) * dims, dtype, power_2=recipe.power_2_scale)


def quantize_operand(x, spec: OperandSpec, key=None, stream: int = 0, reduce_amax=None):
  """``BlockFormat.quantize``: the scales are per block, so no key or amax reduction is used."""
  del key, stream, reduce_amax
  return (*quantize(x, spec.block_shape, spec.q_dtype, spec.power_2), "float8_block")


def _block_shape(t) -> tuple[int, ...]:
  return _block.block_shape_of(t.shape, t.scale_inv.shape)


def dequantize_tensor(t, dtype) -> jax.Array:
  """``BlockFormat.dequantize``."""
  return dequantize_values(t.data, t.scale_inv, _block_shape(t)).astype(dtype)


def tensor_gemm(a, b, out_dtype, out_sharding=None, choice: str = "auto") -> jax.Array:
  """``BlockFormat.gemm``: ``gemm`` on the tensors' data and scales."""
  out = gemm(
    a.data, a.scale_inv, _block_shape(a), b.data, b.scale_inv, _block_shape(b), out_dtype, choice
  )
  return sharding.match_sharding(out, out_sharding)


FORMAT = BlockFormat(
  Float8BlockScaling,
  ("float8_block",),
  operand_spec,
  quantize_operand,
  dequantize_tensor,
  tensor_gemm,
)
