"""Stochastic rounding through the NNX adapter: an RNG stream per layer, as ``nnx.Dropout``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx

NVFP4 = ta.NVFP4BlockScaling()  # stochastic rounding of the gradient is on by default
STEPS = 3


def _batch():
  k = jax.random.split(jax.random.key(0), 2)
  return jax.random.normal(k[0], (32, 32)), jax.random.normal(k[1], (32, 32))


@nnx.jit
def _jit_kernel_grad(model, x, target, key):
  call_kw = {} if key is None else {"rngs": key}
  loss = lambda m: jnp.mean((m(x, **call_kw) - target) ** 2)
  return nnx.grad(loss)(model).kernel[...]


def _kernel_grad(model, x, target, rngs=None):
  return np.asarray(_jit_kernel_grad(model, x, target, rngs))


def test_linear_draws_a_fresh_key_per_call_from_its_stream():
  x, target = _batch()
  layer = ta_nnx.Linear(32, 32, threshold=None, recipe=NVFP4, rngs=nnx.Rngs(0))
  # The stream is forked after the parameters are drawn: they are nnx.Linear's.
  np.testing.assert_array_equal(
    np.asarray(layer.kernel[...]), np.asarray(nnx.Linear(32, 32, rngs=nnx.Rngs(0)).kernel[...])
  )
  optimizer = nnx.Optimizer(layer, optax.sgd(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(layer, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
    optimizer.update(layer, grads)
    return loss

  losses = [float(step(layer, optimizer)) for _ in range(STEPS)]
  assert np.all(np.isfinite(losses)), losses
  assert int(layer.dot_general.rngs.count[...]) == STEPS  # one key per call
  # Each call advances the stream: the same batch rounds differently at the next call ...
  fresh = lambda: ta_nnx.Linear(32, 32, threshold=None, recipe=NVFP4, rngs=nnx.Rngs(0))
  a, b = fresh(), fresh()
  g_a1, g_a2 = _kernel_grad(a, x, target), _kernel_grad(a, x, target)
  g_b1 = _kernel_grad(b, x, target)
  assert not np.array_equal(g_a1, g_a2)
  np.testing.assert_array_equal(g_a1, g_b1)  # ... and the same seed gives the same keys.
  # A key given at the call overrides the stream (and does not advance it).
  count = int(a.dot_general.rngs.count[...])
  k1 = _kernel_grad(a, x, target, rngs=jax.random.key(5))
  np.testing.assert_array_equal(k1, _kernel_grad(a, x, target, rngs=jax.random.key(5)))
  assert not np.array_equal(k1, _kernel_grad(a, x, target, rngs=jax.random.key(6)))
  assert int(a.dot_general.rngs.count[...]) == count


def test_missing_stream_is_an_error_naming_it():
  x, target = _batch()
  layer = ta_nnx.Linear(
    32, 32, threshold=None, recipe=NVFP4, rngs=nnx.Rngs(params=0)
  )  # no sr_rng, no default
  message = (
    "NVFP4BlockScaling rounds the gradient stochastically and needs a key per call from the "
    "'sr_rng' stream: build the layer with rngs=nnx.Rngs(sr_rng=...) (a 'default' stream "
    "works too), or call it with rngs=...; or use disable_stochastic_rounding=True"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    _kernel_grad(layer, x, target)
  assert np.all(np.isfinite(_kernel_grad(layer, x, target, rngs=jax.random.key(1))))


def test_recipe_without_stochastic_rounding_keeps_no_stream():
  x, target = _batch()
  recipe = ta.NVFP4BlockScaling(disable_stochastic_rounding=True)
  rngs, plain = nnx.Rngs(0), nnx.Rngs(0)
  layer = ta_nnx.Einsum("bd,dk->bk", (32, 32), rngs=rngs, threshold=None, recipe=recipe)
  nnx.Einsum("bd,dk->bk", (32, 32), rngs=plain)
  assert layer.einsum_op.rngs is None
  assert int(rngs.default.count[...]) == int(plain.default.count[...])  # no key taken
  assert np.all(np.isfinite(_kernel_grad(layer, x, target)))


def test_quantize_model_gives_each_layer_a_stream():
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return nnx.Linear(32, 32, rngs=rngs)

  model = nnx.Dict(stack=make(nnx.Rngs(0)), head=nnx.Linear(32, 32, rngs=nnx.Rngs(1)))
  message = (
    "quantize_model: NVFP4BlockScaling rounds the gradient stochastically, so every converted "
    "layer needs a key stream: pass rngs=nnx.Rngs(sr_rng=seed) (an Rngs with a 'sr_rng' or "
    "'default' stream), or use disable_stochastic_rounding=True"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    ta_nnx.quantize_model(model, NVFP4, threshold=None)
  report = ta_nnx.quantize_model(model, NVFP4, rngs=nnx.Rngs(sr_rng=3), threshold=None)
  assert report.quantized == ["head", "stack"]
  # Stacked layers get stacked streams, one key per layer, for nnx.scan.
  assert model["stack"].dot_general.rngs.key.shape == (2,)
  x, target = _batch()

  def loss(model):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return jnp.tanh(layer(h))

    return jnp.mean((model["head"](body(model["stack"], x)) - target) ** 2)

  @nnx.jit
  def grads(model):
    g = nnx.grad(loss)(model)
    return g["stack"].kernel[...], g["head"].kernel[...]

  first, second = grads(model), grads(model)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in first)
  # Every layer's stream advanced (stacked counts too), so the next step rounds differently.
  np.testing.assert_array_equal(np.asarray(model["stack"].dot_general.rngs.count[...]), [2, 2])
  assert int(model["head"].dot_general.rngs.count[...]) == 2
  for a, b in zip(first, second, strict=True):
    assert not np.array_equal(np.asarray(a), np.asarray(b))
