"""Quantize and dequantize: a tensor in a low-precision dtype with its scales, as a pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import _scaling

__all__ = ["ScaledTensor", "quantize", "dequantize"]

_FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
  """A quantized tensor: ``x ≈ dequantize(t) = data * scale_inv`` (broadcast per ``scaling_mode``).

  Attributes:
    data: the quantized values (``float8_e4m3fn`` or ``float8_e5m2``), same shape as the input.
    scale_inv: float32 dequantization factors. Shape (1,) for per-tensor scaling; block-scaled
      modes will store one factor per block.
    amax: float32 (1,), ``max(|x|)`` of the high-precision input.
    scaling_mode: ``"tensor"`` (static).
    dq_dtype: dtype of the high-precision input (static), the default of ``dequantize``.
  """

  data: jax.Array
  scale_inv: jax.Array
  amax: jax.Array
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


def quantize(x: jax.Array, q_dtype, *, scale: jax.Array | None = None) -> ScaledTensor:
  """Quantizes ``x`` with one scale for the whole tensor.

  Args:
    x: a real floating-point array.
    q_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: float32 of shape (1,) or (), the multiplier applied before the cast (delayed scaling
      passes its stored scale). ``None`` computes it from ``x`` (current scaling):
      ``fp8_max / amax(|x|)``, or 1 when the amax is zero or not finite.

  Returns:
    A ``ScaledTensor`` with ``scale_inv = 1 / scale``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> t = ta.core.quantize(jnp.array([1.0, -2.0, 4.0]), jnp.float8_e4m3fn)
    >>> float(t.scale_inv[0]) == 4.0 / 448
    True
  """
  check_float_operand("x", x)
  q_dtype = check_fp8_dtype(q_dtype)
  x = jnp.asarray(x)
  a = _scaling.amax(x)
  if scale is None:
    scale = _scaling.compute_scale(a, _scaling.fp8_max(q_dtype), 1.0)
  else:
    scale = jnp.asarray(scale, jnp.float32)
    if scale.size != 1:
      raise ValueError(f"per-tensor scale must have one element, got shape {scale.shape}")
    scale = scale.reshape(1)
  data = cast_with_scale(x, scale, q_dtype)
  return ScaledTensor(
      data=data,
      scale_inv=_scaling.scale_inverse(scale),
      amax=a,
      scaling_mode="tensor",
      dq_dtype=np.dtype(x.dtype),
  )


def dequantize(t: ScaledTensor, dtype=None) -> jax.Array:
  """``data * scale_inv`` in ``dtype`` (default: the dtype the tensor was quantized from)."""
  if not isinstance(t, ScaledTensor):
    raise TypeError(f"dequantize expects a ScaledTensor, got {type(t).__name__}")
  dtype = t.dq_dtype if dtype is None else dtype
  if t.scaling_mode != "tensor":
    raise NotImplementedError(f"scaling mode {t.scaling_mode!r}")
  out = t.data.astype(jnp.float32) * t.scale_inv.reshape(())
  return out.astype(dtype)
