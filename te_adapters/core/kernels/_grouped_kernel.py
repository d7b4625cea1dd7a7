"""The native grouped GEMM of ``ragged_dot`` on Hopper (``csrc/grouped_gemm_*.cu``): FP8, and
bfloat16 (``bf16_ragged_dot``).

CUTLASS 3.x's Hopper grouped GEMM (TMA, warp-specialized, FP8 operands, float32 sums, one
output scale per group read from device memory), built when the extension is compiled with
``TE_ADAPTERS_CUTLASS_DIR`` (see ``csrc/README.md``). A small kernel turns the group sizes into
the per-group problems on the device, so nothing waits for the host inside a jitted step. The
three GEMMs of a grouped layer, each with both operands K-major as Hopper's FP8 tensor cores
want them:

- forward ``y[rows of g] = x[rows of g] @ w[g]``: x (M, K) and the kernels as (G, N, K) (the
  transposed copy that the kernels' one-pass cast, ``_cast_transpose.cast_transpose_per_batch``,
  writes beside the (G, K, N) one);
- dgrad ``dx[rows of g] = dy[rows of g] @ w[g]^T``: dy (M, N) and the kernels as (G, K, N);
- wgrad ``dw[g] = x[rows of g]^T @ dy[rows of g]``: x^T (K, P) and dy^T (N, P), where each
  group's rows start at a multiple of 16 columns (TMA needs 16-byte aligned addresses) and take at
  least 16 (zeros past the group's size, so an empty group gets a zero ``dw[g]``).

Rows past ``sum(group_sizes)`` give zero rows of y and dx and nothing to dw. Sums of group sizes
past M are clamped as ``row_groups`` does.

``Float8BlockScaling``'s grouped GEMM (``block_rows_gemm``, ``block_wgrad_gemm``;
``csrc/grouped_block_gemm_*.cu``) is CUTLASS's Hopper grouped GEMM with blockwise scaling, built
with the same switch: the same three GEMMs and operand orientations, each 128-wide slice of the
contraction multiplied by its operands' float32 inverse scales before it joins the float32 sum
(x and the output gradient in 1x128 blocks, the kernels in 128x128 tiles). Its wgrad operands
come in the padded layout of the format's quantization (each group from a multiple of 128 rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core.kernels import _ffi

__all__ = [
  "available",
  "bf16_ragged_dot",
  "bf16_refusal",
  "block_available",
  "block_refusal",
  "block_rows_gemm",
  "block_wgrad_gemm",
  "grouped_block_scales",
  "clamped_sizes",
  "fast_accumulation",
  "padded_columns",
  "refusal",
  "rows_gemm",
  "wgrad_gemm",
]

_ROWS, _WGRAD = 0, 1
# CUTLASS's workspace (one set of TMA descriptors per multiprocessor) plus the per-group
# arguments (problem shape, three pointers and strides, the alpha pointer: under 128 bytes).
_CUTLASS_WORKSPACE = 4 * 1024 * 1024
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_BF16 = np.dtype(jnp.bfloat16)
_OUT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
_ALIGN = 16
# The kernel's tile configuration: 0 = ping-pong 128x128x128, 1 = cooperative 128x256x128 (fast
# sums) or 128x128x128 (promoted sums). 1 ran faster on an H100 (bench/grouped_kernel.py).
DEFAULT_CONFIG = 1


def available() -> bool:
  """Whether the grouped FP8 GEMM is built here and every local device is a Hopper GPU."""
  return _ffi.hopper_target_available(_ffi.GROUPED_GEMM_TARGET)


def _fast(precision) -> bool:
  pair = precision if isinstance(precision, (tuple, list)) else (precision, precision)
  return all(p is None or str(p).upper().split(".")[-1] in ("DEFAULT", "FASTEST") for p in pair)


def fast_accumulation(precision, gemm: str, recipe) -> bool:
  """Fast FP8 sums for ``gemm`` (``fwd``, ``dgrad``, ``wgrad``), by the rule of ``dot_general``:
  the recipe's ``MMParams.use_split_accumulator`` promotes the sums, else ``precision`` decides."""
  params = getattr(
    recipe,
    {"fwd": "fp8_gemm_fprop", "dgrad": "fp8_gemm_dgrad", "wgrad": "fp8_gemm_wgrad"}[gemm],
    None,
  )
  if params is not None and params.use_split_accumulator:
    return False
  return _fast(precision)


def _shape_refusal(lhs, rhs, align: int = _ALIGN) -> str | None:
  """What every grouped kernel asks of the operands' sizes (K and N multiples of ``align``) and
  placement."""
  k, n = lhs.shape[1], rhs.shape[2]
  if k % align or n % align:
    return f"it needs K and N multiples of {align}"
  if not (_ffi.single_device(lhs) and _ffi.single_device(rhs)):
    return "an operand is sharded over several devices (the kernel has no partitioning rule)"
  return None


def refusal(lhs, rhs, recipe, out_dtypes) -> str | None:
  """Why the native kernel cannot run this grouped GEMM (None: it can). The XLA path runs then.

  ``out_dtypes``: the dtypes of y, dx and dw.
  """
  if not available():
    return "the grouped GEMM is not built here or the devices are not Hopper GPUs"
  pairs = {
    (np.dtype(recipe.fwd_dtype), np.dtype(recipe.fwd_dtype)),
    (np.dtype(recipe.bwd_dtype), np.dtype(recipe.fwd_dtype)),
    (np.dtype(recipe.fwd_dtype), np.dtype(recipe.bwd_dtype)),
  }
  if any(a not in _FP8 or b not in _FP8 or (a, b) == (_FP8[1], _FP8[1]) for a, b in pairs):
    return "it multiplies float8_e4m3fn by float8_e4m3fn or float8_e5m2 only"
  bad = [str(np.dtype(d)) for d in out_dtypes if np.dtype(d) not in _OUT]
  if bad:
    return f"it writes bfloat16 or float32, not {', '.join(bad)}"
  return _shape_refusal(lhs, rhs)


def bf16_refusal(lhs, rhs, out_dtype) -> str | None:
  """Why ``bf16_ragged_dot`` cannot run this grouped GEMM (None: it can)."""
  if not available():
    return "the grouped GEMM is not built here or the devices are not Hopper GPUs"
  if np.dtype(lhs.dtype) != _BF16 or np.dtype(rhs.dtype) != _BF16:
    return f"it multiplies bfloat16 by bfloat16, not {lhs.dtype} by {rhs.dtype}"
  if np.dtype(out_dtype) != _BF16:
    return f"it writes bfloat16 (the operands' dtype), not {np.dtype(out_dtype)}"
  return _shape_refusal(lhs, rhs)


def clamped_sizes(group_sizes, rows: int):
  """Group sizes as the kernel uses them: negative sizes as 0, the sum clamped to ``rows``."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
  return ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])


def _workspace(groups: int) -> int:
  return _CUTLASS_WORKSPACE + 256 * (16 + groups)


def rows_gemm(a, b, group_sizes, alpha, out_dtype, fast: bool, config: int = DEFAULT_CONFIG):
  """``out[rows of g] = (a[rows of g] @ b[g]^T) * alpha[g]``, zero past the groups.

  ``a`` (M, K) and ``b`` (G, N, K) FP8, ``alpha`` (G,) float32; returns (M, N) ``out_dtype``.
  """
  return _ffi.grouped_gemm_call(
    a,
    b,
    group_sizes,
    alpha,
    (a.shape[0], b.shape[1]),
    out_dtype,
    _workspace(b.shape[0]),
    mode=_ROWS,
    fast_accum=fast,
    config=config,
  )


def _padded_sources(group_sizes, rows: int):
  """The source row of each column of ``padded_columns``' output, -1 for zeros; (P,) int32."""
  groups = group_sizes.shape[0]
  width = -(-rows // _ALIGN) * _ALIGN + _ALIGN * groups
  pad = jnp.maximum(_ALIGN, (group_sizes + _ALIGN - 1) // _ALIGN * _ALIGN)
  pad_end = jnp.cumsum(pad)
  pad_start = pad_end - pad
  start = jnp.cumsum(group_sizes) - group_sizes
  col = jnp.arange(width, dtype=pad_end.dtype)
  # Every column against every group's end (one fused compare and sum): the default method of
  # searchsorted is a loop over the bisection steps, which XLA runs as a while loop of small
  # kernels and device copies in every step.
  group = jnp.searchsorted(pad_end, col, side="right", method="compare_all")
  safe = jnp.minimum(group, groups - 1)
  local = col - pad_start[safe]
  valid = (group < groups) & (local < group_sizes[safe])
  return jnp.where(valid, start[safe] + local, -1).astype(jnp.int32)


@functools.cache
def _transpose_registered() -> bool:
  return available() and _ffi.registered(_ffi.PADDED_TRANSPOSE_TARGET)


def padded_columns(q, group_sizes, native: bool | None = None):
  """``q`` (M, F) as (F, P): group g's rows as columns from a multiple of 16, each group taking
  ``max(16, size rounded up to 16)`` columns, zeros in the rest; ``P = M + 16 G`` rounded up.

  ``group_sizes`` must be clamped (``clamped_sizes``). ``native``: the extension's CUDA kernel
  (FP8 or bfloat16 ``q``) or XLA's gather and transpose (much slower on an H100); None: the kernel
  where it is built."""
  rows = q.shape[0]
  src = _padded_sources(group_sizes, rows)
  if native is None:
    native = np.dtype(q.dtype) in (*_FP8, _BF16) and _transpose_registered()
  if native:
    return _ffi.padded_transpose_call(q, src)
  src = jnp.where(src < 0, rows, src)
  padded = jnp.concatenate([q, jnp.zeros((1, q.shape[1]), q.dtype)])[src]
  return padded.T


def wgrad_gemm(x, dy, group_sizes, alpha, out_dtype, fast: bool, config: int = DEFAULT_CONFIG):
  """``dw[g] = (x[rows of g]^T @ dy[rows of g]) * alpha[g]``: (G, K, N) ``out_dtype``.

  ``x`` (M, K) and ``dy`` (M, N) FP8, with rows past the groups ignored; ``group_sizes`` clamped.
  """
  groups = group_sizes.shape[0]
  a = padded_columns(x, group_sizes)
  b = padded_columns(dy, group_sizes)
  return _ffi.grouped_gemm_call(
    a,
    b,
    group_sizes,
    alpha,
    (groups, x.shape[1], dy.shape[1]),
    out_dtype,
    _workspace(groups),
    mode=_WGRAD,
    fast_accum=fast,
    config=config,
  )


@jax.custom_vjp
def bf16_ragged_dot(lhs, rhs, group_sizes):
  """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` for bfloat16 operands on the native grouped
  GEMM, with its VJP (dgrad and wgrad on the same kernel): float32 sums, bfloat16 results; rows
  past the groups give zero rows of the output and of the input gradient, an empty group a zero
  kernel gradient. ``lhs`` (M, K), ``rhs`` (G, K, N), group sizes on the device. Where it runs:
  ``bf16_refusal`` is None. The forward GEMM reads the kernels as (G, N, K), transposed by XLA.
  """
  return _bf16_fwd(lhs, rhs, group_sizes)[0]


def _bf16_fwd(lhs, rhs, group_sizes):
  sizes = clamped_sizes(group_sizes, lhs.shape[0])
  ones = jnp.ones((rhs.shape[0],), jnp.float32)
  y = rows_gemm(lhs, jnp.swapaxes(rhs, 1, 2), sizes, ones, _BF16, False)
  return y, (lhs, rhs, sizes)


def _bf16_bwd(residuals, g):
  lhs, rhs, sizes = residuals
  g = g.astype(_BF16)
  ones = jnp.ones((rhs.shape[0],), jnp.float32)
  dx = rows_gemm(g, rhs, sizes, ones, _BF16, False)
  dw = wgrad_gemm(lhs, g, sizes, ones, _BF16, False)
  return dx, dw, None


bf16_ragged_dot.defvjp(_bf16_fwd, _bf16_bwd)


# ---------------------------------------------------------------------------------------------
# Float8BlockScaling's grouped GEMM (blockwise scaling).

_BLOCK = 128
_E4M3, _E5M2 = _FP8


def block_available() -> bool:
  """Whether Float8BlockScaling's grouped GEMM is built here and every local device is a Hopper
  GPU."""
  return _ffi.hopper_target_available(_ffi.GROUPED_BLOCK_GEMM_TARGET)


def block_refusal(lhs, rhs, x_dtype, w_dtype, g_dtype, out_dtypes) -> str | None:
  """Why ``block_rows_gemm`` and ``block_wgrad_gemm`` cannot run this grouped GEMM (None: they
  can): ``x_dtype``, ``w_dtype``, ``g_dtype`` are the FP8 dtypes of x, the kernels and the output
  gradient, ``out_dtypes`` those of y, dx and dw."""
  if not block_available():
    return "the grouped GEMM is not built here or the devices are not Hopper GPUs"
  x, w, g = np.dtype(x_dtype), np.dtype(w_dtype), np.dtype(g_dtype)
  if x != _E4M3 or w != _E4M3 or g not in _FP8:
    return "it takes float8_e4m3fn x and kernels (float8_e4m3fn or float8_e5m2 gradients)"
  bad = [str(np.dtype(d)) for d in out_dtypes if np.dtype(d) not in _OUT]
  if bad:
    return f"it writes bfloat16 or float32, not {', '.join(bad)}"
  return _shape_refusal(lhs, rhs, _BLOCK)


def grouped_block_scales(scale_inv, group_sizes):
  """The scales (M, S) of x's or the gradient's rows (one per row and 128-wide slice) in the
  kernel's layout, flat (M * S,): group g's rows from offset ``o_g * S`` (``o_g``: the rows
  before it) as (S, m_g) row-major, slice after slice; the rows past the groups last, the same
  way. ``group_sizes`` clamped (``clamped_sizes``)."""
  rows, slices = scale_inv.shape
  sizes = group_sizes.astype(jnp.int32)
  # The rows past the groups as one more group.
  extended = jnp.concatenate([sizes, (rows - jnp.sum(sizes))[None]])
  ends = jnp.cumsum(extended)
  starts = ends - extended
  position = jnp.arange(rows * slices, dtype=jnp.int32).reshape(rows, slices)
  # Group g's scales fill the flat positions [o_g * S, (o_g + m_g) * S), so position p belongs to
  # the group of row p // S.
  group = jnp.searchsorted(
    ends, jnp.arange(rows, dtype=jnp.int32), side="right", method="compare_all"
  )
  start = starts[group][:, None]
  size = jnp.maximum(extended[group], 1)[:, None]
  local = position - start * slices
  return scale_inv[start + local % size, local // size].reshape(-1)


def block_rows_gemm(a, a_scale_inv, b, b_scale_inv, group_sizes, out_dtype):
  """``out[rows of g] = a[rows of g] @ b[g]^T``, zero past the groups, from block-scaled FP8.

  ``a`` (M, K) FP8 in 1x128 blocks along K with ``a_scale_inv`` (M, K/128); ``b`` (G, N, K) FP8
  in 128x128 tiles with ``b_scale_inv`` (G, N/128, K/128); ``group_sizes`` clamped. Returns
  (M, N) ``out_dtype`` (bfloat16 or float32), float32 sums.
  """
  sfa = grouped_block_scales(a_scale_inv, group_sizes)
  sfb = jnp.swapaxes(b_scale_inv, 1, 2)  # each kernel's tile scales slice by slice
  return _ffi.grouped_block_gemm_call(
    a,
    b,
    sfa,
    sfb,
    group_sizes,
    (a.shape[0], b.shape[1]),
    out_dtype,
    _block_workspace(b.shape[0]),
    mode=_ROWS,
  )


def block_wgrad_gemm(a, a_scale_inv, b, b_scale_inv, group_sizes, out_dtype):
  """``dw[g] = a[:, columns of g] @ b[:, columns of g]^T``: (G, K, N) ``out_dtype``.

  ``a`` (K, P) and ``b`` (N, P) FP8 in 1x128 blocks along P with scales (K, P/128) and
  (N, P/128), in the padded layout: group g's columns from the sum of the sizes before it, each
  rounded up to 128, zeros past its size (``formats``' ``group_padding`` with blocks of 128).
  An empty group gets a zero gradient.
  """
  return _ffi.grouped_block_gemm_call(
    a,
    b,
    a_scale_inv.T,  # (P/128, K): each 128-column slice's scales together
    b_scale_inv.T,
    group_sizes,
    (group_sizes.shape[0], a.shape[0], b.shape[0]),
    out_dtype,
    _block_workspace(group_sizes.shape[0]),
    mode=_WGRAD,
  )


def _block_workspace(groups: int) -> int:
  # CUTLASS's workspace plus the per-group arguments (shape, five pointers, two scale layouts,
  # three strides: under 256 bytes).
  return _CUTLASS_WORKSPACE + 256 * (16 + 2 * groups)
