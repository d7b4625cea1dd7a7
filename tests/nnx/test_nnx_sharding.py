"""SPMD keywords through the NNX adapter: ``amax_axes`` and ``kernel_all_gather`` reach the core."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import nnx as ta_nnx
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")


def test_linear_with_amax_axes_inside_shard_map_is_bit_identical_to_one_device():
  layer = ta_nnx.Linear(64, 32, recipe=spmd_checks.RECIPE, amax_axes="dp", rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  x, dy = spmd_checks.exact_data((32, 64), 0), spmd_checks.exact_data((32, 32), 1)

  def loss(state, x, dy):
    y = nnx.merge(graphdef, state)(x)
    return jnp.sum(y * dy), y

  def new_state(state, grads):  # the recipe state is replaced by its gradient
    params, _ = nnx.split_state(state, nnx.Param, ta_nnx.RecipeState)
    _, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    return nnx.merge_state(params, recipe_state)

  steps = spmd_checks.compare_with_one_device(loss, state, new_state, x, dy)
  _, grads = steps[-1]
  assert float(grads["dot_general"]["x_amax_history"][...][-1]) == 7.0  # the global amax


def _linear_general(x, **kw):
  return ta_nnx.LinearGeneral(32, 16, rngs=nnx.Rngs(0), **kw)(x)


def _einsum(x, **kw):
  return ta_nnx.Einsum("bd,dk->bk", (32, 16), rngs=nnx.Rngs(0), **kw)(x)


def _quantized_model(x, **kw):
  model = nnx.Sequential(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
  ta_nnx.quantize_model(model, ta.Float8CurrentScaling(), **kw)
  return model(x)


def _ops(x, **kw):
  layer = nnx.Linear(32, 16, dot_general=ta_nnx.DotGeneral(ta.Float8CurrentScaling(), **kw),
                     rngs=nnx.Rngs(0))
  return layer(x)


@pytest.mark.parametrize("apply", [_linear_general, _einsum, _quantized_model, _ops],
                         ids=lambda f: f.__name__.strip("_"))
def test_spmd_keywords_reach_the_core(apply):
  spmd_checks.assert_spmd_keywords_reach_the_core(apply)


def test_spmd_keywords_are_static_and_hashable():
  """amax_axes by role (a dict, lists inside) is frozen, so nnx.jit can key its cache on it."""
  layer = ta_nnx.Linear(32, 16, amax_axes={"x": ["dp"], "grad": "dp"}, rngs=nnx.Rngs(0))
  assert isinstance(hash(nnx.graphdef(layer)), int)
  assert layer.dot_general.amax_axes == {"x": ("dp",), "grad": "dp"}
  x = spmd_checks.exact_data((16, 32), 0)
  mapped = jax.shard_map(nnx.jit(lambda layer, x: layer(x)), mesh=spmd_checks.dp_mesh(),
                         in_specs=(P(), P("dp")), out_specs=P("dp"))
  assert mapped(layer, x).shape == (16, 16)
