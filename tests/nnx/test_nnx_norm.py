"""NNX LayerNorm, LayerNormDenseGeneral and Softmax: TE's names and shapes, numerics against
float64, recipe state through NNX's ordinary training loop, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import nnx as ta_nnx
from tests.core.test_norm import _data, _inputs, _reference

DELAYED = ta.DelayedScaling(amax_history_len=4)
# Current scaling runs through every adapter in tests/test_norm_adapters_agree.py.
RECIPES = [DELAYED, ta.Float8BlockScaling()]
DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
def test_layer_norm(layernorm_type, zero_centered_gamma):
  # The output and the gradients of x, gamma and beta (nnx.grad) against float64.
  x, g, b, dy = _inputs()
  norm = ta_nnx.LayerNorm(
    128,
    layernorm_type=layernorm_type,
    epsilon=1e-5,
    zero_centered_gamma=zero_centered_gamma,
    rngs=nnx.Rngs(0),
  )
  params = nnx.state(norm, nnx.Param)
  assert sorted(nnx.to_pure_dict(params)) == (
    ["ln_bias", "scale"] if layernorm_type == "layernorm" else ["scale"]
  )
  norm.scale.set_value(g)
  if norm.ln_bias is not None:
    norm.ln_bias.set_value(b)
  ref, (dx, dg, db) = _reference(
    x,
    g,
    b if norm.ln_bias is not None else jnp.zeros_like(b),
    dy,
    layernorm_type,
    zero_centered_gamma,
    1e-5,
  )
  np.testing.assert_allclose(norm(x), ref, rtol=1e-5, atol=1e-5)
  grads, gx = nnx.grad(lambda m, x: jnp.sum(m(x) * dy), argnums=(0, 1))(norm, x)
  np.testing.assert_allclose(gx, dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(grads["scale"][...], dg, rtol=1e-4, atol=1e-4)
  if norm.ln_bias is not None:
    np.testing.assert_allclose(grads["ln_bias"][...], db, rtol=1e-4, atol=1e-4)


def _model(recipe, params=None, **kwargs):
  layer = ta_nnx.LayerNormDenseGeneral(
    128,
    256,
    recipe=recipe,
    threshold=None,
    return_layernorm_output=False,
    rngs=nnx.Rngs(0),
    **kwargs,
  )
  for name, value in (params or {}).items():
    getattr(layer, name).set_value(value)
  return layer


def _loop(layer, x, dz, steps, lr=0.0):
  """NNX's ordinary loop: nnx.value_and_grad over Param + RecipeState, an Optimizer on the
  params, nnx.update with the state's gradient."""
  optimizer = nnx.Optimizer(layer, optax.sgd(lr), wrt=nnx.Param)

  def loss(layer):
    z, ln_out = layer(x)
    assert ln_out is None
    return jnp.sum(z.astype(jnp.float32) * dz), z

  @nnx.jit
  def step(layer, optimizer):
    (_, z), grads = nnx.value_and_grad(loss, argnums=DIFF, has_aux=True)(layer)
    params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    optimizer.update(layer, params)
    nnx.update(layer, recipe_state)
    return z, params

  history = []
  for _ in range(steps):
    history.append((layer.scale.get_value(), layer.ln_bias.get_value()))
    z, grads = step(layer, optimizer)
  return z, nnx.to_pure_dict(grads), history, optimizer


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_layer_norm_dense_general_against_float64(recipe, rel):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  layer = _model(recipe, {"scale": g, "ln_bias": b, "kernel": w})
  z, grads, _, _ = _loop(layer, x, dz, steps=3)
  ref, (_, dg, db, dw) = _reference(x, g, b, None, "layernorm", False, 1e-6, kernel=w, dz=dz)
  errs = {
    "z": rel(z, ref),
    "dgamma": rel(grads["scale"], dg),
    "dbeta": rel(grads["ln_bias"], db),
    "dkernel": rel(grads["kernel"], dw),
  }
  assert errs["z"] < 0.05 and max(errs.values()) < 0.08, errs
  assert errs["z"] > 0.005 and errs["dkernel"] > 0.005, errs


def test_delayed_state_follows_training():
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  layer = _model(DELAYED, {"scale": g, "ln_bias": b, "kernel": w})
  _, _, history, optimizer = _loop(layer, x, dz, steps=3, lr=1e-3)
  amaxes = [float(jnp.max(jnp.abs(core.layernorm(x, s, bb)))) for s, bb in history]
  assert len(set(amaxes)) == 3
  state = layer.dot_general.recipe_state()
  np.testing.assert_allclose(state["x_amax_history"], [0.0, *amaxes], rtol=1e-6)
  np.testing.assert_allclose(state["x_scale"], [448.0 / max(amaxes)], rtol=1e-6)
  assert np.all(np.asarray(state["grad_amax_history"][1:]) > 0)
  assert not jax.tree.leaves(nnx.state(optimizer, ta_nnx.RecipeState))  # never optimized


def test_te_shapes_return_and_bias():
  layer = ta_nnx.LayerNormDenseGeneral(32, (2, 16), use_bias=True, threshold=None, rngs=nnx.Rngs(0))
  shapes = jax.tree_util.tree_map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  assert shapes == {"scale": (32,), "ln_bias": (32,), "kernel": (32, 2, 16), "bias": (2, 16)}
  x = jnp.ones((4, 32), jnp.bfloat16)
  z, ln_out = layer(x)
  assert z.shape == (4, 2, 16) and z.dtype == jnp.bfloat16
  np.testing.assert_array_equal(ln_out, core.layernorm(x, layer.scale[...], layer.ln_bias[...]))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"axis": 0}, "axis must be -1"),
    ({"layernorm_type": "groupnorm"}, "layernorm_type must be one of"),
    ({"features": 24}, "multiples of 16"),
  ],
)
def test_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ta_nnx.LayerNormDenseGeneral(**({"in_features": 32, "features": 32} | kwargs), rngs=nnx.Rngs(0))


def test_softmax():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8, 8))
  sm = ta_nnx.Softmax(scale_factor=0.25, softmax_fusion_type="scaled_upper_triang_masked")
  np.testing.assert_array_equal(
    sm(x), core.softmax(x, scale_factor=0.25, softmax_fusion_type="scaled_upper_triang_masked")
  )
  # A padding mask (1 = masked out, TE's convention) and a bias, with the masked kind.
  mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, (2, 1, 8, 8)), jnp.uint8)
  mask = mask.at[..., 0].set(0)  # every row keeps a position
  bias = jax.random.normal(jax.random.key(1), (1, 3, 8, 8))
  masked = ta_nnx.Softmax(scale_factor=0.5, softmax_fusion_type="scaled_masked")
  want = core.softmax(x, mask, bias, scale_factor=0.5, softmax_fusion_type="scaled_masked")
  np.testing.assert_array_equal(masked(x, mask, bias), want)
  masked_out = np.broadcast_to(np.asarray(mask), want.shape) == 1
  np.testing.assert_array_equal(np.asarray(want)[masked_out], 0)
