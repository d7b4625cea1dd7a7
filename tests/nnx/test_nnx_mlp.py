"""NNX LayerNormMLP: TE's parameters, the state of both GEMMs, NNX's ordinary loop against
float64 and its state, nnx.scan under nnx.remat over stacked blocks, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import nnx as ta_nnx
from tests import mlp_reference as ref

RECIPES = {
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=4),
  "block": ta.Float8BlockScaling(),
}
DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))


def _layer(recipe, params=None, rngs=None, **kw):
  kw = {"activations": ref.GATED, "use_bias": True, "return_layernorm_output": False, **kw}
  layer = ta_nnx.LayerNormMLP(
    ref.K, ref.F, recipe=recipe, threshold=None, rngs=rngs or nnx.Rngs(0), **kw
  )
  for name, value in (params or {}).items():
    getattr(layer, name).set_value(value)
  return layer


def test_te_parameters_and_gemm_state():
  layer = _layer(RECIPES["delayed"])
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  assert shapes == {
    "scale": (128,),
    "ln_bias": (128,),
    "wi_kernel": (128, 2, 128),
    "wo_kernel": (128, 128),
    "wi_bias": (2, 128),
    "wo_bias": (128,),
  }
  state = nnx.to_pure_dict(nnx.state(layer, ta_nnx.RecipeState))
  assert set(state) == {"dot_general_0", "dot_general_1"}
  assert jax.tree.map(jnp.shape, state["dot_general_1"]["state"]) == jax.tree.map(
    jnp.shape, core.init_state(RECIPES["delayed"])
  )


def _loop(layer, x, dy, steps, lr=0.0):
  """NNX's ordinary loop: nnx.value_and_grad over Param + RecipeState, an Optimizer on the
  params, nnx.update with the state's gradient."""
  optimizer = nnx.Optimizer(layer, optax.sgd(lr), wrt=nnx.Param)

  def loss(layer):
    out, _ = layer(x)
    return jnp.sum(out * dy), out

  @nnx.jit
  def step(layer, optimizer):
    (_, out), grads = nnx.value_and_grad(loss, argnums=DIFF, has_aux=True)(layer)
    params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    optimizer.update(layer, params)
    nnx.update(layer, recipe_state)
    return out, params

  for _ in range(steps):
    out, grads = step(layer, optimizer)
  return out, nnx.to_pure_dict(grads)


# Current scaling: against float64 in tests/core/test_mlp.py, and this adapter equal to the
# others in tests/test_mlp_adapters_agree.py (fewer compiles for CI).
@pytest.mark.parametrize("name", ["delayed", "block"])
def test_ordinary_loop_against_float64(name, rel):
  x, dy = ref.inputs()
  params = ref.block_params()
  layer = _layer(RECIPES[name], params)
  out, grads = _loop(layer, x, dy, steps=3)
  ref_out, _, ref_dp = ref.float64_reference(x, params, dy)
  errs = {"out": rel(out, ref_out), **{k: rel(grads[k], ref_dp[k]) for k in params}}
  assert errs["out"] < 0.08 and max(errs.values()) < 0.12, errs
  assert errs["out"] > 0.005 and errs["wi_kernel"] > 0.005, errs
  if name == "delayed":
    _, _, want = ref.unrolled(
      x,
      jax.tree.map(lambda a: a[None], params),
      ref.gemm_states(RECIPES[name], n=1),
      dy,
      RECIPES[name],
    )
    for _ in range(2):
      _, _, want = ref.unrolled(x, jax.tree.map(lambda a: a[None], params), want, dy, RECIPES[name])
    for i, op in enumerate((layer.dot_general_0, layer.dot_general_1)):
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b[0], rtol=ref.STATE_RTOL),
        dict(op.recipe_state()),
        dict(want[i]),
      )
    a = float(jnp.max(jnp.abs(core.layernorm(x, params["scale"], params["ln_bias"]))))
    np.testing.assert_allclose(
      layer.dot_general_0.state.x_amax_history[...], [0, a, a, a], rtol=1e-6
    )


def test_nnx_scan_with_remat_over_two_blocks_matches_unrolled():
  recipe = RECIPES["delayed"]
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), ref.block_params(1), ref.block_params(2))

  @nnx.vmap(in_axes=0, out_axes=0)
  def create(key):
    return _layer(recipe, rngs=nnx.Rngs(key))

  blocks = create(jax.random.split(jax.random.key(0), 2))
  for name, value in stacked.items():
    getattr(blocks, name).set_value(value)
  x, dy = ref.inputs()

  @functools.partial(nnx.remat, policy=core.save_quantized_operands)
  def call(block, h):
    return block(h)[0]

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def forward(block, h):
    return call(block, h)

  def loss(blocks):
    out = forward(blocks, x)
    return jnp.sum(out * dy), out

  @nnx.jit
  def step(blocks):
    (_, out), grads = nnx.value_and_grad(loss, argnums=DIFF, has_aux=True)(blocks)
    params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    nnx.update(blocks, recipe_state)
    return out, params

  states = ref.gemm_states(recipe, n=2)
  for _ in range(2):
    out, grads = step(blocks)
    want_out, want_grads, states = ref.unrolled(x, stacked, states, dy, recipe)
    np.testing.assert_allclose(out, want_out, rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    grads = nnx.to_pure_dict(grads)
    for k in stacked:
      np.testing.assert_allclose(
        grads[k], want_grads[k], rtol=10 * ref.CROSS_RTOL, atol=10 * ref.CROSS_RTOL
      )
    for i, op in enumerate((blocks.dot_general_0, blocks.dot_general_1)):
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=ref.STATE_RTOL),
        dict(op.recipe_state()),
        dict(states[i]),
      )
  history = np.asarray(blocks.dot_general_0.state.x_amax_history[...])
  assert history.shape == (2, 4) and history[0, -1] != history[1, -1]


def test_dropout_follows_train_and_eval():
  x, _ = ref.inputs()
  layer = _layer(None, intermediate_dropout_rate=0.5)
  a, _ = layer(x)
  b, _ = layer(x)
  assert not np.allclose(a, b)  # a fresh key per call
  layer.eval()
  c, _ = layer(x)
  d, _ = layer(x, deterministic=False)
  assert np.allclose(c, layer(x)[0]) and not np.allclose(c, d)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"activations": ("gelu", "geglu")}, "unknown activation 'geglu'"),
    ({"layernorm_type": "batchnorm"}, "layernorm_type must be one of"),
    ({"axis": 0}, r"LayerNormMLP: axis must be -1 .*, got 0"),
    ({"axis": (-2, -1)}, r"LayerNormMLP: axis must be -1 .*, got \(-2, -1\)"),
  ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _layer(RECIPES["current"], **kwargs)


def test_sizes_not_multiples_of_16_are_refused():
  with pytest.raises(ValueError, match="wi_kernel .* multiples of 16, got N=72"):
    ta_nnx.LayerNormMLP(128, 36, activations=ref.GATED, rngs=nnx.Rngs(0))
