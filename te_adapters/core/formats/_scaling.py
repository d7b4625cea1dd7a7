"""Per-tensor scale arithmetic shared by every tensor-scaled recipe (TE's numerics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

__all__ = [
  "fp8_max",
  "tensor_amax",
  "leading_amax",
  "compute_scale",
  "delayed_update",
  "scale_inverse",
]


def fp8_max(dtype: DTypeLike) -> float:
  """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).

  Args:
    dtype: a floating-point dtype (FP8, FP4 or wider).

  Returns:
    Its largest finite value, as a Python float.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> ta.core.fp8_max(jnp.float8_e4m3fn), ta.core.fp8_max(jnp.float8_e5m2)
    (448.0, 57344.0)
  """
  return float(jnp.finfo(dtype).max)


def _magnitudes(x: jnp.ndarray) -> jnp.ndarray:
  # XLA:CPU's vectorised max drops NaNs in large arrays, so NaN is mapped to inf first (one
  # fused reduction): a tensor with a NaN or inf gets an infinite amax, and the scale rule keeps
  # the old scale.
  return jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))


def tensor_amax(x: jnp.ndarray) -> jnp.ndarray:
  """``max(|x|)`` over the whole tensor as float32 of shape (1,); inf if any element is NaN."""
  return jnp.max(_magnitudes(x)).astype(jnp.float32).reshape(1)


def leading_amax(x: jnp.ndarray) -> jnp.ndarray:
  """``tensor_amax`` of each ``x[b]`` (one per index of the leading dim), float32 of shape (B,): the
  grouped GEMM's kernels, one amax per expert."""
  axes = tuple(range(1, x.ndim))
  return jnp.max(_magnitudes(x), axis=axes, initial=0.0).astype(jnp.float32)


def compute_scale(
  amax_value: jnp.ndarray, max_value: float, old_scale: ArrayLike, margin: float = 0.0
) -> jnp.ndarray:
  """``max_value / amax / 2**margin``, or ``old_scale`` where amax is <= 0 or not finite.

  TE's scale rule: the scale maps the amax onto the format's largest value, with ``margin``
  powers of two of headroom.

  Args:
    amax_value: the amax (float32, any shape).
    max_value: the largest value of the target dtype (``fp8_max``).
    old_scale: the scale to keep where the amax is zero, negative or not finite.
    margin: powers of two of headroom (default 0).

  Returns:
    float32 scales of ``amax_value``'s shape.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> amax = jnp.array([2.0, 0.0, jnp.inf])
    >>> ta.core.compute_scale(amax, 448.0, old_scale=3.0, margin=1).tolist()
    [112.0, 3.0, 3.0]
  """
  amax_value = jnp.asarray(amax_value, jnp.float32)
  new = (jnp.float32(max_value) / amax_value) / jnp.float32(2.0**margin)
  ok = (amax_value > 0) & jnp.isfinite(amax_value)
  return jnp.where(ok, new, jnp.asarray(old_scale, jnp.float32)).astype(jnp.float32)


def delayed_update(
  amax_value: jnp.ndarray,
  scale: jnp.ndarray,
  amax_history: jnp.ndarray,
  max_value: float,
  margin: float,
  algo: str,
) -> tuple[jax.Array, jax.Array]:
  """One delayed-scaling step of TE for one tensor role.

  The current ``amax_value`` goes into slot 0 of the history; the scale for the next step comes
  from the window's max (``"max"``) or from slot 0 (``"most_recent"``); then the history rolls by
  one (slot 0 moves to the end) and slot 0 is cleared.

  Args:
    amax_value: this step's amax, float32 (1,).
    scale: the current scale, float32 (1,): kept where the window's amax is zero or not finite.
    amax_history: the history, float32 (L,).
    max_value: the largest value of the target dtype (``fp8_max``).
    margin: powers of two of headroom.
    algo: ``"max"`` or ``"most_recent"`` (``DelayedScaling.amax_compute_algo``).

  Returns:
    ``(new_scale, new_history)``, float32 of shapes (1,) and (L,).

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> history = jnp.array([0.0, 8.0, 1.0])
    >>> scale, history = ta.core.delayed_update(
    ...     jnp.array([2.0]), jnp.ones(1), history, 448.0, 0.0, "max")
    >>> scale.tolist(), history.tolist()  # the window [2, 8, 1]'s max is 8; then it rolls
    ([56.0], [0.0, 1.0, 2.0])
  """
  new_scale, new_history, _ = delayed_update_and_flag(
    amax_value, scale, amax_history, max_value, margin, algo
  )
  return new_scale, new_history


def delayed_update_and_flag(amax_value, scale, amax_history, max_value, margin, algo):
  """``delayed_update`` plus a bool (1,): whether the scale was updated (not kept)."""
  history = amax_history.at[0].set(amax_value[0])
  window_amax = (jnp.max(history) if algo == "max" else history[0]).reshape(1)
  updated = (window_amax > 0) & jnp.isfinite(window_amax)
  new_scale = compute_scale(window_amax, max_value, scale, margin)
  new_history = jnp.roll(history, -1).at[0].set(0.0)
  return new_scale, new_history, updated


def scale_inverse(scale: jnp.ndarray) -> jnp.ndarray:
  return (1.0 / scale.astype(jnp.float32)).astype(jnp.float32)


def float_dtype_of(x) -> np.dtype:
  return np.dtype(x.dtype)
