"""Linen LayerNormMLP: seed 002's usage example, TE's parameters and state postfixes, an
ordinary Linen loop against float64 and its state, nn.scan under nn.remat over stacked blocks,
and bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import linen as ta_linen
from te_adapters.linen import LayerNormMLP
from tests import mlp_reference as ref

OWG = ta_linen.OVERWRITE_WITH_GRADIENT
RECIPES = {
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=4),
  "block": ta.Float8BlockScaling(),
}


# Seed 002's usage example, unchanged but for the import of LayerNormMLP (above).
class MyTransformerBlock(nn.Module):
  hidden_dim: int = 512
  mlp_dim: int = 2048

  @nn.compact
  def __call__(self, x):
    # Fused LayerNorm + MLP with FP8 quantization
    x = LayerNormMLP(
      intermediate_dim=self.mlp_dim,
      activations=("gelu",),
    )(x)
    return x


def test_seed_002_usage_example_runs():
  model = MyTransformerBlock()
  input_data = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 512)), jnp.float32)
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  params = model.init(rngs, input_data)
  output = model.apply(params, input_data, rngs={"dropout": jax.random.key(2)})
  out, ln_out = output  # TE's return: (out, ln_out), ln_out by default
  assert out.shape == ln_out.shape == (2, 8, 512)
  shapes = jax.tree.map(jnp.shape, params["params"]["LayerNormMLP_0"])
  assert shapes == {
    "scale": (512,),
    "ln_bias": (512,),
    "wi_kernel": (512, 1, 2048),
    "wo_kernel": (2048, 512),
  }
  assert bool(jnp.all(jnp.isfinite(out)))


def _layer(recipe, **kw):
  kw = {
    "intermediate_dim": ref.F,
    "activations": ref.GATED,
    "use_bias": True,
    "intermediate_dropout_rate": 0.0,
    "return_layernorm_output": False,
    **kw,
  }
  return LayerNormMLP(recipe=recipe, threshold=None, **kw)


def test_te_parameters_and_state_postfixes():
  layer = _layer(RECIPES["delayed"])
  x, _ = ref.inputs()
  variables = layer.init(jax.random.key(0), x)
  shapes = jax.tree.map(jnp.shape, variables["params"])
  assert shapes == {
    "scale": (128,),
    "ln_bias": (128,),
    "wi_kernel": (128, 2, 128),
    "wo_kernel": (128, 128),
    "wi_bias": (2, 128),
    "wo_bias": (128,),
  }
  expected = ref.postfixed(ref.gemm_states(RECIPES["delayed"]))
  assert jax.tree.map(jnp.shape, variables[OWG]) == jax.tree.map(jnp.shape, expected)
  assert len(expected) == 12 and "x_0_scale" in expected and "grad_1_amax_history" in expected
  # TE's init: n_act kernels, each drawn with variance_scaling(1, fan_in): std ~ 1/sqrt(K).
  wi = np.asarray(variables["params"]["wi_kernel"])
  assert 0.06 < wi.std() < 0.1 and not np.allclose(wi[:, 0], wi[:, 1])


def _loop(recipe, x, dy, params, steps, lr=0.0):
  """An ordinary Linen loop: grads of the whole variable dict, params by SGD, the state
  collection replaced by its gradient."""
  layer = _layer(recipe)
  variables = {**layer.init(jax.random.key(0), x), "params": params}

  @jax.jit
  def step(variables):
    def loss(variables):
      out, _ = layer.apply(variables, x)
      return jnp.sum(out * dy), out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    new = {"params": jax.tree.map(lambda p, g: p - lr * g, variables["params"], grads["params"])}
    if OWG in grads:
      new[OWG] = grads[OWG]
    return new, out, grads["params"]

  for _ in range(steps):
    variables, out, grads = step(variables)
  return variables, out, grads


# Current scaling: against float64 in tests/core/test_mlp.py, and this adapter equal to the
# others in tests/test_mlp_adapters_agree.py (fewer compiles for CI).
@pytest.mark.parametrize("name", ["delayed", "block"])
def test_ordinary_loop_against_float64(name, rel):
  x, dy = ref.inputs()
  params = ref.block_params()
  variables, out, grads = _loop(RECIPES[name], x, dy, params, steps=3)
  ref_out, ref_dx, ref_dp = ref.float64_reference(x, params, dy)
  errs = {"out": rel(out, ref_out), **{k: rel(grads[k], ref_dp[k]) for k in params}}
  assert errs["out"] < 0.08 and max(errs.values()) < 0.12, errs
  assert errs["out"] > 0.005 and errs["wi_kernel"] > 0.005, errs  # FP8 really ran
  if name == "delayed":
    state = variables[OWG]
    a = float(jnp.max(jnp.abs(core.layernorm(x, params["scale"], params["ln_bias"]))))
    np.testing.assert_allclose(state["x_0_amax_history"], [0, a, a, a], rtol=1e-6)
    np.testing.assert_allclose(state["x_0_scale"], [448 / a], rtol=1e-6)
    g = float(jnp.max(jnp.abs(dy)))
    np.testing.assert_allclose(state["grad_1_amax_history"], [0, g, g, g], rtol=1e-6)
    np.testing.assert_allclose(state["grad_1_scale"], [57344 / g], rtol=1e-6)
    assert np.all(np.asarray(state["x_1_amax_history"][1:]) > 0)


class _Block(nn.Module):
  recipe: object = None

  @nn.compact
  def __call__(self, h, _):
    out, _ = _layer(self.recipe)(h)
    return out, None


def test_nn_scan_with_remat_over_two_blocks_matches_unrolled():
  recipe = RECIPES["delayed"]
  block = nn.remat(_Block, policy=core.save_quantized_operands)
  model = nn.scan(
    block, variable_axes={"params": 0, OWG: 0}, split_rngs={"params": True}, length=2
  )(recipe)
  x, dy = ref.inputs()
  variables = model.init(jax.random.key(0), x, None)
  (scope,) = variables["params"]
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), ref.block_params(1), ref.block_params(2))
  assert jax.tree.map(jnp.shape, variables["params"][scope]) == jax.tree.map(jnp.shape, stacked)
  states = ref.gemm_states(recipe, n=2)
  variables = {"params": {scope: stacked}, OWG: {scope: ref.postfixed(states)}}

  @jax.jit
  def step(variables):
    def loss(v):
      h, _ = model.apply(v, x, None)
      return jnp.sum(h * dy), h

    return jax.value_and_grad(loss, has_aux=True)(variables)

  for _ in range(2):  # the second step quantizes with the scales the first one stored
    (_, out), grads = step(variables)
    want_out, want_grads, states = ref.unrolled(x, stacked, states, dy, recipe)
    np.testing.assert_allclose(out, want_out, rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    for k in stacked:
      np.testing.assert_allclose(
        grads["params"][scope][k], want_grads[k], rtol=10 * ref.CROSS_RTOL, atol=10 * ref.CROSS_RTOL
      )
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=ref.STATE_RTOL),
      grads[OWG][scope],
      ref.postfixed(states),
    )
    variables = {"params": variables["params"], OWG: grads[OWG]}
  history = np.asarray(variables[OWG][scope]["x_0_amax_history"])
  assert history.shape == (2, 4) and history[0, -1] != history[1, -1]  # per-block state


def test_dropout_uses_the_dropout_stream():
  x, _ = ref.inputs()
  layer = _layer(None, intermediate_dropout_rate=0.5)
  variables = layer.init(jax.random.key(0), x, deterministic=True)
  a, _ = layer.apply(variables, x, rngs={"dropout": jax.random.key(1)})
  b, _ = layer.apply(variables, x, rngs={"dropout": jax.random.key(2)})
  c, _ = layer.apply(variables, x, deterministic=True)
  assert not np.allclose(a, b) and not np.allclose(a, c)
  with pytest.raises(Exception, match="dropout"):
    layer.apply(variables, x)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"activations": ("gelu", "geglu")}, "unknown activation 'geglu'"),
    ({"axis": -2}, "axis must be -1"),
    ({"enable_low_rank_adaptation": True}, "low-rank adaptation is not supported"),
    ({"intermediate_dim": 36}, "wi_kernel .* multiples of 16, got N=72"),
  ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
  x, _ = ref.inputs()
  with pytest.raises(ValueError, match=match):
    _layer(RECIPES["current"], **kwargs).init(jax.random.key(0), x)


def test_te_sharding_fields_annotate_the_parameters():
  x, _ = ref.inputs()
  axes = dict(
    scale_axes=("embed",),
    ln_bias_axes=("embed",),
    kernel_axes_1=("embed", "act", "mlp"),
    kernel_axes_2=("mlp", "embed"),
    bias_axes_1=("act", "mlp"),
    bias_axes_2=("embed",),
    layernorm_input_axes=("batch", "length", "embed"),
    dot_1_input_axes=("batch", "length", "embed"),
    dot_2_input_axes=("batch", "length", "mlp"),
  )
  layer = _layer(None, **axes)
  variables = layer.init(jax.random.key(0), x)
  names = {k: v.names for k, v in variables["params"].items()}
  assert names == {
    "scale": ("embed",),
    "ln_bias": ("embed",),
    "wi_kernel": ("embed", "act", "mlp"),
    "wo_kernel": ("mlp", "embed"),
    "wi_bias": ("act", "mlp"),
    "wo_bias": ("embed",),
  }
  plain = _layer(None)
  out, _ = layer.apply(variables, x)
  want, _ = plain.apply(nn.meta.unbox(variables), x)
  np.testing.assert_array_equal(out, want)
