"""Linen, NNX and Haiku's LayerNormDenseGeneral agree: the same parameters and data through each
framework's ordinary training loop give the same outputs, gradients and recipe state."""

import numpy as np
import pytest

import te_adapters as ta
from te_adapters.linen import OVERWRITE_WITH_GRADIENT
from tests.core.test_norm import _data, _inputs
from tests.haiku import test_hk_norm as hk_norm
from tests.linen import test_linen_norm as linen_norm
from tests.nnx import test_nnx_norm as nnx_norm


@pytest.mark.parametrize("recipe", [ta.DelayedScaling(amax_history_len=4),
                                    ta.Float8CurrentScaling()], ids=lambda r: type(r).__name__)
def test_layer_norm_dense_general_agrees_across_adapters(recipe):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  params = {"scale": g, "ln_bias": b, "kernel": w}
  lr = 1e-3
  final, z_linen, g_linen, _ = linen_norm._loop(recipe, x, dz, params, steps=3, lr=lr)
  state_linen = final.get(OVERWRITE_WITH_GRADIENT, {})
  layer = nnx_norm._model(recipe, params)
  z_nnx, g_nnx, _, _ = nnx_norm._loop(layer, x, dz, steps=3, lr=lr)
  state_nnx = {} if layer.dot_general is None else layer.dot_general.recipe_state()
  z_hk, g_hk, state_hk, _ = hk_norm._loop(recipe, x, dz, {hk_norm.NAME: params}, steps=3, lr=lr)
  for z in (z_nnx, z_hk):
    np.testing.assert_allclose(z, z_linen, rtol=1e-6, atol=1e-6)
  for grads in (g_nnx, g_hk):
    assert sorted(grads) == sorted(g_linen) == ["kernel", "ln_bias", "scale"]
    for name in grads:
      np.testing.assert_allclose(grads[name], g_linen[name], rtol=1e-5, atol=1e-6)
  assert sorted(state_nnx) == sorted(state_hk) == sorted(state_linen)
  for name in state_linen:
    np.testing.assert_array_equal(state_nnx[name], state_linen[name])
    np.testing.assert_array_equal(state_hk[name], state_linen[name])
