"""Haiku LayerNorm, LayerNormDenseGeneral and Softmax: TE's names and shapes, numerics against
float64, recipe state through Haiku's ordinary training loop, and bad input."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from tests.core.test_norm import _data, _inputs, _reference

DELAYED = ta.DelayedScaling(amax_history_len=4)
# Current scaling runs through every adapter in tests/test_norm_adapters_agree.py.
RECIPES = [DELAYED, ta.Float8BlockScaling()]
NAME = "layer_norm_dense_general"


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
def test_layer_norm(layernorm_type, zero_centered_gamma):
  # The output and the gradients of x, gamma and beta (jax.grad) against float64.
  x, g, b, dy = _inputs()
  f = hk.transform(
    lambda x: ta_hk.LayerNorm(
      layernorm_type=layernorm_type, epsilon=1e-5, zero_centered_gamma=zero_centered_gamma
    )(x)
  )
  params = f.init(jax.random.key(0), x)
  names = ["ln_bias", "scale"] if layernorm_type == "layernorm" else ["scale"]
  assert sorted(params["layer_norm"]) == names
  params = {"layer_norm": {"scale": g} | ({"ln_bias": b} if "ln_bias" in names else {})}
  ref, (dx, dg, db) = _reference(
    x,
    g,
    b if "ln_bias" in names else jnp.zeros_like(b),
    dy,
    layernorm_type,
    zero_centered_gamma,
    1e-5,
  )
  np.testing.assert_allclose(f.apply(params, None, x), ref, rtol=1e-5, atol=1e-5)
  grads, gx = jax.grad(lambda p, x: jnp.sum(f.apply(p, None, x) * dy), argnums=(0, 1))(params, x)
  np.testing.assert_allclose(gx, dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(grads["layer_norm"]["scale"], dg, rtol=1e-4, atol=1e-4)
  if "ln_bias" in names:
    np.testing.assert_allclose(grads["layer_norm"]["ln_bias"], db, rtol=1e-4, atol=1e-4)


def _model(recipe, **kwargs):
  def forward(x):
    z, ln_out = ta_hk.LayerNormDenseGeneral(
      256, recipe=recipe, threshold=None, return_layernorm_output=False, **kwargs
    )(x)
    assert ln_out is None
    return z

  return hk.transform_with_state(forward)


def _loop(recipe, x, dz, params, steps, lr=0.0):
  """Haiku's ordinary loop: jax.grad over params and state; the state's gradient is the new
  state, the params take an SGD step."""
  model = _model(recipe)
  _, state = model.init(jax.random.key(0), x)

  def loss(params, state):
    z, _ = model.apply(params, state, None, x)
    return jnp.sum(z.astype(jnp.float32) * dz), z

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  history = []
  for _ in range(steps):
    history.append(params)
    (_, z), (g_params, state) = step(params, state)
    params = jax.tree.map(lambda p, g: p - lr * g, params, g_params)
  return z, g_params[NAME], state.get(NAME, {}), history


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_layer_norm_dense_general_against_float64(recipe, rel):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  params = {NAME: {"scale": g, "ln_bias": b, "kernel": w}}
  z, grads, _, _ = _loop(recipe, x, dz, params, steps=3)
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
  params = {NAME: {"scale": g, "ln_bias": b, "kernel": w}}
  _, _, state, history = _loop(DELAYED, x, dz, params, steps=3, lr=1e-3)
  amaxes = [
    float(jnp.max(jnp.abs(core.layernorm(x, p[NAME]["scale"], p[NAME]["ln_bias"]))))
    for p in history
  ]
  assert len(set(amaxes)) == 3
  np.testing.assert_allclose(state["x_amax_history"], [0.0, *amaxes], rtol=1e-6)
  np.testing.assert_allclose(state["x_scale"], [448.0 / max(amaxes)], rtol=1e-6)
  assert np.all(np.asarray(state["grad_amax_history"][1:]) > 0)


def test_te_shapes_return_and_bias():
  def forward(x):
    return ta_hk.LayerNormDenseGeneral((2, 16), use_bias=True, threshold=None)(x)

  f = hk.transform_with_state(forward)
  x = jnp.ones((4, 32), jnp.bfloat16)
  params, state = f.init(jax.random.key(0), x)
  shapes = jax.tree_util.tree_map(jnp.shape, params[NAME])
  assert shapes == {"scale": (32,), "ln_bias": (32,), "kernel": (32, 2, 16), "bias": (2, 16)}
  assert state == {}  # current scaling: stateless
  (z, ln_out), _ = f.apply(params, state, None, x)
  assert z.shape == (4, 2, 16) and z.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    ln_out, core.layernorm(x, params[NAME]["scale"], params[NAME]["ln_bias"])
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"axis": 0}, "axis must be -1"),
    ({"layernorm_type": "groupnorm"}, "layernorm_type must be one of"),
    ({"features": 24}, "multiples of 16"),
  ],
)
def test_bad_input(kwargs, match):
  f = hk.transform_with_state(
    lambda x: ta_hk.LayerNormDenseGeneral(**({"features": 32} | kwargs))(x)
  )
  with pytest.raises(ValueError, match=match):
    f.init(jax.random.key(0), jnp.ones((4, 32)))


def test_softmax():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8, 8))
  f = hk.transform(
    lambda x: ta_hk.Softmax(scale_factor=0.25, softmax_fusion_type="scaled_upper_triang_masked")(x)
  )
  np.testing.assert_array_equal(
    f.apply({}, None, x),
    core.softmax(x, scale_factor=0.25, softmax_fusion_type="scaled_upper_triang_masked"),
  )
  # A padding mask (1 = masked out, TE's convention) and a bias, with the masked kind.
  mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, (2, 1, 8, 8)), jnp.uint8)
  mask = mask.at[..., 0].set(0)  # every row keeps a position
  bias = jax.random.normal(jax.random.key(1), (1, 3, 8, 8))
  g = hk.transform(
    lambda x, m, b: ta_hk.Softmax(scale_factor=0.5, softmax_fusion_type="scaled_masked")(x, m, b)
  )
  want = core.softmax(x, mask, bias, scale_factor=0.5, softmax_fusion_type="scaled_masked")
  np.testing.assert_array_equal(g.apply({}, None, x, mask, bias), want)
  masked_out = np.broadcast_to(np.asarray(mask), want.shape) == 1
  np.testing.assert_array_equal(np.asarray(want)[masked_out], 0)
