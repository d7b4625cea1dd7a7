"""te_adapters.haiku.Linear: parity with hk.Linear, FP8 numerics, delayed-scaling state."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import haiku as ta_hk
from te_adapters.core import init_state
from tests.conftest import FP8_GEMM_RTOL

_CONFIGS = [
  {},
  {"with_bias": False},
  {"w_init": hk.initializers.VarianceScaling(2.0), "b_init": jnp.ones},
  {"name": "proj"},
]


def test_parameters_match_hk_linear():
  x32, x16 = jnp.ones((4, 48)), jnp.ones((4, 64), jnp.bfloat16)

  def forward(cls, x32, x16):
    outs = [cls(32, **kw)(x32) for kw in _CONFIGS]
    return outs + [cls(16, name="half")(x16)]  # parameters take the input's dtype

  @jax.jit
  def init_both(key):
    ref = hk.transform(lambda a, b: forward(hk.Linear, a, b)).init(key, x32, x16)
    new = hk.transform(lambda a, b: forward(ta_hk.Linear, a, b)).init(key, x32, x16)
    return ref, new

  p_ref, p_new = init_both(jax.random.key(0))
  assert jax.tree.structure(p_new) == jax.tree.structure(p_ref)
  assert sorted(p_new) == ["half", "linear", "linear_1", "linear_2", "proj"]
  assert set(p_new["linear_1"]) == {"w"} and set(p_new["linear"]) == {"w", "b"}
  assert p_new["half"]["w"].dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(p_new), jax.tree.leaves(p_ref), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_recipe_none_is_hk_linear():
  rng = np.random.default_rng(1)
  cases = []
  for shape, dtype in (((5, 48), jnp.float32), ((2, 3, 48), jnp.bfloat16), ((48,), jnp.float32)):
    params = {"linear": {"w": rng.normal(size=(48, 24)), "b": rng.normal(size=(24,))}}
    cases.append(
      jax.tree.map(lambda a, dtype=dtype: jnp.asarray(a, dtype), (params, rng.normal(size=shape)))
    )
  ref = hk.transform(lambda x: hk.Linear(24)(x))
  new = hk.transform(lambda x: ta_hk.Linear(24, recipe=None)(x))

  @jax.jit
  def outputs_and_grads(cases):
    results = []
    for params, x in cases:
      for f in (ref, new):
        y, vjp = jax.vjp(lambda p, x, f=f: f.apply(p, None, x), params, x)
        results.append((y, vjp(jnp.ones_like(y))))
    return results

  results = outputs_and_grads(cases)
  for (y_ref, g_ref), (y_new, g_new) in zip(results[::2], results[1::2], strict=True):
    assert y_new.dtype == y_ref.dtype and y_new.shape == y_ref.shape
    for a, b in zip(jax.tree.leaves((y_new, g_new)), jax.tree.leaves((y_ref, g_ref)), strict=True):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_current_scaling_numerics_against_float64(rel):
  rng = np.random.default_rng(3)
  x, w, g = (rng.normal(size=s).astype(np.float32) for s in ((64, 128), (128, 64), (64, 64)))
  f = hk.transform(
    lambda x: ta_hk.Linear(64, with_bias=False, threshold=None, recipe=ta.Float8CurrentScaling())(x)
  )
  params = {"linear": {"w": w}}

  @jax.jit
  def output_and_grads(params, x):
    y, vjp = jax.vjp(lambda p, x: f.apply(p, None, x), params, x)
    return y, *vjp(g)

  y, dw, dx = output_and_grads(params, x)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  err_y = rel(y, x64 @ w64)
  assert 0.01 < err_y < 0.05  # clearly above bf16's ~0.003: FP8 quantization happened
  assert rel(dx, g64 @ w64.T) < 0.08
  assert rel(dw["linear"]["w"], x64.T @ g64) < 0.08


def _expected_delayed(amaxes, length, fp8_max):
  """TE's delayed-scaling history and scale after each step (reference spec, section 1.2)."""
  history = np.zeros(length, np.float32)
  scale = np.float32(1.0)
  out = []
  for a in amaxes:
    history[0] = a
    window = np.max(history)
    if window > 0:
      scale = np.float32(fp8_max) / np.float32(window)
    history = np.roll(history, -1)
    history[0] = 0.0
    out.append((history.copy(), np.float32(scale)))
  return out


def _unit_max(rng, shape):
  """float32 N(0,1) samples scaled so that max(|x|) is exactly 1."""
  x = rng.normal(size=shape).astype(np.float32)
  return x / np.max(np.abs(x))


def _fake_quant(x, scale):
  """E4M3 quantize-dequantize in numpy: cast(clip(x * scale)) / scale."""
  scale = np.float32(np.asarray(scale).reshape(()))
  q = np.clip(np.asarray(x, np.float32) * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return q.astype(np.float64) / np.float64(scale)


def test_delayed_scaling_history_through_steps():
  length, steps = 3, 4
  r = ta.DelayedScaling(amax_history_len=length)
  f = hk.transform_with_state(
    lambda x: ta_hk.Linear(32, with_bias=False, threshold=None, recipe=r)(x)
  )
  rng = np.random.default_rng(4)
  base, gbase = _unit_max(rng, (16, 32)), _unit_max(rng, (16, 32))
  # Not powers of two apart, so quantizing with a stale scale gives other values than the current.
  x_amax = [2.0, 0.7, 3.0, 1.3]
  g_amax = [1.0, 6.0, 0.3, 2.5]
  w = rng.normal(size=(32, 32)).astype(np.float32)
  params, state = {"linear": {"w": w}}, {"linear": init_state(r)}

  def loss_fn(params, state, x, g):
    y, state = f.apply(params, state, None, x)
    return jnp.sum(y * g), (y, state)

  step = jax.jit(ta_hk.value_grad_and_state(loss_fn, has_aux=True))
  xs = [base * a for a in x_amax]
  gs = [gbase * a for a in g_amax]
  k = np.max(np.abs(w))
  expect = {
    "x": _expected_delayed([np.max(np.abs(v)) for v in xs], length, 448.0),
    "kernel": _expected_delayed([k] * steps, length, 448.0),
    "grad": _expected_delayed([np.max(np.abs(v)) for v in gs], length, 57344.0),
  }
  for t in range(steps):
    old = state["linear"]
    _, y, _, state = step(params, state, xs[t], gs[t])
    for role, seq in expect.items():
      history, scale = seq[t]
      np.testing.assert_allclose(state["linear"][f"{role}_amax_history"], history, rtol=1e-6)
      np.testing.assert_allclose(state["linear"][f"{role}_scale"], [scale], rtol=1e-6)
    # The forward pass quantizes with the scales stored before the step.
    y_ref = _fake_quant(xs[t], old["x_scale"]) @ _fake_quant(w, old["kernel_scale"])
    np.testing.assert_allclose(y, y_ref, rtol=FP8_GEMM_RTOL, atol=FP8_GEMM_RTOL)
    if t > 0:  # the check can tell the stored scale from the current one
      y_cur = _fake_quant(xs[t], 448 / x_amax[t]) @ _fake_quant(w, 448 / k)
      assert np.max(np.abs(y_cur - y_ref)) > 1e-3
  # The stored scales are the ones of the last step's amaxes; the state kept float32 and shapes.
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state))
  assert state["linear"]["x_amax_history"].shape == (length,)


def test_module_called_twice_records_the_larger_amax():
  r = ta.DelayedScaling(amax_history_len=2)

  def forward(x1, x2):
    lin = ta_hk.Linear(32, threshold=None, recipe=r)
    return lin(x1), lin(x2)

  f = hk.transform_with_state(forward)
  rng = np.random.default_rng(6)
  base = _unit_max(rng, (8, 32))
  x1, x2 = 2.0 * base, 3.0 * base
  g1, g2 = 0.5 * base, 4.0 * base
  w = rng.normal(size=(32, 32)).astype(np.float32)
  params = {"linear": {"w": w, "b": np.zeros(32, np.float32)}}
  state = {"linear": init_state(r)}

  def loss_fn(params, state):
    (y1, y2), state = f.apply(params, state, None, x1, x2)
    return jnp.sum(y1 * g1) + jnp.sum(y2 * g2), state

  _, _, _, new = jax.jit(ta_hk.value_grad_and_state(loss_fn))(params, state)
  s = new["linear"]
  k = np.max(np.abs(w))
  np.testing.assert_allclose(s["x_amax_history"], [0.0, 3.0], rtol=1e-6)  # a sum would give 5
  np.testing.assert_allclose(s["kernel_amax_history"], [0.0, k], rtol=1e-6)
  np.testing.assert_allclose(s["grad_amax_history"], [0.0, 4.0], rtol=1e-6)
  np.testing.assert_allclose(s["x_scale"], [448.0 / 3.0], rtol=1e-6)
  np.testing.assert_allclose(s["grad_scale"], [57344.0 / 4.0], rtol=1e-6)


def test_forward_only_apply_leaves_state_unchanged():
  r = ta.DelayedScaling(amax_history_len=4)
  f = hk.transform_with_state(lambda x: ta_hk.Linear(16, threshold=None, recipe=r)(x))
  x = np.random.default_rng(7).normal(size=(4, 16)).astype(np.float32)

  @jax.jit
  def init_and_apply(key, x):
    params, state = f.init(key, x)
    return state, f.apply(params, state, None, x)[1]

  state, new_state = init_and_apply(jax.random.key(0), x)
  # init creates TE's variables under the module's name with TE's initial values.
  assert jax.tree.structure(state) == jax.tree.structure({"linear": dict(init_state(r))})
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves({"linear": init_state(r)}), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_errors_name_the_problem():
  x = jnp.ones((4, 16))
  key = jax.random.key(0)

  def init(module_fn, x, with_state=False):
    f = (hk.transform_with_state if with_state else hk.transform)(lambda x: module_fn()(x))
    return jax.eval_shape(f.init, key, x)  # errors are raised while tracing

  with pytest.raises(TypeError, match="recipe must be"):
    init(lambda: ta_hk.Linear(16, threshold=None, recipe="fp8"), x)
  with pytest.raises(TypeError, match="floating-point inputs"):
    init(lambda: ta_hk.Linear(16), x.astype(jnp.int32))
  with pytest.raises(ValueError, match="scalar"):
    init(lambda: ta_hk.Linear(16), jnp.float32(1.0))
  # Stateful recipes need transform_with_state.
  with pytest.raises(ValueError, match="transform_with_state"):
    init(lambda: ta_hk.Linear(16, threshold=None, recipe=ta.DelayedScaling()), x)
  # State made for another recipe (history length 4; the module wants 8).
  f8 = hk.transform_with_state(
    lambda x: ta_hk.Linear(16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=8))(x)
  )
  params, state = init(
    lambda: ta_hk.Linear(16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4)),
    x,
    with_state=True,
  )
  with pytest.raises(ValueError, match=r"x_amax_history.*\(4,\).*needs \(8,\)"):
    jax.eval_shape(f8.apply, params, state, None, x)


def test_threshold_is_passed_to_the_core():
  below = dataclasses.replace(ta.core.DEFAULT_SIZE_THRESHOLD, platforms=(jax.default_backend(),))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.bfloat16)
  plain = hk.transform(lambda x: hk.Linear(16)(x))
  params = plain.init(jax.random.key(0), x)
  y_ref = plain.apply(params, None, x)
  recipe = ta.DelayedScaling(amax_history_len=4)
  state = {"linear": init_state(recipe)}
  ours = hk.transform_with_state(lambda x: ta_hk.Linear(16, recipe=recipe, threshold=below)(x))
  q = ta_hk.quantize(recipe, threshold=below)
  intercepted = hk.transform_with_state(q(lambda x: hk.Linear(16)(x)))
  for f in (ours, intercepted):
    with pytest.warns(ta.core.HighPrecisionGemmWarning, match="M=4, K=32, N=16"):
      y, _ = f.apply(params, state, None, x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  forced = hk.transform_with_state(lambda x: ta_hk.Linear(16, recipe=recipe, threshold=None)(x))
  assert ta.inspect.count_fp8_dot_generals(
    lambda p, s, x: forced.apply(p, s, None, x), params, state, x
  ) == (1, 1)
  assert ta_hk.quantize(recipe).threshold == ta.core.DEFAULT_SIZE_THRESHOLD
  with pytest.raises(TypeError, match="threshold must be"):
    ta_hk.quantize(recipe, threshold=1)
