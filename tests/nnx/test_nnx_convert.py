"""te_adapters.nnx.quantize_model on existing NNX models."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx


class _Model(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 32, rngs=rngs)
    self.mix = nnx.LinearGeneral(32, (2, 16), rngs=rngs)
    self.proj = nnx.Einsum("bhd,hdk->bk", (2, 16, 32), (32,), rngs=rngs)
    self.small = nnx.Linear(32, 10, rngs=rngs)  # N=10: stays unquantized
    self.custom = nnx.Linear(
      10, 16, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k), rngs=rngs
    )

  def __call__(self, x):
    h = self.proj(self.mix(jnp.tanh(self.up(x))))
    return self.custom(self.small(h))


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_quantize_model_converts_in_place_and_reports(rel):
  model = _Model(nnx.Rngs(0))
  x = _normal(0, (8, 32))
  forward = nnx.jit(lambda m, x: m(x))
  y_before = forward(model, x)
  params_before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  recipe = ta.DelayedScaling(amax_history_len=8)
  with pytest.warns(ta.SkippedLayersWarning, match="(?s)2 layer.*small: GEMM size K=32, N=10"):
    report = ta_nnx.quantize_model(model, recipe, threshold=None)
  assert report.quantized == ["mix", "proj", "up"]
  skipped = dict(report.skipped)
  assert set(skipped) == {"custom", "small"}
  assert "K=32, N=10 is not a multiple of 16" in skipped["small"]
  assert skipped["custom"] == "it has a dot_general of its own"
  assert "skipped small" in str(report)

  # Parameters kept; recipe state added where quantized; the optimizer ignores it.
  params_after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, params_after, params_before)
  state = nnx.to_pure_dict(ta_nnx.recipe_state(model))
  assert set(state) == {"up", "mix", "proj"}
  assert set(state["proj"]["einsum_op"]["state"]) == set(ta.core.state_names(recipe))
  assert isinstance(model.up.dot_general, ta_nnx.DotGeneral)
  assert model.small.dot_general is jax.lax.dot_general

  # The quantized model computes the same function up to FP8 error, and trains.
  optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    loss, (grads, state_grads) = ta_nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
    optimizer.update(model, grads)
    ta_nnx.update_recipe_state(model, state_grads)
    return loss

  err = rel(forward(model, x), y_before)
  assert 1e-3 < err < 0.1, err  # FP8 error, not bf16's and not a broken GEMM's
  step(model, optimizer, x)
  up = nnx.to_pure_dict(ta_nnx.recipe_state(model))["up"]["dot_general"]["state"]
  np.testing.assert_allclose(up["x_amax_history"][-1], np.max(np.abs(x)), rtol=1e-6)

  # Converting again is an error naming the converted layers, and changes nothing.
  with pytest.raises(ValueError, match="quantized already.*: mix, proj, up. Convert each layer"):
    ta_nnx.quantize_model(model, recipe, threshold=None)
  assert isinstance(model.up.dot_general, ta_nnx.DotGeneral)
  assert model.small.dot_general is jax.lax.dot_general


def test_quantize_model_filter_and_stacked_layers():
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return nnx.Linear(32, 32, rngs=rngs)

  model = nnx.Dict(stack=make(nnx.Rngs(0)), other=nnx.Linear(32, 16, rngs=nnx.Rngs(1)))
  with pytest.warns(DeprecationWarning, match="filter= is deprecated.*rules=") as record:
    report = ta_nnx.quantize_model(
      model,
      ta.DelayedScaling(amax_history_len=4),
      filter=nnx.PathContains("stack"),
      threshold=None,
    )
  assert record[0].filename == __file__  # the caller's line
  assert report.quantized == ["stack"]
  assert report.skipped == {}
  assert report.high_precision == {"other": "no rule selects it"}
  # Stacked state, one per layer, for nnx.scan.
  assert model["stack"].dot_general.state.x_amax_history.shape == (3, 4)
  assert model["stack"].dot_general.state.x_scale.shape == (3, 1)

  xs = _normal(0, (8, 32))

  def loss(stack, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return jnp.tanh(layer(h))

    return jnp.sum(body(stack, x))

  _, (_, state_grads) = nnx.jit(ta_nnx.value_and_grad(loss))(model["stack"], xs)
  ta_nnx.update_recipe_state(model["stack"], state_grads)
  history = np.asarray(model["stack"].dot_general.state.x_amax_history[...])
  np.testing.assert_allclose(history[0, -1], np.max(np.abs(xs)), rtol=1e-6)
  assert np.all(history[:, -1] > 0)


def test_quantize_model_refuses_bad_recipe():
  with pytest.raises(TypeError, match="recipe must be"):
    ta_nnx.quantize_model(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), "fp8", threshold=None)
  layer = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  report = ta_nnx.quantize_model(layer, None, threshold=None)  # no rule: nothing converted
  assert report.quantized == [] and report.high_precision == {".": "no rule selects it"}
  assert layer.dot_general is jax.lax.dot_general


def test_report_names_the_layers_the_threshold_keeps_in_high_precision():
  """The suite's default threshold applies on every platform (tests/conftest.py)."""
  big = ta.core.SizeThreshold(min_mkn=1, min_dim=64, platforms=(jax.default_backend(),))

  def model():
    return nnx.Sequential(
      nnx.Linear(32, 128, rngs=nnx.Rngs(0)), nnx.Linear(128, 64, rngs=nnx.Rngs(1))
    )

  report = ta_nnx.quantize_model(model(), ta.Float8CurrentScaling())
  assert report.quantized == ["layers/0", "layers/1"]
  assert list(report.high_precision) == ["layers/0", "layers/1"]
  assert "K=32, N=128: below the size threshold" in report.high_precision["layers/0"]
  assert "2 of the quantized (all of them) run in high precision" in str(report)
  # min_dim 64: only the first layer's K=32 keeps it below for any M.
  report = ta_nnx.quantize_model(model(), ta.Float8CurrentScaling(), threshold=big)
  assert list(report.high_precision) == ["layers/0"]
  assert "1 of the quantized run" in str(report)
  report = ta_nnx.quantize_model(model(), ta.Float8CurrentScaling(), threshold=None)
  assert report.high_precision == {} and "high precision" not in str(report)
