"""Haiku's ordinary training loop: ``jax.grad`` over params and state combines reuse by max;
``jax.grad`` over params only warns that the state is frozen; a transformer block with
``hk.MultiHeadAttention`` applied twice, converted by ``quantize``, against the helper's loop."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from tests import plain_loops as pl

RECIPE = ta.DelayedScaling(amax_history_len=pl.HISTORY)


def _twice(x1, x2):
  layer = ta_hk.Linear(
    32, with_bias=False, recipe=RECIPE, threshold=None, w_init=lambda s, d: jnp.asarray(pl.W0, d)
  )
  return jnp.sum(layer(x1) * pl.DY1) + jnp.sum(layer(x2) * pl.DY2)


def test_plain_grad_loop_combines_reuse_by_max():
  model = hk.transform_with_state(_twice)
  params, state = model.init(None, pl.X1, pl.X2)

  def loss(params, state):
    return model.apply(params, state, None, pl.X1, pl.X2)[0]

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  kernels = []
  for _ in range(3):
    kernels.append(np.asarray(params["linear"]["w"], np.float64))
    g_params, state = step(params, state)  # the plain loop: the gradient is the new state
    params = jax.tree.map(lambda p, g: p - pl.LR * g, params, g_params)
  pl.assert_state(state["linear"], pl.reference_states(kernels)[-1])
  saved = jax.tree.map(np.asarray, state)  # a plain checkpointer's view
  assert all(v.dtype == np.float32 for v in jax.tree.leaves(saved))


def test_params_only_grad_warns_and_helper_does_not():
  model = hk.transform_with_state(_twice)
  params, state = model.init(None, pl.X1, pl.X2)

  def loss(params, state):
    return model.apply(params, state, None, pl.X1, pl.X2)

  with pytest.warns(core.FrozenStateWarning, match="value_grad_and_state"):
    jax.grad(lambda p, s: loss(p, s)[0])(params, state)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    ta_hk.value_grad_and_state(loss)(params, state)


def _block(tokens):
  """Embedding, one attention + MLP block applied twice (reuse), and an output projection."""
  x = hk.Embed(64, 32, name="embed")(tokens)
  attn = hk.MultiHeadAttention(num_heads=2, key_size=16, w_init=hk.initializers.VarianceScaling())
  mlp = hk.nets.MLP([64, 32])
  for _ in range(2):
    x = x + attn(x, x, x)
    x = x + mlp(jax.nn.gelu(x))
  logits = hk.Linear(64, name="logits")(x)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def _train(helper, steps=3):
  q = ta_hk.quantize(RECIPE, threshold=None)
  model = hk.transform_with_state(q(_block))
  tokens = jnp.arange(2 * 16).reshape(2, 16) % 64
  params, state = model.init(jax.random.key(0), tokens)

  def loss(params, state):
    return model.apply(params, state, None, tokens)

  if helper:
    step = ta_hk.value_grad_and_state(loss)
    run = lambda p, s: step(p, s)[2:]
  else:
    run = jax.grad(lambda p, s: loss(p, s)[0], argnums=(0, 1))
  run = jax.jit(run)
  for _ in range(steps):
    g_params, state = run(params, state)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g_params)
  return q.report, state


def test_attention_block_applied_twice_plain_loop_matches_the_helper_loop():
  report, plain = _train(helper=False)
  _, helper = _train(helper=True)
  assert len(report.quantized) == 7  # query, key, value, linear (output), 2 MLP layers, logits
  assert jax.tree.structure(plain) == jax.tree.structure(helper)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(helper), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  history = np.asarray(plain["multi_head_attention/query"]["x_amax_history"])
  assert np.all(history[-3:] > 0)


_SCAN_XS = jnp.stack([pl.X1 * 0 + a * jnp.sign(pl.X1) for a in (2.0, 5.0, 3.0)])


def _scanned(xs):
  """One layer run on three inputs (amax 2, 5, 3) through hk.scan, which carries its state."""
  layer = ta_hk.Linear(32, with_bias=False, recipe=RECIPE, threshold=None)

  def body(carry, x):
    return carry, layer(x)

  return jnp.sum(hk.scan(body, 0.0, xs)[1])


def test_plain_grad_over_state_inside_hk_scan_is_refused_at_trace_time():
  """hk.scan carries the layer's state unchanged through the iterations, so a plain jax.grad
  over it would add up their amaxes (10.0, not 5.0): tracing it raises and names the helper.
  The forward pass and a gradient over the parameters alone still trace."""
  model = hk.transform_with_state(_scanned)
  params, state = model.init(jax.random.key(0), _SCAN_XS)

  def loss(params, state):
    return model.apply(params, state, None, _SCAN_XS)[0]

  with pytest.raises(ValueError, match=r"hk\.scan.*add up.*value_grad_and_state"):
    jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)
  assert np.isfinite(float(jax.jit(loss)(params, state)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.FrozenStateWarning)
    grads = jax.jit(jax.grad(loss))(params, state)
  assert np.all(np.isfinite(np.asarray(grads["linear"]["w"])))


def test_helper_inside_hk_scan_takes_the_max():
  model = hk.transform_with_state(_scanned)
  params, state = model.init(jax.random.key(0), _SCAN_XS)

  def loss(params, state):
    return model.apply(params, state, None, _SCAN_XS)

  _, _, _, new_state = jax.jit(ta_hk.value_grad_and_state(loss))(params, state)
  history = np.asarray(new_state["linear"]["x_amax_history"])
  assert history[-1] == 5.0, history  # a sum over the iterations would be 10.0
  np.testing.assert_allclose(new_state["linear"]["x_scale"], [448.0 / 5.0], rtol=1e-6)


def test_plain_grad_through_layer_stack_gives_each_layer_its_state():
  """hk.layer_stack stacks the layers' state (one slice per iteration): the plain jax.grad is
  allowed there, and each layer's history holds the amax of its own input."""

  def stacked(xs):
    @hk.layer_stack(3, with_per_layer_inputs=True)
    def body(carry, x):
      return carry, ta_hk.Linear(32, with_bias=False, recipe=RECIPE, threshold=None)(x)

    return jnp.sum(body(jnp.zeros(()), xs)[1])

  model = hk.transform_with_state(stacked)
  params, state = model.init(jax.random.key(0), _SCAN_XS)

  def loss(params, state):
    return model.apply(params, state, None, _SCAN_XS)[0]

  _, state_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)
  (layer_state,) = state_grads.values()
  np.testing.assert_array_equal(np.asarray(layer_state["x_amax_history"])[:, -1], [2.0, 5.0, 3.0])
