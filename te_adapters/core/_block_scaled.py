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
from jax import lax

from te_adapters.core import _block, _float8_block, _mxfp8, _nvfp4, _sharding
from te_adapters.core._recipes import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from te_adapters.core._scaled_tensor import ScaledTensor

__all__ = [
  "BLOCK_MODES",
  "OperandSpec",
  "operand_spec",
  "quantize_trailing",
  "dequantize",
  "transpose_tiles",
  "gemm",
  "native_gemm_available",
  "emulation_dtype",
]

BLOCK_MODES = ("mxfp8", "nvfp4", "nvfp4_rht", "float8_block")
ROLES = ("x", "kernel", "grad")


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one copy of one operand is quantized (static)."""

  mode: str  # "mxfp8", "nvfp4" or "float8_block"
  block_shape: tuple[int, ...]
  q_dtype: np.dtype
  rht: bool = False
  stochastic: bool = False
  power_2: bool = True

  @property
  def block_size(self) -> int:
    return self.block_shape[-1]


def operand_spec(recipe, role: str, *, wgrad: bool = False) -> OperandSpec:
  """The quantization of ``role`` under a block recipe; ``wgrad`` marks the weight-gradient copy."""
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  if isinstance(recipe, MXFP8BlockScaling):
    return OperandSpec("mxfp8", (_mxfp8.BLOCK,), dtype)
  if isinstance(recipe, NVFP4BlockScaling):
    two_d = role == "kernel" and not recipe.disable_2d_quantization
    return OperandSpec(
      "nvfp4",
      (_nvfp4.BLOCK,) * (2 if two_d else 1),
      dtype,
      rht=wgrad and role != "kernel" and not recipe.disable_rht,
      stochastic=role == "grad" and not recipe.disable_stochastic_rounding,
    )
  if isinstance(recipe, Float8BlockScaling):
    dims = {
      "x": recipe.x_block_scaling_dim,
      "kernel": recipe.w_block_scaling_dim,
      "grad": recipe.grad_block_scaling_dim,
    }[role]
    return OperandSpec(
      "float8_block", (_float8_block.BLOCK,) * dims, dtype, power_2=recipe.power_2_scale
    )
  raise TypeError(f"{type(recipe).__name__} is not a block-scaled recipe")


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
  mode = spec.mode
  if spec.mode == "mxfp8":
    data, scale_inv, amax = _mxfp8.quantize(x, spec.q_dtype)
  elif spec.mode == "nvfp4":
    if spec.rht:
      x = _nvfp4.apply_rht(x)
      mode = "nvfp4_rht"
    seed = _nvfp4.random_seed(key, stream) if spec.stochastic else None
    data, scale_inv, amax = _nvfp4.quantize(x, spec.block_shape, seed, reduce_amax)
  else:
    data, scale_inv, amax = _float8_block.quantize(x, spec.block_shape, spec.q_dtype, spec.power_2)
  return ScaledTensor(data, scale_inv, amax, scaling_mode=mode, dq_dtype=dq_dtype)


def _block_shape(t: ScaledTensor) -> tuple[int, ...]:
  return _block.block_shape_of(t.data.shape, t.scale_inv.shape)


def _values(t: ScaledTensor) -> jax.Array:
  """float32 ``data * block scale`` (NVFP4: without the tensor factor ``amax / (6 * 448)``)."""
  bs = _block_shape(t)
  if t.scaling_mode == "mxfp8":
    return _mxfp8.dequantize_values(t.data, t.scale_inv, bs)
  if t.scaling_mode in ("nvfp4", "nvfp4_rht"):
    return _nvfp4.dequantize_values(t.data, t.scale_inv, bs)
  return _float8_block.dequantize_values(t.data, t.scale_inv, bs)


def _tensor_factor(t: ScaledTensor) -> jax.Array | None:
  if t.scaling_mode in ("nvfp4", "nvfp4_rht"):
    return _nvfp4.global_factor(t.amax).reshape(())
  return None


def dequantize(t: ScaledTensor, dtype) -> jax.Array:
  """The high-precision values of a block-scaled tensor (the RHT undone for ``nvfp4_rht``)."""
  out = _values(t)
  factor = _tensor_factor(t)
  if factor is not None:
    out = out * factor
  if t.scaling_mode == "nvfp4_rht":
    ratios = [d // s for d, s in zip(t.data.shape, t.scale_inv.shape, strict=True)]
    axis = ratios.index(_nvfp4.BLOCK)
    out = jnp.moveaxis(_nvfp4.invert_rht(jnp.moveaxis(out, axis, -1)), -1, axis)
  return out.astype(dtype)


def transpose_tiles(t: ScaledTensor) -> ScaledTensor:
  """Swaps the last two axes of a tiled tensor (data and per-tile scales): exact, no rounding."""
  return dataclasses.replace(
    t, data=jnp.swapaxes(t.data, -1, -2), scale_inv=jnp.swapaxes(t.scale_inv, -1, -2)
  )


def native_gemm_available(mode: str) -> bool:
  """Whether ``jax.nn.scaled_matmul`` runs ``mode`` natively here (Blackwell GPUs, cuDNN)."""
  if mode not in ("mxfp8", "nvfp4", "nvfp4_rht") or jax.default_backend() != "gpu":
    return False
  try:
    capabilities = [float(d.compute_capability) for d in jax.local_devices()]
  except (AttributeError, TypeError, ValueError):
    return False
  return bool(capabilities) and min(capabilities) >= 10.0


def _use_native(mode: str, choice: str) -> bool:
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


def _row_scales(t: ScaledTensor) -> jax.Array:
  """Block scales as one row per data row (a tile's scale repeated on each of its rows)."""
  bs = _block_shape(t)
  scales = t.scale_inv
  if len(bs) == 2:
    scales = _block.repeat(scales, bs[0], axis=-2)
  return scales


def emulation_dtype():
  """The dtype emulated block-scaled GEMMs multiply dequantized values in."""
  # Dequantized NVFP4 values (<= 6 significant bits) and MXFP8 values are exact in bfloat16
  # (MXFP8 down to 2**-126), which runs at full speed on GPUs; CPUs are faster in float32.
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


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
  if a.scaling_mode == "float8_block":
    out = _float8_block.gemm(
      a.data, a.scale_inv, _block_shape(a), b.data, b.scale_inv, _block_shape(b), out_dtype,
      choice,
    )
    return _sharding.match_sharding(out, out_sharding)
  if _use_native(a.scaling_mode, choice):
    out = jax.nn.scaled_matmul(
      a.data, b.data, _row_scales(a), _row_scales(b), preferred_element_type=jnp.float32
    )
  else:
    dtype = emulation_dtype()
    out = lax.dot_general(
      _values(a).astype(dtype),
      _values(b).astype(dtype),
      (((2,), (2,)), ((0,), (0,))),
      precision=lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
      out_sharding=out_sharding,
    )
  fa, fb = _tensor_factor(a), _tensor_factor(b)
  if fa is not None:
    out = out * (fa * fb)
  return out
