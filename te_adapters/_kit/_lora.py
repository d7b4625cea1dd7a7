"""TE's low-rank adaptation term added to a quantized layer's output, the same in every adapter."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from te_adapters import core

__all__ = ["add_lora"]


def add_lora(
  y,
  inputs,
  lora_a,
  lora_b,
  *,
  state,
  kernel_shape,
  axis=-1,
  threshold=core.DEFAULT_THRESHOLD,
  alpha: float | None = None,
  promote: Callable | None = None,
  layer: str | None = None,
  framework: str | None = None,
):
  """``y`` plus ``core.low_rank_adaptation(inputs, lora_a, lora_b)``, in ``y``'s dtype.

  The factors first pass ``core.watch_lora_state`` with the base GEMM's recipe ``state``,
  ``kernel_shape``, ``axis`` and ``threshold`` (a loop that trains the factors alone is told
  when that state would stay frozen, naming ``layer`` with ``framework``'s remedy), then
  ``promote(inputs, lora_a, lora_b)`` when given (the Flax layers' dtype promotion).

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters._kit import add_lora
    >>> x, y = jnp.ones((2, 32)), jnp.zeros((2, 16))
    >>> a, b = jnp.ones((32, 4)), jnp.ones((4, 16))
    >>> float(add_lora(y, x, a, b, state=None, kernel_shape=(32, 16), alpha=8.0)[0, 0])
    256.0
  """
  lora_a, lora_b = core.watch_lora_state(
    lora_a,
    lora_b,
    state,
    x_shape=jnp.shape(inputs),
    kernel_shape=tuple(kernel_shape),
    axis=axis,
    threshold=threshold,
    layer=layer,
    framework=framework,
  )
  if promote is not None:
    inputs, lora_a, lora_b = promote(inputs, lora_a, lora_b)
  lora = core.low_rank_adaptation(inputs, lora_a, lora_b, axis=axis, alpha=alpha)
  return y + lora.astype(y.dtype)
