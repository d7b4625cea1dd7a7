"""Plain ``jax.grad`` over core state: reuse combines by max; a frozen state is warned about."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from tests import plain_loops as pl

DN = (((1,), (0,)), ((), ()))
RECIPE = ta.DelayedScaling(amax_history_len=pl.HISTORY)


def _gemm(x, w, state):
  return core.dot_general(x, w, DN, recipe=RECIPE, state=state, threshold=None)


def _loss_twice(w, state):
  return jnp.sum(_gemm(pl.X1, w, state) * pl.DY1) + jnp.sum(_gemm(pl.X2, w, state) * pl.DY2)


def _loss_scan(w, state):  # the same state closed over by a scan body: two iterations
  def body(total, xs):
    x, dy = xs
    return total + jnp.sum(_gemm(x, w, state) * dy), None

  xs = (jnp.stack([pl.X1, pl.X2]), jnp.stack([pl.DY1, pl.DY2]))
  return jax.lax.scan(body, 0.0, xs)[0]


def _loss_remat(w, state):  # one use inside jax.checkpoint, one outside
  inner = jax.checkpoint(lambda w: jnp.sum(_gemm(pl.X1, w, state) * pl.DY1))
  return inner(w) + jnp.sum(_gemm(pl.X2, w, state) * pl.DY2)


@pytest.mark.parametrize(
  "loss", [_loss_twice, _loss_scan, _loss_remat], ids=["twice", "scan", "remat"]
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plain_grad_loop_combines_uses_by_max(loss, jit):
  grad = jax.grad(loss, argnums=(0, 1))
  grad = jax.jit(grad) if jit else grad
  w, state = jnp.asarray(pl.W0), core.init_state(RECIPE)
  kernels = []
  for _ in range(3):
    kernels.append(np.asarray(w, np.float64))
    g_w, state = grad(w, state)  # the plain loop: the gradient is the new state
    w = w - pl.LR * g_w
    assert all(v.dtype == jnp.float32 for v in state.values())
  pl.assert_state(state, pl.reference_states(kernels)[-1])
  assert float(state["x_amax_history"][-1]) == 5.0  # a sum would give 8


def test_helper_and_plain_grad_agree_and_checkpoint_as_numpy():
  state = core.init_state(RECIPE)
  plain = jax.grad(_loss_twice, argnums=1)(jnp.asarray(pl.W0), state)
  helper = jax.grad(lambda w, s: _loss_twice(w, core.with_max_grad(s)), argnums=1)(
    jnp.asarray(pl.W0), state
  )
  for k in plain:
    np.testing.assert_array_equal(plain[k], helper[k])
  saved = {k: np.asarray(v) for k, v in plain.items()}  # a plain checkpointer's view
  assert all(v.dtype == np.float32 for v in saved.values())


def test_gemm_below_threshold_keeps_the_state_under_a_plain_grad():
  state = dict(core.init_state(RECIPE), x_scale=jnp.float32([7.0]))
  always_high = core.SizeThreshold(min_mkn=10**12, min_dim=1, platforms=("cpu", "gpu", "tpu"))

  def loss(w, state):  # two uses, both below the threshold: not 2x the old state
    f = lambda x: core.dot_general(x, w, DN, recipe=RECIPE, state=state, threshold=always_high)
    return jnp.sum(f(pl.X1)) + jnp.sum(f(pl.X2))

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    new = jax.grad(loss, argnums=1)(jnp.asarray(pl.W0), state)
  for k in state:
    np.testing.assert_array_equal(new[k], state[k])


def test_params_only_grad_warns_that_the_state_is_frozen():
  state = core.init_state(RECIPE)
  with pytest.warns(core.FrozenStateWarning, match="not differentiated"):
    jax.grad(_loss_twice)(jnp.asarray(pl.W0), state)


def test_no_warning_when_the_state_is_differentiated_or_forward_only():
  state, w = core.init_state(RECIPE), jnp.asarray(pl.W0)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    jax.grad(_loss_twice, argnums=(0, 1))(w, state)
    jax.jit(_loss_twice)(w, state)
    jax.grad(_loss_twice, argnums=1)(w, state)  # the state alone


def test_state_carried_through_a_scan_combines_by_max_after_with_max_grad():
  """A lax.scan that carries the state unchanged as its carry: marked with ``with_max_grad``
  before the scan (the README's way out), the iterations combine by max, as one use would."""

  def loss(w, state):
    state = core.with_max_grad(state)

    def body(state, xs):
      x, dy = xs
      return state, jnp.sum(_gemm(x, w, state) * dy)

    xs = (jnp.stack([pl.X1, pl.X2]), jnp.stack([pl.DY1, pl.DY2]))
    return jnp.sum(jax.lax.scan(body, state, xs)[1])

  state = core.init_state(RECIPE)
  _, g_state = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(pl.W0), state)
  (expected,) = pl.reference_states([pl.W0])
  for name in ("x_amax_history", "grad_amax_history", "x_scale", "grad_scale"):
    np.testing.assert_allclose(np.asarray(g_state[name]), expected[name], rtol=1e-6, err_msg=name)
