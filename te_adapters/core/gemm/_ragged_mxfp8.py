"""The MXFP8 grouped GEMM: ``ragged_dot`` with 1x32 E8M0-scaled blocks, and its custom VJP.

Each GEMM quantizes both of its operands in blocks of 32 along the dimension it contracts, each
copy from the high-precision tensor, with the rules of ``core.dot_general`` under
``MXFP8BlockScaling`` (TE's E8M0 round-up; ``_mxfp8``):

- forward ``y[i] = x[i] · W[g(i)]`` contracts K: x in 1x32 blocks along K (within a row, so
  groups do not matter), each expert's kernel in blocks along K;
- dgrad ``dx[i] = dy[i] · W[g(i)]^T`` contracts N: dy along N, each expert's kernel along N;
- wgrad ``dW[g] = x_g^T · dy_g`` contracts the rows (tokens) of group g: x and dy in blocks of
  32 rows **of one group**. The rows of each group are quantized as if the group were padded
  with zero rows to a multiple of 32, its first block starting at the group's first row; the
  zero rows change no block amax and add nothing to the product.

The wgrad operands are built in a padded layout (``_grouping.group_padding``) of static size
``P = 32 * ((M + 31 * G) // 32)`` rows, in which every group starts on a multiple of 32: the
layout of TE's grouped GEMM, whose MXFP8 path takes group sizes that are multiples of 32 (TE's
PyTorch MoE pads each expert's tokens to 32 with ``Fp8Padding`` for MXFP8). The result therefore
equals padding every group with zero rows to a multiple of 32, running TE's MXFP8 grouped GEMM,
and dropping the padding; where the group sizes already are multiples of 32 nothing is padded and
the blocks are TE's. The padding is computed on the device from ``group_sizes`` by gathers,
without a host transfer.

The GEMMs are emulated: the quantized values are dequantized (exactly, to bfloat16 on GPUs and
float32 elsewhere) and multiplied by ``jax.lax.ragged_dot_general`` accumulating in float32.
JAX has no ragged counterpart of ``jax.nn.scaled_matmul`` for hardware with MX GEMMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core.formats import ScaledTensor, _block_scaled, _mxfp8, operand_spec
from te_adapters.core.gemm import _grouping, _remat

__all__ = ["mxfp8_ragged_dot", "check_sizes", "forward_operands", "gradient_operands"]

BLOCK = _mxfp8.BLOCK
# The forward pass (C = K) and dgrad (C = N) both contract the kernel copy's last axis.
_ROWS_DIMS = _grouping.ROWS_TIMES_GROUP_KERNEL_DIMS
_WGRAD_DIMS = _grouping.PER_GROUP_WGRAD_DIMS


def check_sizes(recipe, k: int, n: int | None = None) -> None:
  """Raises a ValueError naming K (always) or N (when given) if it is not a multiple of 32."""
  name = type(recipe).__name__
  checks = [
    ("the contracting size K", k, "the forward GEMM quantizes lhs and rhs in blocks along K")
  ]
  if n is not None:
    why = "the dgrad GEMM quantizes the output gradient and rhs in blocks along N"
    checks.append(("the output size N (rhs dim 2)", n, why))
  for text, size, why in checks:
    if size % BLOCK:
      raise ValueError(
        f"{name}: {text} is {size}, which is not a multiple of {BLOCK}; {why}. Pad the "
        "features, or pass recipe=None for a high-precision GEMM."
      )


def _rows(x, in_group, spec, what) -> ScaledTensor:
  """Blocks along the last axis of [M, F] rows; rows in no group are quantized as zeros."""
  x = jnp.where(in_group[:, None], x, jnp.zeros((), x.dtype))
  return _block_scaled.quantize_trailing(x, spec, what=what)


def _group_columns(x, padding, spec, what) -> ScaledTensor:
  """[M, F] rows as [F, P]: blocks of 32 padded rows, each within one group, along the last axis."""
  return _block_scaled.quantize_trailing(_grouping.padded_rows(x, padding).T, spec, what=what)


def forward_operands(lhs, rhs, group_sizes, recipe):
  """The quantized operands the forward pass makes, and the copies it saves for the backward.

  Returns:
    ``(qx, qw, qx_t, qw_t, padding)``: ``qx`` [M, K] (blocks along K; rows in no group are
    zero), ``qw`` [G, N, K] (the kernels transposed, blocks along K), ``qx_t`` [K, P] (x in the
    padded layout, blocks of 32 rows of one group), ``qw_t`` [G, K, N] (blocks along N), and the
    ``_grouping.GroupPadding`` of the padded layout.
  """
  qx, qw = _forward_gemm_operands(lhs, rhs, group_sizes, recipe)
  padding = _grouping.group_padding(group_sizes, lhs.shape[0], BLOCK)
  qx_t = _group_columns(lhs, padding, operand_spec(recipe, "x", wgrad=True), "lhs (x)")
  qw_t = _block_scaled.quantize_trailing(rhs, operand_spec(recipe, "kernel"), what="rhs (kernel)")
  return qx, qw, qx_t, qw_t, padding


def _forward_gemm_operands(lhs, rhs, group_sizes, recipe):
  in_group = _grouping.row_groups(group_sizes, lhs.shape[0]) < rhs.shape[0]
  qx = _rows(lhs, in_group, operand_spec(recipe, "x"), "lhs (x)")
  qw = _block_scaled.quantize_trailing(
    jnp.swapaxes(rhs, 1, 2), operand_spec(recipe, "kernel"), what="rhs (kernel)"
  )
  return qx, qw


def gradient_operands(g, group_sizes, num_groups: int, recipe):
  """The quantized copies of the output gradient ``g`` [M, N] the backward pass multiplies.

  Returns:
    ``(qg, qg_t, padding)``: ``qg`` [M, N] for dgrad (blocks along N; rows in no group are
    zero), ``qg_t`` [N, P] for wgrad (the padded layout, blocks of 32 rows of one group), and
    the ``_grouping.GroupPadding`` of the padded layout.
  """
  in_group = _grouping.row_groups(group_sizes, g.shape[0]) < num_groups
  padding = _grouping.group_padding(group_sizes, g.shape[0], BLOCK)
  qg = _rows(g, in_group, operand_spec(recipe, "grad"), "output gradient")
  g_t_spec = operand_spec(recipe, "grad", wgrad=True)
  return qg, _group_columns(g, padding, g_t_spec, "output gradient"), padding


def _values(t: ScaledTensor) -> jax.Array:
  return _block_scaled.dequantize(t, _block_scaled.emulation_dtype())


def _ragged(a, b, group_sizes, dims):
  return lax.ragged_dot_general(
    a, b, group_sizes, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )


def mxfp8_ragged_dot(lhs, rhs, group_sizes, out_dtype, recipe):
  """``lax.ragged_dot(lhs, rhs, group_sizes)`` under ``MXFP8BlockScaling`` (module docstring)."""
  check_sizes(recipe, lhs.shape[1])
  operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  return _mxfp8_vjp(lhs, rhs, group_sizes, np.dtype(out_dtype), operand_dtypes, recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _mxfp8_vjp(lhs, rhs, group_sizes, out_dtype, operand_dtypes, recipe):
  del operand_dtypes
  qx, qw = _forward_gemm_operands(lhs, rhs, group_sizes, recipe)
  return _ragged(_values(qx), _values(qw), group_sizes, _ROWS_DIMS).astype(out_dtype)


def _mxfp8_fwd(lhs, rhs, group_sizes, out_dtype, operand_dtypes, recipe):
  del operand_dtypes
  check_sizes(recipe, lhs.shape[1], rhs.shape[2])
  qx, qw, qx_t, qw_t, _ = forward_operands(lhs, rhs, group_sizes, recipe)
  y = _ragged(_values(qx), _values(qw), group_sizes, _ROWS_DIMS).astype(out_dtype)
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  qx_t = _remat.name_quantized(qx_t, _remat.QUANTIZED_X)
  qw_t = _remat.name_quantized(qw_t, _remat.QUANTIZED_KERNEL)
  return y, (qx_t, qw_t, group_sizes)


def _mxfp8_bwd(out_dtype, operand_dtypes, recipe, residuals, g):
  del out_dtype
  qx_t, qw_t, group_sizes = residuals
  lhs_dtype, rhs_dtype = operand_dtypes
  qg, qg_t, padding = gradient_operands(g, group_sizes, qw_t.shape[0], recipe)
  dx = _ragged(_values(qg), _values(qw_t), group_sizes, _ROWS_DIMS).astype(lhs_dtype)
  # The padding rows are zero in both operands, so each group's padded size may be contracted.
  dw = _ragged(_values(qx_t).T, _values(qg_t).T, padding.padded_sizes, _WGRAD_DIMS)
  return dx, dw.astype(rhs_dtype), None


_mxfp8_vjp.defvjp(_mxfp8_fwd, _mxfp8_bwd)
