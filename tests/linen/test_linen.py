"""The Linen adapter: seed usage, TE variable names, state threading, scan, remat, train state."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import te_adapters as ta
from bench.seed_layer import FlaxDenseBlock, FlaxTransformerLayer
from te_adapters import core, inspect
from te_adapters import linen as ta_linen
from tests import plain_loops

OWG = ta_linen.OVERWRITE_WITH_GRADIENT


def _probe(amax, shape, seed=0):
  t = np.asarray(jax.random.uniform(jax.random.PRNGKey(seed), shape, minval=-0.5, maxval=0.5))
  t = (t * amax).astype(np.float32)
  t[0, 0] = amax
  return jnp.asarray(t)


def test_seed_000_pattern_creates_te_variables():
  recipe = ta.DelayedScaling()
  model = FlaxDenseBlock(
    features=32, dot_general_cls=ta_linen.make_dot_general_cls(recipe, threshold=None)
  )
  x = jnp.ones((2, 16, 64), jnp.bfloat16)
  variables = model.init(jax.random.PRNGKey(0), x)
  assert sorted(variables) == [OWG, "params"]
  # The dot_general module is created in FlaxDenseBlock's compact method, so Linen makes it a
  # child of FlaxDenseBlock named after its class.
  assert list(variables[OWG]) == ["DelayedScalingDotGeneral_0"]
  meta = variables[OWG]["DelayedScalingDotGeneral_0"]
  assert {k: (v.shape, v.dtype) for k, v in meta.items()} == {
    f"{r}_{k}": (s, jnp.float32)
    for r in ("x", "kernel", "grad")
    for k, s in (("scale", (1,)), ("amax_history", (1024,)))
  }
  assert variables["params"]["Dense_0"]["kernel"].shape == (64, 32)
  # Stateless recipes add no collection.
  cls = ta_linen.make_dot_general_cls(ta.Float8CurrentScaling(), threshold=None)
  model = FlaxDenseBlock(32, dot_general_cls=cls)
  assert sorted(model.init(jax.random.PRNGKey(0), x)) == ["params"]


def test_numerics_against_float64(rel):
  model = FlaxDenseBlock(
    features=64,
    dtype=jnp.float32,
    dot_general_cls=ta_linen.make_dot_general_cls(ta.Float8CurrentScaling(), threshold=None),
  )
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 128))
  variables = model.init(jax.random.PRNGKey(0), x)
  dy = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 64))

  def loss(v, x):
    return jnp.sum(model.apply(v, x) * dy)

  y = model.apply(variables, x)
  gv, gx = jax.grad(loss, argnums=(0, 1))(variables, x)
  w64 = np.asarray(variables["params"]["Dense_0"]["kernel"], np.float64)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  assert rel(y, x64 @ w64) < 0.05
  assert rel(gx, dy64 @ w64.T) < 0.08
  ref_dw = np.einsum("bsk,bsn->kn", x64, dy64)
  assert 0.01 < rel(gv["params"]["Dense_0"]["kernel"], ref_dw) < 0.08


def test_history_sequence_through_linen_train_steps():
  # te_jax_reference.md §11 items 1(b) and 6: three jitted train steps, state replaced by its grad.
  recipe = ta.DelayedScaling(amax_history_len=3)
  model = nn.Dense(
    16, use_bias=False, dot_general=ta_linen.make_dot_general_cls(recipe, threshold=None)()
  )
  amaxes = [1.0, 4.0, 2.0, 0.5]
  xs = [_probe(a, (16, 32), seed=i) for i, a in enumerate(amaxes)]
  dys = [_probe(a, (16, 16), seed=10 + i) for i, a in enumerate(amaxes)]
  variables = model.init(jax.random.PRNGKey(0), xs[0])
  # Pin the kernel's amax to each step's value too (SGD with lr 0 keeps it fixed).
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.0))

  @jax.jit
  def step(state, x, dy, w):
    state = state.replace(params={"kernel": w})
    loss = lambda v: jnp.sum(model.apply(v, x) * dy)
    _, grads = state.value_and_grad(loss)
    return state.apply_gradients(grads=grads)

  histories = [[0, 0, 1], [0, 1, 4], [0, 4, 2], [0, 2, 0.5]]
  windows = [1, 4, 4, 4]  # max over the stored history before the roll and the current amax
  for i, a in enumerate(amaxes):
    state = step(state, xs[i], dys[i], _probe(a, (32, 16), seed=20 + i))
    meta = state.recipe_state["dot_general"]
    for role, limit in (("x", 448.0), ("kernel", 448.0), ("grad", 57344.0)):
      np.testing.assert_array_equal(meta[f"{role}_amax_history"], np.float32(histories[i]))
      np.testing.assert_array_equal(
        meta[f"{role}_scale"], [np.float32(limit) / np.float32(windows[i])]
      )
  assert state.step == 4


def test_shared_layer_called_twice_takes_max():
  recipe = ta.DelayedScaling(amax_history_len=4)

  class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      layer = ta_linen.Dense(16, use_bias=False, threshold=None, recipe=recipe)
      return layer(a), layer(b)

  model = Twice()
  a, b = _probe(2.0, (16, 32)), _probe(7.0, (16, 32), seed=1)
  variables = model.init(jax.random.PRNGKey(0), a, b)
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1))

  def loss(v):
    ya, yb = model.apply(v, a, b)
    return jnp.sum(ya) + jnp.sum(yb)

  _, grads = jax.jit(lambda s: s.value_and_grad(loss))(state)
  (hist,) = grads[OWG]["Dense_0"].values()
  np.testing.assert_array_equal(hist["x_amax_history"], [0, 0, 0, 7.0])
  np.testing.assert_array_equal(hist["x_scale"], [np.float32(448.0) / np.float32(7.0)])


def test_nn_scan_stacks_per_layer_state_and_remat_matches():
  recipe = ta.DelayedScaling(amax_history_len=4)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      h = jnp.tanh(ta_linen.Dense(32, threshold=None, recipe=recipe)(h))
      return h, None

  def stack(remat):
    block = nn.remat(Block, policy=core.save_quantized_operands) if remat else Block
    return nn.scan(
      block, variable_axes={"params": 0, OWG: 0}, split_rngs={"params": True}, length=3
    )()

  x = _probe(3.0, (16, 32))
  results = []
  for remat in (False, True):
    model = stack(remat)
    variables = model.init(jax.random.PRNGKey(0), x, None)
    meta = variables[OWG]
    leaf = jax.tree_util.tree_leaves(meta)[0]
    assert leaf.shape[0] == 3  # one state per layer

    def loss(v, model=model):
      h, _ = model.apply(v, x, None)
      return jnp.sum(h**2)

    grads = jax.jit(jax.grad(loss))(variables)
    results.append(grads)
    x_hist = jax.tree_util.tree_leaves(
      {
        k: v
        for k, v in jax.tree_util.tree_flatten_with_path(grads[OWG])[0]
        if "x_amax_history" in jax.tree_util.keystr(k)
      }
    )
    first_layer_amax = float(np.asarray(x_hist[0])[0, -1])
    assert first_layer_amax == 3.0
  jax.tree_util.tree_map(np.testing.assert_array_equal, results[0], results[1])


def test_dense_general_matches_flax_parameters_and_numerics(rel):
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 64))
  ref = nn.DenseGeneral(features=(4, 16), axis=-1)
  ours = ta_linen.DenseGeneral(
    features=(4, 16), axis=-1, threshold=None, recipe=ta.Float8CurrentScaling()
  )
  plain = ta_linen.DenseGeneral(features=(4, 16), axis=-1)
  v_ref = ref.init(jax.random.PRNGKey(0), x)
  v_ours = ours.init(jax.random.PRNGKey(0), x)
  jax.tree_util.tree_map(np.testing.assert_array_equal, v_ours["params"], v_ref["params"])
  np.testing.assert_array_equal(plain.apply(v_ref, x), ref.apply(v_ref, x))
  e = rel(ours.apply(v_ref, x), np.asarray(ref.apply(v_ref, x), np.float64))
  assert 0.01 < e < 0.05
  with pytest.raises(ValueError, match="either recipe or dot_general"):
    ta_linen.DenseGeneral(
      features=4, threshold=None, recipe=ta.Float8CurrentScaling(), dot_general=jax.lax.dot_general
    ).init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize(
  "recipe",
  [
    ta.Float8CurrentScaling(),
    ta.DelayedScaling(amax_history_len=4),
    ta.Float8BlockScaling(),
    ta.MXFP8BlockScaling(),
  ],
  ids=lambda r: type(r).__name__,
)
def test_dense_general_ordinary_loop_against_float64(recipe, rel):
  # features (2, 64) over x's last axis, with a bias: the output and the gradients of x, the
  # kernel and the bias after three steps of Linen's ordinary loop (grads of the whole
  # variables, the state collection replaced by its gradient), against float64.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 64, 128)), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(2, 64, 2, 64)), jnp.float32)
  layer = ta_linen.DenseGeneral(
    (2, 64), recipe=recipe, threshold=None, bias_init=nn.initializers.normal(0.1)
  )
  y, dx, grads, variables = plain_loops.linen_loop(layer, x, dy, 3, key=jax.random.PRNGKey(3))
  w = np.asarray(variables["params"]["kernel"], np.float64)
  b = np.asarray(variables["params"]["bias"], np.float64)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  want = {
    "y": np.einsum("bsk,kfn->bsfn", x64, w) + b,
    "dx": np.einsum("bsfn,kfn->bsk", dy64, w),
    "dkernel": np.einsum("bsk,bsfn->kfn", x64, dy64),
    "dbias": dy64.sum(axis=(0, 1)),
  }
  got = {"y": y, "dx": dx, "dkernel": grads["params"]["kernel"], "dbias": grads["params"]["bias"]}
  errs = {k: rel(got[k], want[k]) for k in want}
  assert errs["y"] < 0.05 and max(errs.values()) < 0.1, errs
  assert errs["y"] > 1e-3 and errs["dx"] > 1e-3 and errs["dkernel"] > 1e-3, errs  # FP8 ran
  assert errs["dbias"] < 1e-6, errs
  if isinstance(recipe, ta.DelayedScaling):
    state = variables[OWG]["DelayedScalingDotGeneral_0"]
    a = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(state["x_amax_history"], [0, a, a, a], rtol=1e-6)
    np.testing.assert_allclose(state["x_scale"], [448 / a], rtol=1e-6)
    g = float(jnp.max(jnp.abs(dy)))
    np.testing.assert_allclose(state["grad_amax_history"], [0, g, g, g], rtol=1e-6)


def test_dense_general_takes_te_sharding_fields(rel):
  # A TE-style model passes TE's DenseGeneral fields: the parameters carry the logical axis
  # names, the numbers are those of the unnamed layer, and training through the boxed
  # parameters (jax.grad over the whole variables, DelayedScaling's state replaced by its
  # "gradient") gives the unnamed layer's gradients and state.
  P = jax.sharding.PartitionSpec
  recipe = ta.DelayedScaling(amax_history_len=4)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 64))
  te_fields = {
    "kernel_axes": ("embed", "mlp"),
    "bias_axes": ("mlp",),
    "input_axes": ("batch", "length", "embed"),
    "transpose_batch_sequence": False,
  }
  named = ta_linen.DenseGeneral(32, threshold=None, recipe=recipe, **te_fields)
  plain = ta_linen.DenseGeneral(32, threshold=None, recipe=recipe)
  variables = named.init(jax.random.PRNGKey(0), x)
  assert nn.get_partition_spec(variables)["params"] == {
    "kernel": P("embed", "mlp"),
    "bias": P("mlp"),
  }
  unboxed = nn.unbox(variables)
  jax.tree_util.tree_map(
    np.testing.assert_array_equal, unboxed, plain.init(jax.random.PRNGKey(0), x)
  )
  # A clone (as nn.scan, nn.remat and bind make) does not annotate twice; one with other axes
  # takes them.
  assert named.clone().kernel_init == named.kernel_init
  for axes, spec in ((("a", "b"), P("a", "b")), ((), P())):
    clone = named.clone(kernel_axes=axes)
    assert nn.get_partition_spec(clone.init(jax.random.PRNGKey(0), x))["params"]["kernel"] == spec
  v_named, v_plain = variables, unboxed
  for _ in range(3):
    g_named = jax.grad(lambda v: jnp.sum(named.apply(v, x) ** 2))(v_named)
    g_plain = jax.grad(lambda v: jnp.sum(plain.apply(v, x) ** 2))(v_plain)
    jax.tree_util.tree_map(np.testing.assert_array_equal, nn.unbox(g_named), g_plain)
    v_named = {**v_named, "_overwrite_with_gradient": g_named["_overwrite_with_gradient"]}
    v_plain = {**v_plain, "_overwrite_with_gradient": g_plain["_overwrite_with_gradient"]}
  np.testing.assert_array_equal(named.apply(v_named, x), plain.apply(v_plain, x))
  ref = np.einsum(
    "blk,kn->bln", np.asarray(x, np.float64), np.asarray(unboxed["params"]["kernel"], np.float64)
  )
  assert rel(named.apply(v_named, x), ref) < 0.05
  lora = ta_linen.DenseGeneral(
    32, enable_low_rank_adaptation=True, low_rank_adaptation_dim=4, recipe=None, **te_fields
  )
  assert nn.get_partition_spec(lora.init(jax.random.PRNGKey(0), x))["params"] == {
    "kernel": P("embed", "mlp"),
    "bias": P("mlp"),
    "lora_a_kernel": P(),
    "lora_b_kernel": P(),
  }


@pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
)
def test_dense_general_input_axes_constrain_the_input_on_a_mesh():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((8, 4, 32))
  rules = (("batch", "data"), ("embed", None))
  specs = []
  for axes in ((), ("batch", None, "embed")):
    layer = ta_linen.DenseGeneral(16, recipe=None, input_axes=axes)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      variables = jax.jit(layer.init)(jax.random.key(0), x)
      y = jax.jit(layer.apply)(variables, x)
    specs.append(tuple(y.sharding.spec))
  assert specs[0] in ((), (None, None, None)) and specs[1][0] == "data", specs


def test_train_state_keeps_recipe_state_out_of_optimizer():
  recipe = ta.DelayedScaling(amax_history_len=4)
  model = ta_linen.Dense(16, threshold=None, recipe=recipe)
  x = _probe(2.0, (16, 32))
  variables = model.init(jax.random.PRNGKey(0), x)
  tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.5))
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)
  assert jax.tree_util.tree_structure(state.opt_state[1][0].mu) == jax.tree_util.tree_structure(
    variables["params"]
  )
  _, grads = state.value_and_grad(lambda v: jnp.sum(model.apply(v, x)))
  new = state.apply_gradients(grads=grads)
  # Clipping and weight decay did not touch the state: it is exactly the gradient.
  jax.tree_util.tree_map(np.testing.assert_array_equal, new.recipe_state, grads[OWG])
  with pytest.raises(ValueError, match="_overwrite_with_gradient"):
    state.apply_gradients(grads={"params": grads["params"]})


def test_forward_only_apply_does_not_change_state():
  model = ta_linen.Dense(16, threshold=None, recipe=ta.DelayedScaling(amax_history_len=4))
  x = _probe(2.0, (16, 32))
  variables = model.init(jax.random.PRNGKey(0), x)
  out, mutated = model.apply(variables, x, mutable=True)
  jax.tree_util.tree_map(np.testing.assert_array_equal, mutated[OWG], variables[OWG])


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=8)]
)
def test_seed_001_transformer_layer_trains(recipe):
  layer = FlaxTransformerLayer(
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    dot_general_cls=ta_linen.make_dot_general_cls(recipe, threshold=None),
  )
  key = jax.random.PRNGKey(42)
  x = jax.random.normal(key, (2, 16, 64)).astype(jnp.bfloat16)
  target = jnp.roll(x, 1, axis=1).astype(jnp.float32)
  variables = layer.init(key, x, attention_mask=None, deterministic=True)
  state = ta_linen.TrainState.create(apply_fn=layer.apply, variables=variables, tx=optax.adam(3e-3))
  fp8_dots, dots = inspect.count_fp8_dot_generals(
    jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True))), state.variables
  )
  assert fp8_dots == 12  # 4 Dense layers x 3 GEMMs; attention stays in high precision

  @jax.jit
  def step(state):
    loss_fn = lambda v: jnp.mean((layer.apply(v, x, deterministic=True) - target) ** 2)
    loss, grads = state.value_and_grad(loss_fn)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(6):
    state, loss = step(state)
    losses.append(float(loss))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  if recipe.stateful:
    meta = state.recipe_state["DelayedScalingDotGeneral_0"]
    assert float(meta["x_amax_history"][-1]) > 0 and float(meta["grad_amax_history"][-1]) > 0


def test_threshold_is_passed_to_the_core():
  below = dataclasses.replace(core.DEFAULT_SIZE_THRESHOLD, platforms=(jax.default_backend(),))
  recipe = ta.DelayedScaling(amax_history_len=4)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 64)).astype(jnp.bfloat16)
  ref = nn.Dense(32, dtype=jnp.bfloat16)
  variables = ref.init(jax.random.PRNGKey(0), x)
  cls = ta_linen.make_dot_general_cls(recipe, threshold=below)
  assert cls.threshold == below and ta_linen.make_dot_general_cls(recipe).threshold == (
    core.DEFAULT_SIZE_THRESHOLD
  )
  layers = [
    nn.Dense(32, dtype=jnp.bfloat16, dot_general=cls()),
    ta_linen.Dense(32, dtype=jnp.bfloat16, recipe=recipe, threshold=below),
    ta_linen.DenseGeneral(32, dtype=jnp.bfloat16, recipe=recipe, threshold=below),
  ]
  for layer in layers:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
      v = {**variables, OWG: layer.init(jax.random.PRNGKey(0), x)[OWG]}
    with pytest.warns(core.HighPrecisionGemmWarning, match="M=32, K=64, N=32"):
      np.testing.assert_array_equal(layer.apply(v, x), ref.apply(variables, x))
  forced = ta_linen.Dense(32, dtype=jnp.bfloat16, recipe=recipe, threshold=None)
  v = forced.init(jax.random.PRNGKey(0), x)
  assert inspect.count_fp8_dot_generals(forced.apply, v, x) == (1, 1)
  with pytest.raises(TypeError, match="threshold must be"):
    ta_linen.make_dot_general_cls(recipe, threshold=2**36)


def _recording_dot_general(monkeypatch):
  """Replaces core.dot_general with a wrapper that records the config each call passes."""
  seen = []
  original = core.dot_general

  def record(*args, config=None, **kwargs):
    seen.append(config)
    return original(*args, config=config, **kwargs)

  monkeypatch.setattr(core, "dot_general", record)
  return seen


def test_config_reaches_the_core(monkeypatch):
  seen = _recording_dot_general(monkeypatch)
  config = ta.GemmConfig(backend="jax", fp8_gemm="xla")
  x = jnp.ones((16, 32))
  layer = ta_linen.Dense(16, recipe=ta.Float8CurrentScaling(), threshold=None, config=config)
  layer.init(jax.random.PRNGKey(0), x)
  q = ta_linen.quantize(ta.Float8CurrentScaling(), threshold=None, config=config)
  q(nn.Dense(16).init)(jax.random.PRNGKey(0), x)
  assert seen == [config, config]
