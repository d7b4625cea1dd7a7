"""Linen, NNX and Haiku's LayerNormDenseGeneral agree: the same parameters and data through each
framework's ordinary training loop give the same outputs, gradients and recipe state."""

import inspect

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from te_adapters.linen import OVERWRITE_WITH_GRADIENT
from tests.core.test_norm import _data, _inputs, _reference
from tests.haiku import test_hk_norm as hk_norm
from tests.linen import test_linen_norm as linen_norm
from tests.nnx import test_nnx_norm as nnx_norm


@pytest.mark.parametrize(
  "recipe",
  [ta.DelayedScaling(amax_history_len=4), ta.Float8CurrentScaling()],
  ids=lambda r: type(r).__name__,
)
def test_layer_norm_dense_general_agrees_across_adapters(recipe, rel):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  params = {"scale": g, "ln_bias": b, "kernel": w}
  lr = 1e-3
  final, z_linen, g_linen, history = linen_norm._loop(recipe, x, dz, params, steps=3, lr=lr)
  state_linen = final.get(OVERWRITE_WITH_GRADIENT, {})
  layer = nnx_norm._model(recipe, params)
  z_nnx, g_nnx, _, _ = nnx_norm._loop(layer, x, dz, steps=3, lr=lr)
  state_nnx = {} if layer.dot_general is None else layer.dot_general.recipe_state()
  z_hk, g_hk, state_hk, _ = hk_norm._loop(recipe, x, dz, {hk_norm.NAME: params}, steps=3, lr=lr)
  # Normwise: the programs differ, and on a GPU XLA may fuse (and round) them differently.
  for z in (z_nnx, z_hk):
    assert rel(z, z_linen) < 1e-5
  # ... and right: the last step's output and kernel gradient against float64.
  p = history[-1]["params"]
  ref, (_, _, _, dw) = _reference(
    x, p["scale"], p["ln_bias"], None, "layernorm", False, 1e-6, kernel=p["kernel"], dz=dz
  )
  assert 0.005 < rel(z_linen, ref) < 0.05 and rel(g_linen["kernel"], dw) < 0.08
  for grads in (g_nnx, g_hk):
    assert sorted(grads) == sorted(g_linen) == ["kernel", "ln_bias", "scale"]
    for name in grads:
      assert rel(grads[name], g_linen[name]) < 1e-5, name
  assert sorted(state_nnx) == sorted(state_hk) == sorted(state_linen)
  for name in state_linen:
    np.testing.assert_allclose(state_nnx[name], state_linen[name], rtol=1e-6)
    np.testing.assert_allclose(state_hk[name], state_linen[name], rtol=1e-6)


def test_defaults_are_every_adapters():
  fields = ta_linen.LayerNormDenseGeneral.__dataclass_fields__
  assert fields["recipe"].default is core.DEFAULT_RECIPE
  assert fields["threshold"].default is core.DEFAULT_THRESHOLD
  assert fields["return_layernorm_output"].default is True  # TE's default
  for layer in (ta_nnx.LayerNormDenseGeneral, ta_hk.LayerNormDenseGeneral):
    params = inspect.signature(layer.__init__).parameters
    assert params["recipe"].default is core.DEFAULT_RECIPE
    assert params["threshold"].default is core.DEFAULT_THRESHOLD
    assert params["return_layernorm_output"].default is True


def test_training_helpers_carry_the_state():
  # Each adapter's value_and_grad helper, two steps: the same recipe state everywhere.
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, g, b, _ = _inputs()
  w = _data([(128, 256)], seed=1)[0]
  params = {"scale": g, "ln_bias": b, "kernel": w}

  def loss(z_ln):
    return jnp.mean(z_ln[0].astype(jnp.float32) ** 2)

  linen = ta_linen.LayerNormDenseGeneral(256, recipe=recipe, threshold=None)
  variables = {**linen.init(jax.random.key(0), x), "params": params}
  step = jax.jit(ta_linen.value_and_grad(lambda v, x: loss(linen.apply(v, x))))
  for _ in range(2):
    _, (_, state) = step(variables, x)
    variables = {**variables, OVERWRITE_WITH_GRADIENT: state}
  linen_state = variables[OVERWRITE_WITH_GRADIENT]

  layer = nnx_norm._model(recipe, params)
  for _ in range(2):
    _, (_, state_grads) = ta_nnx.value_and_grad(lambda m, x: loss(m(x)))(layer, x)
    ta_nnx.update_recipe_state(layer, state_grads)

  model = hk.transform_with_state(
    lambda x: ta_hk.LayerNormDenseGeneral(256, recipe=recipe, threshold=None)(x)
  )
  _, hk_state = model.init(jax.random.key(0), x)

  def hk_loss(params, state, x):
    out, state = model.apply(params, state, None, x)
    return loss(out), state

  hk_step = jax.jit(ta_hk.value_and_grad(hk_loss))
  for _ in range(2):
    _, (_, hk_state) = hk_step({hk_norm.NAME: params}, hk_state, x)

  assert float(linen_state["x_amax_history"][-2]) > 0  # two steps recorded
  for name in core.state_names(recipe):
    np.testing.assert_allclose(layer.dot_general.recipe_state()[name], linen_state[name], rtol=1e-6)
    np.testing.assert_allclose(hk_state[hk_norm.NAME][name], linen_state[name], rtol=1e-6)
