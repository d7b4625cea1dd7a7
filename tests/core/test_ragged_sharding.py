"""Expert parallelism: ``core.ragged_dot`` with the experts sharded over a mesh axis.

Runs on 4 of the 8 virtual CPU devices that ``tests/conftest.py`` asks for. Two ways a user
shards experts: under ``jax.jit`` with the kernels and their recipe state placed with a
``NamedSharding`` over the expert axis (Auto axes: XLA partitions the rest; Explicit axes: each
result gets its sharding from the operands), and inside ``shard_map`` (each device its own
experts and the tokens routed to them). Both must give what one device gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
import te_adapters.nnx as ta_nnx
from te_adapters import core
from tests import spmd_checks
from tests.conftest import FP8_GEMM_RTOL

pytestmark = pytest.mark.skipif(
  jax.device_count() < 4,
  reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
)

EP = 4  # devices on the expert axis
G, M, K, N = 8, 256, 64, 96
RECIPES = {
  "bf16": None,
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=4),
}
# Uneven groups, one empty, rows 240..255 past the groups.
GROUP_SIZES = np.array([40, 0, 24, 56, 16, 48, 32, 24], np.int32)


def _data(seed=0):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)
  dy = jax.random.normal(kd, (M, N), jnp.float32).astype(jnp.bfloat16)
  return x, w, dy


def _step(recipe):
  def loss(x, w, state, group_sizes, dy):
    y = core.ragged_dot(
      x, w, group_sizes, preferred_element_type=jnp.bfloat16, recipe=recipe, state=state
    )
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  def step(x, w, state, group_sizes, dy):
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, group_sizes, dy
    )
    return y, grads

  return step


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((EP,), ("ep",), devices=jax.devices()[:EP], axis_types=(axis_type,))


def _state(recipe):
  return core.init_ragged_state(recipe, G) if recipe is not None else None


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("rows_sharded", [False, True], ids=["tokens-replicated", "tokens-sharded"])
@pytest.mark.parametrize("name", RECIPES)
def test_experts_sharded_under_jit_equal_one_device(name, rows_sharded, axis_type):
  if name == "bf16" and axis_type == AxisType.Explicit:
    pytest.skip("recipe=None is jax.lax.ragged_dot, which needs out_sharding there (tested below)")
  recipe = RECIPES[name]
  x, w, dy = _data()
  step = jax.jit(_step(recipe))
  state = _state(recipe)
  gs = jnp.asarray(GROUP_SIZES)
  y1, (dx1, dw1, st1) = step(x, w, state, gs, dy)
  mesh = _mesh(axis_type)
  experts = NamedSharding(mesh, P("ep"))
  tokens = NamedSharding(mesh, P("ep") if rows_sharded else P())
  put = lambda a, s: jax.device_put(a, s)  # noqa: E731
  args = (
    put(x, tokens),
    put(w, experts),
    jax.tree.map(lambda a: put(a, experts), state),
    put(gs, NamedSharding(mesh, P())),
    put(dy, tokens),
  )
  with jax.set_mesh(mesh):
    y2, (dx2, dw2, st2) = step(*args)
  if recipe is not None:  # each device keeps its experts' gradient (bf16: XLA's own choice)
    assert dw2.sharding.spec[0] == "ep"
  if axis_type == AxisType.Explicit:  # the output's rows and dx as lhs, dw as rhs
    assert (
      tuple(y2.sharding.spec)[:1]
      == tuple(dx2.sharding.spec)[:1]
      == (("ep",) if rows_sharded else (None,))
    )
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y1, np.float32))
  np.testing.assert_array_equal(np.asarray(dx2, np.float32), np.asarray(dx1, np.float32))
  if rows_sharded:
    # Each expert's weight gradient sums over rows held by several devices: the partial sums
    # are added in another order, so float32 rounding differs.
    # (bf16: XLA sums the partial products in bfloat16.)
    tol = 1e-2 if recipe is None else 1e-5
    np.testing.assert_allclose(dw2, dw1, rtol=tol, atol=tol * float(jnp.max(jnp.abs(dw1))))
  else:
    np.testing.assert_array_equal(dw2, dw1)
  for a, b in zip(jax.tree.leaves(st2), jax.tree.leaves(st1), strict=True):
    np.testing.assert_array_equal(a, b)
  if name == "delayed":  # the next state is real: every non-empty expert saw an amax
    hist = np.asarray(st2["x_amax_history"])
    assert (hist[GROUP_SIZES > 0].max(axis=1) > 0).all() and (hist[GROUP_SIZES == 0] == 0).all()


@pytest.mark.parametrize("name", RECIPES)
def test_shard_map_each_device_its_experts_and_tokens(name):
  recipe = RECIPES[name]
  x, w, dy = _data(1)
  g_local, m_local = G // EP, M // EP
  # Per device: its two experts' sizes (sums 40, 56, 48, 40, at most its 64 rows).
  gs = jnp.asarray([40, 0, 24, 32, 16, 32, 16, 24], jnp.int32)
  state = _state(recipe)
  local = _step(recipe)
  mesh = _mesh()
  spec = P("ep")
  state_spec = jax.tree.map(lambda _: spec, state)
  sharded = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(spec, spec, state_spec, spec, spec),
      out_specs=(spec, (spec, spec, state_spec)),
    )
  )
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  y2, (dx2, dw2, st2) = sharded(put(x), put(w), jax.tree.map(put, state), put(gs), put(dy))
  one = jax.jit(local)
  for d in range(EP):
    rows, groups = slice(d * m_local, (d + 1) * m_local), slice(d * g_local, (d + 1) * g_local)
    st = jax.tree.map(lambda a, groups=groups: a[groups], state)
    y1, (dx1, dw1, st1) = one(x[rows], w[groups], st, gs[groups], dy[rows])
    np.testing.assert_array_equal(np.asarray(y2[rows], np.float32), np.asarray(y1, np.float32))
    np.testing.assert_array_equal(np.asarray(dx2[rows], np.float32), np.asarray(dx1, np.float32))
    np.testing.assert_array_equal(dw2[groups], dw1)
    for a, b in zip(jax.tree.leaves(st2), jax.tree.leaves(st1), strict=True):
      np.testing.assert_array_equal(a[groups], b)


def test_sharded_experts_against_float64():
  # The sharded FP8 result is the grouped GEMM, not just self-consistent.
  recipe = RECIPES["current"]
  x, w, dy = _data(2)
  mesh = _mesh()
  experts = NamedSharding(mesh, P("ep"))
  with jax.set_mesh(mesh):
    y, (dx, dw, _) = jax.jit(_step(recipe))(
      x, jax.device_put(w, experts), None, jnp.asarray(GROUP_SIZES), dy
    )
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  ends = np.cumsum(GROUP_SIZES)
  y_ref, dx_ref, dw_ref = np.zeros((M, N)), np.zeros((M, K)), np.zeros((G, K, N))
  for g, (s, e) in enumerate(zip(ends - GROUP_SIZES, ends, strict=True)):
    y_ref[s:e], dx_ref[s:e] = x64[s:e] @ w64[g], dy64[s:e] @ w64[g].T
    dw_ref[g] = x64[s:e].T @ dy64[s:e]
  for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    got = np.asarray(got, np.float64)
    # FP8 E4M3/E5M2 quantization: a few percent normwise; a wrong expert or scale is O(1).
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.08
  assert not np.asarray(y[ends[-1] :]).any()  # rows past the groups stay zero


@pytest.mark.parametrize("name", ["current", "delayed", "mxfp8"])
def test_explicit_axes_take_the_callers_out_sharding(name):
  recipe = RECIPES.get(name) or ta.MXFP8BlockScaling()
  x, w, _ = _data()
  gs = jnp.asarray(GROUP_SIZES)
  state = _state(recipe) if name != "mxfp8" else None
  want = core.ragged_dot(x, w, gs, recipe=recipe, state=state)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("ep")))
    ws = jax.device_put(w, NamedSharding(mesh, P("ep")))
    f = jax.jit(
      lambda x, w: core.ragged_dot(x, w, gs, out_sharding=P(), recipe=recipe, state=state)
    )
    y = f(xs, ws)
  assert tuple(y.sharding.spec) in ((), (None, None))  # replicated, as asked
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_high_precision_takes_out_sharding_on_explicit_axes():
  # recipe=None is jax.lax.ragged_dot, out_sharding included.
  x, w, _ = _data()
  mesh = _mesh(AxisType.Explicit)
  gs = jnp.asarray(GROUP_SIZES)
  with jax.set_mesh(mesh):
    w_sharded = jax.device_put(w, NamedSharding(mesh, P("ep")))
    f = jax.jit(lambda x, w: core.ragged_dot(x, w, gs, out_sharding=P(), recipe=None))
    y = f(x, w_sharded)
  np.testing.assert_array_equal(
    np.asarray(y, np.float32), np.asarray(jax.lax.ragged_dot(x, w, gs), np.float32)
  )


def test_nnx_grouped_linear_trains_with_experts_sharded():
  # The user's way: an NNX model whose experts' kernel and recipe state are placed over the
  # expert axis, trained with NNX's own loop under nnx.jit (nnx.value_and_grad over Param and
  # RecipeState, nnx.Optimizer over Param, the state's gradient is its next value).
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, _, dy = _data(3)
  gs = jnp.asarray(GROUP_SIZES)

  def train(mesh):
    model = ta_nnx.GroupedLinear(G, K, N, recipe=recipe, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    if mesh is not None:
      graph, state = nnx.split((model, opt))
      state = jax.tree.map(
        lambda a: (
          jax.device_put(a, NamedSharding(mesh, P("ep"))) if a.ndim >= 1 and a.shape[0] == G else a
        ),
        state,
      )
      model, opt = nnx.merge(graph, state)

    diff = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))

    @nnx.jit
    def step(model, opt, x, dy):
      def loss(model):
        return jnp.vdot(model(x, gs).astype(jnp.float32), dy.astype(jnp.float32))

      value, grads = nnx.value_and_grad(loss, argnums=diff)(model)
      params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
      opt.update(model, params)
      nnx.update(model, recipe_state)
      return value

    losses = [float(step(model, opt, x, dy)) for _ in range(3)]
    return losses, model

  losses1, model1 = train(None)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    losses2, model2 = train(mesh)
  assert model2.kernel[...].sharding.spec[0] == "ep"
  if spmd_checks.ON_GPU:
    # The loss sums y * dy over the devices' outputs in another order, and y's FP8 GEMMs may sum
    # in another order too (spmd_checks); the first loss cancels to about 1 out of terms of
    # about 1e3, so its relative error is that of the terms' sums, FP8_GEMM_RTOL. The kernel
    # and its amax (which moves by at most the kernel's largest change) to the same bound.
    np.testing.assert_allclose(losses2, losses1, rtol=FP8_GEMM_RTOL)
    spmd_checks.assert_close_to_one_device(model2.kernel[...], model1.kernel[...], "kernel")
    for name in model1.state_names:
      spmd_checks.assert_close_to_one_device(
        getattr(model2, name)[...], getattr(model1, name)[...], name
      )
  else:
    np.testing.assert_allclose(losses2, losses1, rtol=1e-6)
    np.testing.assert_array_equal(model2.kernel[...], model1.kernel[...])
    for name in model1.state_names:
      np.testing.assert_array_equal(getattr(model2, name)[...], getattr(model1, name)[...])
  assert np.asarray(model1.x_amax_history[...])[GROUP_SIZES > 0].max() > 0  # state moved
