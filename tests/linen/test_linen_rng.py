"""Stochastic rounding through the Linen adapter: keys from the ``sr_rng`` stream, as in TE."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import te_adapters as ta
from te_adapters import linen as ta_linen

NVFP4 = ta.NVFP4BlockScaling()  # stochastic rounding of the gradient is on by default
STEPS = 3


def _batch():
  k = jax.random.split(jax.random.key(0), 2)
  return jax.random.normal(k[0], (32, 32)), jax.random.normal(k[1], (32, 32))


class _Block(nn.Module):
  recipe: ta.Recipe

  @nn.compact
  def __call__(self, h, _=None):
    h = jnp.tanh(ta_linen.Dense(32, threshold=None, recipe=self.recipe)(h))
    return h, None


class _Model(nn.Module):
  recipe: ta.Recipe

  @nn.compact
  def __call__(self, x):
    # Two layers under nn.scan and nn.remat; sr_rng is split per layer like params.
    stack = nn.scan(
      nn.remat(_Block),
      variable_axes={"params": 0},
      split_rngs={"params": True, "sr_rng": True},
      length=2,
    )
    h, _ = stack(self.recipe)(x, None)
    cls = ta_linen.make_dot_general_cls(self.recipe, threshold=None)
    return nn.Dense(32, dot_general=cls())(h)


def _loss(model, params, x, target, **apply_kw):
  return jnp.mean((model.apply(params, x, **apply_kw) - target) ** 2)


def test_nvfp4_draws_its_keys_from_sr_rng():
  model = _Model(NVFP4)
  x, target = _batch()
  params = model.init(jax.random.key(1), x)
  tx = optax.sgd(1e-2)

  @jax.jit
  def step(params, opt_state, key):
    loss, grads = jax.value_and_grad(lambda p: _loss(model, p, x, target, rngs={"sr_rng": key}))(
      params
    )
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  opt_state = tx.init(params)
  losses = []
  for i in range(STEPS):
    params, opt_state, loss, _ = step(params, opt_state, jax.random.key(10 + i))
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)), losses
  grads = [step(params, opt_state, jax.random.key(k))[3] for k in (1, 1, 2)]
  # The kernels' gradients (the biases' do not go through a quantized GEMM).
  leaves = [
    [v for path, v in jax.tree_util.tree_leaves_with_path(g) if "kernel" in str(path)]
    for g in grads
  ]
  for a, b in zip(leaves[0], leaves[1], strict=True):  # same key, same rounding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Another key rounds the gradient differently (every layer: scanned and plain).
  assert len(leaves[0]) == 2
  assert all(not np.array_equal(a, b) for a, b in zip(leaves[0], leaves[2], strict=True))


def test_missing_sr_rng_is_an_error_naming_the_stream():
  model = ta_linen.Dense(32, threshold=None, recipe=NVFP4)
  x, _ = _batch()
  params = model.init(jax.random.key(1), x)  # init falls back to the params stream, as in Flax
  message = (
    "NVFP4BlockScaling rounds the gradient stochastically and draws a key per call from the "
    "Linen RNG stream 'sr_rng': pass rngs={'sr_rng': key} to apply (a fresh key per step), or "
    "use disable_stochastic_rounding=True"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    jax.grad(lambda p: jnp.sum(model.apply(p, x)))(params)


def test_recipe_without_stochastic_rounding_draws_no_key():
  model = ta_linen.Dense(
    32, threshold=None, recipe=ta.NVFP4BlockScaling(disable_stochastic_rounding=True)
  )
  x, _ = _batch()
  params = model.init(jax.random.key(1), x)
  grad = jax.jit(jax.grad(lambda p, **kw: jnp.sum(model.apply(p, x, **kw) ** 2)))
  # No rngs needed, and a given stream is not drawn from: the result does not depend on it.
  g = grad(params)
  assert np.all(np.isfinite(np.asarray(g["params"]["kernel"])))
  np.testing.assert_array_equal(
    np.asarray(grad(params, rngs={"sr_rng": jax.random.key(3)})["params"]["kernel"]),
    np.asarray(g["params"]["kernel"]),
  )
