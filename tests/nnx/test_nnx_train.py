"""Training with te_adapters.nnx: recipe state over steps, reuse, transforms, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx
from tests.conftest import FP8_GEMM_RTOL

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _normal(seed, shape, amax=None):
  """Standard normal float32 data; with ``amax``, rescaled so that max|x| is exactly amax."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  if amax is not None:
    x = x / np.max(np.abs(x)) * np.float32(amax)
    x.flat[np.argmax(np.abs(x))] = np.float32(amax)
  return jnp.asarray(x)


def _amax(x) -> float:
  return float(np.max(np.abs(np.asarray(x))))


def _state(model, *path):
  out = nnx.to_pure_dict(ta_nnx.recipe_state(model))
  for key in path:
    out = out[key]
  return jax.tree.map(np.asarray, out)


def _product_loss(model, x, c):
  # d(loss)/d(output) = c exactly, so c's amax is the amax the grad role records.
  return jnp.sum(model(x) * c)


@nnx.jit
def _train_step(model, optimizer, x, c):
  loss, (grads, state_grads) = ta_nnx.value_and_grad(_product_loss)(model, x, c)
  optimizer.update(model, grads)
  ta_nnx.update_recipe_state(model, state_grads)
  return loss


def test_delayed_scaling_history_over_optimizer_steps():
  """TE's sequence with L=3: [0,0,a1], [0,a1,a2], [0,a2,a3], [0,a3,a4]; scale from the window."""
  recipe = ta.DelayedScaling(amax_history_len=3)
  model = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  x_amaxes, c_amaxes = [1.0, 3.0, 2.0, 0.5], [4.0, 1.5, 0.25, 2.0]
  seen = {"x": [], "kernel": [], "grad": []}
  for step, (xa, ca) in enumerate(zip(x_amaxes, c_amaxes, strict=True)):
    x, c = _normal(step, (8, 32), xa), _normal(10 + step, (8, 16), ca)
    seen["x"].append(_amax(x))
    seen["kernel"].append(_amax(model.kernel[...]))  # the kernel this step quantizes
    seen["grad"].append(_amax(c))
    _train_step(model, optimizer, x, c)
    state = _state(model, "dot_general", "state")
    for role, fp8_max in (("x", E4M3_MAX), ("kernel", E4M3_MAX), ("grad", E5M2_MAX)):
      a = seen[role]
      expected = [0.0] + [0.0] * max(0, 2 - len(a)) + a[-2:]
      np.testing.assert_allclose(state[f"{role}_amax_history"], expected[-3:], rtol=1e-6)
      np.testing.assert_allclose(state[f"{role}_scale"], [fp8_max / max(a[-3:])], rtol=1e-6)
  # The kernel changed between steps, so its history holds distinct amaxes.
  assert len(set(seen["kernel"])) == 4

  # The next forward quantizes with the stored scales, not with the current amax.
  x = _normal(7, (8, 32), 0.5)
  s_x, s_k = state["x_scale"][0], state["kernel_scale"][0]
  q = lambda v, s: np.asarray(
    jnp.clip(v * s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), np.float32
  )
  expected = (q(x, s_x) @ q(model.kernel[...], s_k)) / (s_x * s_k) + np.asarray(model.bias[...])
  np.testing.assert_allclose(
    nnx.jit(lambda m, x: m(x))(model, x), expected, rtol=FP8_GEMM_RTOL, atol=FP8_GEMM_RTOL / 10
  )
  assert s_x != E4M3_MAX / 0.5  # current scaling would have used this one


def test_layer_called_twice_takes_the_max_not_the_sum():
  model = ta_nnx.Linear(
    32, 16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0)
  )
  xa, xb = _normal(0, (8, 32), 2.0), _normal(1, (8, 32), 3.0)
  ca, cb = _normal(2, (8, 16), 5.0), _normal(3, (8, 16), 7.0)

  def loss(m, xa, xb, ca, cb):
    return jnp.sum(m(xa) * ca) + jnp.sum(m(xb) * cb)

  @nnx.jit
  def step(m, *batch):
    _, (_, state_grads) = ta_nnx.value_and_grad(loss)(m, *batch)
    ta_nnx.update_recipe_state(m, state_grads)

  k_amax = _amax(model.kernel[...])
  step(model, xa, xb, ca, cb)
  state = _state(model, "dot_general", "state")
  np.testing.assert_allclose(state["x_amax_history"], [0, 0, 0, 3.0], rtol=1e-6)
  np.testing.assert_allclose(state["x_scale"], [E4M3_MAX / 3.0], rtol=1e-6)
  np.testing.assert_allclose(state["grad_amax_history"], [0, 0, 0, 7.0], rtol=1e-6)
  np.testing.assert_allclose(state["grad_scale"], [E5M2_MAX / 7.0], rtol=1e-6)
  np.testing.assert_allclose(state["kernel_amax_history"], [0, 0, 0, k_amax], rtol=1e-6)
  np.testing.assert_allclose(state["kernel_scale"], [E4M3_MAX / k_amax], rtol=1e-6)


def test_evaluation_and_optimizer_leave_state_alone():
  model = ta_nnx.Linear(
    32, 16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0)
  )
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, c = _normal(0, (8, 32), 2.0), _normal(1, (8, 16))
  _train_step(model, optimizer, x, c)
  before = _state(model)

  forward = nnx.jit(lambda m, x: m(x))
  for scale in (1.0, 10.0):
    forward(model, x * scale)
  jax.tree.map(np.testing.assert_array_equal, _state(model), before)

  # The optimizer only sees parameters: its state holds no recipe state, and an update leaves
  # the recipe state as it was.
  opt_leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(optimizer, nnx.OptState)))
  n_params = len(jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  assert len([leaf for leaf in opt_leaves if np.ndim(leaf) > 0]) == 2 * n_params
  _, (grads, _) = nnx.jit(ta_nnx.value_and_grad(_product_loss))(model, x, c)
  assert not nnx.to_pure_dict(nnx.state(grads, ta_nnx.RecipeState))
  nnx.jit(lambda m, opt, g: opt.update(m, g))(model, optimizer, grads)
  jax.tree.map(np.testing.assert_array_equal, _state(model), before)


class _Pair(nnx.Module):
  def __init__(self, recipe, rngs):
    self.used = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=rngs)
    self.unused = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.used(x)


def test_layer_outside_the_loss_keeps_its_state():
  model = _Pair(ta.DelayedScaling(amax_history_len=4), nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  _train_step(model, optimizer, _normal(0, (8, 32), 2.0), _normal(1, (8, 16)))
  used = _state(model, "used", "dot_general", "state")
  np.testing.assert_allclose(used["x_amax_history"][-1], 2.0)
  unused = _state(model, "unused", "dot_general", "state")
  np.testing.assert_array_equal(unused["x_scale"], [1.0])
  np.testing.assert_array_equal(unused["x_amax_history"], np.zeros(4))


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.linear = ta_nnx.Linear(
      32, 32, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=rngs
    )

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


def test_scan_over_stacked_layers_matches_unrolled_loop():
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return _Block(rngs)

  stack = make(nnx.Rngs(0))
  graphdef, state = nnx.split(stack)
  layers = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(3)]
  x, c = _normal(0, (8, 32), 3.0), _normal(1, (8, 32))

  def scanned(stack, x, c):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, h):
      return block(h)

    return jnp.sum(body(stack, x) * c)

  def unrolled(layers, x, c):
    for block in layers:
      x = block(x)
    return jnp.sum(x * c)

  loss_s, (g_s, s_s) = nnx.jit(ta_nnx.value_and_grad(scanned))(stack, x, c)
  loss_u, (g_u, s_u) = nnx.jit(ta_nnx.value_and_grad(unrolled))(nnx.List(layers), x, c)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  s_s, s_u = nnx.to_pure_dict(s_s), nnx.to_pure_dict(s_u)
  g_s, g_u = nnx.to_pure_dict(g_s), nnx.to_pure_dict(g_u)
  for i in range(3):
    jax.tree.map(
      lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-7),
      (s_s, g_s),
      (s_u[i], g_u[i]),
    )
  # Each layer recorded its own input's amax: the first one saw x.
  history = s_s["linear"]["dot_general"]["state"]["x_amax_history"]
  np.testing.assert_allclose(history[0, -1], 3.0, rtol=1e-6)
  assert np.all(history[1:, -1] < 1.0)  # tanh outputs

  ta_nnx.update_recipe_state(stack, s_s)
  np.testing.assert_array_equal(stack.linear.dot_general.state.x_amax_history[...], history)


def test_scan_with_broadcast_layer_takes_the_max():
  model = ta_nnx.Linear(
    32, 32, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0)
  )
  xs = jnp.stack([_normal(i, (8, 32), a) for i, a in enumerate((2.0, 5.0, 3.0))])

  def loss(m, xs):
    @nnx.scan(in_axes=(None, 0), out_axes=0)
    def body(m, x):
      return m(x)

    return jnp.sum(body(m, xs))

  _, (_, state_grads) = nnx.jit(ta_nnx.value_and_grad(loss))(model, xs)
  state = nnx.to_pure_dict(state_grads)["dot_general"]["state"]
  np.testing.assert_allclose(state["x_amax_history"], [0, 0, 0, 5.0], rtol=1e-6)
  np.testing.assert_allclose(state["x_scale"], [E4M3_MAX / 5.0], rtol=1e-6)


def test_remat_gives_the_same_grads_and_state():
  model = ta_nnx.Linear(
    32, 16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0)
  )
  x, c = _normal(0, (8, 32), 2.0), _normal(1, (8, 16))

  def plain(m, x, c):
    return jnp.sum(jnp.tanh(m(x)) * c)

  def rematted(m, x, c):
    f = nnx.remat(lambda m, x: jnp.tanh(m(x)), policy=ta.core.save_quantized_operands)
    return jnp.sum(f(m, x) * c)

  out_plain = nnx.jit(ta_nnx.value_and_grad(plain))(model, x, c)
  out_remat = nnx.jit(ta_nnx.value_and_grad(rematted))(model, x, c)
  np.testing.assert_allclose(out_plain[0], out_remat[0], rtol=1e-6)
  for a, b in zip(out_plain[1], out_remat[1], strict=True):
    jax.tree.map(
      lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6),
      nnx.to_pure_dict(a),
      nnx.to_pure_dict(b),
    )


def test_vmap_over_stacked_models_keeps_per_model_state():
  recipe = ta.DelayedScaling(amax_history_len=4)

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=rngs)

  ensemble = make(nnx.Rngs(0))
  xs = jnp.stack([_normal(0, (8, 32), 2.0), _normal(1, (8, 32), 3.0)])

  def loss(models, xs):
    return jnp.sum(nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))(models, xs))

  @nnx.jit
  def step(models, xs):
    _, (_, state_grads) = ta_nnx.value_and_grad(loss)(models, xs)
    ta_nnx.update_recipe_state(models, state_grads)

  step(ensemble, xs)
  history = np.asarray(ensemble.dot_general.state.x_amax_history[...])
  np.testing.assert_allclose(history[:, -1], [2.0, 3.0], rtol=1e-6)
  np.testing.assert_allclose(ensemble.dot_general.state.x_scale[...][:, 0], [224.0, E4M3_MAX / 3])


def _state_leaf(tree, name):
  (leaf,) = [
    v for p, v in jax.tree_util.tree_leaves_with_path(tree) if name in jax.tree_util.keystr(p)
  ]
  return np.asarray(leaf)


def test_vmap_with_broadcast_layer():
  xs = jnp.stack([_normal(0, (8, 32), 2.0), _normal(1, (8, 32), 3.0)])
  per_example = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))

  # Stateless recipe: works, and each example is quantized on its own.
  model = ta_nnx.Linear(32, 16, threshold=None, recipe=ta.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  ys = nnx.jit(per_example)(model, xs)
  np.testing.assert_allclose(ys[1], nnx.jit(lambda m, x: m(x))(model, xs[1]), rtol=1e-6)

  # Delayed scaling: the broadcast layer's new state is that of one GEMM over the whole batch.
  recipe = ta.DelayedScaling(amax_history_len=4)
  model = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=nnx.Rngs(0))
  _, state_grads = nnx.jit(ta_nnx.grad(lambda m, xs: jnp.sum(per_example(m, xs))))(model, xs)
  _, whole = nnx.jit(ta_nnx.grad(lambda m, xs: jnp.sum(m(xs.reshape(16, 32)))))(model, xs)
  jax.tree.map(np.testing.assert_array_equal, state_grads, whole)
  np.testing.assert_array_equal(
    _state_leaf(state_grads, "x_amax_history")[-1], np.abs(np.asarray(xs)).max()
  )


def test_split_merge_and_plain_dict_round_trip():
  recipe = ta.DelayedScaling(amax_history_len=4)
  model = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  batches = [(_normal(i, (8, 32), 1.0 + i), _normal(5 + i, (8, 16))) for i in range(3)]
  for x, c in batches[:2]:
    _train_step(model, optimizer, x, c)

  # What a checkpointer stores: a nested dict of numpy arrays.
  saved = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  assert set(saved["dot_general"]["state"]) == set(ta.core.state_names(recipe))
  restored = ta_nnx.Linear(32, 16, threshold=None, recipe=recipe, rngs=nnx.Rngs(1))
  state = nnx.state(restored)
  nnx.replace_by_pure_dict(state, saved)
  nnx.update(restored, state)
  jax.tree.map(np.testing.assert_array_equal, _state(restored), _state(model))

  # A functional step on split state (jax.jit, nnx.merge inside) continues identically.
  graphdef, params, recipe_state = nnx.split(restored, nnx.Param, ta_nnx.RecipeState)

  @jax.jit
  def functional_step(params, recipe_state, x, c):
    m = nnx.merge(graphdef, params, recipe_state)
    _, (grads, state_grads) = ta_nnx.value_and_grad(_product_loss)(m, x, c)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    ta_nnx.update_recipe_state(m, state_grads)
    return params, nnx.state(m, ta_nnx.RecipeState)

  params, recipe_state = functional_step(params, recipe_state, *batches[2])
  _train_step(model, optimizer, *batches[2])
  expected = nnx.to_pure_dict(nnx.state(model))
  got = nnx.to_pure_dict(nnx.merge_state(params, recipe_state))
  # The same float32 arithmetic in two programs, its sums in XLA's order of each.
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max()),
    got,
    expected,
  )


def test_update_recipe_state_refuses_mismatched_grads():
  model = ta_nnx.Linear(
    32, 16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0)
  )
  x, c = _normal(0, (8, 32)), _normal(1, (8, 16))
  _, (grads, state_grads) = nnx.jit(ta_nnx.value_and_grad(_product_loss))(model, x, c)
  with pytest.raises(ValueError, match="do not match the recipe state"):
    ta_nnx.update_recipe_state(model, grads)  # parameter grads by mistake
  bad = nnx.to_pure_dict(state_grads)
  bad["dot_general"]["state"]["x_amax_history"] = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="x_amax_history has shape"):
    ta_nnx.update_recipe_state(model, bad)
  with pytest.raises(TypeError, match="state_grads must be"):
    ta_nnx.update_recipe_state(model, [1.0])
