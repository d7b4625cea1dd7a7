"""The quantized-tensor pytree, and TE's per-tensor cast with the checks on its inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core.formats import _scaling

__all__ = [
  "ScaledTensor",
  "cast_with_scale",
  "check_float_operand",
  "check_fp8_dtype",
  "flag_non_finite",
  "non_finite_scale_inv",
]

_FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
  """A quantized tensor: ``x ≈ dequantize(t) = data * scale_inv`` (broadcast per ``scaling_mode``).

  Attributes:
    data: the quantized values (``float8_e4m3fn``, ``float8_e5m2`` or, for NVFP4,
      ``float4_e2m1fn``), same shape as the input.
    scale_inv: dequantization factors. Per-tensor scaling: float32 of shape (1,). Block-scaled
      modes: one factor per block, with the data's number of axes and each blocked axis divided by
      its block size (``float8_e8m0fnu`` for MXFP8, ``float8_e4m3fn`` for NVFP4, float32 for FP8
      blocks); a 16x16 or 128x128 tile has one entry.
    amax: float32 (1,), ``max(|x|)`` of the high-precision input (NVFP4: of the transformed input
      when the random Hadamard transform was applied; it sets the tensor-level scale).
    scaling_mode: ``"tensor"``, ``"mxfp8"``, ``"nvfp4"``, ``"nvfp4_rht"`` (NVFP4 after the random
      Hadamard transform along the blocked axis) or ``"float8_block"`` (static).
    dq_dtype: dtype of the high-precision input (static), the default of ``dequantize``.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> t = ta.quantize(jnp.array([0.5, -1.0, 2.0], jnp.bfloat16), jnp.float8_e4m3fn)
    >>> t.data.dtype, t.scale_inv.shape, t.scaling_mode, t.dq_dtype
    (dtype(float8_e4m3fn), (1,), 'tensor', dtype(bfloat16))
    >>> ta.dequantize(t).tolist()
    [0.5, -1.0, 2.0]
    >>> len(jax.tree.leaves(t))  # a pytree: data, scale_inv and amax pass through jit
    3
  """

  data: jax.Array
  scale_inv: jax.Array
  amax: jax.Array | None
  scaling_mode: str = dataclasses.field(default="tensor", metadata=dict(static=True))
  dq_dtype: Any = dataclasses.field(default=np.dtype(np.float32), metadata=dict(static=True))

  @property
  def shape(self):
    return self.data.shape

  @property
  def dtype(self):
    return self.data.dtype


def check_fp8_dtype(dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  if dtype not in _FP8_DTYPES:
    raise ValueError(f"quantized dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
  return dtype


def check_float_operand(name: str, x) -> None:
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(f"{name} must be a real floating-point array, got complex dtype {dtype}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def cast_with_scale(x, scale, q_dtype) -> jax.Array:
  """``cast(clip(float32(x) * scale, ±max))``: TE's quantization of one tensor."""
  limit = _scaling.fp8_max(q_dtype)
  scaled = x.astype(jnp.float32) * scale.astype(jnp.float32).reshape(())
  return jnp.clip(scaled, -limit, limit).astype(q_dtype)


def non_finite_scale_inv(scale_inv, amax, non_finite: str) -> jax.Array:
  """``scale_inv``, NaN where ``amax`` (broadcast against it) is not finite, unless
  ``non_finite`` is ``"saturate"`` (``GemmConfig.non_finite``).

  The amax is the one a format computes for its scales anyway (inf for a NaN where the format
  maps it so), so the check costs no pass over the operand: a GEMM that multiplies by the
  inverse scales writes NaN where the operand held a NaN or an infinity, which TE's saturating
  cast would otherwise turn into finite values.
  """
  if non_finite == "saturate" or amax is None:
    return scale_inv
  nan = jnp.asarray(jnp.nan, scale_inv.dtype)
  return jnp.where(jnp.isfinite(amax), scale_inv, nan)


def flag_non_finite(t: ScaledTensor | None, non_finite: str) -> ScaledTensor | None:
  """``t`` with ``non_finite_scale_inv`` applied from its own (tensor-wide) amax."""
  if t is None or t.amax is None or non_finite == "saturate":
    return t
  amax = jnp.reshape(t.amax, (1,) * t.scale_inv.ndim) if t.amax.size == 1 else t.amax
  return dataclasses.replace(t, scale_inv=non_finite_scale_inv(t.scale_inv, amax, non_finite))
