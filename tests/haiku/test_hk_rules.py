"""Haiku's quantize with rules: a model shaped like Haiku's transformer example converted by rules
(attention kept in high precision, the MLPs in FP8, one layer delayed) trains in Haiku's plain
loop; its warnings name the layer and point at the user's line."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_adapters as ta
from te_adapters import haiku as ta_hk
from tests.models import token_batch, transformer_haiku

DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
RULES = [
  (r"transformer/multi_head_attention(_\d+)?/.*", None),
  ("transformer/linear", DELAYED),
  (r"transformer/linear_\d+", CURRENT),
]


def test_transformer_converted_by_rules_trains_in_the_plain_loop():
  q = ta_hk.quantize(rules=RULES, threshold=None)
  f = hk.transform_with_state(q(transformer_haiku.forward))
  tokens = token_batch(0, 4, 16, 64)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.SkippedLayersWarning)  # nothing a rule asked for is skipped
    params, state = jax.jit(f.init)(jax.random.key(0), tokens)
  mlp = [
    "transformer/linear",
    "transformer/linear_1",
    "transformer/linear_2",
    "transformer/linear_3",
  ]
  assert q.report.quantized == mlp
  assert q.report.recipes == {mlp[0]: DELAYED, **dict.fromkeys(mlp[1:], CURRENT)}
  rule = r"rule 0 ('transformer/multi_head_attention(_\d+)?/.*') keeps it in high precision"
  assert q.report.high_precision == {
    **{
      f"transformer/multi_head_attention{i}/{n}": rule
      for i in ("", "_1")
      for n in ("query", "key", "value", "linear")
    },
    "language_model/linear": "no rule selects it",
  }
  assert q.report.skipped == {}
  assert set(state) == {"transformer/linear"}  # the delayed layer's state, no other

  # Haiku's plain loop: jax.grad over params and state; the state's gradient is the new state.
  def loss_fn(params, state, tokens):
    logits, _ = f.apply(params, state, None, tokens)
    return transformer_haiku.next_token_loss(logits, tokens)

  fp8, total = ta.inspect.count_fp8_dot_generals(loss_fn, params, state, tokens)
  assert fp8 == 4 and total > fp8  # the MLPs' four GEMMs, nothing of attention or the logits
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, state, opt_state, tokens):
    loss, (grads, state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss

  losses = []
  for s in range(50):
    params, state, opt_state, loss = step(params, state, opt_state, token_batch(s, 4, 16, 64))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
  layer = state["transformer/linear"]
  assert np.count_nonzero(np.asarray(layer["x_amax_history"])) >= 3
  assert float(layer["x_scale"][0]) != 1.0
  assert float(layer["grad_amax_history"][-1]) > 0


def test_rules_match_haikus_own_names_tilde_scopes_included():
  q = ta_hk.quantize(
    rules=[("mlp/~/linear_0", DELAYED), (r"mlp/~/linear_\d", CURRENT)], threshold=None
  )
  f = hk.transform_with_state(q(lambda x: hk.nets.MLP([32, 32, 16])(x)))
  _, state = jax.eval_shape(f.init, jax.random.key(0), jnp.ones((4, 16)))
  assert q.report.quantized == ["mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2"]
  assert q.report.recipes["mlp/~/linear_0"] == DELAYED
  assert set(state) == {"mlp/~/linear_0"}


class _Block(hk.Module):
  def __call__(self, x):
    return hk.Linear(32, name="up")(x)  # the line FrozenStateWarning points at


def _forward(x):
  return _Block(name="block_1")(_Block(name="block_0")(x))


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  f = hk.transform_with_state(ta_hk.quantize(DELAYED, threshold=None)(_forward))
  x = jnp.ones((4, 32))
  params, state = jax.eval_shape(f.init, jax.random.key(0), x)

  def loss(params, state):
    return jnp.sum(f.apply(params, state, None, x)[0])

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # The parameters alone: the state cannot update. Traced: the warning is a trace's.
    jax.eval_shape(jax.grad(loss), params, state)
  frozen = [w for w in record if issubclass(w.category, ta.core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2  # one per layer, both of one shape
  for i, w in enumerate(frozen):
    message = str(w.message)
    assert f"layer 'block_{i}/up' (x (4, 32) float32 . kernel (32, 32) float32)" in message
    assert "te_adapters.haiku.value_grad_and_state" in message
    assert "nnx" not in message and "Linen" not in message  # Haiku's remedy only


def test_the_deprecated_module_filter_warns_at_the_callers_line_and_still_works():
  with pytest.warns(DeprecationWarning, match=r"quantize: module_filter= is deprecated") as rec:
    q = ta_hk.quantize(CURRENT, module_filter=lambda name: name != "block_1/up", threshold=None)
  assert rec[0].filename == __file__
  jax.eval_shape(hk.transform(q(_forward)).init, jax.random.key(0), jnp.ones((4, 32)))
  assert q.report.quantized == ["block_0/up"]
  assert q.report.high_precision == {"block_1/up": "no rule selects it"}


def test_layers_with_a_recipe_already_are_an_error_naming_them():
  def forward(x):
    x = ta_hk.Linear(32, recipe=CURRENT, threshold=None, name="own")(x)
    x = ta_hk.Linear(32, recipe=None, name="own_plain")(x)  # a plain hk.Linear, left alone
    return hk.Linear(32, name="plain")(x)

  x = jnp.ones((4, 32))
  with pytest.raises(
    ValueError,
    match=(
      r"te_adapters.haiku.quantize: these layers are quantized already, by an earlier conversion"
      r" or a recipe of their own: own\. Convert each layer once"
    ),
  ):
    jax.eval_shape(
      hk.transform(ta_hk.quantize(CURRENT, threshold=None)(forward)).init, jax.random.key(0), x
    )
  q = ta_hk.quantize(rules=[("plain", CURRENT)], threshold=None)
  jax.eval_shape(hk.transform(q(forward)).init, jax.random.key(0), x)
  assert q.report.quantized == ["plain"]
