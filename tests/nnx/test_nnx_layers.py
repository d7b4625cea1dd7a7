"""te_adapters.nnx layers: parity with their NNX counterparts, FP8 numerics, errors."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx

CURRENT = ta.Float8CurrentScaling()
DELAYED = ta.DelayedScaling(amax_history_len=4)

PAIRS = [
  (ta_nnx.Linear, nnx.Linear),
  (ta_nnx.LinearGeneral, nnx.LinearGeneral),
  (ta_nnx.Einsum, nnx.Einsum),
]


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=lambda c: c.__name__)
def test_signature_accepts_every_nnx_argument(ours, theirs):
  ours_params = inspect.signature(ours.__init__).parameters
  for name, p in inspect.signature(theirs.__init__).parameters.items():
    assert name in ours_params, f"{ours.__name__} lacks argument {name!r}"
    q = ours_params[name]
    assert q.kind == p.kind, name
    assert q.default is p.default or q.default == p.default, name
  assert ours_params["recipe"].kind == inspect.Parameter.KEYWORD_ONLY
  assert issubclass(ours, theirs)


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _params(module):
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _builders():
  return [
    (
      lambda cls, **kw: cls(32, 48, rngs=nnx.Rngs(3), **kw),
      (2, 5, 32),
    ),
    (
      lambda cls, **kw: cls((2, 16), (3, 16), axis=(-2, -1), rngs=nnx.Rngs(3), **kw),
      (4, 2, 16),
    ),
    (
      lambda cls, **kw: cls("btd,dhk->bthk", (32, 2, 16), (2, 16), rngs=nnx.Rngs(3), **kw),
      (2, 3, 32),
    ),
  ]


@pytest.mark.parametrize("index", range(3), ids=["Linear", "LinearGeneral", "Einsum"])
def test_same_parameters_and_recipe_none_is_identical(index):
  ours_cls, theirs_cls = PAIRS[index]
  build, x_shape = _builders()[index]
  theirs = build(theirs_cls)
  ours_plain = build(ours_cls, recipe=None)
  ours_fp8 = build(ours_cls, recipe=DELAYED)
  # Same names, shapes, dtypes and initial values (same initialisers, same rng use).
  _assert_trees_equal(_params(theirs), _params(ours_plain))
  _assert_trees_equal(_params(theirs), _params(ours_fp8))
  assert not nnx.to_pure_dict(nnx.state(ours_plain, ta_nnx.RecipeState))

  x = _normal(0, x_shape)

  def loss(m, x):
    return jnp.sum(jnp.sin(m(x)))

  out_theirs = nnx.jit(nnx.value_and_grad(loss))(theirs, x)
  out_ours = nnx.jit(nnx.value_and_grad(loss))(ours_plain, x)
  _assert_trees_equal(out_theirs[0], out_ours[0])
  _assert_trees_equal(nnx.to_pure_dict(out_theirs[1]), nnx.to_pure_dict(out_ours[1]))


def test_parameters_load_both_ways():
  theirs = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  ours = ta_nnx.Linear(32, 16, threshold=None, recipe=DELAYED, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  _assert_trees_equal(_params(theirs), _params(ours))
  back = nnx.Linear(32, 16, rngs=nnx.Rngs(2))
  nnx.update(back, nnx.state(ours, nnx.Param))
  _assert_trees_equal(_params(back), _params(theirs))


def test_recipe_none_bf16_matches_nnx_linear():
  kw = dict(dtype=jnp.bfloat16, use_bias=False)
  theirs = nnx.Linear(24, 10, rngs=nnx.Rngs(0), **kw)
  ours = ta_nnx.Linear(24, 10, recipe=None, rngs=nnx.Rngs(0), **kw)
  x = _normal(1, (3, 24))
  np.testing.assert_array_equal(np.asarray(theirs(x)), np.asarray(ours(x)))
  assert ours(x).dtype == jnp.bfloat16


def test_state_variables_have_te_names_and_shapes():
  layer = ta_nnx.Linear(32, 16, threshold=None, recipe=DELAYED, rngs=nnx.Rngs(0))
  state = nnx.to_pure_dict(ta_nnx.recipe_state(layer))["dot_general"]["state"]
  assert set(state) == set(ta.core.state_names(DELAYED))
  for name, value in state.items():
    assert value.dtype == jnp.float32
    assert value.shape == ((1,) if name.endswith("_scale") else (4,))
  assert not nnx.to_pure_dict(ta_nnx.recipe_state(ta_nnx.Linear(32, 16, rngs=nnx.Rngs(0))))
  assert ta_nnx.Linear(32, 16, rngs=nnx.Rngs(0)).recipe == CURRENT  # the default recipe


def _reference_grads(x, w, g, contract):
  """float64 forward and grads of sum(einsum(x, w) * g)."""
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  y = np.einsum(contract, x64, w64)
  ins, out = contract.split("->")
  x_sub, w_sub = ins.split(",")
  dx = np.einsum(f"{out},{w_sub}->{x_sub}", g64, w64)
  dw = np.einsum(f"{x_sub},{out}->{w_sub}", x64, g64)
  return y, dx, dw


# (layer builder, input shape, equation of the same product on the kernel)
NUMERICS_CASES = {
  "Linear": (
    lambda r: ta_nnx.Linear(64, 48, use_bias=False, threshold=None, recipe=r, rngs=nnx.Rngs(0)),
    (4, 16, 64),
    "btk,kn->btn",
  ),
  "LinearGeneral": (
    lambda r: ta_nnx.LinearGeneral(
      (4, 16), 32, axis=(-2, -1), use_bias=False, threshold=None, recipe=r, rngs=nnx.Rngs(0)
    ),
    (32, 4, 16),
    "bij,ijn->bn",
  ),
  # jnp.einsum hands this layer's kernel to its dot_general first.
  "Einsum-kernel-first": (
    lambda r: ta_nnx.Einsum(
      "nta,hab->nthb", (2, 64, 32), threshold=None, recipe=r, rngs=nnx.Rngs(0)
    ),
    (4, 8, 64),
    "nta,hab->nthb",
  ),
  "Einsum-input-first": (
    lambda r: ta_nnx.Einsum("ij,jk->ik", (64, 32), threshold=None, recipe=r, rngs=nnx.Rngs(0)),
    (64, 64),
    "ij,jk->ik",
  ),
}


@pytest.mark.parametrize(
  "case, recipe",
  [(case, CURRENT) for case in NUMERICS_CASES]
  + [("Linear", DELAYED), ("Einsum-kernel-first", DELAYED)],
  ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_fp8_numerics_against_float64(case, recipe, rel):
  build, x_shape, contract = NUMERICS_CASES[case]
  layer = build(recipe)
  kernel = _normal(1, layer.kernel.shape)
  layer.kernel.set_value(kernel)
  if isinstance(recipe, ta.DelayedScaling):
    # Delayed scaling quantizes with the stored scales: give it the scales of this data.
    op = getattr(layer, "dot_general", None) or layer.einsum_op
    op.state.x_scale.set_value(jnp.full((1,), 448 / 4.0))
    op.state.kernel_scale.set_value(jnp.full((1,), 448 / 4.0))
    op.state.grad_scale.set_value(jnp.full((1,), 57344 / 4.0))
  x = _normal(2, x_shape)
  y_ref = np.einsum(contract, np.asarray(x, np.float64), np.asarray(kernel, np.float64))
  g = _normal(3, y_ref.shape)

  def loss(m, x, g):
    y = m(x)
    return jnp.sum(y * g), y

  grad_fn = nnx.jit(ta_nnx.grad(loss, argnums=(0, 1), has_aux=True))
  ((g_model, dx), (state_grads, none)), y = grad_fn(layer, x, g)
  assert none is None
  _, dx_ref, dw_ref = _reference_grads(x, kernel, g, contract)
  err_y, err_dx, err_dw = rel(y, y_ref), rel(dx, dx_ref), rel(g_model["kernel"][...], dw_ref)
  assert err_y < 0.05 and err_dx < 0.08 and err_dw < 0.08, (err_y, err_dx, err_dw)
  # Well above bf16's ~0.003: the GEMMs really ran in FP8.
  assert min(err_y, err_dx, err_dw) > 0.01, (err_y, err_dx, err_dw)
  if isinstance(recipe, ta.DelayedScaling):
    # The x role recorded the input's amax, the kernel role the kernel's, whatever order
    # jnp.einsum chose.
    op_grads = next(iter(nnx.to_pure_dict(state_grads).values()))["state"]
    np.testing.assert_allclose(op_grads["x_amax_history"][-1], np.max(np.abs(x)), rtol=1e-6)
    np.testing.assert_allclose(
      op_grads["kernel_amax_history"][-1], np.max(np.abs(kernel)), rtol=1e-6
    )
    np.testing.assert_allclose(op_grads["grad_amax_history"][-1], np.max(np.abs(g)), rtol=1e-6)


def test_dims_not_multiple_of_16_are_refused():
  with pytest.raises(ValueError, match="multiples of 16.*N=10"):
    ta_nnx.Linear(32, 10, threshold=None, recipe=CURRENT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="multiples of 16.*K=24"):
    ta_nnx.LinearGeneral((2, 12), 16, axis=(-2, -1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="multiples of 16.*K=8"):
    ta_nnx.Einsum("btd,dk->btk", (8, 16), rngs=nnx.Rngs(0))
  # The same sizes are fine unquantized.
  assert ta_nnx.Linear(32, 10, recipe=None, rngs=nnx.Rngs(0))(jnp.ones((2, 32))).shape == (2, 10)


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="either recipe= or a custom dot_general="):
    ta_nnx.Linear(32, 16, dot_general=lambda *a, **k: None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="either recipe= or a custom einsum_op="):
    ta_nnx.Einsum("ij,jk->ik", (16, 16), einsum_op=lambda *a, **k: None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dot_general_cls"):
    ta_nnx.LinearGeneral(16, 16, dot_general_cls=object, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="recipe must be"):
    ta_nnx.Linear(32, 16, threshold=None, recipe="fp8", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="recipe instance"):
    ta_nnx.Linear(32, 16, threshold=None, recipe=ta.DelayedScaling, rngs=nnx.Rngs(0))
  repeated = ta_nnx.Einsum("iij,jk->ik", (16, 16), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="repeats in the input"):
    repeated(jnp.ones((16, 16, 16)))
  lonely = ta_nnx.Einsum("ijm,jk->ik", (16, 16), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"\['m'\] are summed over one operand"):
    lonely(jnp.ones((16, 16, 4)))
  # An input of another rank than the equation's: the rank is named, not a label's size.
  two_d = ta_nnx.Einsum("bd,df->bf", (32, 16), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"input has rank 3 \(shape \(2, 4, 32\)\).* 2 labels"):
    two_d(jnp.ones((2, 4, 32)))


def test_threshold_is_passed_to_the_core():
  below = dataclasses.replace(ta.core.DEFAULT_SIZE_THRESHOLD, platforms=(jax.default_backend(),))
  for index, (build, x_shape) in enumerate(_builders()):
    ours = build(PAIRS[index][0], recipe=DELAYED, threshold=below, dtype=jnp.bfloat16)
    theirs = build(PAIRS[index][1], dtype=jnp.bfloat16)
    op = ours.einsum_op if index == 2 else ours.dot_general
    assert op.threshold == below and ours.threshold == below
    x = _normal(index, x_shape)
    with pytest.warns(ta.core.HighPrecisionGemmWarning, match="threshold=None"):
      np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(theirs(x)))
  forced = ta_nnx.Linear(32, 48, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(0))
  assert ta.inspect.count_fp8_dot_generals(lambda x: forced(x), _normal(0, (4, 32))) == (1, 1)
  assert ta_nnx.Linear(32, 48, rngs=nnx.Rngs(0)).dot_general.threshold == (
    ta.core.DEFAULT_SIZE_THRESHOLD
  )
  with pytest.raises(TypeError, match="threshold must be"):
    ta_nnx.DotGeneral(DELAYED, threshold="small")
  model = nnx.Sequential(
    nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.Einsum("bd,dk->bk", (64, 16), rngs=nnx.Rngs(0))
  )
  ta_nnx.quantize_model(model, DELAYED, threshold=below)
  assert model.layers[0].dot_general.threshold == model.layers[1].einsum_op.threshold == below
  model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)))
  ta_nnx.quantize_model(model, DELAYED)
  assert model.layers[0].dot_general.threshold == ta.core.DEFAULT_SIZE_THRESHOLD


def test_config_reaches_the_core(monkeypatch):
  from te_adapters import core

  seen = []
  original = core.dot_general

  def record(*args, config=None, **kwargs):
    seen.append(config)
    return original(*args, config=config, **kwargs)

  monkeypatch.setattr(core, "dot_general", record)
  config = ta.GemmConfig(backend="jax", fp8_gemm="xla")
  x = jnp.ones((4, 32))
  ta_nnx.Linear(32, 16, rngs=nnx.Rngs(0), threshold=None, config=config)(x)
  model = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  ta_nnx.quantize_model(model, ta.Float8CurrentScaling(), threshold=None, config=config)
  model(x)
  assert seen == [config, config]
