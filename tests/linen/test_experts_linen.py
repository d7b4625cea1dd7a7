"""Linen make_ragged_dot_cls: state in _overwrite_with_gradient, numerics, drop-in for lax."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import te_adapters as ta
from te_adapters import core
from te_adapters.linen._ragged import OVERWRITE_WITH_GRADIENT, make_ragged_dot_cls

G, M, K, N = 4, 64, 32, 16
SIZES = np.array([20, 0, 28, 8], np.int32)  # group 1 empty, rows 56..63 in no group


class Experts(nn.Module):
  recipe: ta.Recipe | None
  features: int = N

  @nn.compact
  def __call__(self, x, group_sizes):
    shape = (G, K, self.features)
    w = self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), shape)
    return make_ragged_dot_cls(self.recipe)(name="ragged_dot")(x, w, group_sizes)


def data(step):
  rng = np.random.default_rng(step)
  x = rng.standard_normal((M, K)).astype(np.float32) * (3.0 - step)  # no clipping by old scales
  dy = rng.standard_normal((M, N)).astype(np.float32)
  return x, dy


def group_amax(a):
  ends = np.cumsum(SIZES)
  pairs = zip(SIZES, ends, strict=True)
  return np.array([np.abs(a[e - s : e]).max() if s else 0.0 for s, e in pairs])


def test_delayed_state_lives_in_overwrite_with_gradient_and_updates(rel):
  recipe = ta.DelayedScaling(amax_history_len=3)
  model = Experts(recipe)
  x0, _ = data(0)
  variables = jax.jit(model.init)(jax.random.key(0), jnp.asarray(x0), jnp.asarray(SIZES))
  state = variables[OVERWRITE_WITH_GRADIENT]["ragged_dot"]
  assert sorted(state) == sorted(core.state_names(recipe))
  assert state["x_scale"].shape == (G, 1) and state["grad_amax_history"].shape == (G, 3)

  @jax.jit
  def step(variables, x, dy):
    def loss(variables):
      y = model.apply(variables, x, jnp.asarray(SIZES))
      return jnp.vdot(y, dy), y

    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    new = core.updated_state(variables[OVERWRITE_WITH_GRADIENT], grads[OVERWRITE_WITH_GRADIENT])
    return y, grads["params"], {"params": variables["params"], OVERWRITE_WITH_GRADIENT: new}

  for i in range(3):
    x, dy = data(i)
    y, param_grads, variables = step(variables, jnp.asarray(x), jnp.asarray(dy))
  state = variables[OVERWRITE_WITH_GRADIENT]["ragged_dot"]
  w = np.asarray(variables["params"]["kernel"], np.float64)
  # Histories after 3 steps with L=3: [0, amax(step 1), amax(step 2)] per group.
  np.testing.assert_allclose(state["x_amax_history"][:, 2], group_amax(x), rtol=1e-6)
  np.testing.assert_allclose(state["grad_amax_history"][:, 2], group_amax(dy), rtol=1e-6)
  np.testing.assert_allclose(
    state["kernel_amax_history"][:, 2], np.abs(w).max(axis=(1, 2)), rtol=1e-6
  )
  window = np.max([group_amax(data(i)[0]) for i in range(3)], axis=0)  # L=3: all three steps
  want = np.where(window > 0, 448.0 / np.where(window > 0, window, 1), 1.0)
  np.testing.assert_allclose(state["x_scale"][:, 0], want, rtol=1e-6)
  # The output of the last step against float64, per group; FP8 error, not bf16's.
  ends = np.cumsum(SIZES)
  ref = np.zeros((M, N))
  for g, (s, e) in enumerate(zip(ends - SIZES, ends, strict=True)):
    ref[s:e] = x[s:e].astype(np.float64) @ w[g]
  assert 0.01 < rel(y, ref) < 0.06
  assert np.all(np.asarray(param_grads["kernel"][1]) == 0)  # the empty expert


def test_stateless_recipes_create_no_variables_and_none_is_lax():
  x, _ = data(0)
  for recipe in (None, ta.Float8CurrentScaling()):
    shapes = jax.eval_shape(Experts(recipe).init, jax.random.key(0), x, jnp.asarray(SIZES))
    assert list(shapes) == ["params"]
  variables = jax.jit(Experts(None).init)(jax.random.key(0), x, jnp.asarray(SIZES))
  y = jax.jit(Experts(None).apply)(variables, jnp.asarray(x), jnp.asarray(SIZES))
  want = jax.lax.ragged_dot(jnp.asarray(x), variables["params"]["kernel"], jnp.asarray(SIZES))
  np.testing.assert_array_equal(y, want)


def test_drop_in_signature_and_errors():
  cls = make_ragged_dot_cls(ta.Float8CurrentScaling())
  x, w, gs = jnp.ones((16, 16)), jnp.ones((2, 16, 16)), jnp.array([8, 8])
  apply = jax.jit(cls().apply, static_argnums=(4, 5))
  y = apply({}, x, w, gs, None, jnp.float32)  # lax.ragged_dot's positional order
  assert y.dtype == jnp.float32 and y.shape == (16, 16)
  with pytest.raises(NotImplementedError, match="group_offset"):
    jax.eval_shape(cls().apply, {}, x, w, gs, group_offset=jnp.array([1]))
  with pytest.raises(TypeError, match="recipe instance"):
    make_ragged_dot_cls(ta.DelayedScaling)
  with pytest.raises(ValueError, match=r"rhs must be 3-D"):
    init = make_ragged_dot_cls(ta.DelayedScaling())().init
    jax.eval_shape(init, jax.random.key(0), x, jnp.ones((16, 16)), gs)


def test_mxfp8_trains_with_no_state_and_the_core_numerics():
  """MXFP8 (stateless): no recipe collection; two SGD steps; the output is core.ragged_dot's."""
  recipe = ta.MXFP8BlockScaling()
  model = Experts(recipe, features=32)  # MXFP8 blocks of 32 along K and N
  x, _ = data(0)
  target = np.tanh(data(1)[0])  # [M, 32]
  variables = jax.jit(model.init)(jax.random.key(0), jnp.asarray(x), jnp.asarray(SIZES))
  assert list(variables) == ["params"]

  @jax.jit
  def step(variables):
    def loss(variables):
      y = model.apply(variables, jnp.asarray(x), jnp.asarray(SIZES))
      return jnp.mean((y[:56] - target[:56]) ** 2), y

    (value, y), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    return value, y, grads, jax.tree.map(lambda p, g: p - 0.5 * g, variables, grads)

  losses = []
  for _ in range(3):
    kernel = variables["params"]["kernel"]
    value, y, grads, variables = step(variables)
    losses.append(float(value))
  assert losses[2] < losses[0], losses
  np.testing.assert_array_equal(grads["params"]["kernel"][1], 0.0)  # the empty expert
  np.testing.assert_array_equal(y[56:], 0.0)
  want = jax.jit(core.ragged_dot, static_argnames="recipe")(
    jnp.asarray(x), kernel, jnp.asarray(SIZES), recipe=recipe
  )
  np.testing.assert_array_equal(y, want)


class _TwoExperts(nn.Module):
  @nn.compact
  def __call__(self, x):
    recipe = ta.DelayedScaling(amax_history_len=3)
    for i in range(2):
      w = self.param(f"kernel_{i}", nn.initializers.lecun_normal(batch_axis=(0,)), (G, K, K))
      x = make_ragged_dot_cls(recipe)(name=f"experts_{i}")(x, w, SIZES)  # the user's line
    return x


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _TwoExperts(name="moe")(x)


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  model, x = _Model(), jnp.ones((M, K))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(params, recipe_state):
    return jnp.sum(model.apply({"params": params, OVERWRITE_WITH_GRADIENT: recipe_state}, x))

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("default")
    # The parameters alone: the state cannot update. Traced twice: one warning per layer.
    for _ in range(2):
      grad = jax.grad(lambda p, s: loss(p, s))
      jax.eval_shape(grad, variables["params"], variables[OVERWRITE_WITH_GRADIENT])
  frozen = [w for w in record if issubclass(w.category, core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2  # two layers of one shape
  for i, w in enumerate(frozen):
    message = str(w.message)
    assert f"layer 'moe/experts_{i}' (x (64, 32) float32 . kernel (4, 32, 32) float32)" in message
    assert "te_adapters.linen.TrainState.value_and_grad" in message
    assert "nnx" not in message and "haiku" not in message  # Linen's remedy only
