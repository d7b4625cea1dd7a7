"""Linen, NNX and Haiku LayerNormMLP agree: with the same parameters, the same outputs,
gradients and recipe state after two steps of each framework's ordinary loop."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from tests import mlp_reference as ref

RECIPE = ta.DelayedScaling(amax_history_len=4)
OWG = ta_linen.OVERWRITE_WITH_GRADIENT
KW = {
  "activations": ("silu", "linear"),
  "use_bias": True,
  "return_layernorm_output": False,
  "intermediate_dropout_rate": 0.0,
  "recipe": RECIPE,
  "threshold": None,
}


def _linen(params, x, dy, steps):
  layer = ta_linen.LayerNormMLP(ref.F, **KW)
  variables = {**layer.init(jax.random.key(0), x), "params": params}

  @jax.jit
  def step(variables):
    def loss(v):
      out, _ = layer.apply(v, x)
      return jnp.sum(out * dy), out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    return out, grads

  for _ in range(steps):
    out, grads = step(variables)
    variables = {"params": params, OWG: grads[OWG]}
  states = tuple(
    {
      n: grads[OWG][f"{n.split('_', 1)[0]}_{i}_{n.split('_', 1)[1]}"]
      for n in core.state_names(RECIPE)
    }
    for i in range(2)
  )
  return out, grads["params"], states


def _nnx(params, x, dy, steps):
  layer = ta_nnx.LayerNormMLP(ref.K, ref.F, rngs=nnx.Rngs(0), **KW)
  for name, value in params.items():
    getattr(layer, name).set_value(value)
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))

  @nnx.jit
  def step(layer):
    def loss(m):
      out, _ = m(x)
      return jnp.sum(out * dy), out

    (_, out), grads = nnx.value_and_grad(loss, argnums=diff, has_aux=True)(layer)
    p, s = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    nnx.update(layer, s)
    return out, p

  for _ in range(steps):
    out, grads = step(layer)
  return (
    out,
    nnx.to_pure_dict(grads),
    (layer.dot_general_0.recipe_state(), layer.dot_general_1.recipe_state()),
  )


def _haiku(params, x, dy, steps):
  model = hk.transform_with_state(lambda x: ta_hk.LayerNormMLP(ref.F, **KW)(x))
  _, state = model.init(jax.random.key(0), x)

  def loss(p, s):
    out, _ = model.apply(p, s, None, x)[0]
    return jnp.sum(out * dy), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  for _ in range(steps):
    (_, out), (grads, state) = step({"layer_norm_mlp": params}, state)
  return (
    out,
    grads["layer_norm_mlp"],
    tuple(dict(state[f"layer_norm_mlp/gemm_{i}"]) for i in range(2)),
  )


def test_the_three_adapters_agree():
  params = ref.block_params(3)
  x, dy = ref.inputs(4)
  results = [run(params, x, dy, steps=2) for run in (_linen, _nnx, _haiku)]
  for out, grads, states in results:
    np.testing.assert_allclose(out, results[0][0], rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    for k in params:
      np.testing.assert_allclose(
        grads[k], results[0][1][k], rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL
      )
    for i in range(2):
      for name, value in states[i].items():
        np.testing.assert_allclose(value, results[0][2][i][name], rtol=ref.STATE_RTOL)
  # And the state after two steps is the core function's.
  stack = jax.tree.map(lambda a: a[None], params)
  _, _, states = ref.unrolled(
    x, stack, ref.gemm_states(RECIPE, n=1), dy, RECIPE, activations=KW["activations"]
  )
  _, _, states = ref.unrolled(x, stack, states, dy, RECIPE, activations=KW["activations"])
  for i in range(2):
    for name, value in results[0][2][i].items():
      np.testing.assert_allclose(value, states[i][name][0], rtol=ref.STATE_RTOL)


CURRENT = {**KW, "recipe": ta.Float8CurrentScaling()}


def _linen_grads(params, x, dy):
  layer = ta_linen.LayerNormMLP(ref.F, **CURRENT)
  variables = {**layer.init(jax.random.key(0), x), "params": params}

  def loss(v, x):
    out, _ = layer.apply(v, x)
    return jnp.sum(out * dy), out

  (_, out), (grads, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    variables, x
  )
  return out, dx, grads["params"]


def _nnx_grads(params, x, dy):
  layer = ta_nnx.LayerNormMLP(ref.K, ref.F, rngs=nnx.Rngs(0), **CURRENT)
  for name, value in params.items():
    getattr(layer, name).set_value(value)

  @nnx.jit
  def step(layer, x):
    def loss(m, x):
      out, _ = m(x)
      return jnp.sum(out * dy), out

    return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)

  (_, out), (grads, dx) = step(layer, x)
  return out, dx, nnx.to_pure_dict(grads)


def _haiku_grads(params, x, dy):
  model = hk.transform_with_state(lambda x: ta_hk.LayerNormMLP(ref.F, **CURRENT)(x))
  _, state = model.init(jax.random.key(0), x)

  def loss(p, x):
    out, _ = model.apply(p, state, None, x)[0]
    return jnp.sum(out * dy), out

  (_, out), (grads, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    {"layer_norm_mlp": params}, x
  )
  return out, dx, grads["layer_norm_mlp"]


def test_current_scaling_in_every_adapter_against_float64(rel):
  # The default recipe (stateless), gated silu with both biases: the output, the input's
  # gradient and every parameter's gradient against float64, in each framework's own grad.
  params = ref.block_params(5)
  x, dy = ref.inputs(6)
  want_out, want_dx, want = ref.float64_reference(x, params, dy, activations=KW["activations"])
  results = [run(params, x, dy) for run in (_linen_grads, _nnx_grads, _haiku_grads)]
  for out, dx, grads in results:
    errs = {
      "out": rel(out, want_out),
      "dx": rel(dx, want_dx),
      **{k: rel(grads[k], want[k]) for k in params},
    }
    assert errs["out"] < 0.08 and max(errs.values()) < 0.12, errs
    assert errs["out"] > 0.005 and errs["dx"] > 0.005 and errs["wi_kernel"] > 0.005, errs
    np.testing.assert_allclose(out, results[0][0], rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    np.testing.assert_allclose(dx, results[0][1], rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    for k in params:
      np.testing.assert_allclose(
        grads[k], results[0][2][k], rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL
      )
