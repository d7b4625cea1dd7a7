"""Linen's ordinary training loop: ``jax.grad`` over params and ``_overwrite_with_gradient``
combines reuse by max; ``jax.grad`` over params only warns that the state is frozen;
``quantize`` converts an existing model (attention, a block applied twice, a tied embedding)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import linen as ta_linen
from tests import plain_loops as pl

RECIPE = ta.DelayedScaling(amax_history_len=pl.HISTORY)
OWG = ta_linen.OVERWRITE_WITH_GRADIENT


class Twice(nn.Module):
  @nn.compact
  def __call__(self, x1, x2):
    layer = nn.Dense(
      32,
      use_bias=False,
      kernel_init=lambda *_: jnp.asarray(pl.W0),
      dot_general_cls=ta_linen.make_dot_general_cls(RECIPE, threshold=None),
    )
    return jnp.sum(layer(x1) * pl.DY1) + jnp.sum(layer(x2) * pl.DY2)


def test_plain_grad_loop_combines_reuse_by_max():
  model = Twice()
  variables = model.init(jax.random.key(0), pl.X1, pl.X2)
  params, state = variables["params"], variables[OWG]

  def loss(params, state):
    return model.apply({"params": params, OWG: state}, pl.X1, pl.X2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  kernels = []
  for _ in range(3):
    kernels.append(np.asarray(params["Dense_0"]["kernel"], np.float64))
    g_params, state = step(params, state)  # the plain loop: the gradient is the new state
    params = jax.tree.map(lambda p, g: p - pl.LR * g, params, g_params)
  pl.assert_state(state["Dense_0"]["DelayedScalingDotGeneral_0"], pl.reference_states(kernels)[-1])


def test_params_only_grad_warns_and_train_state_does_not():
  model = Twice()
  variables = model.init(jax.random.key(0), pl.X1, pl.X2)
  with pytest.warns(core.FrozenStateWarning, match="TrainState.value_and_grad"):
    jax.grad(lambda p: model.apply({**variables, "params": p}, pl.X1, pl.X2))(variables["params"])
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(pl.LR))
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    state.value_and_grad(lambda v: model.apply(v, pl.X1, pl.X2))


def test_dense_given_the_class_instead_of_an_instance_says_so():
  cls = ta_linen.make_dot_general_cls(RECIPE)
  message = r"pass an instance.*dot_general=DelayedScalingDotGeneral\(\)"
  with pytest.raises(TypeError, match=message):
    nn.Dense(32, dot_general=cls).init(jax.random.key(0), jnp.ones((16, 32)))
  nn.Dense(32, dot_general=cls()).init(jax.random.key(0), jnp.ones((16, 32)))  # the fix works


class LM(nn.Module):
  """An lm1b-shaped model: tied embedding, attention + MLP block applied twice."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(64, 32)
    x = embed(tokens)
    attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    mlp = nn.Sequential([nn.Dense(64), nn.gelu, nn.Dense(32)])
    small = nn.Dense(10)  # not a multiple of 16: stays in high precision
    for _ in range(2):
      x = x + attn(x)
      x = x + mlp(x)
    return embed.attend(x) + jnp.mean(small(x))


def _train(plain, steps=3):
  q = ta_linen.quantize(RECIPE, threshold=None)
  model = LM()
  tokens = jnp.arange(2 * 16).reshape(2, 16) % 64
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the layers left in high precision
    variables = q(model.init)(jax.random.key(0), tokens)

  def loss_fn(variables):
    logits = q(model.apply)(variables, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  if plain:
    params, recipe_state = variables["params"], variables[OWG]
    step = jax.jit(jax.grad(lambda p, s: loss_fn({"params": p, OWG: s}), argnums=(0, 1)))
    for _ in range(steps):
      g_params, recipe_state = step(params, recipe_state)
      params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g_params)
    return q.report, recipe_state
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1))
  for _ in range(steps):
    _, grads = state.value_and_grad(loss_fn)
    state = state.apply_gradients(grads=grads)
  return q.report, state.recipe_state


def test_quantize_converts_an_existing_model_and_reports_what_it_could_not():
  report, _ = _train(plain=True, steps=0)
  attn = "MultiHeadDotProductAttention_0"
  assert report.quantized == [f"{attn}/{n}" for n in ("query", "key", "value", "out")] + [
    "Dense_0",
    "Dense_1",
  ]
  assert "K=32, N=10" in report.skipped["Dense_2"]
  assert "Embed.attend" in report.skipped["Embed_0"]
  assert "skipped 2" in str(report)


def test_converted_model_plain_loop_matches_the_train_state_loop():
  _, plain = _train(plain=True)
  _, helper = _train(plain=False)
  assert jax.tree.structure(plain) == jax.tree.structure(helper)
  # The same arithmetic in two programs: identical on CPU. On the GPU their FP8 sums may differ
  # in the last bits (see FP8_GEMM_RTOL), which E5M2 gradients and three training steps grow to
  # a few percent of an amax (3.4% seen on an H100). A sum of the two uses instead of their max
  # is 2x.
  rtol = 1e-6 if jax.default_backend() == "cpu" else 0.1
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(helper), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol)
  query = plain["MultiHeadDotProductAttention_0"]["query"]["DelayedScalingDotGeneral_0"]
  assert np.all(np.asarray(query["x_amax_history"])[-3:] > 0)


def test_quantize_none_and_rules_keep_layers_in_high_precision():
  tokens = jnp.arange(32).reshape(2, 16) % 64
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    q = ta_linen.quantize(rules=[(r"Dense_\d", RECIPE)], threshold=None)
    variables = q(LM().init)(jax.random.key(0), tokens)
    assert set(variables[OWG]) == {"Dense_0", "Dense_1"}
    assert q.report.high_precision["MultiHeadDotProductAttention_0/query"] == "no rule selects it"
    assert "Embed_0" not in q.report.skipped  # no rule asked for its attend
    none = ta_linen.quantize(None)
    assert set(none(LM().init)(jax.random.key(0), tokens)) == {"params"}


def test_quantize_report_names_the_gemms_the_threshold_kept_in_high_precision():
  """The suite's default threshold applies on every platform (tests/conftest.py)."""
  model = nn.Sequential([nn.Dense(64), nn.Dense(32)])
  x = jnp.ones((4, 32), jnp.float32)
  for threshold, expected in ((core.DEFAULT_SIZE_THRESHOLD, ["layers_0", "layers_1"]), (None, [])):
    q = ta_linen.quantize(ta.Float8CurrentScaling(), threshold=threshold)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
      q(model.init)(jax.random.key(0), x)
    assert len(q.report.quantized) == 2
    assert [p.rsplit("/", 1)[-1] for p in q.report.high_precision] == expected
  q = ta_linen.quantize(ta.Float8CurrentScaling())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    q(model.init)(jax.random.key(0), x)
  assert list(q.report.high_precision.values())[0].startswith("M=4, K=32, N=64: below the size")
  assert "2 of the quantized (all of them) run in high precision" in str(q.report)
