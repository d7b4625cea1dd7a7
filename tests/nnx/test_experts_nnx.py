"""NNX GroupedLinear: parameters and RecipeState, a training step, numerics."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters.nnx import RecipeState
from te_adapters.nnx._experts import GroupedLinear

G, M, K, N = 4, 64, 32, 16
SIZES = jnp.array([20, 0, 28, 8], jnp.int32)  # group 1 empty, rows 56..63 in no group


def reference(x, w, sizes):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ends = np.cumsum(sizes)
  y = np.zeros((x.shape[0], w.shape[2]))
  for g, (s, e) in enumerate(zip(ends - sizes, ends, strict=True)):
    y[s:e] = x[s:e] @ w[g]
  return y


def test_parameters_state_and_init():
  layer = GroupedLinear(G, K, N, recipe=ta.DelayedScaling(amax_history_len=5), rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  assert jax.tree.map(jnp.shape, params) == {"kernel": (G, K, N)}
  recipe_state = nnx.to_pure_dict(nnx.state(layer, RecipeState))["state"]
  assert sorted(recipe_state) == sorted(core.state_names(ta.DelayedScaling()))
  assert recipe_state["kernel_scale"].shape == (G, 1)
  assert recipe_state["grad_amax_history"].shape == (G, 5)
  # lecun_normal per expert: fan-in K.
  std = float(jnp.std(layer.kernel[...]))
  assert 0.8 / np.sqrt(K) < std < 1.2 / np.sqrt(K)
  plain = GroupedLinear(G, K, N, rngs=nnx.Rngs(0))
  assert not nnx.to_pure_dict(nnx.state(plain, RecipeState))
  with pytest.raises(TypeError, match="recipe instance"):
    GroupedLinear(G, K, N, recipe=ta.Float8CurrentScaling, rngs=nnx.Rngs(0))


def test_training_step_updates_params_and_recipe_state(rel):
  recipe = ta.DelayedScaling(amax_history_len=3)
  model = GroupedLinear(G, K, N, recipe=recipe, rngs=nnx.Rngs(1))
  optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, dy):
    def loss_fn(model):
      y = model(x, SIZES)
      return jnp.vdot(y, dy), y

    diff = nnx.DiffState(0, nnx.Any(nnx.Param, RecipeState))
    (_, y), grads = nnx.value_and_grad(loss_fn, argnums=diff, has_aux=True)(model)
    param_grads, state_grads = nnx.filter_state(grads, nnx.Param, RecipeState)
    optimizer.update(model, param_grads)
    old = nnx.to_pure_dict(nnx.state(model, RecipeState))
    nnx.update(model, core.updated_state(old, nnx.to_pure_dict(state_grads)))
    return y

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  # Evaluation (no gradient) leaves the recipe state as it was.
  before = nnx.to_pure_dict(nnx.state(model, RecipeState))
  nnx.jit(lambda m, x: m(x, SIZES))(model, x)
  after = nnx.to_pure_dict(nnx.state(model, RecipeState))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  kernels = []
  for _ in range(3):
    kernels.append(np.asarray(model.kernel[...]))
    y = step(model, optimizer, x, dy)
  # The kernel moved by SGD; the recipe state came from the gradient channel.
  assert not np.allclose(kernels[-1], model.kernel[...])
  assert 0.01 < rel(y, reference(x, kernels[-1], SIZES)) < 0.06
  # L=3 after three steps: [0, amax(step 1), amax(step 2)] per expert.
  kernel_amax = np.stack([np.abs(k).max(axis=(1, 2)) for k in kernels], axis=1)
  np.testing.assert_allclose(model.kernel_amax_history[...][:, 1:], kernel_amax[:, 1:], rtol=1e-6)
  np.testing.assert_allclose(model.kernel_scale[...][:, 0], 448 / kernel_amax.max(1), rtol=1e-6)
  ends = np.cumsum(SIZES)
  pairs = zip(SIZES, ends, strict=True)
  x_amax = [np.abs(np.asarray(x)[e - s : e]).max() if s else 0.0 for s, e in pairs]
  np.testing.assert_allclose(model.x_amax_history[...][:, 2], x_amax, rtol=1e-6)
  # The empty expert keeps its scale.
  np.testing.assert_array_equal(model.state.x_scale[...][1], 1.0)
  assert np.all(np.asarray(model.state.x_scale[...])[[0, 2, 3]] != 1.0)


def test_no_recipe_is_lax_ragged_dot_and_dtype_promotion():
  layer = GroupedLinear(G, K, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((M, K)), jnp.float32)
  y = nnx.jit(lambda m, x: m(x, SIZES))(layer, x)
  want = jax.lax.ragged_dot(x.astype(jnp.bfloat16), layer.kernel[...].astype(jnp.bfloat16), SIZES)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(y, want)


def test_mxfp8_trains_with_no_recipe_state_and_the_core_numerics():
  """MXFP8 (stateless): no RecipeState; two optimizer steps; the output is core.ragged_dot's."""
  recipe = ta.MXFP8BlockScaling()
  model = GroupedLinear(G, K, 32, recipe=recipe, rngs=nnx.Rngs(4))  # blocks of 32 on K and N
  assert not nnx.to_pure_dict(nnx.state(model, RecipeState))
  optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  target = jnp.tanh(jnp.asarray(rng.standard_normal((M, 32)), jnp.float32))

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      y = model(x, SIZES)
      return jnp.mean((y[:56] - target[:56]) ** 2), y

    (loss, y), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, y, grads

  losses = []
  for _ in range(3):
    kernel = model.kernel[...]
    loss, y, grads = step(model, optimizer)
    losses.append(float(loss))
  assert losses[2] < losses[0], losses
  np.testing.assert_array_equal(grads["kernel"][...][1], 0.0)  # the empty expert
  np.testing.assert_array_equal(y[56:], 0.0)
  want = jax.jit(core.ragged_dot, static_argnames="recipe")(x, kernel, SIZES, recipe=recipe)
  np.testing.assert_array_equal(y, want)


def test_unsupported_block_recipes_fail_at_construction():
  with pytest.raises(NotImplementedError, match="does not implement NVFP4BlockScaling"):
    GroupedLinear(G, K, 32, recipe=ta.NVFP4BlockScaling(), rngs=nnx.Rngs(0))


def test_nnx_params_only_loop_warns_that_the_state_is_frozen():
  model = GroupedLinear(8, 64, 96, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0))
  x = jnp.ones((256, 64), jnp.bfloat16)
  with pytest.warns(core.FrozenStateWarning, match="te_adapters.nnx.value_and_grad"):
    nnx.value_and_grad(lambda m: jnp.sum(m(x, jnp.full((8,), 32, jnp.int32))))(model)


class _TwoExperts(nnx.Module):
  def __init__(self, rngs):
    recipe = ta.DelayedScaling(amax_history_len=4)
    self.up = GroupedLinear(G, K, 2 * K, recipe=recipe, rngs=rngs)
    self.down = GroupedLinear(G, 2 * K, N, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.down(self.up(x, SIZES), SIZES)  # the user's line


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  model = _TwoExperts(nnx.Rngs(0))
  x = jnp.ones((M, K))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("default")
    # wrt=nnx.Param only: the state cannot update. Traced twice: one warning per layer.
    for _ in range(2):
      nnx.eval_shape(nnx.value_and_grad(lambda m, x: jnp.sum(m(x))), model, x)
  frozen = [w for w in record if issubclass(w.category, core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2
  # An NNX layer does not know its path in the model: the layer's class and shapes name it.
  shapes = [
    "kernel (4, 32, 64)) (x (64, 32) float32 . kernel (4, 32, 64) float32",
    "kernel (4, 64, 16)) (x (64, 64) float32 . kernel (4, 64, 16)",
  ]
  for w, shape in zip(frozen, shapes, strict=True):
    message = str(w.message)
    assert f"the DelayedScaling state of GroupedLinear layer ({shape}" in message
    assert "te_adapters.nnx.value_and_grad" in message
    assert "Linen" not in message and "haiku" not in message  # NNX's remedy only
