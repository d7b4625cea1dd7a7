"""A NaN or an infinity in a quantized GEMM's operand reaches its output (``GemmConfig.non_finite``,
default ``"propagate"``), as a high-precision GEMM's would, on every path: ``dot_general`` under
each recipe, its gradients, the fused norm and MLP, ``ragged_dot``; ``"saturate"`` keeps TE's
clipping casts. Delayed scaling's state follows TE's rule for a non-finite amax either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core

DN = (((1,), (0,)), ((), ()))
SATURATE = ta.GemmConfig(non_finite="saturate")

RECIPES = [
  ta.DelayedScaling(),
  ta.Float8CurrentScaling(),
  ta.MXFP8BlockScaling(),
  ta.NVFP4BlockScaling(),
  ta.Float8BlockScaling(),
  ta.Float8RowwiseScaling(),
]
IDS = [type(r).__name__ for r in RECIPES]


def _operands(bad=None, where=(3, 5)):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((128, 256)).astype(np.float32)
  w = (rng.standard_normal((256, 128)) / 16).astype(np.float32)
  if bad is not None:
    x[where] = bad
  return jnp.asarray(x), jnp.asarray(w)


def _dot(recipe, x, w, config=None, rng=None):
  state = core.init_state(recipe) or None
  return core.dot_general(
    x, w, DN, recipe=recipe, state=state, threshold=None, config=config, rng=rng
  )


@pytest.mark.parametrize("bad", [-np.inf, np.nan], ids=["-inf", "nan"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_non_finite_input_reaches_the_output(recipe, bad):
  x, w = _operands(bad)
  y = np.asarray(_dot(recipe, x, w))
  bf16 = np.asarray(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16), np.float32)
  assert not np.isfinite(bf16[3]).any()  # what the user's NaN check sees without FP8
  if isinstance(recipe, ta.Float8RowwiseScaling):
    # One scale per row: exactly the row holding the entry, as in bf16.
    assert np.isnan(y[3]).all()
    assert np.isfinite(np.delete(y, 3, axis=0)).all()
  else:
    # One tensor-wide amax: the whole output.
    assert np.isnan(y).all()


@pytest.mark.parametrize("recipe", RECIPES[:2] + RECIPES[4:], ids=IDS[:2] + IDS[4:])
def test_saturate_keeps_te_clipping(recipe):
  """TE's cast clips an infinity to the format's largest value: the output stays finite, and
  the row holding it is dominated by 448 times the dequantization scale."""
  x, w = _operands(np.inf)
  y = np.asarray(_dot(recipe, x, w, config=SATURATE))
  assert np.isfinite(y).all()
  clean = np.asarray(_dot(recipe, *_operands(None), config=SATURATE))
  np.testing.assert_allclose(
    np.delete(y, 3, axis=0), np.delete(clean, 3, axis=0), rtol=0.2, atol=0.2
  )
  # Without the infinity the same recipe's output is finite too: the flag is the input's alone.
  assert np.isfinite(np.asarray(_dot(recipe, *_operands(None)))).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.filterwarnings("ignore::te_adapters.core.FrozenStateWarning")
def test_a_non_finite_output_gradient_reaches_both_gradients(recipe):
  x, w = _operands(None)
  dy = np.ones((128, 128), np.float32)
  dy[7, 9] = np.inf
  rng = jax.random.PRNGKey(0) if recipe.uses_rng else None

  def loss(x, w):
    return jnp.sum(_dot(recipe, x, w, rng=rng) * dy)

  gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
  gx, gw = np.asarray(gx), np.asarray(gw)
  assert not np.isfinite(gx[7]).any()  # the row of dx that the entry feeds, in every format
  assert not np.isfinite(gw[:, 9]).any()  # and the column of dw
  if not isinstance(recipe, ta.Float8RowwiseScaling):
    assert np.isnan(gx).all() and np.isnan(gw).all()


@pytest.mark.parametrize("recipe", RECIPES[:3] + RECIPES[4:], ids=IDS[:3] + IDS[4:])
def test_fused_mlp_and_norm_dense_propagate(recipe):
  rng = np.random.default_rng(1)
  k, f = 128, 128
  x = jnp.asarray(rng.standard_normal((32, k)), jnp.float32)
  wi = rng.standard_normal((k, 1, f)).astype(np.float32) / 8
  wo = jnp.asarray(rng.standard_normal((f, k)) / 8, jnp.float32)
  wi[2, 0, 3] = np.inf
  wi = jnp.asarray(wi)
  states = (core.init_state(recipe) or None, core.init_state(recipe) or None)

  def mlp(config):
    out, _ = core.layernorm_mlp(
      x,
      jnp.ones(k),
      jnp.zeros(k),
      wi,
      wo,
      activations=("relu",),
      recipe=recipe,
      states=states,
      threshold=None,
      config=config,
    )
    return np.asarray(out)

  assert np.isnan(mlp(None)).all()
  assert np.isnan(mlp(ta.GemmConfig(fuse_activation_cast=True))).all()  # the fused path
  assert np.isnan(mlp(ta.GemmConfig(fuse_activation_cast=False))).all()  # the composed path
  # TE's saturation (an E8M0 scale of an inf's block is 2**127: MXFP8's stays inf).
  saturates = not isinstance(recipe, ta.MXFP8BlockScaling)
  assert np.isfinite(mlp(SATURATE)).all() or not saturates

  def norm_dense(config):
    z, _ = core.layernorm_dense(
      x,
      jnp.ones(k),
      jnp.zeros(k),
      wi[:, 0, :],
      recipe=recipe,
      state=states[0],
      threshold=None,
      config=config,
    )
    return np.asarray(z)

  z = norm_dense(None)
  if isinstance(recipe, ta.Float8RowwiseScaling):
    # A scale per row of the (N, K) kernel: the output column of the entry, as in bf16.
    assert np.isnan(z[:, 3]).all() and np.isfinite(np.delete(z, 3, axis=1)).all()
  else:
    assert np.isnan(z).all()
  assert np.isfinite(norm_dense(SATURATE)).all() or not saturates


@pytest.mark.parametrize("recipe", RECIPES[:3] + RECIPES[4:], ids=IDS[:3] + IDS[4:])
def test_ragged_dot_propagates(recipe):
  x, _ = _operands(np.inf, where=(70, 5))  # a row of group 1
  w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 256, 128)) / 16, jnp.float32)
  sizes = jnp.array([64, 64], jnp.int32)
  state = core.init_ragged_state(recipe, 2) if core.init_state(recipe) else None
  y = np.asarray(core.ragged_dot(x, w, sizes, recipe=recipe, state=state))
  if recipe.__class__ in (ta.DelayedScaling, ta.Float8CurrentScaling):
    # Per-group scales: the group holding the entry.
    assert np.isnan(y[64:]).all() and np.isfinite(y[:64]).all()
  elif isinstance(recipe, ta.Float8RowwiseScaling):
    # Per-row scales: the row holding the entry, as in bf16.
    assert np.isnan(y[70]).all() and np.isfinite(np.delete(y, 70, axis=0)).all()
  else:
    assert np.isnan(y).all()
  saturated = core.ragged_dot(x, w, sizes, recipe=recipe, state=state, config=SATURATE)
  if not isinstance(recipe, ta.MXFP8BlockScaling):  # an E8M0 scale of inf's block is 2**127
    assert np.isfinite(np.asarray(saturated)).all()


def test_delayed_scaling_records_a_non_finite_amax_as_te_does():
  """TE's rule: the step's amax enters the history, inf included, and the scale stays at its
  last value while a non-finite amax is in the window; it moves again once the entry has left
  (``amax_history_len`` steps later)."""
  recipe = ta.DelayedScaling(amax_history_len=3)
  x, w = _operands(None)
  bad, _ = _operands(np.inf)

  @jax.jit
  def step(state, x):
    _, grads = jax.value_and_grad(
      lambda s: jnp.sum(core.dot_general(x, w, DN, recipe=recipe, state=s, threshold=None))
    )(state)
    return core.updated_state(state, grads)

  state = step(core.init_state(recipe), x)
  scale = float(state["x_scale"][0])
  assert scale == pytest.approx(448.0 / float(jnp.max(jnp.abs(x))), rel=1e-6)
  state = step(state, bad)
  assert np.isinf(np.asarray(state["x_amax_history"])).any()  # visible in the state
  assert float(state["x_scale"][0]) == scale  # kept, not poisoned
  for _ in range(2):
    state = step(state, 2 * x)
    assert float(state["x_scale"][0]) == scale  # the inf is still in the window
  state = step(state, 2 * x)
  assert np.isfinite(np.asarray(state["x_amax_history"])).all()
  assert float(state["x_scale"][0]) == pytest.approx(scale / 2, rel=1e-6)


def test_adapter_layers_propagate_by_default():
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  layer = ta_nnx.Linear(
    256, 128, recipe=ta.Float8CurrentScaling(), threshold=None, rngs=nnx.Rngs(0)
  )
  x, _ = _operands(np.inf)
  assert np.isnan(np.asarray(layer(x))).all()
  saturating = ta_nnx.Linear(
    256, 128, recipe=ta.Float8CurrentScaling(), threshold=None, config=SATURATE, rngs=nnx.Rngs(0)
  )
  assert np.isfinite(np.asarray(saturating(x))).all()


def test_config_rejects_an_unknown_choice():
  with pytest.raises(ValueError, match="non_finite must be one of"):
    ta.GemmConfig(non_finite="clip")


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_inside_shard_map_every_shard_sees_another_shards_infinity(recipe):
  """The flag is the amax the scale uses, reduced over the mesh: an inf in one device's rows
  makes every device's output NaN, as the one-device GEMM's."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
  x, w = _operands(np.inf)  # row 3: the first device's rows
  state = core.init_state(recipe) or None

  def run(config):
    f = jax.shard_map(
      lambda x, w: core.dot_general(
        x, w, DN, recipe=recipe, state=state, threshold=None, config=config
      ),
      mesh=mesh,
      in_specs=(P("dp"), P()),
      out_specs=P("dp"),
    )
    return np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("dp"))), w))

  assert np.isnan(run(None)).all()
  saturated = run(SATURATE)
  assert np.isfinite(saturated).all()
