"""Linen's quantize with rules: an lm1b-shaped model converted by rules (attention kept in high
precision, the MLPs in FP8, one layer delayed) trains in Linen's plain loop; its warnings name
the layer and point at the user's line."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_adapters as ta
from te_adapters import linen as ta_linen
from tests.models import lm1b_linen, token_batch

OWG = ta_linen.OVERWRITE_WITH_GRADIENT
DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
BLOCK = r"decoder/encoderdecoderblock_\d+"
RULES = [
  (rf"{BLOCK}/SelfAttention_0/.*", None),
  ("decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0", DELAYED),
  (rf"{BLOCK}/MlpBlock_0/Dense_\d", CURRENT),
]


def test_lm1b_converted_by_rules_trains_in_the_plain_loop():
  config = lm1b_linen.TransformerConfig()
  model = lm1b_linen.TransformerLM(config)
  q = ta_linen.quantize(rules=RULES, threshold=None)
  tokens = token_batch(0, 4, 16, config.vocab_size)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.SkippedLayersWarning)  # nothing a rule asked for is skipped
    variables = jax.jit(q(model.init))(jax.random.key(0), tokens)
  mlp = [
    f"decoder/encoderdecoderblock_{i}/MlpBlock_0/Dense_{j}" for i in range(2) for j in range(2)
  ]
  assert q.report.quantized == mlp
  assert q.report.recipes[mlp[0]] == DELAYED and q.report.recipes[mlp[1]] == CURRENT
  attention = {
    f"decoder/encoderdecoderblock_{i}/SelfAttention_0/{n}": (
      r"rule 0 ('decoder/encoderdecoderblock_\d+/SelfAttention_0/.*') keeps it in high precision"
    )
    for i in range(2)
    for n in ("query", "key", "value", "out")
  }
  assert q.report.high_precision == {**attention, "decoder/logitdense": "no rule selects it"}
  assert q.report.skipped == {}

  # Linen's plain loop: jax.grad over the parameters and the recipe state collection, whose
  # gradient is its next value.
  params, recipe_state = nn.unbox(variables["params"]), variables[OWG]
  apply = q(model.apply)

  def loss_fn(params, recipe_state, tokens):
    logits = apply({"params": params, OWG: recipe_state}, tokens)
    return lm1b_linen.next_token_loss(logits, tokens)

  fp8, total = ta.inspect.count_fp8_dot_generals(loss_fn, params, recipe_state, tokens)
  assert fp8 == 4 and total > fp8  # the MLPs' four GEMMs, nothing of attention or the logits
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, recipe_state, opt_state, tokens):
    loss, (grads, recipe_state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      params, recipe_state, tokens
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), recipe_state, opt_state, loss

  losses = []
  for s in range(50):
    params, recipe_state, opt_state, loss = step(
      params, recipe_state, opt_state, token_batch(s, 4, 16, config.vocab_size)
    )
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
  state = recipe_state["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"]["Dense_0"][
    "DelayedScalingDotGeneral_0"
  ]
  assert np.count_nonzero(np.asarray(state["x_amax_history"])) >= 3
  assert float(state["x_scale"][0]) != 1.0
  assert float(state["grad_amax_history"][-1]) > 0
  # Current scaling keeps no state: the delayed layer's is the only one.
  assert jax.tree.map(np.shape, recipe_state) == {
    "decoder": {
      "encoderdecoderblock_0": {
        "MlpBlock_0": {"Dense_0": {"DelayedScalingDotGeneral_0": jax.tree.map(np.shape, state)}}
      }
    }
  }


def test_the_tied_embedding_a_rule_asks_for_is_skipped_with_one_warning_at_the_callers_line():
  config = lm1b_linen.TransformerConfig(logits_via_embedding=True)
  q = ta_linen.quantize(CURRENT, threshold=None)
  tokens = token_batch(0, 2, 16, config.vocab_size)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    jax.eval_shape(q(lm1b_linen.TransformerLM(config).init), jax.random.key(0), tokens)
  [warning] = [w for w in record if issubclass(w.category, ta.SkippedLayersWarning)]
  assert warning.filename == __file__
  assert str(warning.message).startswith(
    "te_adapters.linen.quantize: 1 layer(s) that a rule gave a recipe stay in high precision:"
    "\n  decoder/Embed_0: nn.Embed.attend (a tied output projection) computes its GEMM outside"
    " any dot_general slot"
  )
  assert "stays in high precision" not in str(warning.message)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, name="up")(x)  # the line FrozenStateWarning points at


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Block(name="block_1")(_Block(name="block_0")(x))


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  model, x = _Model(), jnp.ones((4, 32))
  q = ta_linen.quantize(DELAYED, threshold=None)
  variables = jax.eval_shape(q(model.init), jax.random.key(0), x)

  def loss(params, recipe_state):
    return jnp.sum(q(model.apply)({"params": params, OWG: recipe_state}, x))

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # The parameters alone: the state cannot update. Traced: the warning is a trace's.
    jax.eval_shape(jax.grad(loss), variables["params"], variables[OWG])
  frozen = [w for w in record if issubclass(w.category, ta.core.FrozenStateWarning)]
  assert [w.filename for w in frozen] == [__file__] * 2  # one per layer, both of one shape
  for i, w in enumerate(frozen):
    message = str(w.message)
    assert f"layer 'block_{i}/up' (x (4, 32) float32 . kernel (32, 32) float32)" in message
    assert "te_adapters.linen.TrainState.value_and_grad" in message
    assert "nnx" not in message and "haiku" not in message  # Linen's remedy only


def test_the_deprecated_filter_warns_at_the_callers_line_and_still_works():
  with pytest.warns(DeprecationWarning, match=r"quantize: filter= is deprecated.*rules=") as rec:
    q = ta_linen.quantize(CURRENT, filter=lambda path: "MlpBlock" in path, threshold=None)
  assert rec[0].filename == __file__
  config = lm1b_linen.TransformerConfig(num_layers=1)
  jax.eval_shape(
    q(lm1b_linen.TransformerLM(config).init), jax.random.key(0), token_batch(0, 2, 16, 64)
  )
  assert q.report.quantized == [
    f"decoder/encoderdecoderblock_0/MlpBlock_0/Dense_{j}" for j in range(2)
  ]
  assert q.report.high_precision["decoder/logitdense"] == "no rule selects it"
  with pytest.raises(TypeError, match="filter must be callable"):
    ta_linen.quantize(CURRENT, filter="MlpBlock")


def test_layers_with_a_recipe_already_are_an_error_naming_them():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = ta_linen.Dense(32, recipe=CURRENT, threshold=None, name="own")(x)
      x = nn.Dense(
        32, dot_general_cls=ta_linen.make_dot_general_cls(CURRENT, threshold=None), name="slot"
      )(x)
      return nn.Dense(32, name="plain")(x)

  x = jnp.ones((4, 32))
  with pytest.raises(
    ValueError,
    match=(
      r"te_adapters.linen.quantize: these layers are quantized already, by an earlier conversion"
      r" or a recipe of their own: own, slot\. Convert each layer once"
    ),
  ):
    ta_linen.quantize(DELAYED, threshold=None)(Model().init)(jax.random.key(0), x)
  # Rules that leave them out convert the rest; the others keep their own recipe.
  q = ta_linen.quantize(rules=[("plain", DELAYED)], threshold=None)
  variables = q(Model().init)(jax.random.key(0), x)
  assert q.report.quantized == ["plain"]
  assert set(variables[OWG]) == {"plain"}
