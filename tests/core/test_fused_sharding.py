"""The fused norm and MLP paths (``core.layernorm_mlp``, ``core.layernorm_dense``: one custom VJP
around the per-tensor FP8 GEMMs) under sharding, against one device: inside ``shard_map``
(data-parallel rows), under ``jit`` with the input's rows sharded, and with the adapters'
sharding constraints (TE's ``dot_1_input_axes`` / ``dot_2_input_axes``, tensor-parallel hidden
dim); and the norm cast's partitioning rule, with a pure-JAX stand-in for the CUDA kernel.

Before, each of these took the composed path (the norm written in the input's dtype, the
activation too, and cast again). On CPU the sharded programs equal one device's bit for bit
where no GEMM sums over a sharded dim (the data-parallel weight gradients are summed over the
devices in float32: within float32 reassociation); on a GPU the shards' FP8 GEMMs also sum in
another order (``tests/spmd_checks.py``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core
from te_adapters.core import kernels
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

B, S, K, F = 4, 16, 64, 128
RECIPES = {"current": ta.Float8CurrentScaling(), "delayed": ta.DelayedScaling(amax_history_len=4)}
ACTS = ("gelu", "linear")
# Float32 sums of a split K's partial products (the data-parallel weight gradients): one
# device's bound on a GPU (spmd_checks); the default bf16 sums: tests/core/test_sharding_gpu.py.
CONFIG = core.GemmConfig(partial_sums="float32")


def _mesh(name):
  return jax.make_mesh((2,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _params():
  def r(seed, *shape, scale=1.0):
    return spmd_checks.random(shape, seed) * scale

  return {
    "scale": 1.0 + r(1, K, scale=0.1),
    "ln_bias": r(2, K, scale=0.1),
    "wi_kernel": r(3, K, 2, F, scale=K**-0.5),
    "wo_kernel": r(4, F, K, scale=F**-0.5),
    "wi_bias": r(5, 2, F, scale=0.3),
    "wo_bias": r(6, K, scale=0.1),
    "kernel": r(7, K, F, scale=K**-0.5),
    "dense_bias": r(8, F, scale=0.1),
  }


def _data():
  x = spmd_checks.random((B, S, K), 10).astype(jnp.bfloat16)
  return x, spmd_checks.random((B, S, K), 11), spmd_checks.random((B, S, F), 12)


def _mlp(x, p, states, recipe, **kw):
  return core.layernorm_mlp(
    x,
    p["scale"],
    p["ln_bias"],
    p["wi_kernel"],
    p["wo_kernel"],
    p["wi_bias"],
    p["wo_bias"],
    activations=ACTS,
    recipe=recipe,
    states=states,
    threshold=None,
    config=CONFIG,
    **kw,
  )[0]


def _dense(x, p, state, recipe, **kw):
  return core.layernorm_dense(
    x,
    p["scale"],
    p["ln_bias"],
    p["kernel"],
    recipe=recipe,
    state=state,
    threshold=None,
    config=CONFIG,
    dense_bias=p["dense_bias"],
    **kw,
  )[0]


def _states(recipe, n):
  return tuple(core.init_state(recipe) for _ in range(n)) if recipe.stateful else (None,) * n


def _loss(block, recipe, kw, x, p, states, dy):
  out = block(x, p, states if block is _mlp else states[0], recipe, **kw)
  return jnp.sum(out.astype(jnp.float32) * dy), out


def _fused(fn, *args):
  """Whether ``fn`` runs its block as the fused path: one run of the quantized GEMM rule, the
  norm inside it (no separate norm of the input)."""
  text = str(jax.make_jaxpr(fn)(*args))
  norm_outside = "name=_norm " in text or "name=_norm\n" in text
  return text.count("name=_quantized_gemms") == 1 and not norm_outside


def _steps(step, x, p, states, dy):
  """Two steps (x scaled per ``spmd_checks.FACTORS``), the recipe state replaced by its
  gradient: per step the output and the gradients."""
  out = []
  for factor in spmd_checks.FACTORS:
    (_, y), grads = step(x * factor, p, states, dy)
    states = grads[2]
    out.append((y, grads))
  return out


def _grad(loss):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("block", ["mlp", "dense"])
@pytest.mark.parametrize("name", RECIPES)
def test_fused_path_inside_shard_map_matches_one_device(name, block):
  """Data parallel inside ``shard_map``: each device normalizes and casts its rows; the amaxes,
  the weight gradients and the norm's and biases' gradients are summed over the devices."""
  recipe, fn = RECIPES[name], {"mlp": _mlp, "dense": _dense}[block]
  x, dy_mlp, dy_dense = _data()
  dy = dy_mlp if block == "mlp" else dy_dense
  p, states = _params(), _states(recipe, 2 if block == "mlp" else 1)
  loss = functools.partial(_loss, fn, recipe, {})

  def body(x, p, states, dy):
    value, y = loss(x, p, states, dy)
    return jax.lax.psum(value, "dp"), y

  sharded = jax.shard_map(
    body, mesh=_mesh("dp"), in_specs=(P("dp"), P(), P(), P("dp")), out_specs=(P(), P("dp"))
  )
  assert _fused(sharded, x, p, states, dy)
  want = _steps(_grad(loss), x, p, states, dy)
  got = _steps(_grad(sharded), x, p, states, dy)
  # The weight, gamma, beta and bias gradients are each device's rows' sums added: float32
  # reassociation (the composed path's gradients are the same sums).
  _assert_within_reassociation(got, want)
  if recipe.stateful:
    assert float(np.max(np.asarray(want[-1][1][2][0]["x_amax_history"]))) > 0


@pytest.mark.parametrize("name", RECIPES)
def test_fused_mlp_with_constraints_under_jit_matches_one_device(name):
  """TE's ``dot_1_input_axes`` / ``dot_2_input_axes`` as constraints on a (data, model) layout:
  rows over "dp", GEMM 1 column-parallel and GEMM 2 row-parallel (the kernels over "tp"); the
  fused path runs, constrained, and gives one device's results."""
  recipe = RECIPES[name]
  x, dy, _ = _data()
  p, states = _params(), _states(recipe, 2)
  mesh = jax.make_mesh(
    (1, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:2]
  )
  rows = NamedSharding(mesh, P("dp", None, None))
  hidden = NamedSharding(mesh, P("dp", None, "tp"))
  kw = dict(
    dot_1_input_constraint=lambda y: jax.lax.with_sharding_constraint(y, rows),
    dot_2_input_constraint=lambda z: jax.lax.with_sharding_constraint(z, hidden),
  )
  loss = functools.partial(_loss, _mlp, recipe, kw)
  with jax.set_mesh(mesh):
    assert _fused(loss, x, p, states, dy)
    placed = {
      **p,
      "wi_kernel": jax.device_put(p["wi_kernel"], NamedSharding(mesh, P(None, None, "tp"))),
      "wo_kernel": jax.device_put(p["wo_kernel"], NamedSharding(mesh, P("tp", None))),
    }
    step = _grad(loss)
    text = step.lower(x, placed, states, dy).compile().as_text()
    got = _steps(step, x, placed, states, dy)
  want = _steps(_grad(functools.partial(_loss, _mlp, recipe, {})), x, p, states, dy)
  # GEMM 2 sums over the sharded hidden dim: its output is the two halves' partial sums added.
  _assert_within_reassociation(got, want)
  assert "all-reduce" in [c.op for c in ta.inspect.hlo_collectives(text)]


def _assert_within_reassociation(got, want):
  """Recipe state within 2 float32 ulps (the norm's float32 output, whose amax the state
  records, is computed by XLA's fusion of each program, shard or whole, and came out one ulp
  apart once); the rest within float32 reassociation on CPU (one device's GPU bound on a GPU):
  normwise 1e-6 for float32 arrays, 1e-3 for bfloat16 ones, where a float32 difference in the
  last bit tips the rounding of an element now and then (one bf16 ulp is 2**-8 of it; a missing
  sum over the devices would be off by a factor of 2)."""
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    name = jax.tree_util.keystr(path)
    if spmd_checks.is_recipe_state(path):
      np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=2)
    else:
      rel = 1e-6 if a.dtype == jnp.float32 else 1e-3
      spmd_checks.assert_close_to_one_device(a, b, name, cpu_rel=rel)


@pytest.mark.parametrize("name", RECIPES)
def test_fused_dense_with_its_input_constraint_under_jit_matches_one_device(name):
  recipe = RECIPES[name]
  x, _, dy = _data()
  p, states = _params(), _states(recipe, 1)
  mesh = _mesh("dp")
  rows = NamedSharding(mesh, P("dp", None, None))
  kw = dict(dot_input_constraint=lambda y: jax.lax.with_sharding_constraint(y, rows))
  loss = functools.partial(_loss, _dense, recipe, kw)
  with jax.set_mesh(mesh):
    assert _fused(loss, x, p, states, dy)
    got = _steps(_grad(loss), jax.device_put(x, rows), p, states, jax.device_put(dy, rows))
  want = _steps(_grad(functools.partial(_loss, _dense, recipe, {})), x, p, states, dy)
  _assert_within_reassociation(got, want)


def _norm_cast_stand_in(x, mean, rsigma, gamma, beta, scale):
  """The CUDA norm cast's contract in pure JAX (``(q, q_t, amax)``, amax of this shard)."""
  y = (x.astype(jnp.float32) - mean[:, None]) * rsigma[:, None] * gamma
  if beta.size:
    y = y + beta
  q = jnp.clip(y * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
  return q, q.T, jnp.max(jnp.abs(y)).reshape(1)


@pytest.mark.parametrize("has_beta", [True, False], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize(
  "spec", [P("a", None), P(None, "a"), P("a", "b")], ids=["rows", "cols", "both"]
)
def test_norm_cast_rule_casts_each_shard_like_one_device(spec, has_beta):
  """The rule runs the kernel per shard under ``jit`` (rows, columns or both sharded) and
  inside ``shard_map``: the FP8 copies as one device's, the amax the whole tensor's."""
  m, k = 32, 64
  x = spmd_checks.random((m, k), 0).astype(jnp.bfloat16) * 3
  mean, rsigma = jnp.mean(x.astype(jnp.float32), -1), jnp.full((m,), 0.5)
  gamma, scale = spmd_checks.random((k,), 1), jnp.full((1,), 2.0)
  beta = spmd_checks.random((k,), 2) if has_beta else jnp.zeros((0,))
  args = (x, mean, rsigma, gamma, beta, scale)
  want = _norm_cast_stand_in(*args)
  rule = kernels.norm_cast(_norm_cast_stand_in, has_beta, True)
  if spec == P("a", "b"):
    if jax.device_count() < 4:
      pytest.skip("needs 4 devices")
    mesh = jax.make_mesh(
      (2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
  else:
    mesh = _mesh("a")
  rows, cols = spec
  x_sharded = jax.device_put(x, NamedSharding(mesh, spec))
  got = jax.jit(rule)(x_sharded, mean, rsigma, gamma, beta, scale)
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
  assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(cols, rows)), 2)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(
      np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    )
  # Inside shard_map each device casts its shard and keeps its own amax (the format reduces it
  # over amax_axes, as for the other casts).
  beta_spec = P(cols) if has_beta else P()
  mapped = jax.shard_map(
    rule,
    mesh=mesh,
    in_specs=(spec, P(rows), P(rows), P(cols), beta_spec, P()),
    out_specs=(spec, P(cols, rows), P(tuple(mesh.axis_names))),
  )
  q, q_t, amaxes = jax.jit(mapped)(*args)
  for a, b in zip((q, q_t), want, strict=False):
    np.testing.assert_array_equal(
      np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    )
  assert amaxes.shape == (mesh.size,)
  np.testing.assert_array_equal(np.max(np.asarray(amaxes)), np.asarray(want[2])[0])


@pytest.mark.skipif(
  not kernels.hopper_target_available(kernels.NORM_CAST_TARGET),
  reason="the CUDA norm cast runs on Hopper GPUs with the extension built",
)
def test_cuda_norm_cast_runs_in_a_jitted_program_on_a_multi_gpu_host():
  """On a host with several GPUs every traced value used to count as possibly sharded, so even
  a one-device program lost the CUDA norm cast; with its rule it runs, sharded or not."""
  recipe = RECIPES["current"]
  x, _, dy = _data()
  p, states = _params(), _states(recipe, 1)
  loss = functools.partial(_loss, _dense, recipe, {})
  text = _grad(loss).lower(x, p, states, dy).compile().as_text()
  assert kernels.NORM_CAST_TARGET in text
  mesh = _mesh("dp")
  rows = NamedSharding(mesh, P("dp", None, None))
  with jax.set_mesh(mesh):
    text = _grad(loss).lower(jax.device_put(x, rows), p, states, dy).compile().as_text()
  assert kernels.NORM_CAST_TARGET in text
