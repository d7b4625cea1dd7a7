"""The PRNG key a recipe's stochastic rounding takes: checked once, at the API's edge."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_rng"]


def check_rng(recipe, rng):
  """Validates ``rng`` for ``recipe``; returns it as a typed PRNG key (or None)."""
  name = type(recipe).__name__
  if rng is None:
    return None
  if not getattr(recipe, "uses_rng", False):
    raise ValueError(
      f"rng was given but {name} does not use one (only NVFP4BlockScaling with stochastic "
      "rounding does); pass rng=None"
    )
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if rng.shape != ():
      raise ValueError(f"rng must be a single PRNG key, got a key array of shape {rng.shape}")
    return rng
  rng = jnp.asarray(rng)
  if rng.dtype != np.uint32 or rng.shape != (2,):
    raise TypeError(
      "rng must be a PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), got an "
      f"array of dtype {rng.dtype} and shape {rng.shape}"
    )
  return jax.random.wrap_key_data(rng)
