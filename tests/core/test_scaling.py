"""Scale arithmetic and TE's delayed-scaling history, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core

DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("margin", [0, 3])
def test_compute_scale_cases(margin):
  old = jnp.float32(7.0)
  amaxes = np.array([0.0, np.inf, np.nan, 1e-30, 448.0, 1.0], np.float32)
  got = np.asarray([core.compute_scale(jnp.float32(a), 448.0, old, margin) for a in amaxes])
  f32 = np.float32
  expected = [
    7.0,
    7.0,
    7.0,
    f32(f32(448.0) / f32(1e-30)) / f32(2.0**margin),
    f32(1.0) / f32(2.0**margin),
    f32(448.0) / f32(2.0**margin),
  ]
  np.testing.assert_array_equal(got, np.asarray(expected, np.float32))


def _probe(amax, shape):
  """A tensor whose amax is exactly `amax` (other entries smaller)."""
  t = np.full(shape, 0.25 * amax, np.float32)
  t[0, 0] = amax
  return jnp.asarray(t)


@pytest.mark.parametrize(
  "algo, fmt, expected_divisors",
  [
    ("max", ta.Format.HYBRID, [1, 4, 4, 4]),
    ("most_recent", ta.Format.HYBRID, [1, 4, 2, 0.5]),
    ("max", ta.Format.E4M3, [1, 4, 4, 4]),
  ],
)
def test_history_sequence_through_dot_general(algo, fmt, expected_divisors):
  # te_jax_reference.md §11 item 1(b): L=3, amaxes 1, 4, 2, 0.5 on every role.
  recipe = ta.DelayedScaling(amax_history_len=3, amax_compute_algo=algo, fp8_format=fmt)
  amaxes = [1.0, 4.0, 2.0, 0.5]
  expected_histories = [[0, 0, 1], [0, 1, 4], [0, 4, 2], [0, 2, 0.5]]
  grad_max = 57344.0 if fmt is ta.Format.HYBRID else 448.0
  state = core.init_state(recipe)

  @jax.jit
  def step(x, w, dy, state):
    def loss(x, w, state):
      return jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state) * dy)

    return jax.grad(loss, argnums=2)(x, w, state)

  for a, hist, div in zip(amaxes, expected_histories, expected_divisors, strict=True):
    scales_used = {k: float(state[k][0]) for k in ("x_scale", "kernel_scale", "grad_scale")}
    state = step(_probe(a, (16, 32)), _probe(a, (32, 16)), _probe(a, (16, 16)), state)
    for role in ("x", "kernel", "grad"):
      np.testing.assert_array_equal(state[f"{role}_amax_history"], np.float32(hist))
      limit = grad_max if role == "grad" else 448.0
      np.testing.assert_array_equal(state[f"{role}_scale"], [np.float32(limit) / np.float32(div)])
    # The scale in the state before a step is the one that step quantized with.
    assert scales_used["x_scale"] > 0


def test_margin_divides_scale():
  recipe = ta.DelayedScaling(amax_history_len=2, margin=2)
  new_scale, new_hist = core.delayed_update(
    jnp.float32([2.0]), jnp.float32([1.0]), jnp.zeros(2, jnp.float32), 448.0, 2, "max"
  )
  np.testing.assert_array_equal(new_scale, [np.float32(448.0 / 2.0 / 4.0)])
  np.testing.assert_array_equal(new_hist, [0.0, 2.0])
  assert recipe.margin == 2


def test_non_finite_amax_keeps_scale_and_quantizes_with_stored_scale():
  recipe = ta.DelayedScaling(amax_history_len=2)
  state = dict(core.init_state(recipe))
  state["x_scale"] = jnp.float32([3.0])
  x = _probe(1.0, (16, 32)).at[1, 1].set(jnp.nan)
  w = _probe(1.0, (32, 16))

  def loss(x, w, state):
    return jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state))

  new = jax.grad(loss, argnums=2)(x, w, state)
  np.testing.assert_array_equal(new["x_scale"], [3.0])
  assert np.isposinf(np.asarray(new["x_amax_history"])[-1])  # a NaN input records amax inf
  np.testing.assert_array_equal(new["kernel_scale"], [448.0])
  x_inf = _probe(1.0, (16, 32)).at[1, 1].set(jnp.inf)
  new = jax.grad(loss, argnums=2)(x_inf, w, state)
  np.testing.assert_array_equal(new["x_scale"], [3.0])


def test_leading_amax_is_the_amax_of_each_leading_index():
  """One amax per expert: max |w[g]| exactly (float64 reference), inf where w[g] holds a NaN or
  an inf, as the per-tensor amax of that slice."""
  from te_adapters.core import formats

  rng = np.random.default_rng(3)
  w = rng.standard_normal((4, 6, 5)) * np.array([1e-3, 1.0, 50.0, 2.0])[:, None, None]
  w[2, 1, 1], w[3, 4, 0] = np.nan, -np.inf
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(w, dtype)
    got = np.asarray(formats.leading_amax(x))
    assert got.dtype == np.float32 and got.shape == (4,)
    want = np.max(np.abs(np.asarray(x, np.float64)[:2]), axis=(1, 2))
    np.testing.assert_array_equal(got[:2], want.astype(np.float32))
    assert np.isposinf(got[2:]).all()
    for g in range(4):
      np.testing.assert_array_equal(got[g : g + 1], np.asarray(formats.tensor_amax(x[g])))
