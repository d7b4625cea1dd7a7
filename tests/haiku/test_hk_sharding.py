"""SPMD keywords through the Haiku adapter: ``amax_axes`` and ``kernel_all_gather`` reach the
core."""

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import te_adapters as ta
from te_adapters import haiku as ta_hk
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")


def test_linear_with_amax_axes_inside_shard_map_is_bit_identical_to_one_device():
  model = hk.transform_with_state(
    lambda x: ta_hk.Linear(32, threshold=None, recipe=spmd_checks.RECIPE, amax_axes="dp")(x)
  )
  x, dy = spmd_checks.exact_data((32, 64), 0), spmd_checks.exact_data((32, 32), 1)
  params, state = model.init(jax.random.key(0), x)

  def loss(variables, x, dy):
    params, state = variables
    y, _ = model.apply(params, state, None, x)
    return jnp.sum(y * dy), y

  # The gradient with respect to the recipe state is the new state.
  steps = spmd_checks.compare_with_one_device(
    loss, (params, state), lambda v, g: (v[0], g[1]), x, dy
  )
  _, (_, new_state) = steps[-1]
  assert float(new_state["linear"]["x_amax_history"][-1]) == 7.0  # the global amax


def _linear(x, **kw):
  return hk.transform(lambda x: ta_hk.Linear(16, threshold=None, **kw)(x)).init(
    jax.random.key(0), x
  )


def _quantize(x, **kw):
  forward = ta_hk.quantize(ta.Float8CurrentScaling(), threshold=None, **kw)(
    lambda x: hk.Linear(16)(x)
  )
  return hk.transform(forward).init(jax.random.key(0), x)


@pytest.mark.parametrize("apply", [_linear, _quantize], ids=lambda f: f.__name__.strip("_"))
def test_spmd_keywords_reach_the_core(apply):
  spmd_checks.assert_spmd_keywords_reach_the_core(apply)
