"""``te_adapters.linen.wrap_function_in_te_state_module``: a function calling the core, given
recipe state by a Linen module (TE's function of that name)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import te_adapters as ta
from te_adapters import core
from te_adapters import linen as ta_linen
from tests.conftest import rel_err

OWG = ta_linen.OVERWRITE_WITH_GRADIENT
DIMS = (((1,), (0,)), ((), ()))
# Two compiled programs agree bit for bit on CPU; on a GPU XLA may fuse them differently, and a
# float32 sum an ulp apart can move an FP8 code by one step: compared normwise there.
ON_CPU = jax.default_backend() == "cpu"


def _assert_same(got, want, what):
  if ON_CPU:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)
  else:
    assert rel_err(got, want) < 1e-2, what


def _matmul(quantization, x, w):
  return core.dot_general(x, w, DIMS, **quantization())


def _data(step, m=32, k=64, n=32):
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(step), 3)
  # A different amax each step, so the history moves.
  x = jax.random.normal(kx, (m, k)) * (1.0 + step)
  return x, jax.random.normal(kw, (k, n)), jax.random.normal(kd, (m, n))


def test_trains_in_a_plain_grad_loop_like_the_explicit_core_call():
  recipe = ta.DelayedScaling(amax_history_len=4)
  Matmul = ta_linen.wrap_function_in_te_state_module(_matmul, recipe, threshold=None)
  assert Matmul.__name__ == "TEWrapper__matmul"
  model = Matmul()
  x, w, dy = _data(0)
  variables = model.init(jax.random.PRNGKey(0), x, w)
  assert set(variables) == {OWG}  # the module owns no parameters
  state = dict(variables[OWG])
  initial = core.init_state(recipe)
  assert set(state) == set(initial)
  for name, value in initial.items():
    np.testing.assert_array_equal(state[name], value, err_msg=name)

  @jax.jit
  def wrapped_step(variables, w, x, dy):
    # Linen's plain loop: the gradient of the state collection is its next value.
    loss = lambda v, w: jnp.sum(model.apply(v, x, w) * dy)
    g_vars, g_w = jax.grad(loss, argnums=(0, 1))(variables, w)
    return {OWG: g_vars[OWG]}, w - 0.1 * g_w

  @jax.jit
  def core_step(state, w, x, dy):
    loss = lambda s, w: jnp.sum(
      core.dot_general(x, w, DIMS, recipe=recipe, state=s, threshold=None) * dy
    )
    new_state, g_w = jax.grad(loss, argnums=(0, 1))(state, w)
    return new_state, w - 0.1 * g_w

  w_core = w
  for step in range(3):
    x, _, dy = _data(step)
    variables, w = wrapped_step(variables, w, x, dy)
    state, w_core = core_step(state, w_core, x, dy)
    for name, value in state.items():
      _assert_same(variables[OWG][name], value, name)
    _assert_same(w, w_core, "w")
  # The x history holds the three steps' amaxes, newest last.
  history = np.asarray(variables[OWG]["x_amax_history"])
  amaxes = [float(jnp.max(jnp.abs(_data(s)[0]))) for s in range(3)]
  np.testing.assert_allclose(history[1:], amaxes, rtol=1e-6)


def test_quantizes_in_fp8_against_float64(rel):
  Matmul = ta_linen.wrap_function_in_te_state_module(
    _matmul, ta.Float8CurrentScaling(), threshold=None
  )
  x, w, dy = _data(1, 64, 128, 64)
  variables = Matmul().init(jax.random.PRNGKey(0), x, w)
  assert variables == {}  # current scaling keeps no state
  y, vjp = jax.vjp(lambda x, w: Matmul().apply({}, x, w), x, w)
  gx, gw = vjp(dy)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  # FP8's rounding, not float32's: E4M3 operands give errors of a few percent.
  assert 0.005 < rel(y, x64 @ w64) < 0.05
  assert 0.005 < rel(gx, dy64 @ w64.T) < 0.08
  assert 0.005 < rel(gw, x64.T @ dy64) < 0.08


def test_no_recipe_is_high_precision_without_state():
  Matmul = ta_linen.wrap_function_in_te_state_module(_matmul, None, name="plain")
  assert Matmul.__name__ == "TEWrapper_plain"
  x, w, _ = _data(2)
  variables = Matmul().init(jax.random.PRNGKey(0), x, w)
  assert variables == {}
  np.testing.assert_allclose(Matmul().apply({}, x, w), x @ w, rtol=1e-6, atol=1e-5)


def test_postfixes_give_layernorm_mlps_names_and_results():
  recipe = ta.DelayedScaling(amax_history_len=8)
  mlp = ta_linen.LayerNormMLP(
    intermediate_dim=64,
    activations=("gelu",),
    use_bias=True,
    intermediate_dropout_rate=0.0,
    return_layernorm_output=False,
    recipe=recipe,
    threshold=None,
  )
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 32))
  ref_vars = mlp.init(jax.random.PRNGKey(0), x, deterministic=True)
  p = ref_vars["params"]

  def block(quantization, x, p):
    q0, q1 = quantization("_0"), quantization("_1")
    return core.layernorm_mlp(
      x,
      p["scale"],
      p["ln_bias"],
      p["wi_kernel"],
      p["wo_kernel"],
      p["wi_bias"],
      p["wo_bias"],
      activations=("gelu",),
      recipe=q0["recipe"],
      states=(q0["state"], q1["state"]),
      threshold=q0["threshold"],
    )

  Block = ta_linen.wrap_function_in_te_state_module(block, recipe, threshold=None)
  variables = Block().init(jax.random.PRNGKey(0), x, p)
  assert set(variables[OWG]) == set(ref_vars[OWG]) >= {"x_0_scale", "kernel_1_amax_history"}
  dy = jax.random.normal(jax.random.PRNGKey(4), (2, 16, 32))

  def grads(apply):
    return jax.jit(jax.grad(lambda v: jnp.sum(apply(v) * dy)))

  got = grads(lambda v: Block().apply({OWG: v[OWG]}, x, v["params"])[0])(
    {OWG: variables[OWG], "params": p}
  )
  want = grads(lambda v: mlp.apply(v, x, deterministic=True)[0])(ref_vars)
  for name in ref_vars[OWG]:
    _assert_same(got[OWG][name], want[OWG][name], name)
  for name in p:
    _assert_same(got["params"][name], want["params"][name], name)


def test_grouped_state_with_n_groups():
  recipe = ta.DelayedScaling(amax_history_len=4)

  def experts(quantization, x, w, group_sizes):
    return core.ragged_dot(x, w, group_sizes, **quantization("_e", n_groups=w.shape[0]))

  Experts = ta_linen.wrap_function_in_te_state_module(experts, recipe)
  x = jax.random.normal(jax.random.PRNGKey(5), (32, 32))
  w = jax.random.normal(jax.random.PRNGKey(6), (4, 32, 16))
  gs = jnp.array([8, 0, 16, 8], jnp.int32)
  variables = Experts().init(jax.random.PRNGKey(0), x, w, gs)
  shapes = {k: v.shape for k, v in variables[OWG].items()}
  assert shapes["x_e_amax_history"] == (4, 4) and shapes["kernel_e_scale"] == (4, 1)
  y = Experts().apply(variables, x, w, gs)
  want = jax.lax.ragged_dot(x, w, gs)
  assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.08
  # Current scaling keeps no grouped state.
  Current = ta_linen.wrap_function_in_te_state_module(experts, ta.Float8CurrentScaling())
  assert Current().init(jax.random.PRNGKey(0), x, w, gs) == {}


def test_bad_use_is_a_clear_error():
  x, w, _ = _data(0)
  with pytest.raises(TypeError, match="f must be callable"):
    ta_linen.wrap_function_in_te_state_module("matmul", ta.DelayedScaling())

  def twice(quantization, x, w):
    return core.dot_general(x, w, DIMS, **quantization()) + core.dot_general(
      x, w, DIMS, **quantization()
    )

  Twice = ta_linen.wrap_function_in_te_state_module(twice, ta.DelayedScaling(), threshold=None)
  with pytest.raises(ValueError, match="postfix '' was already declared in this call"):
    Twice().init(jax.random.PRNGKey(0), x, w)

  def zero_groups(quantization, x, w):
    return quantization(n_groups=0)

  Zero = ta_linen.wrap_function_in_te_state_module(zero_groups, ta.DelayedScaling())
  with pytest.raises(ValueError, match="n_groups must be a positive int"):
    Zero().init(jax.random.PRNGKey(0), x, w)


def _ffn(quantization, x, w_experts, w_out, group_sizes):
  y = core.ragged_dot(x, w_experts, group_sizes, **quantization("_0", n_groups=2))
  return core.dot_general(y, w_out, DIMS, **quantization("_1"))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, w_experts, w_out, group_sizes):
    recipe = ta.DelayedScaling(amax_history_len=4)
    ffn = ta_linen.wrap_function_in_te_state_module(_ffn, recipe, threshold=None)
    return ffn(name="ffn")(x, w_experts, w_out, group_sizes)  # the user's line


def test_frozen_state_warning_names_the_wrapper_and_its_gemms():
  args = (jnp.ones((32, 64)), jnp.ones((2, 64, 32)), jnp.ones((32, 16)), jnp.array([16, 16]))
  variables = jax.eval_shape(_Block().init, jax.random.PRNGKey(0), *args)

  def loss(w_experts, w_out, variables):
    return jnp.sum(_Block().apply(variables, args[0], w_experts, w_out, args[3]))

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # The weights alone: the state cannot update.
    jax.eval_shape(jax.grad(loss, argnums=(0, 1)), args[1], args[2], variables)
  frozen = [w for w in record if issubclass(w.category, core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2
  wanted = [
    "layer 'ffn', GEMM '_0' (x (32, 64) float32 . kernel (2, 64, 32) float32)",
    "layer 'ffn', GEMM '_1' (x (32, 32) float32 . kernel (32, 16) float32)",
  ]
  for w, want in zip(frozen, wanted, strict=True):
    message = str(w.message)
    assert want in message
    assert "te_adapters.linen.TrainState.value_and_grad" in message
    assert "nnx" not in message and "haiku" not in message  # Linen's remedy only
