"""Stochastic rounding through the Haiku adapter: keys from ``hk.next_rng_key()``."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_adapters as ta
from te_adapters import haiku as ta_hk

NVFP4 = ta.NVFP4BlockScaling()  # stochastic rounding of the gradient is on by default
STEPS = 3


def _batch():
  k = jax.random.split(jax.random.key(0), 2)
  return jax.random.normal(k[0], (32, 32)), jax.random.normal(k[1], (32, 32))


def _forward(recipe):
  def forward(x):
    h = jnp.tanh(ta_hk.Linear(32, threshold=None, recipe=recipe)(x))
    with ta_hk.quantize(recipe, threshold=None):  # an unedited hk.Linear, quantized by interception
      return hk.Linear(32)(h)

  return forward


def test_nvfp4_draws_its_keys_with_next_rng_key():
  model = hk.transform(_forward(NVFP4))
  x, target = _batch()
  params = model.init(jax.random.key(1), x)
  tx = optax.sgd(1e-2)

  @jax.jit
  def step(params, opt_state, key):
    loss_fn = lambda p: jnp.mean((model.apply(p, key, x) - target) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  opt_state = tx.init(params)
  losses = []
  for i in range(STEPS):
    params, opt_state, loss, _ = step(params, opt_state, jax.random.key(10 + i))
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)), losses
  grads = [step(params, opt_state, jax.random.key(k))[3] for k in (1, 1, 2)]
  kernels = [[np.asarray(g[name]["w"]) for name in ("linear", "linear_1")] for g in grads]
  for a, b in zip(kernels[0], kernels[1], strict=True):  # same key, same rounding
    np.testing.assert_array_equal(a, b)
  # Another key rounds both layers' gradients differently.
  assert all(not np.array_equal(a, b) for a, b in zip(kernels[0], kernels[2], strict=True))


def test_apply_without_rng_is_a_clear_error():
  model = hk.transform(_forward(NVFP4))
  x, _ = _batch()
  params = model.init(jax.random.key(1), x)
  message = (
    "linear: NVFP4BlockScaling rounds the gradient stochastically and draws a key per call "
    "with hk.next_rng_key(), but apply was given rng=None: pass a PRNG key to apply (a fresh "
    "one per step), or use disable_stochastic_rounding=True"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    jax.grad(lambda p: jnp.sum(model.apply(p, None, x)))(params)


def test_recipe_without_stochastic_rounding_needs_no_rng():
  model = hk.without_apply_rng(
    hk.transform(_forward(ta.NVFP4BlockScaling(disable_stochastic_rounding=True)))
  )
  x, _ = _batch()
  params = model.init(jax.random.key(1), x)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2)))(params)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
