"""Linen, NNX and Haiku apply the core's rules the same way: one rule on GEMM sizes, one default
recipe and threshold, one report type for their conversions."""

import inspect
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from tests import plain_loops

CURRENT = ta.Float8CurrentScaling()
# (K, N) of one layer: accepted, K not a multiple of 16, N not, both not.
SIZES = [(32, 48), (24, 32), (32, 24), (40, 10)]


def _x(k):
  return jnp.asarray(np.random.default_rng(k).normal(size=(4, k)), jnp.float32)


def _linen_layer(k, n):
  """The explicit Linen layer's output and FP8 dot count, or the error it raised."""
  layer = ta_linen.Dense(n, recipe=CURRENT, threshold=None)
  x = _x(k)
  variables = layer.init(jax.random.key(0), x)
  return ta.inspect.count_fp8_dot_generals(layer.apply, variables, x)


def _nnx_layer(k, n):
  layer = ta_nnx.Linear(k, n, recipe=CURRENT, threshold=None, rngs=nnx.Rngs(0))
  return ta.inspect.count_fp8_dot_generals(lambda x: layer(x), _x(k))


def _haiku_layer(k, n):
  f = hk.transform(lambda x: ta_hk.Linear(n, recipe=CURRENT, threshold=None)(x))
  x = _x(k)
  params = f.init(jax.random.key(0), x)
  return ta.inspect.count_fp8_dot_generals(lambda p, x: f.apply(p, None, x), params, x)


@pytest.mark.parametrize("k, n", SIZES)
@pytest.mark.parametrize(
  "build", [_linen_layer, _nnx_layer, _haiku_layer], ids=["linen", "nnx", "haiku"]
)
def test_explicit_layers_apply_one_size_rule(build, k, n):
  refusal = core.gemm_dims_refusal(k, n)
  assert (refusal is None) == (k % 16 == 0 and n % 16 == 0)
  if refusal is None:
    assert build(k, n) == (1, 1)  # the layer's one GEMM, in FP8
  else:
    bad = ", ".join(f"{d}={s}" for d, s in (("K", k), ("N", n)) if s % 16)
    with pytest.raises(ValueError, match=f"multiples of 16, got {bad}; keep this layer"):
      build(k, n)


def _linen_convert(k, n):
  q = ta_linen.quantize(CURRENT, threshold=None)
  model = nn.Dense(n)
  q(model.init)(jax.random.key(0), _x(k))
  return q.report


def _nnx_convert(k, n):
  model = nnx.Sequential(nnx.Linear(k, n, rngs=nnx.Rngs(0)))
  return ta_nnx.quantize_model(model, CURRENT, threshold=None)


def _haiku_convert(k, n):
  q = ta_hk.quantize(CURRENT, threshold=None)
  hk.transform(q(lambda x: hk.Linear(n)(x))).init(jax.random.key(0), _x(k))
  return q.report


@pytest.mark.parametrize("k, n", SIZES)
def test_conversions_apply_one_size_rule_and_return_one_report_type(k, n):
  refusal = core.gemm_dims_refusal(k, n)
  reports = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the skip warning of Linen and Haiku
    for convert in (_linen_convert, _nnx_convert, _haiku_convert):
      reports.append(convert(k, n))
  for report in reports:
    assert type(report) is core.QuantizeReport
    assert report.high_precision == {}
    if refusal is None:
      assert len(report.quantized) == 1 and report.skipped == {}
    else:
      assert report.quantized == [] and list(report.skipped.values()) == [refusal]


def _default(fn, name):
  return inspect.signature(fn).parameters[name].default


def test_one_default_recipe_and_threshold():
  assert core.DEFAULT_RECIPE == ta.Float8CurrentScaling()
  assert core.DEFAULT_THRESHOLD is core.DEFAULT_SIZE_THRESHOLD
  for layer in (ta_linen.Dense, ta_linen.DenseGeneral):
    fields = layer.__dataclass_fields__
    assert fields["recipe"].default is core.DEFAULT_RECIPE
    assert fields["threshold"].default is core.DEFAULT_THRESHOLD
  for layer in (ta_nnx.Linear, ta_nnx.LinearGeneral, ta_nnx.Einsum, ta_hk.Linear):
    assert _default(layer.__init__, "recipe") is core.DEFAULT_RECIPE, layer
  for fn in (
    ta_nnx.Linear.__init__,
    ta_nnx.LinearGeneral.__init__,
    ta_nnx.Einsum.__init__,
    ta_nnx.DotGeneral.__init__,
    ta_nnx.EinsumOp.__init__,
    ta_nnx.quantize_model,
    ta_hk.Linear.__init__,
    ta_hk.quantize.__init__,
    ta_linen.quantize.__init__,
    ta_linen.make_dot_general_cls,
  ):
    assert _default(fn, "threshold") is core.DEFAULT_THRESHOLD, fn
  assert ta_linen.QuantizedDotGeneral.__dataclass_fields__["threshold"].default is (
    core.DEFAULT_THRESHOLD
  )


def test_layers_built_without_a_recipe_use_the_default_one():
  # Each adapter's layer with no recipe= quantizes with current scaling, with no recipe state.
  k, n = 32, 48
  x = _x(k)
  linen = ta_linen.Dense(n, threshold=None)
  variables = linen.init(jax.random.key(0), x)
  assert set(variables) == {"params"}
  assert ta.inspect.count_fp8_dot_generals(linen.apply, variables, x) == (1, 1)
  layer = ta_nnx.Linear(k, n, threshold=None, rngs=nnx.Rngs(0))
  assert layer.recipe == CURRENT
  assert ta.inspect.count_fp8_dot_generals(lambda x: layer(x), x) == (1, 1)
  f = hk.transform_with_state(lambda x: ta_hk.Linear(n, threshold=None)(x))
  params, state = f.init(jax.random.key(0), x)
  assert state == {}
  assert ta.inspect.count_fp8_dot_generals(lambda p, x: f.apply(p, state, None, x), params, x) == (
    1,
    1,
  )


def test_training_helpers_share_one_shape_and_agree_after_several_steps():
  # One DelayedScaling layer, the same kernel in every framework, three SGD steps through each
  # adapter's value_and_grad: (value, (param_grads, state)) everywhere, the same losses, kernels
  # and recipe state.
  recipe = ta.DelayedScaling(amax_history_len=4)
  k, n, lr = 32, 48, 0.5
  rng = np.random.default_rng(7)
  kernel = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.float32)
  batches = [jnp.asarray(rng.normal(size=(8, k)) * (1 + i), jnp.float32) for i in range(3)]

  linen = ta_linen.Dense(n, use_bias=False, recipe=recipe, threshold=None)
  variables = linen.init(jax.random.key(0), batches[0])
  variables = {**variables, "params": {"kernel": kernel}}
  linen_step = jax.jit(ta_linen.value_and_grad(lambda v, x: jnp.mean(linen.apply(v, x) ** 2)))
  linen_losses = []
  for x in batches:
    loss, (grads, recipe_state) = linen_step(variables, x)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, variables["params"], grads)
    variables = {"params": params, "_overwrite_with_gradient": recipe_state}
    linen_losses.append(float(loss))
  (linen_state,) = variables["_overwrite_with_gradient"].values()

  layer = ta_nnx.Linear(k, n, use_bias=False, recipe=recipe, threshold=None, rngs=nnx.Rngs(0))
  layer.kernel.set_value(kernel)
  nnx_losses = []
  for x in batches:
    loss, (grads, state_grads) = ta_nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(layer, x)
    layer.kernel.set_value(layer.kernel.get_value() - lr * grads["kernel"].get_value())
    ta_nnx.update_recipe_state(layer, state_grads)
    nnx_losses.append(float(loss))
  nnx_state = layer.dot_general.recipe_state()

  model = hk.transform_with_state(
    lambda x: ta_hk.Linear(n, with_bias=False, recipe=recipe, threshold=None)(x)
  )
  params, state = model.init(jax.random.key(0), batches[0])
  params = {"linear": {"w": kernel}}

  def hk_loss(params, state, x):
    y, state = model.apply(params, state, None, x)
    return jnp.mean(y**2), state

  hk_step = jax.jit(ta_hk.value_and_grad(hk_loss))
  hk_losses = []
  for x in batches:
    loss, (grads, state) = hk_step(params, state, x)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    hk_losses.append(float(loss))

  np.testing.assert_allclose(linen_losses, nnx_losses, rtol=1e-6)
  np.testing.assert_allclose(linen_losses, hk_losses, rtol=1e-6)
  np.testing.assert_allclose(params["linear"]["w"], variables["params"]["kernel"], rtol=1e-6)
  np.testing.assert_allclose(layer.kernel.get_value(), variables["params"]["kernel"], rtol=1e-6)
  # Three steps of amaxes: the histories hold them, equal in every adapter.
  assert float(linen_state["x_amax_history"][-1]) > 0
  for name in core.state_names(recipe):
    np.testing.assert_array_equal(nnx_state[name], linen_state[name], err_msg=name)
    np.testing.assert_array_equal(state["linear"][name], linen_state[name], err_msg=name)
  history = np.asarray(linen_state["x_amax_history"])
  np.testing.assert_allclose(
    sorted(history[history > 0]), sorted(float(jnp.max(jnp.abs(x))) for x in batches), rtol=1e-6
  )


def test_haiku_value_grad_and_state_is_value_and_grad_reordered():
  model = hk.transform_with_state(
    lambda x: ta_hk.Linear(16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)(x)
  )
  x = _x(32)
  params, state = model.init(jax.random.key(0), x)

  def loss_fn(params, state, x):
    y, state = model.apply(params, state, None, x)
    return jnp.mean(y**2), (jnp.max(y), state)

  (loss, aux), (grads, new_state) = ta_hk.value_and_grad(loss_fn, has_aux=True)(params, state, x)
  old = ta_hk.value_grad_and_state(loss_fn, has_aux=True)(params, state, x)
  for a, b in zip(
    jax.tree_util.tree_leaves((loss, aux, grads, new_state)),
    jax.tree_util.tree_leaves(old),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


DENSE_RECIPES = [
  ta.Float8CurrentScaling(),
  ta.DelayedScaling(amax_history_len=4),
  ta.Float8BlockScaling(),
  ta.MXFP8BlockScaling(),
]


def _dense_linen(recipe, x, dy, steps):
  layer = ta_linen.Dense(128, recipe=recipe, threshold=None)
  y, dx, grads, variables = plain_loops.linen_loop(layer, x, dy, steps)
  # The one GEMM's state, in its dot_general child's variables (none for stateless recipes).
  children = variables.get(ta_linen.OVERWRITE_WITH_GRADIENT, {})
  state = dict(*children.values()) if children else {}
  p = variables["params"]
  return y, dx, grads["params"]["kernel"], grads["params"]["bias"], p["kernel"], state


def _dense_nnx(recipe, x, dy, steps):
  layer = ta_nnx.Linear(128, 128, recipe=recipe, threshold=None, rngs=nnx.Rngs(0))
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))

  @nnx.jit
  def step(layer, x):
    def loss(m, x):
      y = m(x)
      return jnp.sum(y * dy), y

    (_, y), (grads, dx) = nnx.value_and_grad(loss, argnums=(diff, 1), has_aux=True)(layer, x)
    params, state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    nnx.update(layer, state)
    return y, dx, params

  for _ in range(steps):
    y, dx, grads = step(layer, x)
  state = layer.dot_general.recipe_state()  # {} for stateless recipes
  return y, dx, grads["kernel"][...], grads["bias"][...], layer.kernel[...], state


def _dense_haiku(recipe, x, dy, steps):
  f = hk.transform_with_state(lambda x: ta_hk.Linear(128, recipe=recipe, threshold=None)(x))
  params, state = f.init(jax.random.key(0), x)

  @jax.jit
  def step(params, state, x):
    def loss(p, s, x):
      y, _ = f.apply(p, s, None, x)
      return jnp.sum(y * dy), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, state, x)

  for _ in range(steps):
    (_, y), (grads, state, dx) = step(params, state, x)
  return (
    y,
    dx,
    grads["linear"]["w"],
    grads["linear"]["b"],
    params["linear"]["w"],
    dict(state.get("linear", {})),
  )


@pytest.mark.parametrize("recipe", DENSE_RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize(
  "loop",
  [_dense_linen, _dense_nnx, _dense_haiku],
  ids=["linen-Dense", "nnx-Linear", "haiku-Linear"],
)
def test_dense_layers_in_each_frameworks_loop_against_float64(loop, recipe, rel):
  # Three steps of the framework's plain loop (the recipe state, where there is one, replaced by
  # its gradient): the output and the gradients of x, the kernel and the bias against float64,
  # and DelayedScaling's state after the steps.
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 64, 128)), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(2, 64, 128)), jnp.float32)
  y, dx, dw, db, w, state = loop(recipe, x, dy, steps=3)
  x64, dy64, w64 = (np.asarray(v, np.float64) for v in (x, dy, w))
  errs = {
    "y": rel(y, x64 @ w64),
    "dx": rel(dx, dy64 @ w64.T),
    "dkernel": rel(dw, np.einsum("bsk,bsn->kn", x64, dy64)),
  }
  assert errs["y"] < 0.05 and max(errs.values()) < 0.1, errs
  assert min(errs.values()) > 1e-3, errs  # FP8 ran in the forward, dgrad and wgrad
  assert rel(db, dy64.sum(axis=(0, 1))) < 1e-6
  if isinstance(recipe, ta.DelayedScaling):
    assert sorted(state) == sorted(core.state_names(recipe))
    for role, operand, fp8_max in (("x", x, 448), ("kernel", w, 448), ("grad", dy, 57344)):
      a = float(jnp.max(jnp.abs(operand)))
      np.testing.assert_allclose(state[f"{role}_amax_history"], [0, a, a, a], rtol=1e-6)
      np.testing.assert_allclose(state[f"{role}_scale"], [fp8_max / a], rtol=1e-6)
  else:
    assert not state
