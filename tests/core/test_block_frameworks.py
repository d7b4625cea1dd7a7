"""Block-scaled recipes drop into Flax Linen, Flax NNX and Haiku through ``core.dot_general``.

The recipes are stateless, so a framework only has to pass the recipe and, for NVFP4's
stochastic rounding, a fresh PRNG key per call from its own RNG machinery: Linen's
``make_rng``, an ``nnx.Rngs`` stream, Haiku's ``next_rng_key``. One recipe per framework keeps
the compile time down; the recipes are interchangeable in all three.
"""

import functools

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_adapters as ta

DN = (((1,), (0,)), ((), ()))
STEPS = 4


def _batch():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((128, 128)).astype(np.float32)
  target = np.tanh(x @ (rng.standard_normal((128, 128)) / np.sqrt(128))).astype(np.float32)
  return x, target


def _decreasing(losses):
  losses = np.asarray(losses)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_linen_dense_takes_a_block_recipe_unchanged():
  recipe = ta.MXFP8BlockScaling()
  dot_general = functools.partial(ta.core.dot_general, threshold=None, recipe=recipe)
  model = nn.Sequential([nn.Dense(128, dot_general=dot_general), nn.tanh, nn.Dense(128)])
  x, target = _batch()
  params = model.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - target) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state)
    losses.append(loss)
  _decreasing(losses)


class _NNXLinear(nnx.Module):
  """What an NNX layer does for NVFP4: draw the rounding key from an ``nnx.Rngs`` stream."""

  def __init__(self, din, dout, recipe, rngs: nnx.Rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
    self.recipe = recipe
    self.rngs = rngs

  def __call__(self, x):
    rng = self.rngs.sr_rng() if self.recipe.uses_rng else None
    return ta.core.dot_general(x, self.kernel[...], DN, threshold=None, recipe=self.recipe, rng=rng)


def test_nnx_layer_with_nvfp4_stochastic_rounding():
  recipe = ta.NVFP4BlockScaling()
  rngs = nnx.Rngs(params=0, sr_rng=1)
  model = nnx.Sequential(
    _NNXLinear(128, 128, recipe, rngs), nnx.tanh, nnx.Linear(128, 128, rngs=rngs)
  )
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _batch()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [step(model, optimizer) for _ in range(STEPS)]
  _decreasing(losses)
  # Each step drew a new key from the stream (4 steps, 1 key each).
  assert int(rngs.sr_rng.count[...]) == STEPS


def test_haiku_function_with_a_block_recipe():
  recipe = ta.Float8BlockScaling()

  def forward(x):
    w = hk.get_parameter("w", (128, 128), init=hk.initializers.VarianceScaling())
    rng = hk.next_rng_key() if recipe.uses_rng else None
    h = jnp.tanh(ta.core.dot_general(x, w, DN, threshold=None, recipe=recipe, rng=rng))
    return hk.Linear(128)(h)

  model = hk.transform(forward)
  x, target = _batch()
  params = model.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, key):
    loss_fn = lambda p: jnp.mean((model.apply(p, key, x) - target) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(STEPS):
    params, opt_state, loss = step(params, opt_state, jax.random.key(i))
    losses.append(loss)
  _decreasing(losses)
