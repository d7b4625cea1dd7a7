"""NNX's quantize_model with rules: a Gemma-shaped model converted by rules (attention kept in
high precision, the MLPs in FP8, one layer delayed) trains in NNX's plain loop; its warnings
name the layer and point at the user's line."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx
from tests.models import gemma_nnx, token_batch

DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
RULES = [
  (r"layers/\d+/attn/.*", None),
  ("layers/0/mlp/gate_proj", DELAYED),
  (r"layers/\d+/mlp/.*", CURRENT),
]
# NNX's plain loop: differentiate the parameters and the recipe state together.
DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["qkv_einsum", "q_and_kv_einsum"])
def test_gemma_converted_by_rules_trains_in_the_plain_loop(num_kv_heads):
  config = gemma_nnx.GemmaConfig(num_kv_heads=num_kv_heads)
  model = gemma_nnx.Transformer(config, rngs=nnx.Rngs(0))
  report = ta_nnx.quantize_model(model, rules=RULES, threshold=None)
  mlp = [f"layers/{i}/mlp/{n}" for i in range(2) for n in ("down_proj", "gate_proj", "up_proj")]
  attn = (
    ["attn_vec_einsum", "qkv_einsum"]
    if num_kv_heads == 2
    else ["attn_vec_einsum", "kv_einsum", "q_einsum"]
  )
  assert report.quantized == mlp
  assert report.recipes["layers/0/mlp/gate_proj"] == DELAYED
  assert report.recipes["layers/1/mlp/gate_proj"] == CURRENT
  assert report.high_precision == {
    f"layers/{i}/attn/{n}": r"rule 0 ('layers/\d+/attn/.*') keeps it in high precision"
    for i in range(2)
    for n in attn
  }
  assert report.skipped == {}

  tokens = token_batch(0, 4, 17, config.num_embed)
  # FP8 in the forward pass for the six MLP layers, and for nothing else (attention, logits).
  fp8, total = ta.inspect.count_fp8_dot_generals(
    lambda t: gemma_nnx.next_token_loss(model, t), tokens
  )
  assert fp8 == 6 and total > fp8

  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(gemma_nnx.next_token_loss, argnums=DIFF)(model, tokens)
    params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    optimizer.update(model, params)
    nnx.update(model, recipe_state)
    return loss

  if num_kv_heads != 2:
    return  # the same loop as above; the conversion and its FP8 are what differ
  losses = [
    float(step(model, optimizer, token_batch(s, 4, 17, config.num_embed))) for s in range(50)
  ]
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
  state = model.layers[0].mlp.gate_proj.dot_general.state
  history = np.asarray(state.x_amax_history[...])
  assert np.count_nonzero(history) >= 3  # the last steps' amaxes recorded
  assert float(state.x_scale[...][0]) != 1.0  # the scale moved off its initial value
  assert float(np.asarray(state.grad_amax_history[...])[-1]) > 0


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 32, rngs=rngs)


class _Model(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([_Block(rngs), _Block(rngs)])

  def __call__(self, x):
    for block in self.blocks:
      x = block.up(x)  # the line FrozenStateWarning points at
    return x


def test_frozen_state_warning_names_each_layer_and_points_at_the_users_line():
  model = _Model(nnx.Rngs(0))
  ta_nnx.quantize_model(model, DELAYED, threshold=None)
  x = jnp.ones((4, 32))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # wrt=nnx.Param only; traced (the warning comes at trace time), not run.
    nnx.eval_shape(nnx.value_and_grad(lambda m, x: jnp.sum(m(x))), model, x)
  frozen = [w for w in record if issubclass(w.category, ta.core.FrozenStateWarning)]
  # One per layer (two layers of one shape, two warnings), pointing at the model's call.
  assert [w.filename for w in frozen] == [__file__] * 2
  messages = [str(w.message) for w in frozen]
  for i, message in enumerate(messages):
    assert f"layer 'blocks/{i}/up' (x (4, 32) float32 . kernel (32, 32)" in message
    assert "te_adapters.nnx.value_and_grad" in message
    assert "Linen" not in message and "haiku" not in message  # NNX's remedy only


def test_converting_again_is_an_error_naming_the_layers():
  model = gemma_nnx.Transformer(gemma_nnx.GemmaConfig(), rngs=nnx.Rngs(0))
  ta_nnx.quantize_model(model, rules=[(r".*/mlp/.*", CURRENT)], threshold=None)
  # Attention alone: the MLPs match no rule and are left as they are.
  report = ta_nnx.quantize_model(model, rules=[(r".*/attn/.*", DELAYED)], threshold=None)
  assert len(report.quantized) == 4 and report.high_precision == {}
  before = nnx.to_pure_dict(nnx.state(model))
  with pytest.raises(
    ValueError,
    match=(
      r"quantize_model: these layers are quantized already, .*: layers/0/attn/attn_vec_einsum, "
      r"layers/0/attn/qkv_einsum, layers/0/mlp/down_proj, .*layers/1/mlp/up_proj\. Convert"
    ),
  ):
    ta_nnx.quantize_model(model, rules=[(r"layers/.*", CURRENT)], threshold=None)
  # The refused call changed nothing.
  after = nnx.to_pure_dict(nnx.state(model))
  assert jax.tree.structure(after) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  with pytest.raises(ValueError, match="layers/1/mlp/gate_proj"):
    ta_nnx.quantize_model(model, rules=[(r"layers/1/mlp/.*", None)], threshold=None)
