"""Haiku GroupedLinear: hk.get_state recipe state, a training step, reuse within a step."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.haiku._experts import GroupedLinear

G, M, K, N = 4, 64, 32, 16
SIZES = jnp.array([20, 0, 28, 8], jnp.int32)  # group 1 empty, rows 56..63 in no group
RECIPE = ta.DelayedScaling(amax_history_len=3)


def group_amax(a):
  a = np.asarray(a)
  ends = np.cumsum(SIZES)
  pairs = zip(SIZES, ends, strict=True)
  return np.array([np.abs(a[e - s : e]).max() if s else 0.0 for s, e in pairs])


def test_params_state_and_a_training_step(rel):
  f = hk.transform_with_state(lambda x: GroupedLinear(G, N, recipe=RECIPE)(x, SIZES))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  params, state = jax.jit(f.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, params) == {"grouped_linear": {"w": (G, K, N)}}
  s = state["grouped_linear"]
  assert sorted(s) == sorted(core.state_names(RECIPE))
  assert s["x_scale"].shape == (G, 1) and s["x_amax_history"].shape == (G, 3)
  w_std = float(jnp.std(params["grouped_linear"]["w"]))
  assert 0.7 / np.sqrt(K) < w_std < 1.0 / np.sqrt(K)  # hk.Linear's truncated normal

  @jax.jit
  def step(params, state, x):
    def loss(params, state):
      y, _ = f.apply(params, state, None, x)
      return jnp.vdot(y, dy), y

    (_, y), (g_params, g_state) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, state)
    return y, g_params, core.updated_state(state, g_state)

  for i in range(3):
    y, g_params, state = step(params, state, x * (3.0 - i))
  s = state["grouped_linear"]
  np.testing.assert_allclose(s["x_amax_history"][:, 1], group_amax(x) * 2, rtol=1e-6)
  np.testing.assert_allclose(s["x_amax_history"][:, 2], group_amax(x), rtol=1e-6)
  np.testing.assert_allclose(s["grad_amax_history"][:, 2], group_amax(dy), rtol=1e-6)
  np.testing.assert_allclose(
    s["x_scale"][[0, 2, 3], 0], 448 / group_amax(x * 3)[[0, 2, 3]], rtol=1e-6
  )
  np.testing.assert_array_equal(g_params["grouped_linear"]["w"][1], 0.0)  # the empty expert
  w = np.asarray(params["grouped_linear"]["w"], np.float64)
  ref = np.zeros((M, N))
  ends = np.cumsum(SIZES)
  for g, (a, e) in enumerate(zip(ends - SIZES, ends, strict=True)):
    ref[a:e] = np.asarray(x, np.float64)[a:e] @ w[g]
  assert 0.01 < rel(y, ref) < 0.06


def test_layer_applied_twice_combines_state_by_max():
  """One module used on two batches in a step: its new state sees the larger amax per group."""

  def forward(x1, x2):
    layer = GroupedLinear(G, N, recipe=RECIPE, w_init=hk.initializers.Constant(1.0))
    return layer(x1, SIZES) + layer(x2, SIZES)

  f = hk.transform_with_state(forward)
  x1 = jnp.ones((M, K)).at[:20].multiply(3.0)  # group 0 amax 3, others 1
  x2 = jnp.ones((M, K)).at[20:48].multiply(5.0)  # group 2 amax 5, others 1
  params, state = jax.jit(f.init)(None, x1, x2)

  @jax.jit
  def new_state(params, state):
    def loss(state):
      state = core.with_max_grad(state)
      return jnp.sum(f.apply(params, state, None, x1, x2)[0])

    return jax.grad(loss)(state)

  s = new_state(params, state)["grouped_linear"]
  np.testing.assert_allclose(s["x_amax_history"][:, -1], [3.0, 0.0, 5.0, 1.0])
  np.testing.assert_allclose(s["x_scale"][:, 0], [448 / 3, 1.0, 448 / 5, 448.0], rtol=1e-6)


def test_no_recipe_and_errors():
  f = hk.transform_with_state(lambda x: GroupedLinear(G, N)(x, SIZES))
  x = jnp.ones((M, K))
  params, state = jax.jit(f.init)(jax.random.key(1), x)
  assert state == {}
  y, _ = jax.jit(f.apply)(params, state, None, x)
  np.testing.assert_array_equal(y, jax.lax.ragged_dot(x, params["grouped_linear"]["w"], SIZES))
  bad = hk.transform_with_state(lambda x: GroupedLinear(G, N, recipe=RECIPE)(x, SIZES))
  with pytest.raises(ValueError, match=r"inputs must be 2-D"):
    bad.init(jax.random.key(1), jnp.ones((2, M, K)))
  with pytest.raises(TypeError, match="recipe instance"):
    hk.transform(lambda: GroupedLinear(G, N, recipe=ta.DelayedScaling)).init(None)


def test_mxfp8_trains_with_no_state_and_the_core_numerics():
  """MXFP8 (stateless): no hk state; two SGD steps; the output is core.ragged_dot's."""
  recipe = ta.MXFP8BlockScaling()
  f = hk.transform_with_state(lambda x: GroupedLinear(G, 32, recipe=recipe)(x, SIZES))
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  target = jnp.tanh(jnp.asarray(rng.standard_normal((M, 32)), jnp.float32))
  params, state = jax.jit(f.init)(jax.random.key(2), x)
  assert state == {}

  @jax.jit
  def step(params):
    def loss(params):
      y, _ = f.apply(params, state, None, x)
      return jnp.mean((y[:56] - target[:56]) ** 2), y

    (value, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, y, grads, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

  losses = []
  for _ in range(3):
    w = params["grouped_linear"]["w"]
    value, y, grads, params = step(params)
    losses.append(float(value))
  assert losses[2] < losses[0], losses
  np.testing.assert_array_equal(grads["grouped_linear"]["w"][1], 0.0)  # the empty expert
  np.testing.assert_array_equal(y[56:], 0.0)
  want = jax.jit(core.ragged_dot, static_argnames="recipe")(x, w, SIZES, recipe=recipe)
  np.testing.assert_array_equal(y, want)


class _Experts(hk.Module):
  def __call__(self, x):
    for i in range(2):
      x = GroupedLinear(G, K, recipe=RECIPE, name=f"experts_{i}")(x, SIZES)  # the user's line
    return x


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  f = hk.transform_with_state(lambda x: _Experts(name="moe")(x))
  x = jnp.ones((M, K))
  params, state = jax.eval_shape(f.init, jax.random.key(0), x)

  def loss(params, state):
    return jnp.sum(f.apply(params, state, None, x)[0])

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("default")
    # The parameters alone: the state cannot update. Traced twice: one warning per layer.
    for _ in range(2):
      jax.eval_shape(jax.grad(lambda p, s: loss(p, s)), params, state)
  frozen = [w for w in record if issubclass(w.category, core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2  # two layers of one shape
  for i, w in enumerate(frozen):
    message = str(w.message)
    assert f"layer 'moe/experts_{i}' (x (64, 32) float32 . kernel (4, 32, 32) float32)" in message
    assert "te_adapters.haiku.value_grad_and_state" in message
    assert "nnx" not in message and "Linen" not in message  # Haiku's remedy only
