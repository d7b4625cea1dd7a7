"""Haiku LayerNormMLP: TE's parameters, each GEMM's state, Haiku's ordinary jax.grad loop against
float64 and its state, hk.layer_stack under hk.remat over stacked blocks, and bad
input."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from tests import mlp_reference as ref

RECIPES = {
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=4),
  "block": ta.Float8BlockScaling(),
}
NAME = "layer_norm_mlp"


def _block(recipe, **kw):
  kw = {"activations": ref.GATED, "use_bias": True, "return_layernorm_output": False, **kw}
  return ta_hk.LayerNormMLP(ref.F, recipe=recipe, threshold=None, **kw)


def _model(recipe, **kw):
  return hk.transform_with_state(lambda x: _block(recipe, **kw)(x))


def test_te_parameters_and_gemm_state():
  x, _ = ref.inputs()
  params, state = _model(RECIPES["delayed"]).init(jax.random.key(0), x)
  shapes = jax.tree.map(jnp.shape, params[NAME])
  assert shapes == {
    "scale": (128,),
    "ln_bias": (128,),
    "wi_kernel": (128, 2, 128),
    "wo_kernel": (128, 128),
    "wi_bias": (2, 128),
    "wo_bias": (128,),
  }
  assert set(state) == {f"{NAME}/gemm_0", f"{NAME}/gemm_1"}
  recipe_state, other = ta_hk.split_state(state)
  assert recipe_state == state and not other  # TE's names, one GEMM per module


def _loop(recipe, x, dy, params, steps):
  """Haiku's ordinary loop: jax.grad over params and state; the state's gradient is the new
  state."""
  model = _model(recipe)
  _, state = model.init(jax.random.key(0), x)

  def loss(params, state):
    out, _ = model.apply(params, state, None, x)[0]
    return jnp.sum(out * dy), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  for _ in range(steps):
    (_, out), (grads, state) = step(params, state)
  return out, grads[NAME], state


# Current scaling: against float64 in tests/core/test_mlp.py, and this adapter equal to the
# others in tests/test_mlp_adapters_agree.py (fewer compiles for CI).
@pytest.mark.parametrize("name", ["delayed", "block"])
def test_ordinary_loop_against_float64(name, rel):
  x, dy = ref.inputs()
  params = ref.block_params()
  out, grads, state = _loop(RECIPES[name], x, dy, {NAME: params}, steps=3)
  ref_out, _, ref_dp = ref.float64_reference(x, params, dy)
  errs = {"out": rel(out, ref_out), **{k: rel(grads[k], ref_dp[k]) for k in params}}
  assert errs["out"] < 0.08 and max(errs.values()) < 0.12, errs
  assert errs["out"] > 0.005 and errs["wi_kernel"] > 0.005, errs
  if name == "delayed":
    a = float(jnp.max(jnp.abs(core.layernorm(x, params["scale"], params["ln_bias"]))))
    np.testing.assert_allclose(state[f"{NAME}/gemm_0"]["x_amax_history"], [0, a, a, a], rtol=1e-6)
    g = float(jnp.max(jnp.abs(dy)))
    np.testing.assert_allclose(
      state[f"{NAME}/gemm_1"]["grad_amax_history"], [0, g, g, g], rtol=1e-6
    )
    np.testing.assert_allclose(state[f"{NAME}/gemm_1"]["grad_scale"], [57344 / g], rtol=1e-6)


def test_layer_stack_with_remat_over_two_blocks_matches_unrolled():
  recipe = RECIPES["delayed"]

  def block(h):
    return _block(recipe)(h)[0]

  def stack(x):
    return hk.layer_stack(2)(hk.remat(block, policy=core.save_quantized_operands))(x)

  model = hk.transform_with_state(stack)
  x, dy = ref.inputs()
  params, state = model.init(jax.random.key(0), x)
  (pname,) = params
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), ref.block_params(1), ref.block_params(2))
  assert jax.tree.map(jnp.shape, params[pname]) == jax.tree.map(jnp.shape, stacked)
  params = {pname: stacked}
  snames = sorted(state)  # .../gemm_0, .../gemm_1

  @jax.jit
  def step(params, state):
    def loss(params, state):
      out, _ = model.apply(params, state, None, x)
      return jnp.sum(out * dy), out

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, state)

  states = ref.gemm_states(recipe, n=2)
  for _ in range(2):
    (_, out), (grads, state) = step(params, state)
    want_out, want_grads, states = ref.unrolled(x, stacked, states, dy, recipe)
    np.testing.assert_allclose(out, want_out, rtol=ref.CROSS_RTOL, atol=ref.CROSS_RTOL)
    for k in stacked:
      np.testing.assert_allclose(
        grads[pname][k], want_grads[k], rtol=10 * ref.CROSS_RTOL, atol=10 * ref.CROSS_RTOL
      )
    for i, sname in enumerate(snames):
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=ref.STATE_RTOL),
        dict(state[sname]),
        dict(states[i]),
      )
  history = np.asarray(state[snames[0]]["x_amax_history"])
  assert history.shape == (2, 4) and history[0, -1] != history[1, -1]


def test_dropout_draws_from_the_apply_rng():
  x, _ = ref.inputs()
  f = hk.transform(
    lambda x, det: _block(None, intermediate_dropout_rate=0.5)(x, deterministic=det)[0]
  )
  params = f.init(jax.random.key(0), x, True)
  a, b = (f.apply(params, jax.random.key(k), x, False) for k in (1, 2))
  c = f.apply(params, None, x, True)
  assert not np.allclose(a, b) and not np.allclose(a, c)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"activations": ("gelu", "geglu")}, "unknown activation 'geglu'"),
    ({"layernorm_type": "batchnorm"}, "layernorm_type must be one of"),
    ({"recipe": RECIPES["current"]}, "wi_kernel .* multiples of 16, got N=72"),
    ({"axis": 0}, r"LayerNormMLP: axis must be -1 .*, got 0"),
    ({"axis": (-2, -1)}, r"LayerNormMLP: axis must be -1 .*, got \(-2, -1\)"),
  ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
  x, _ = ref.inputs()
  kw = {"activations": ref.GATED, **kwargs}
  with pytest.raises(ValueError, match=match):
    hk.transform_with_state(lambda x: ta_hk.LayerNormMLP(36, **kw)(x)).init(jax.random.key(0), x)
