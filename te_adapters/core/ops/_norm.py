"""LayerNorm and RMSNorm over the last axis.

``layernorm`` computes in float32 whatever the input dtype and returns the input's dtype; its
custom VJP saves the input, the row statistics and gamma (as TE's does), not the normalized
tensor. The norm followed by a quantized GEMM is ``_norm_dense.layernorm_dense``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from jax.typing import ArrayLike

__all__ = [
  "LAYERNORM_TYPES",
  "check_norm_args",
  "layernorm",
  "norm_bwd",
  "norm_gamma",
  "norm_stats",
  "normalized",
]

LAYERNORM_TYPES = ("layernorm", "rmsnorm")


def check_norm_args(x, scale, bias, layernorm_type):
  """``layernorm``'s errors for bad arguments (an unknown type, wrong shapes or dtypes)."""
  _check(
    jnp.asarray(x), jnp.asarray(scale), None if bias is None else jnp.asarray(bias), layernorm_type
  )


def _check(x, scale, bias, layernorm_type):
  if layernorm_type not in LAYERNORM_TYPES:
    raise ValueError(f"layernorm_type must be one of {LAYERNORM_TYPES}, got {layernorm_type!r}")
  for name, a in (("x", x), ("scale", scale), ("bias", bias)):
    if a is not None and not jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
      raise TypeError(f"layernorm: {name} must be a floating-point array, got {a.dtype}")
  if x.ndim < 1:
    raise ValueError("layernorm: x must have at least one axis (the normalized last axis)")
  features = x.shape[-1]
  if tuple(scale.shape) != (features,):
    raise ValueError(
      f"layernorm: scale must have shape ({features},) for x of shape {tuple(x.shape)} (the "
      f"norm runs over the last axis), got {tuple(scale.shape)}"
    )
  if layernorm_type == "rmsnorm":
    if bias is not None:
      raise ValueError("layernorm: rmsnorm has no bias (beta); pass bias=None")
  elif bias is None:
    raise ValueError(
      f"layernorm: layernorm_type='layernorm' needs a bias (beta) of shape ({features},)"
    )
  elif tuple(bias.shape) != (features,):
    raise ValueError(
      f"layernorm: bias must have shape ({features},) for x of shape {tuple(x.shape)}, got "
      f"{tuple(bias.shape)}"
    )


def layernorm(
  x: ArrayLike,
  scale: ArrayLike,
  bias: ArrayLike | None = None,
  *,
  layernorm_type: str = "layernorm",
  zero_centered_gamma: bool = False,
  epsilon: float = 1e-6,
) -> jax.Array:
  """LayerNorm or RMSNorm of ``x`` over its last axis, as TE's ``layernorm``.

  ``layernorm``: ``(x - mean) / sqrt(var + epsilon) * gamma + beta``; ``rmsnorm``:
  ``x / sqrt(mean(x**2) + epsilon) * gamma``. With ``zero_centered_gamma`` the factor is
  ``1 + gamma`` (so a zero-initialised ``scale`` is the identity). Computed in float32, returned
  in ``x``'s dtype; the gradients of ``x``, ``scale`` and ``bias`` come back in their dtypes.

  Args:
    x: the input, normalized over its last axis.
    scale: gamma, of shape ``(x.shape[-1],)``.
    bias: beta, of shape ``(x.shape[-1],)``; ``None`` for rmsnorm (which has none).
    layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
    zero_centered_gamma: use ``1 + scale`` as the factor.
    epsilon: added to the variance (mean square for rmsnorm).

  Returns:
    The normalized ``x``, of its shape and dtype.

  Raises:
    ValueError: an unknown ``layernorm_type``, a ``scale`` or ``bias`` of another shape than
      ``(x.shape[-1],)``, a bias for rmsnorm or none for layernorm, or a scalar ``x``.
    TypeError: an operand that is not floating point.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> y = ta.core.layernorm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2), epsilon=0.0)
    >>> y.tolist()
    [[-1.0, 1.0]]
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale)
  bias = None if bias is None else jnp.asarray(bias)
  _check(x, scale, bias, layernorm_type)
  if bias is None:
    bias = jnp.zeros((0,), scale.dtype)  # rmsnorm: a placeholder with no gradient of its own
  return _norm(x, scale, bias, layernorm_type, bool(zero_centered_gamma), float(epsilon))


def norm_stats(x32, layernorm_type, epsilon):
  """Row mean (zeros for rmsnorm) and 1/sigma, float32, with a trailing axis of 1."""
  if layernorm_type == "layernorm":
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  else:
    mean = jnp.zeros(x32.shape[:-1] + (1,), jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return mean, jax.lax.rsqrt(var + epsilon)


def norm_gamma(scale, zero_centered_gamma):
  gamma = scale.astype(jnp.float32)
  return gamma + 1.0 if zero_centered_gamma else gamma


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon):
  y, _ = _norm_fwd(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon)
  return y


def normalized(x, mean, rsigma, scale, bias, zero_centered_gamma):
  """The norm's output in float32 from the row statistics (``bias``: empty for rmsnorm)."""
  y = (x.astype(jnp.float32) - mean) * rsigma * norm_gamma(scale, zero_centered_gamma)
  if bias.size:
    y = y + bias.astype(jnp.float32)
  return y


def _norm_fwd(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon):
  mean, rsigma = norm_stats(x.astype(jnp.float32), layernorm_type, epsilon)
  y = normalized(x, mean, rsigma, scale, bias, zero_centered_gamma)
  protos = (np.zeros((0,), bias.dtype),)
  return y.astype(x.dtype), (x, mean, rsigma, scale, protos)


def norm_bwd(layernorm_type, zero_centered_gamma, epsilon, residuals, dy):
  del epsilon
  x, mean, rsigma, scale, (bias_proto,) = residuals
  dy32 = dy.astype(jnp.float32)
  xhat = (x.astype(jnp.float32) - mean) * rsigma
  rows = tuple(range(x.ndim - 1))
  dgamma = jnp.sum(dy32 * xhat, axis=rows)
  g = dy32 * norm_gamma(scale, zero_centered_gamma)
  # d/dx of xhat * gamma: 1/sigma * (g - mean(g) - xhat * mean(g * xhat)); rmsnorm has no mean
  # to subtract, so the mean(g) term drops.
  proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
  inner = g - xhat * proj
  if layernorm_type == "layernorm":
    inner = inner - jnp.mean(g, axis=-1, keepdims=True)
  dx = (rsigma * inner).astype(x.dtype)
  if layernorm_type == "rmsnorm":
    dbeta = jnp.zeros((0,), bias_proto.dtype)
  else:
    dbeta = jnp.sum(dy32, axis=rows).astype(bias_proto.dtype)
  return dx, dgamma.astype(scale.dtype), dbeta


_norm.defvjp(_norm_fwd, norm_bwd)
