"""SPMD keywords through the NNX adapter: ``amax_axes`` and ``kernel_all_gather`` reach the core."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import nnx as ta_nnx
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")


def test_linear_with_amax_axes_inside_shard_map_is_bit_identical_to_one_device():
  layer = ta_nnx.Linear(
    64, 32, threshold=None, recipe=spmd_checks.RECIPE, amax_axes="dp", rngs=nnx.Rngs(0)
  )
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
  assert float(grads["dot_general"]["state"]["x_amax_history"][...][-1]) == 7.0  # the global amax


def _linear_general(x, **kw):
  return ta_nnx.LinearGeneral(32, 16, threshold=None, rngs=nnx.Rngs(0), **kw)(x)


def _einsum(x, **kw):
  return ta_nnx.Einsum("bd,dk->bk", (32, 16), threshold=None, rngs=nnx.Rngs(0), **kw)(x)


def _quantized_model(x, **kw):
  model = nnx.Sequential(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
  ta_nnx.quantize_model(model, ta.Float8CurrentScaling(), threshold=None, **kw)
  return model(x)


def _ops(x, **kw):
  layer = nnx.Linear(
    32,
    16,
    dot_general=ta_nnx.DotGeneral(ta.Float8CurrentScaling(), threshold=None, **kw),
    rngs=nnx.Rngs(0),
  )
  return layer(x)


@pytest.mark.parametrize(
  "apply", [_linear_general, _einsum, _quantized_model, _ops], ids=lambda f: f.__name__.strip("_")
)
def test_spmd_keywords_reach_the_core(apply):
  spmd_checks.assert_spmd_keywords_reach_the_core(apply)


def test_spmd_keywords_are_static_and_hashable():
  """amax_axes by role (a dict, lists inside) is frozen, so nnx.jit can key its cache on it."""
  layer = ta_nnx.Linear(32, 16, amax_axes={"x": ["dp"], "grad": "dp"}, rngs=nnx.Rngs(0))
  assert isinstance(hash(nnx.graphdef(layer)), int)
  assert layer.dot_general.amax_axes == {"x": ("dp",), "grad": "dp"}
  x = spmd_checks.exact_data((16, 32), 0)
  mapped = jax.shard_map(
    nnx.jit(lambda layer, x: layer(x)),
    mesh=spmd_checks.dp_mesh(),
    in_specs=(P(), P("dp")),
    out_specs=P("dp"),
  )
  assert mapped(layer, x).shape == (16, 16)


def test_row_parallel_linear_with_out_sharding_on_an_explicit_mesh():
  # The contracting dim is sharded over "tp": with Explicit axes the GEMM needs out_sharding,
  # which the layer passes to the core. Output, gradients and new state against one device.
  recipe = ta.DelayedScaling(amax_history_len=4)
  layer = ta_nnx.Linear(64, 32, threshold=None, recipe=recipe, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  x, dy = spmd_checks.exact_data((32, 64), 0), spmd_checks.exact_data((32, 32), 1)

  def step(state, x, dy, out_sharding=None):
    def loss(state):
      y = nnx.merge(graphdef, state)(x, out_sharding=out_sharding)
      return jnp.sum(y * dy), y

    return jax.value_and_grad(loss, has_aux=True)(state)

  (_, ref_y), ref_grads = jax.jit(step)(state, x, dy)
  mesh = jax.make_mesh(
    (2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
  )
  with jax.set_mesh(mesh):
    # The (64, 32) kernel is the only 2-D leaf: rows over "tp"; bias and recipe state replicated.
    sharded = jax.tree.map(
      lambda v: jax.device_put(v, NamedSharding(mesh, P("tp", None) if v.ndim == 2 else P())),
      state,
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    dys = jax.device_put(dy, NamedSharding(mesh, P("dp", None)))
    (_, y), grads = jax.jit(step, static_argnums=3)(sharded, xs, dys, P("dp", None))
  assert y.sharding.spec == P("dp", None)

  # The row-parallel sum adds the two K halves across devices: float32 reassociation only on
  # CPU; on a GPU each half's FP8 GEMM also sums in another order (spmd_checks). The recipe
  # state (amaxes, scales) is exact everywhere.
  def close(got, want, name):
    if spmd_checks.ON_GPU:
      spmd_checks.assert_close_to_one_device(got, want, name)
    else:
      np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=name
      )

  close(y, ref_y, "y")
  for path, want in jax.tree_util.tree_leaves_with_path(ref_grads):
    got = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
    if spmd_checks.is_recipe_state(path):
      np.testing.assert_array_equal(
        np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path)
      )
    else:
      close(got, want, jax.tree_util.keystr(path))
