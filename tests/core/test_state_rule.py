"""The state rule: gradient = new state; reuse combines by max; scan, remat, forward-only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

import te_adapters as ta
from te_adapters import core
from tests.conftest import assert_scales_equal

DN = (((1,), (0,)), ((), ()))
RECIPE = ta.DelayedScaling(amax_history_len=4)


def _probe(amax, shape, seed=0):
  t = np.asarray(jax.random.uniform(jax.random.PRNGKey(seed), shape, minval=-0.5, maxval=0.5))
  t = (t * amax).astype(np.float32)
  t[0, 0] = amax
  return jnp.asarray(t)


def _single_use_state(x, w, dy, state):
  def loss(x, w, state):
    return jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=state) * dy)

  return jax.grad(loss, argnums=2)(x, w, state)


def test_two_uses_give_the_larger_amax_not_a_sum():
  state = core.init_state(RECIPE)
  w = _probe(1.5, (32, 16))
  x_small, x_large = _probe(2.0, (16, 32)), _probe(5.0, (16, 32), seed=1)
  dy_small, dy_large = _probe(0.5, (16, 16)), _probe(3.0, (16, 16), seed=2)

  def loss(w, state, max_grad):
    if max_grad:
      state = core.with_max_grad(state)
    y1 = core.dot_general(x_small, w, DN, threshold=None, recipe=RECIPE, state=state)
    y2 = core.dot_general(x_large, w, DN, threshold=None, recipe=RECIPE, state=state)
    return jnp.sum(y1 * dy_large) + jnp.sum(y2 * dy_small)

  for jit in (False, True):
    grad = jax.grad(loss, argnums=1)
    grad = jax.jit(grad, static_argnums=2) if jit else grad
    new = grad(w, state, True)
    # One use that saw x_large and dy_large (the larger amaxes of each role).
    expected = _single_use_state(x_large, w, dy_large, state)
    for k in expected:
      np.testing.assert_array_equal(new[k], expected[k], err_msg=k)
      assert new[k].dtype == jnp.float32
    np.testing.assert_array_equal(new["x_amax_history"], [0, 0, 0, 5.0])
    assert_scales_equal(new["grad_scale"], [np.float32(57344.0) / np.float32(3.0)])
  # A plain jax.grad (no with_max_grad) gives the same max: dot_general marks the state itself,
  # once per traced array, so the uses do not add up (that would be 7.0).
  plain = jax.grad(loss, argnums=1)(w, state, False)
  for k in expected:
    np.testing.assert_array_equal(plain[k], expected[k], err_msg=k)
    assert plain[k].dtype == jnp.float32


def test_reuse_where_one_use_keeps_its_scale():
  # First step: the history is empty; one use sees an all-zero x (keeps scale 1), the other an
  # amax of 2 (updates to 448/2). One use seeing the larger amax gives 224, not 1.
  state = core.init_state(RECIPE)
  w = _probe(1.0, (32, 16))
  zeros, x = jnp.zeros((16, 32)), _probe(2.0, (16, 32), seed=3)

  def loss(w, state):
    state = core.with_max_grad(state)
    return jnp.sum(
      core.dot_general(zeros, w, DN, threshold=None, recipe=RECIPE, state=state)
    ) + jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=state))

  for order in (False, True):
    fn = (lambda w, s: loss(w, s)) if not order else jax.jit(loss)
    new = jax.grad(fn, argnums=1)(w, state)
    assert_scales_equal(new["x_scale"], [np.float32(448.0) / np.float32(2.0)])
    np.testing.assert_array_equal(new["x_amax_history"], [0, 0, 0, 2.0])

  # Both uses keep the scale (all-zero x twice): the old scale comes back, positive.
  state = dict(state, x_scale=jnp.float32([5.0]))

  def loss_zero(w, state):
    state = core.with_max_grad(state)
    return sum(
      jnp.sum(core.dot_general(zeros, w, DN, threshold=None, recipe=RECIPE, state=state))
      for _ in range(2)
    )

  new = jax.grad(loss_zero, argnums=1)(w, state)
  np.testing.assert_array_equal(new["x_scale"], [5.0])


def test_with_max_grad_on_unused_state_gives_zero_gradient():
  state = core.init_state(RECIPE)

  def loss(w, state):
    state = core.with_max_grad(state)
    used = core.dot_general(
      _probe(1.0, (16, 32)), w, DN, threshold=None, recipe=RECIPE, state=state["a"]
    )
    return jnp.sum(used)

  states = {"a": state, "b": dict(state, x_scale=jnp.float32([3.0]))}
  new = jax.grad(loss, argnums=1)(_probe(1.0, (32, 16)), states)
  jax.tree_util.tree_map(lambda g: np.testing.assert_array_equal(g, np.zeros_like(g)), new["b"])
  np.testing.assert_array_equal(core.updated_state(states, new)["b"]["x_scale"], [3.0])


def test_scan_over_stacked_per_layer_state():
  n_layers = 3
  states = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n_layers), core.init_state(RECIPE))
  ws = jnp.stack([_probe(1.0 + i, (32, 32), seed=i) for i in range(n_layers)])
  x = _probe(2.0, (16, 32), seed=7)

  def loss(ws, states):
    def body(h, layer):
      w, s = layer
      return core.dot_general(h, w, DN, threshold=None, recipe=RECIPE, state=s), None

    h, _ = jax.lax.scan(body, x, (ws, states))
    return jnp.sum(h)

  new = jax.jit(jax.grad(loss, argnums=1))(ws, states)

  # Reference: the same layers unrolled in Python.
  def loss_unrolled(ws, states):
    h = x
    for i in range(n_layers):
      s = jax.tree_util.tree_map(lambda a, i=i: a[i], states)
      h = core.dot_general(h, ws[i], DN, threshold=None, recipe=RECIPE, state=s)
    return jnp.sum(h)

  ref = jax.grad(loss_unrolled, argnums=1)(ws, states)
  for k in ref:
    np.testing.assert_allclose(new[k], ref[k], rtol=1e-6, err_msg=k)
  np.testing.assert_array_equal(new["kernel_amax_history"][:, -1], [1.0, 2.0, 3.0])


def test_scan_with_broadcast_state_and_microbatches_take_max():
  state = core.init_state(RECIPE)
  w = _probe(1.0, (32, 16))
  amaxes = [1.0, 6.0, 2.0]
  xs = jnp.stack([_probe(a, (16, 32), seed=i) for i, a in enumerate(amaxes)])

  def loss(w, state):
    state = core.with_max_grad(state)

    def body(total, x):
      return total + jnp.sum(
        core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=state)
      ), None

    return jax.lax.scan(body, 0.0, xs)[0]

  new = jax.jit(jax.grad(loss, argnums=1))(w, state)
  np.testing.assert_array_equal(new["x_amax_history"], [0, 0, 0, 6.0])
  assert_scales_equal(new["x_scale"], [np.float32(448.0) / np.float32(6.0)])
  np.testing.assert_array_equal(new["kernel_amax_history"], [0, 0, 0, 1.0])


def test_remat_gives_same_grads_and_state():
  state = core.init_state(RECIPE)
  x, w = _probe(3.0, (16, 32)), _probe(1.0, (32, 32), seed=1)

  def block(x, w, state):
    h = jnp.tanh(core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=state))
    return core.dot_general(h, w, DN, threshold=None, recipe=RECIPE, state=state)

  def make_loss(fn):
    def loss(x, w, state):
      return jnp.sum(fn(x, w, core.with_max_grad(state)) ** 2)

    return loss

  plain = jax.jit(jax.grad(make_loss(block), argnums=(0, 1, 2)))(x, w, state)
  for policy in (None, core.save_quantized_operands, core.checkpoint_dots_and_quantized_gemms):
    remat = jax.checkpoint(block, policy=policy)
    got = jax.jit(jax.grad(make_loss(remat), argnums=(0, 1, 2)))(x, w, state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, plain)


def test_remat_policy_saves_the_quantized_operands():
  x, w = _probe(3.0, (16, 32)), _probe(1.0, (32, 16), seed=1)
  recipe = ta.Float8CurrentScaling()

  def f(x, w):
    return jnp.sum(jnp.sin(core.dot_general(x, w, DN, threshold=None, recipe=recipe)))

  def saved(policy):
    return [
      (str(aval.dtype), aval.shape)
      for aval, _ in saved_residuals(jax.checkpoint(f, policy=policy), x, w)
    ]

  # The FP8 data is saved as its uint8 bit pattern (see core/_gemm.py: _name_fp8).
  kept = saved(core.save_quantized_operands)
  fp8_saved = [shape for d, shape in kept if d == "uint8"]
  assert sorted(int(np.prod(s)) for s in fp8_saved) == [16 * 32, 32 * 16]
  nothing = saved(jax.checkpoint_policies.nothing_saveable)
  assert not any(d == "uint8" or d.startswith("float8") for d, _ in nothing)
  assert ("float32", (16, 16)) in saved(core.save_quantized_gemms)


def test_forward_only_leaves_state_alone_and_unused_gemm_keeps_state():
  state = core.init_state(RECIPE)
  x, w = _probe(3.0, (16, 32)), _probe(1.0, (32, 16))
  before = jax.tree_util.tree_map(np.asarray, state)
  for _ in range(3):
    jax.jit(lambda x, w, s: core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=s))(
      x, w, state
    )
  jax.tree_util.tree_map(np.testing.assert_array_equal, state, before)

  def loss(w, states):
    used = core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=states["used"])
    unused = core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=states["unused"])
    return jnp.sum(used) + 0.0 * jax.lax.stop_gradient(jnp.sum(unused))

  states = {"used": state, "unused": dict(state, x_scale=jnp.float32([9.0]))}
  grads = jax.grad(loss, argnums=1)(w, states)
  np.testing.assert_array_equal(grads["unused"]["x_scale"], [0.0])  # raw gradient: zero
  new = core.updated_state(states, grads)
  np.testing.assert_array_equal(new["unused"]["x_scale"], [9.0])
  np.testing.assert_array_equal(new["used"]["x_amax_history"], [0, 0, 0, 3.0])


@pytest.mark.parametrize("recipe", [ta.Float8CurrentScaling(), None])
def test_stateless_state_is_empty(recipe):
  if recipe is None:
    with pytest.raises(TypeError):
      core.init_state(recipe)
    return
  assert core.init_state(recipe) == {}
