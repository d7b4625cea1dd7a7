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
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import kernels
from te_adapters.core import sharding as core_sharding
from te_adapters.core.formats import _block, _float8_block, _mxfp8, _nvfp4
from te_adapters.core.formats._block import emulation_dtype, native_gemm_available
from te_adapters.core.formats._format import (
  BlockFormat,
  GroupedFormat,
  OperandSpec,
  QuantizationFormat,
  Quantized,
  QuantizeRequest,
)
from te_adapters.core.formats._scaled_tensor import ScaledTensor, flag_non_finite
from te_adapters.core.state import EmptyState

__all__ = [
  "BLOCK_MODES",
  "OperandSpec",
  "block_format",
  "block_of",
  "cast_copies",
  "operand_spec",
  "quantize_trailing",
  "dequantize",
  "transpose_tiles",
  "gemm",
  "native_gemm_available",
  "emulation_dtype",
]

ROLES = ("x", "kernel", "grad")
# The block-scaled formats of the package, one module each; ``register_block`` adds others.
_BLOCKS: list[BlockFormat] = [_mxfp8.FORMAT, _nvfp4.FORMAT, _float8_block.FORMAT]
_BY_MODE = {mode: f for f in _BLOCKS for mode in f.scaling_modes}
BLOCK_MODES = tuple(_BY_MODE)


def register_block(block: BlockFormat) -> None:
  """Makes a new block format's recipe and scaling modes known here (``_registry.register_format``
  calls it)."""
  if block not in _BLOCKS:
    _BLOCKS.append(block)
  for mode in block.scaling_modes:
    _BY_MODE[mode] = block


def unregister_block(block: BlockFormat) -> None:
  if block in _BLOCKS:
    _BLOCKS.remove(block)
  for mode in block.scaling_modes:
    _BY_MODE.pop(mode, None)


def block_of(recipe) -> BlockFormat:
  """The ``BlockFormat`` of a block-scaled recipe; a TypeError for any other recipe."""
  for block in _BLOCKS:
    if isinstance(recipe, block.recipe_type):
      return block
  raise TypeError(f"{type(recipe).__name__} is not a block-scaled recipe")


def operand_spec(recipe, role: str, *, wgrad: bool = False) -> OperandSpec:
  """The quantization of ``role`` under a block recipe; ``wgrad`` marks the weight-gradient copy."""
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  return block_of(recipe).operand_spec(recipe, role, wgrad)


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


def is_block_mode(mode: str) -> bool:
  """Whether ``mode`` is the scaling mode of a registered block format."""
  return mode in _BY_MODE


# --- the QuantizationFormat of a block-scaled recipe ---------------------------------------


def _amax_reducer(x, role, plan):
  """For NVFP4 inside shard_map: the global amax of ``x``'s tensor from its shard's."""
  return functools.partial(core_sharding.global_amax, x=x, role=role, plan=plan, state_varying=None)


_CAST_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _one_pass_blocks(spec, spec_t, backend: str) -> bool | None:
  """Whether both copies are FP8 block scaling's 128x128 tiles (True) or 1x128 blocks (False),
  cast in one pass of the extension's kernels; None where no such pass applies (another format,
  stochastic rounding, copies of different dtypes or blocks, ``GemmConfig(backend="jax")``)."""
  if backend == "jax" or spec.mode != "float8_block" or spec_t.mode != "float8_block":
    return None
  if spec.stochastic or spec_t.stochastic:
    return None
  if (spec.q_dtype, spec.power_2) != (spec_t.q_dtype, spec_t.power_2):
    return None
  if spec.block_shape != spec_t.block_shape or spec.block_shape not in ((128,), (128, 128)):
    return None
  return spec.block_shape == (128, 128)


def _produced_both(block: BlockFormat, req: QuantizeRequest):
  """``(q, q_t)`` of a producer's 2-D operand (P, C) cast into 1x128 blocks in the pass that
  computes it (``Producer.block_cast``), or None where it does not (no such cast, tiles, a copy
  not asked for, or the producer's kernel does not run here). The values are those of
  ``quantize_trailing`` of the producer's float32 ``value``."""
  producer = req.producer
  if producer is None or producer.block_cast is None or not (req.rows and req.cols):
    return None
  spec = block.operand_spec(req.recipe, req.role, False)
  spec_t = block.operand_spec(req.recipe, req.role, req.role != "kernel")
  if _one_pass_blocks(spec, spec_t, req.config.backend) is not False:
    return None
  out = producer.block_cast(spec.q_dtype, spec.power_2)
  if out is None:
    return None
  q, s, q_t, s_t, amax = out
  f32 = np.dtype(jnp.float32)  # the producers' values are float32
  return (
    ScaledTensor(q, s, amax, scaling_mode="float8_block", dq_dtype=f32),
    ScaledTensor(q_t, s_t, amax, scaling_mode="float8_block", dq_dtype=f32),
  )


def cast_copies(
  x3, spec, spec_t, backend: str, *, rows: bool = True, cols: bool = True, source_rows=None
):
  """``(q, q_t)``: ``x3`` (B, P, Q) quantized with ``spec`` and its (B, Q, P) copy with
  ``spec_t``, from one pass of the extension's CUDA block cast (``rows`` / ``cols``: which of
  the two it writes; the other is None); None where it does not apply (another format, the CPU,
  a shape or dtype it does not take, several devices, or ``GemmConfig(backend="jax")``). The
  values are those of ``quantize_trailing``. The tiled copies (128x128) come from one scale per
  tile, so they ask for ``rows``.

  ``source_rows`` (P,) int32: quantize the rows ``x3[:, source_rows]`` instead, zero rows where
  an entry is negative (``x3`` (B, M, Q), any M), gathered as the cast reads them."""
  tile = _one_pass_blocks(spec, spec_t, backend)
  if tile is None or not (rows or cols) or (tile and not rows):
    return None
  p = x3.shape[-2] if source_rows is None else source_rows.shape[0]
  if x3.shape[-1] % 128 or p % 128 or np.dtype(x3.dtype) not in _CAST_DTYPES:
    return None
  if jax.default_backend() != "gpu" or not kernels.registered(kernels.BLOCK_CAST_TARGET):
    return None
  if not kernels.single_device(x3):
    return None
  q, s, q_t, s_t, amax = kernels.block_cast_call(
    x3,
    spec.q_dtype,
    rowwise=rows,
    colwise=cols,
    tile=tile,
    power_2=spec.power_2,
    source_rows=source_rows,
  )
  if tile:
    s_t = jnp.swapaxes(s, -1, -2)
  dq = np.dtype(x3.dtype)
  return (
    ScaledTensor(q, s, amax, scaling_mode="float8_block", dq_dtype=dq) if rows else None,
    ScaledTensor(q_t, s_t, amax, scaling_mode="float8_block", dq_dtype=dq) if cols else None,
  )


_WHAT = {"x": "lhs (x)", "kernel": "rhs (kernel)", "grad": "output gradient"}


def _with_batch(t: ScaledTensor) -> ScaledTensor:
  """A 2-D copy as the block GEMMs take it, (1, P, C) (its scales likewise)."""
  return dataclasses.replace(t, data=t.data[None], scale_inv=t.scale_inv[None])


def _without_batch(t: ScaledTensor | None) -> ScaledTensor | None:
  if t is None:
    return None
  return dataclasses.replace(t, data=t.data[0], scale_inv=t.scale_inv[0])


def _quantize(block: BlockFormat, req: QuantizeRequest) -> Quantized:
  """Both copies of a (B, P, C) operand: along C with the role's blocks, and the (B, C, P) copy
  with the blocks of the GEMM it feeds (x's and the gradient's: the weight gradient's). A tiled
  copy is quantized once and transposed (its tiles are the same either way).

  With a ``Producer`` (the fused norm and MLP paths), the operand is its ``value``: float32
  values quantized in blocks as they are computed. A 2-D operand (P, C) (those paths' GEMMs)
  gives 2-D copies; a producer whose kernel casts into FP8 block scaling's 1x128 blocks as it
  computes the operand (``Producer.block_cast``) gives them without writing the values."""
  if req.producer is not None:
    both = _produced_both(block, req)
    if both is not None:
      both_rows, both_cols = (flag_non_finite(t, req.config.non_finite) for t in both)
      return Quantized(both_rows, both_cols, None)
    if req.producer.value is None:
      raise NotImplementedError(
        f"{type(req.recipe).__name__}: block scales need the operand's values; this producer "
        "gives only a per-tensor cast"
      )
    req = dataclasses.replace(req, x=req.producer.value(), producer=None)
  if req.x.ndim == 2:
    q = _quantize(block, dataclasses.replace(req, x=req.x[None]))
    return Quantized(_without_batch(q.rows), _without_batch(q.cols), q.state)
  x, role, recipe, plan = req.x, req.role, req.recipe, req.plan
  spec = block.operand_spec(recipe, role, False)
  spec_t = block.operand_spec(recipe, role, role != "kernel")
  what = _WHAT[role]
  reduce = _amax_reducer(x, role, plan)
  tiled = len(spec_t.block_shape) == 2
  if req.rows and req.cols:
    both = cast_copies(x, spec, spec_t, req.config.backend)
    if both is not None:
      both_rows, both_cols = (flag_non_finite(t, req.config.non_finite) for t in both)
      return Quantized(both_rows, both_cols, None)
  # One key, two random streams: the copy along C (0) and the swapped copy (1).
  rows = cols = None
  if req.rows or (req.cols and tiled):
    rows = quantize_trailing(x, spec, req.key, stream=0, what=what, reduce_amax=reduce)
  if req.cols:
    if tiled:
      assert rows is not None  # quantized above for the tiles
      cols = transpose_tiles(rows)
    else:
      cols = quantize_trailing(
        jnp.swapaxes(x, -1, -2), spec_t, req.key, stream=1, what=what, reduce_amax=reduce
      )
  # A NaN or inf in x (a non-finite global amax) makes the GEMM's output NaN
  # (GemmConfig.non_finite).
  rows, cols = (flag_non_finite(t, req.config.non_finite) for t in (rows, cols))
  return Quantized(rows if req.rows else None, cols, None)


def _gemm(block, a, b, out_dtype, which, recipe, config, precision=None, out_sharding=None):
  """The block GEMM, in ``out_dtype``; blocks promote per block, ``precision`` is unused. 2-D
  copies (the fused paths') give a 2-D product."""
  if a.data.ndim == 2:
    out = _gemm(
      block,
      _with_batch(a),
      _with_batch(b),
      out_dtype,
      which,
      recipe,
      config,
      precision,
      out_sharding,
    )
    return out[0]
  del which, recipe, precision
  return block.gemm(a, b, out_dtype, out_sharding, config.block_gemm).astype(out_dtype)


def _shards(layout, lhs, rhs) -> dict[str, tuple[int, tuple[str, ...]]]:
  """Under Explicit mesh axes, per GEMM dim (M, N, K): the device count and mesh axes."""
  (lc, _), _ = layout.dn
  out = {}
  groups = (("M", lhs, layout.lhs_free), ("K", lhs, lc), ("N", rhs, layout.rhs_free))
  for letter, operand, dims in groups:
    sharding = core_sharding.explicit_sharding(operand)
    if sharding is None:
      continue
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    entries = [sharding.spec[d] for d in dims]
    axes = tuple(a for e in entries for a in ((e,) if isinstance(e, str) else (e or ())))
    out[letter] = (math.prod(sizes[a] for a in axes), axes)
  return out


def _check(block, recipe, layout, backward: bool, lhs=None, rhs=None):
  """Raises a ValueError naming the dimension the recipe's blocks cannot tile.

  With ``lhs`` and ``rhs`` sharded over Explicit mesh axes, each device's part must hold whole
  blocks too.
  """
  (lc, rc), _ = layout.dn
  shards = {} if lhs is None else _shards(layout, lhs, rhs)
  name = type(recipe).__name__
  x_tiled = len(block.operand_spec(recipe, "x", False).block_shape) == 2
  w_spec = block.operand_spec(recipe, "kernel", False)
  w_tiled = len(w_spec.block_shape) == 2
  size = w_spec.block_size
  tiles = f"{size}x{size} tiles"
  checks = [
    (
      "K",
      layout.k,
      f"the contracting size K (lhs dims {tuple(lc)}, rhs dims {tuple(rc)})",
      "the forward GEMM quantizes both operands in blocks along K",
    )
  ]
  if backward or w_tiled:
    why = "the dgrad GEMM quantizes the gradient and the kernel in blocks along N"
    if not backward:
      why = f"the kernel is quantized in {tiles} over (N, K)"
    checks.append(("N", layout.n, f"the rhs free size N (rhs dims {tuple(layout.rhs_free)})", why))
  if backward or x_tiled:
    why = "the wgrad GEMM quantizes x and the gradient in blocks along M"
    if block.operand_spec(recipe, "x", True).rht:
      why += " (and applies the 16-point random Hadamard transform along M)"
    if not backward:
      why = f"x is quantized in {tiles} over (M, K)"
    checks.append(("M", layout.m, f"the lhs free size M (lhs dims {tuple(layout.lhs_free)})", why))
  for letter, dim, text, why in checks:
    if dim % size:
      raise ValueError(f"{name}: {text} is {dim}, which is not a multiple of {size}; {why}")
    count, axes = shards.get(letter, (1, ()))
    if (dim // count) % size:
      raise ValueError(
        f"{name}: {text} is {dim}, split over {count} devices (mesh axes {axes}): "
        f"{dim // count} per device, which is not a multiple of {size}; {why}"
      )


def _stateless_next(recipe, state, roles):
  del recipe, roles
  return state


def block_format(block: BlockFormat, grouped: GroupedFormat | None = None) -> QuantizationFormat:
  """The ``QuantizationFormat`` of a block-scaled recipe from its block functions (stateless);
  ``grouped``: its grouped GEMM (``_grouped_block.grouped_format(block)``), or None: none."""
  return QuantizationFormat(
    recipe_type=block.recipe_type,
    scaling_modes=block.scaling_modes,
    init_state=lambda recipe: EmptyState(),
    state_shapes=lambda recipe: {},
    quantize=functools.partial(_quantize, block),
    gemm=functools.partial(_gemm, block),
    next_state=_stateless_next,
    dequantize=block.dequantize,
    check=functools.partial(_check, block),
    per_tensor=False,
    block=block,
    grouped=grouped,
    takes_producer=True,
  )
