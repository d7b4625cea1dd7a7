"""The grouped GEMM of a block format: blocks along each GEMM's contracting dim, never across
a group (the ``GroupedFormat`` the registry gives ``MXFP8BlockScaling``).

Each GEMM quantizes both of its operands in the blocks of the format's ``operand_spec`` along
the dimension it contracts, each copy from the high-precision tensor, with the rules of
``core.dot_general`` under the same recipe (MXFP8: 1x32 blocks, TE's E8M0 round-up):

- forward ``y[i] = x[i] · W[g(i)]`` contracts K: x in blocks along K (within a row, so groups do
  not matter), each expert's kernel in blocks along K;
- dgrad ``dx[i] = dy[i] · W[g(i)]^T`` contracts N: dy along N, each expert's kernel along N;
- wgrad ``dW[g] = x_g^T · dy_g`` contracts the rows (tokens) of group g: x and dy in blocks of
  rows **of one group**. The rows of each group are quantized as if the group were padded with
  zero rows to a multiple of the block, its first block starting at the group's first row; the
  zero rows change no block amax and add nothing to the product.

The wgrad copies are built in a padded layout (``_grouping.group_padding``) of static size
``P = B * ((M + (B - 1) * G) // B)`` rows for blocks of B, in which every group starts on a
multiple of B: for MXFP8 the layout of TE's grouped GEMM, whose MXFP8 path takes group sizes that
are multiples of 32 (TE's PyTorch MoE pads each expert's tokens to 32 with ``Fp8Padding``). The
result therefore equals padding every group with zero rows to a multiple of the block, running
the grouped GEMM, and dropping the padding; where the group sizes already are multiples of the
block nothing is padded. The padding is computed on the device from ``group_sizes`` by gathers,
without a host transfer.

``Float8BlockScaling`` (``grouped_format(block, native=True)``): on a Hopper GPU with the
extension's grouped GEMM built (CUTLASS), its three GEMMs run in FP8 on
``kernels.block_rows_gemm`` / ``kernels.block_wgrad_gemm`` (CUTLASS's grouped GEMM with blockwise
scaling: each 128-wide slice of the contraction multiplied by its operands' scales in float32,
the formulation of ``dot_general``'s block-scaled GEMM), from the same quantized copies: the
route ``NATIVE``, where ``kernels.block_refusal`` is None and the kernels are in 128x128 tiles.
Elsewhere, and for MXFP8, the GEMMs are emulated: the quantized values are dequantized (exactly,
to bfloat16 on GPUs and float32 elsewhere) and multiplied by ``jax.lax.ragged_dot_general``
accumulating in float32. JAX has no ragged counterpart of ``jax.nn.scaled_matmul`` for hardware
with MX GEMMs. Stateless.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from te_adapters.core import kernels
from te_adapters.core.formats import _block_scaled
from te_adapters.core.formats._block import emulation_dtype
from te_adapters.core.formats._format import BlockFormat, GroupedFormat, GroupedRequest, Quantized
from te_adapters.core.formats._grouping import (
  PER_GROUP_WGRAD_DIMS,
  ROWS_TIMES_GROUP_KERNEL_DIMS,
  group_padding,
  padded_rows,
  row_groups,
)
from te_adapters.core.formats._scaled_tensor import flag_non_finite

__all__ = ["NATIVE", "grouped_format"]

# The route of the FP8 grouped GEMMs with blockwise scaling (None: the emulated GEMMs).
NATIVE = "native"

_WHAT = {"x": "lhs (x)", "kernel": "rhs (kernel)", "grad": "output gradient"}


def _check(block: BlockFormat, recipe, k: int, n: int, backward: bool) -> None:
  """Raises where the blocks cannot quantize the grouped GEMM: K (always) or N (under
  differentiation, or in the forward GEMM where the kernel is tiled) that the blocks do not tile
  (a ValueError), or rows (x, the gradient) in 2-D tiles, which would cross groups, or blocks with
  the random Hadamard transform or stochastic rounding (a NotImplementedError). M is free (groups
  are padded)."""
  name = type(recipe).__name__
  for role in ("x", "grad"):
    for wgrad in (False, True):
      spec = block.operand_spec(recipe, role, wgrad)
      if len(spec.block_shape) != 1:
        shape = "x".join(map(str, spec.block_shape))
        raise NotImplementedError(
          f"{name}: ragged_dot cannot quantize {role} in {shape} tiles, which would cross "
          "groups (its blocks run along one row, or along one group's rows)"
        )
      if spec.rht or spec.stochastic:
        raise NotImplementedError(
          f"{name}: ragged_dot does not implement the random Hadamard transform or stochastic "
          f"rounding of {role}"
        )
  w_spec = block.operand_spec(recipe, "kernel", False)
  size = w_spec.block_size
  tiled = len(w_spec.block_shape) == 2
  checks = [
    ("the contracting size K", k, "the forward GEMM quantizes lhs and rhs in blocks along K")
  ]
  if backward or tiled:
    why = "the dgrad GEMM quantizes the output gradient and rhs in blocks along N"
    if not backward:
      why = f"the kernel is quantized in {size}x{size} tiles over (K, N)"
    checks.append(("the output size N (rhs dim 2)", n, why))
  for text, dim, why in checks:
    if dim % size:
      raise ValueError(
        f"{name}: {text} is {dim}, which is not a multiple of {size}; {why}. Pad the "
        "features, or pass recipe=None for a high-precision GEMM."
      )


def _route(block: BlockFormat, native: bool, lhs, rhs, recipe, out_dtypes):
  """``NATIVE`` where the format's blocks run on the extension's grouped GEMM (``native``, the
  kernels in 128x128 tiles, ``kernels.block_refusal`` None), else None: the emulated GEMMs."""
  if not native:
    return None
  w_spec = block.operand_spec(recipe, "kernel", False)
  if len(w_spec.block_shape) != 2:
    return None
  x_dtype = block.operand_spec(recipe, "x", False).q_dtype
  g_dtype = block.operand_spec(recipe, "grad", False).q_dtype
  refusal = kernels.block_refusal(lhs, rhs, x_dtype, w_spec.q_dtype, g_dtype, out_dtypes)
  return NATIVE if refusal is None else None


def _quantize(block: BlockFormat, req: GroupedRequest) -> Quantized:
  """x and the gradient: ``rows`` [M, F] in blocks along F (rows in no group are zeros),
  ``cols`` [F, P] in blocks of padded rows of one group. The kernels: ``rows`` (G, N, K) in
  blocks along K, ``cols`` (G, K, N) in blocks along N."""
  x, role, recipe = req.x, req.role, req.recipe
  what = _WHAT[role]
  spec = block.operand_spec(recipe, role, False)
  rows = cols = None
  if role == "kernel":
    # The extension's block cast writes both tiled copies in one pass (Float8BlockScaling on a
    # GPU): the copy along N and the (G, N, K) one.
    both = _block_scaled.cast_copies(x, spec, spec, "auto") if req.rows and req.cols else None
    if both is not None:
      return _flagged(both[1], both[0], req.non_finite)
    if req.rows:
      rows = _block_scaled.quantize_trailing(jnp.swapaxes(x, 1, 2), spec, what=what)
    if req.cols:
      cols = _block_scaled.quantize_trailing(x, spec, what=what)
    return _flagged(rows, cols, req.non_finite)
  # The extension's block cast gathers the rows it quantizes as it reads them (rows in no group
  # as zeros, the padded layout's rows), so neither the masked nor the padded copy of x is
  # written first.
  if req.rows:
    in_group = row_groups(req.group_sizes, x.shape[0]) < req.group_sizes.shape[0]
    source = jnp.where(in_group, jnp.arange(x.shape[0], dtype=jnp.int32), -1)
    rows = _cast_one(x, spec, spec, transposed=False, source_rows=source)
    if rows is None:
      x_rows = jnp.where(in_group[:, None], x, jnp.zeros((), x.dtype))
      rows = _block_scaled.quantize_trailing(x_rows, spec, what=what)
  if req.cols:
    spec_t = block.operand_spec(recipe, role, True)
    padding = group_padding(req.group_sizes, x.shape[0], spec_t.block_size)
    source = jnp.where(padding.valid, padding.source, -1)
    cols = _cast_one(x, spec_t, spec_t, transposed=True, source_rows=source)
    if cols is None:
      cols = _block_scaled.quantize_trailing(padded_rows(x, padding).T, spec_t, what=what)
  return _flagged(rows, cols, req.non_finite)


def _cast_one(x, spec, spec_t, transposed: bool, source_rows):
  """One copy of ``x[source_rows]`` (R, C) (zero rows where ``source_rows`` is negative) from the
  extension's block cast: along C, or (``transposed``) the (C, R) copy along R; None where the
  cast does not apply (then ``quantize_trailing``, the same values)."""
  copies = _block_scaled.cast_copies(
    x[None], spec, spec_t, "auto", rows=not transposed, cols=transposed, source_rows=source_rows
  )
  if copies is None:
    return None
  t = copies[1] if transposed else copies[0]
  return dataclasses.replace(t, data=t.data[0], scale_inv=t.scale_inv[0])


def _flagged(rows, cols, non_finite) -> Quantized:
  # A NaN or inf in the operand (a non-finite global amax) makes the products it feeds NaN
  # (GemmConfig.non_finite).
  return Quantized(flag_non_finite(rows, non_finite), flag_non_finite(cols, non_finite), None)


def _values(t):
  return _block_scaled.dequantize(t, emulation_dtype())


def _ragged(a, b, group_sizes, dims):
  return lax.ragged_dot_general(
    a, b, group_sizes, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )


def _gemm(block, a, b, group_sizes, out_dtype, which, recipe, precision=None, route=None):
  """The grouped GEMM of two block-scaled copies: FP8 on the extension's kernel (``NATIVE``), or
  emulated; float32 sums either way (``precision`` is unused)."""
  del precision
  if route == NATIVE:
    if which == "wgrad":
      return kernels.block_wgrad_gemm(
        a.data, a.scale_inv, b.data, b.scale_inv, group_sizes, out_dtype
      )
    sizes = kernels.clamped_sizes(group_sizes, a.data.shape[0])
    return kernels.block_rows_gemm(a.data, a.scale_inv, b.data, b.scale_inv, sizes, out_dtype)
  if which == "wgrad":
    # The padding rows are zero in both operands, so each group's padded size may be contracted.
    size = block.operand_spec(recipe, "x", True).block_size
    padded_sizes = (group_sizes.astype(jnp.int32) + (size - 1)) // size * size
    out = _ragged(_values(a).T, _values(b).T, padded_sizes, PER_GROUP_WGRAD_DIMS)
  else:
    out = _ragged(_values(a), _values(b), group_sizes, ROWS_TIMES_GROUP_KERNEL_DIMS)
  return out.astype(out_dtype)


def _stateless_next(recipe, state, roles):
  del recipe, roles
  return state


def grouped_format(block: BlockFormat, native: bool = False) -> GroupedFormat:
  """The ``GroupedFormat`` of a block format whose blocks are 1-D along each GEMM's contracting
  dim (MXFP8; ``Float8BlockScaling``'s kernels in 128x128 tiles). ``native``: the format's
  scales are float32 per 1x128 block or 128x128 tile, which the extension's grouped GEMM takes
  (``Float8BlockScaling``)."""
  return GroupedFormat(
    check=functools.partial(_check, block),
    route=functools.partial(_route, block, native),
    quantize=functools.partial(_quantize, block),
    gemm=functools.partial(_gemm, block),
    next_state=_stateless_next,
  )
