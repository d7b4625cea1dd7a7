"""Seed 000 section 4 through the Linen adapter: FlaxDenseBlock on a DP=2 x TP=2 mesh.

Column-parallel, as in the seed: kernel ``P(None, "tp")``, x ``P("dp", None, None)``, output
gradient ``P("dp", None, "tp")``, built with ``Mesh(create_device_mesh((2, 2)), ("dp", "tp"))``.
No ``MeshResource``: ``jax.set_mesh`` and the arrays' shardings are all there is. Runs under
``jax.jit`` and inside ``shard_map`` on virtual CPU devices (``tests/conftest.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import lax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from bench.seed_layer import FlaxDenseBlock
from te_adapters import inspect
from te_adapters import linen as ta_linen
from tests import spmd_checks

pytestmark = pytest.mark.skipif(
  jax.device_count() < 4,
  reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
)

OWG = ta_linen.OVERWRITE_WITH_GRADIENT
BATCH, SEQ, HIDDEN, FEATURES = 4, 16, 64, 64
STEPS = 3
RECIPES = [ta.DelayedScaling(amax_history_len=4), ta.Float8CurrentScaling()]


def _data():
  k = jax.random.split(jax.random.PRNGKey(0), 2)
  x = jax.random.normal(k[0], (BATCH, SEQ, HIDDEN)).astype(jnp.bfloat16)
  dy = jax.random.normal(k[1], (BATCH, SEQ, FEATURES)).astype(jnp.bfloat16)
  return x, dy


def _model(recipe, features=FEATURES):
  # Float32 sums of the partial products over a split K (dW over dp), so that on a GPU dW keeps
  # one device's bound (spmd_checks); the default bf16 sums: tests/core/test_sharding_gpu.py.
  config = ta.core.GemmConfig(partial_sums="float32")
  return FlaxDenseBlock(
    features=features,
    dot_general_cls=ta_linen.make_dot_general_cls(recipe, threshold=None, config=config),
  )


def _loss(model, variables, x, dy):
  y = model.apply(variables, x)
  return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y


def _train(step, variables, x, dy):
  """STEPS steps, recipe state replaced by its gradient; returns y, grads and the states."""
  states = []
  for _ in range(STEPS):
    y, (g_vars, g_x) = step(variables, x, dy)
    if OWG in g_vars:
      variables = {**variables, OWG: g_vars[OWG]}
      states.append(g_vars[OWG])
  return y, g_vars["params"], g_x, states


@functools.cache
def _reference(recipe):
  model = _model(recipe)
  x, dy = _data()
  variables = model.init(jax.random.PRNGKey(1), x)
  step = jax.jit(jax.value_and_grad(functools.partial(_loss, model), argnums=(0, 1), has_aux=True))
  step_fn = lambda v, x, dy: (lambda out: (out[0][1], out[1]))(step(v, x, dy))
  return variables, jax.tree_util.tree_map(np.asarray, _train(step_fn, variables, x, dy))


def _seed_mesh():
  devices = mesh_utils.create_device_mesh((2, 2), devices=jax.devices()[:4])
  return Mesh(devices, axis_names=("dp", "tp"))


def _compare(result, reference, rel):
  y, g_params, g_x, states = result
  ref_y, ref_params, ref_x, ref_states = reference
  # dx sums bf16 partial products over tp (to bf16 rounding); the rest as on one device: to
  # float32 reassociation on CPU, to the order of the FP8 sums on a GPU (spmd_checks).
  spmd_checks.assert_close_to_one_device(y, ref_y, "y", cpu_rel=1e-5)
  assert rel(g_x, ref_x) < 1e-2
  kernel = lambda g: g["Dense_0"]["kernel"]
  spmd_checks.assert_close_to_one_device(kernel(g_params), kernel(ref_params), "dW", cpu_rel=1e-5)
  assert len(states) == len(ref_states)
  for got, want in zip(states, ref_states, strict=True):  # bit-identical recipe state
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(got), want)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_seed_000_dp_tp_under_jit_matches_single_device(recipe, rel):
  variables, reference = _reference(recipe)
  mesh = _seed_mesh()
  x, dy = _data()
  kernel = variables["params"]["Dense_0"]["kernel"]
  sharded = {
    **variables,
    "params": {"Dense_0": {"kernel": jax.device_put(kernel, NamedSharding(mesh, P(None, "tp")))}},
  }
  if OWG in variables:
    sharded[OWG] = jax.device_put(variables[OWG], NamedSharding(mesh, P()))
  xs = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
  dys = jax.device_put(dy, NamedSharding(mesh, P("dp", None, "tp")))
  model = _model(recipe)
  grad_fn = jax.value_and_grad(functools.partial(_loss, model), argnums=(0, 1), has_aux=True)
  step = jax.jit(lambda v, x, dy: (lambda out: (out[0][1], out[1]))(grad_fn(v, x, dy)))
  with jax.set_mesh(mesh):
    compiled = step.lower(sharded, xs, dys).compile()
    result = _train(compiled, sharded, xs, dys)
  text = compiled.as_text()
  _compare(result, reference, rel)
  y = result[0]
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp")), 3)
  ops = {c.op for c in inspect.hlo_collectives(text)}
  assert ops == {"all-reduce"}, ops  # amaxes, dx over tp, dW over dp; no gather of activations


def test_seed_000_dp_tp_inside_shard_map_matches_single_device(rel):
  """The Linen layer applied per device: each holds FEATURES / 2 output columns."""
  recipe = RECIPES[0]
  variables, reference = _reference(recipe)
  mesh = _seed_mesh()
  x, dy = _data()
  local_model = _model(recipe, features=FEATURES // 2)

  def body(variables, x, dy):
    loss, y = _loss(local_model, variables, x, dy)
    return lax.psum(loss, ("dp", "tp")), y

  var_specs = {"params": {"Dense_0": {"kernel": P(None, "tp")}}, OWG: P()}
  mapped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(var_specs, P("dp"), P("dp", None, "tp")),
    out_specs=(P(), P("dp", None, "tp")),
  )
  grad_fn = jax.value_and_grad(mapped, argnums=(0, 1), has_aux=True)
  step = jax.jit(lambda v, x, dy: (lambda out: (out[0][1], out[1]))(grad_fn(v, x, dy)))
  _compare(_train(step, variables, x, dy), reference, rel)


# --------------------------------------------------------------------------- SPMD keywords


def test_dense_with_amax_axes_inside_shard_map_is_bit_identical_to_one_device():
  model = ta_linen.Dense(32, threshold=None, recipe=spmd_checks.RECIPE, amax_axes="dp")
  x, dy = spmd_checks.exact_data((32, 64), 0), spmd_checks.exact_data((32, 32), 1)
  variables = model.init(jax.random.PRNGKey(0), x)

  def loss(variables, x, dy):
    y = model.apply(variables, x)
    return jnp.sum(y * dy), y

  steps = spmd_checks.compare_with_one_device(
    loss, variables, lambda v, g: {**v, OWG: g[OWG]}, x, dy
  )
  _, grads = steps[-1]
  (state,) = grads[OWG].values()
  assert float(state["x_amax_history"][-1]) == 7.0  # the global amax


def test_dense_with_kernel_all_gather_gathers_fp8_bytes(rel):
  """FSDP: the kernel sharded over fsdp is quantized per shard and gathered as uint8."""
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  recipe = ta.Float8CurrentScaling()
  model = ta_linen.Dense(64, threshold=None, recipe=recipe, kernel_all_gather=P("fsdp", None))
  x, dy = spmd_checks.random((16, 64), 0), spmd_checks.random((16, 64), 1)

  def grads(model, variables, x, dy):
    return jax.grad(lambda v, x: jnp.sum(model.apply(v, x) * dy), argnums=(0, 1))(variables, x)

  one_device = ta_linen.Dense(64, threshold=None, recipe=recipe)  # the same parameters, no gather
  variables = one_device.init(jax.random.PRNGKey(0), x)
  ref = jax.jit(functools.partial(grads, one_device))(variables, x, dy)
  with jax.set_mesh(mesh):
    kernel = variables["params"]["kernel"]
    placed = {
      "params": {
        "kernel": jax.device_put(kernel, NamedSharding(mesh, P("fsdp", None))),
        "bias": jax.device_put(variables["params"]["bias"], NamedSharding(mesh, P())),
      }
    }
    args = (placed, jax.device_put(x, NamedSharding(mesh, P("fsdp"))), dy)
    compiled, gathers = spmd_checks.fsdp_gathers(functools.partial(grads, model), args)
    got = compiled(*args)
  assert gathers == [("u8", kernel.shape)]  # one FP8 gather of the whole kernel, nothing else
  g_kernel = got[0]["params"]["kernel"]
  assert g_kernel.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)
  spmd_checks.assert_close_to_one_device(g_kernel, ref[0]["params"]["kernel"], "dW", cpu_rel=1e-5)
  spmd_checks.assert_close_to_one_device(got[1], ref[1], "dx", cpu_rel=1e-6)


def _dense_general(x, **kw):
  model = ta_linen.DenseGeneral(16, threshold=None, recipe=ta.Float8CurrentScaling(), **kw)
  return model.init_with_output(jax.random.PRNGKey(0), x)[0]


def _dot_general_cls(x, **kw):
  cls = ta_linen.make_dot_general_cls(ta.Float8CurrentScaling(), **kw, threshold=None)
  return nn.Dense(16, dot_general=cls()).init_with_output(jax.random.PRNGKey(0), x)[0]


@pytest.mark.parametrize(
  "apply", [_dense_general, _dot_general_cls], ids=lambda f: f.__name__.strip("_")
)
def test_spmd_keywords_reach_the_core(apply):
  spmd_checks.assert_spmd_keywords_reach_the_core(apply)


class _FusedQkv(nn.Module):
  """Gemma's qkv projection in Linen: ``nn.DenseGeneral`` to (S, N, H) (``BTD,DSNH->BTSNH``),
  its kernel placed with the heads over "tp": not the first of the flattened free dims."""

  @nn.compact
  def __call__(self, x):
    return nn.DenseGeneral((3, 4, 16), use_bias=False)(x)


def test_fused_qkv_dense_general_with_heads_sharded_matches_one_device():
  """Converted by ``ta_linen.quantize``, on a 2-device Explicit mesh: outputs, gradients and the
  next state as on one device."""
  model, q = _FusedQkv(), ta_linen.quantize(spmd_checks.RECIPE, threshold=None)
  x = spmd_checks.exact_data((2, 8, 32), 0)
  dy = spmd_checks.exact_data((2, 8, 3, 4, 16), 1)
  variables = q(model.init)(jax.random.key(0), x)
  variables = jax.tree.map(lambda v: v, variables)
  params = variables["params"]["DenseGeneral_0"]
  params["kernel"] = spmd_checks.exact_data(params["kernel"].shape, 2)

  def step(variables):
    def loss(variables):
      y = q(model.apply)(variables, x)
      return jnp.sum(y * dy), y

    return jax.value_and_grad(loss, has_aux=True)(variables)

  want = jax.jit(step)(variables)
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    heads = P(None, None, "tp", None)
    sharded = jax.tree.map(
      lambda v: jax.device_put(v, NamedSharding(mesh, heads if v.ndim == 4 else P())), variables
    )
    got = jax.jit(step)(sharded)
  assert got[0][1].sharding.spec == P(None, None, None, "tp", None)
  spmd_checks.assert_trees_match_one_device(got, want)
