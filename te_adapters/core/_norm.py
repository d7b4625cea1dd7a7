"""LayerNorm and RMSNorm over the last axis, and the norm followed by a quantized GEMM.

``layernorm`` computes in float32 whatever the input dtype and returns the input's dtype; its
custom VJP saves the input, the row statistics and gamma (as TE's does), not the normalized
tensor. ``layernorm_dense`` feeds the norm's output into ``dot_general`` within one jitted
computation: the amax and the FP8 cast of the GEMM's input consume it there, the backward pass
keeps only its FP8 copy, and it is returned only on request (``return_layernorm_output=True``).
Whether XLA also fuses the norm's elementwise pass into the amax and cast fusions, so that the
normalized tensor is never written, is XLA's choice per backend (``bench/layernorm_fusion.py``
lists what the compiled forward writes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core._gemm import dot_general
from te_adapters.core._layer import check_last_axis
from te_adapters.core._threshold import DEFAULT_SIZE_THRESHOLD

__all__ = ["LAYERNORM_TYPES", "layernorm", "layernorm_dense"]

LAYERNORM_TYPES = ("layernorm", "rmsnorm")


def check_norm_args(x, scale, bias, layernorm_type):
  """``layernorm``'s errors for bad arguments (an unknown type, wrong shapes or dtypes)."""
  _check(jnp.asarray(x), jnp.asarray(scale), None if bias is None else jnp.asarray(bias),
         layernorm_type)


def _check(x, scale, bias, layernorm_type):
  if layernorm_type not in LAYERNORM_TYPES:
    raise ValueError(
        f"layernorm_type must be one of {LAYERNORM_TYPES}, got {layernorm_type!r}"
    )
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
    raise ValueError("layernorm: layernorm_type='layernorm' needs a bias (beta) of shape "
                     f"({features},)")
  elif tuple(bias.shape) != (features,):
    raise ValueError(
        f"layernorm: bias must have shape ({features},) for x of shape {tuple(x.shape)}, got "
        f"{tuple(bias.shape)}"
    )


def layernorm(
    x,
    scale,
    bias=None,
    *,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
):
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


def _stats(x32, layernorm_type, epsilon):
  """Row mean (zeros for rmsnorm) and 1/sigma, float32, with a trailing axis of 1."""
  if layernorm_type == "layernorm":
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  else:
    mean = jnp.zeros(x32.shape[:-1] + (1,), jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return mean, jax.lax.rsqrt(var + epsilon)


def _gamma(scale, zero_centered_gamma):
  gamma = scale.astype(jnp.float32)
  return gamma + 1.0 if zero_centered_gamma else gamma


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon):
  y, _ = _norm_fwd(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon)
  return y


def normalized(x, mean, rsigma, scale, bias, zero_centered_gamma):
  """The norm's output in float32 from the row statistics (``bias``: empty for rmsnorm)."""
  y = (x.astype(jnp.float32) - mean) * rsigma * _gamma(scale, zero_centered_gamma)
  if bias.size:
    y = y + bias.astype(jnp.float32)
  return y


def _norm_fwd(x, scale, bias, layernorm_type, zero_centered_gamma, epsilon):
  mean, rsigma = _stats(x.astype(jnp.float32), layernorm_type, epsilon)
  y = normalized(x, mean, rsigma, scale, bias, zero_centered_gamma)
  protos = (np.zeros((0,), bias.dtype),)
  return y.astype(x.dtype), (x, mean, rsigma, scale, protos)


def _norm_bwd(layernorm_type, zero_centered_gamma, epsilon, residuals, dy):
  del epsilon
  x, mean, rsigma, scale, (bias_proto,) = residuals
  dy32 = dy.astype(jnp.float32)
  xhat = (x.astype(jnp.float32) - mean) * rsigma
  rows = tuple(range(x.ndim - 1))
  dgamma = jnp.sum(dy32 * xhat, axis=rows)
  g = dy32 * _gamma(scale, zero_centered_gamma)
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


_norm.defvjp(_norm_fwd, _norm_bwd)


def _dense_dims(x_ndim, kernel_ndim, axis, kernel_axes):
  """``dot_general`` dimension numbers of ``x`` (contracting ``axis``) with the kernel
  (contracting ``kernel_axes``), as TE's ``LayerNormDenseGeneral`` contracts them."""
  axis = tuple(a % x_ndim for a in axis)
  kernel_axes = tuple(a % kernel_ndim for a in kernel_axes)
  return ((axis, kernel_axes), ((), ()))


def layernorm_dense(
    x,
    scale,
    bias,
    kernel,
    *,
    layernorm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    axis=-1,
    kernel_axes=None,
    recipe,
    state=None,
    rng=None,
    threshold=DEFAULT_SIZE_THRESHOLD,
    config=None,
    return_layernorm_output: bool = False,
    dot_input_constraint=None,
):
  """The norm of ``x`` (``layernorm``), then its quantized GEMM with ``kernel``.

  The GEMM is ``core.dot_general`` itself (same recipes, state rule, size threshold and
  ``GemmConfig``): ``z = dot_general(layernorm(x), kernel, ((axis, kernel_axes), ((), ())))``.
  As TE's ``LayerNormDenseGeneral``, the norm runs over the last axis of ``x``, which is also
  the contracting axis (``axis`` must be -1), and the kernel contracts its leading axes.

  Under ``jit`` the norm's output feeds the GEMM's amax and FP8 cast in the same computation,
  and only its FP8 copy is kept for the backward pass; with ``return_layernorm_output=True`` it
  is also returned.

  Args:
    x: the input, ``(..., K)``.
    scale, bias: gamma and beta of the norm, ``(K,)`` each (``bias=None`` for rmsnorm).
    kernel: ``(K, *features)`` (or ``(*x.shape[axis], *features)``).
    layernorm_type, zero_centered_gamma, epsilon: as for ``layernorm``.
    axis: the contracting axis of ``x``: -1 (TE accepts no other).
    kernel_axes: the contracting axes of the kernel; default its leading ``len(axis)`` axes.
    recipe, state, rng, threshold, config: as for ``dot_general``.
    return_layernorm_output: also return the norm's output.
    dot_input_constraint: a function applied to the norm's output before the GEMM, for a
      sharding constraint (``lambda y: jax.lax.with_sharding_constraint(y, spec)``); the
      adapters pass TE's ``dot_input_axes`` this way.

  Returns:
    ``(z, ln_out)``: the GEMM's output ``(..., *features)`` in ``x``'s dtype (as TE's), and the
    norm's output (in ``x``'s dtype) or ``None``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> z, ln = ta.core.layernorm_dense(x, jnp.ones(32), jnp.zeros(32), w,
    ...                                 recipe=ta.Float8CurrentScaling())
    >>> z.shape, ln
    ((16, 16), None)
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  check_last_axis(axis, x.ndim, "layernorm_dense", "LayerNormDenseGeneral")
  if kernel_axes is None:
    kernel_axes = (0,)
  kernel_axes = tuple(kernel_axes) if isinstance(kernel_axes, (tuple, list)) else (kernel_axes,)
  if len(kernel_axes) != 1:
    raise ValueError(
        f"layernorm_dense: the kernel contracts one axis with x's last axis, got kernel_axes="
        f"{kernel_axes}"
    )
  if kernel.ndim < 1 or kernel.shape[kernel_axes[0]] != x.shape[-1]:
    raise ValueError(
        f"layernorm_dense: kernel of shape {tuple(kernel.shape)} does not contract x of shape "
        f"{tuple(x.shape)}: its axis {kernel_axes[0]} must have size {x.shape[-1]}"
    )
  y = layernorm(
      x, scale, bias, layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma,
      epsilon=epsilon,
  )
  if dot_input_constraint is not None:
    y = dot_input_constraint(y)
  dims = _dense_dims(x.ndim, kernel.ndim, (x.ndim - 1,), kernel_axes)
  z = dot_general(
      y, kernel, dims, preferred_element_type=x.dtype, recipe=recipe, state=state, rng=rng,
      threshold=threshold, config=config,
  )
  return z, (y if return_layernorm_output else None)
