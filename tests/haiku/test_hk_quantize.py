"""te_adapters.haiku.quantize: FP8 for the hk.Linear layers of an unedited model."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk

CURRENT = ta.Float8CurrentScaling()
DELAYED = ta.DelayedScaling(amax_history_len=4)
DN = (((1,), (0,)), ((), ()))
W_INIT = hk.initializers.RandomNormal(0.25)


def _np_init(seed, stddev=0.2):
  """A weight initialiser drawing from numpy: no PRNG to compile, so init(None, ...) works."""
  rng = np.random.default_rng(seed)
  return lambda shape, dtype: jnp.asarray(stddev * rng.normal(size=shape), dtype)


def _mlp(x):
  # Plain hk.Linear layers; the last one's 10 outputs cannot go through an FP8 GEMM.
  return hk.nets.MLP([32, 32, 10], w_init=W_INIT)(x)


def test_mlp_is_quantized_without_edits(rel):
  x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
  plain = hk.transform(_mlp)
  q = ta_hk.quantize(CURRENT, threshold=None)
  quantized = hk.transform(q(_mlp))

  def reference(p, x):
    # The first two layers through the core's FP8 GEMM, the last one in float32.
    h = x
    for i in range(2):
      w, b = p[f"mlp/~/linear_{i}"]["w"], p[f"mlp/~/linear_{i}"]["b"]
      h = jax.nn.relu(core.dot_general(h, w, DN, threshold=None, recipe=CURRENT) + b)
    return h @ p["mlp/~/linear_2"]["w"] + p["mlp/~/linear_2"]["b"]

  @jax.jit
  def run(key, x):
    p_plain, p_quant = plain.init(key, x), quantized.init(key, x)
    outputs = [
      plain.apply(p_plain, None, x),
      quantized.apply(p_plain, None, x),
      reference(p_plain, x),
    ]
    return p_plain, p_quant, outputs

  with pytest.warns(
    ta.SkippedLayersWarning, match="mlp/~/linear_2: GEMM size K=32, N=10 is not a multiple of 16"
  ):
    p_plain, p_quant, (y_plain, y_quant, y_ref) = run(jax.random.key(0, impl="rbg"), x)

  # Parameters: same names, shapes, initial values.
  for a, b in zip(jax.tree.leaves(p_quant), jax.tree.leaves(p_plain), strict=True):
    np.testing.assert_array_equal(a, b)
  assert q.report.quantized == ["mlp/~/linear_0", "mlp/~/linear_1"]
  assert q.report.skipped == {"mlp/~/linear_2": "GEMM size K=32, N=10 is not a multiple of 16"}
  assert rel(y_quant, y_ref) < 1e-5
  assert rel(y_quant, y_plain) > 3e-3  # the FP8 layers did quantize


def test_delayed_scaling_state_under_the_linear_names():
  x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
  r = ta.DelayedScaling(amax_history_len=4)
  model = hk.transform_with_state(
    ta_hk.quantize(r, threshold=None)(lambda x: hk.nets.MLP([32, 32, 10], w_init=_np_init(1))(x))
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the 10-wide layer's warning is tested above
    params, state = jax.jit(model.init)(None, x)

    def loss_fn(params, state, x):
      y, state = model.apply(params, state, None, x)
      return jnp.sum(y * y), state

    step = jax.jit(ta_hk.value_grad_and_state(loss_fn))
    _, _, grads, new_state = step(params, state, x)
  assert set(state) == {"mlp/~/linear_0", "mlp/~/linear_1"}
  assert all(set(v) == ta_hk.RECIPE_STATE_NAMES for v in state.values())
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  np.testing.assert_allclose(
    new_state["mlp/~/linear_0"]["x_amax_history"], [0, 0, 0, np.max(np.abs(x))], rtol=1e-6
  )
  assert float(new_state["mlp/~/linear_1"]["grad_amax_history"][-1]) > 0


def test_attention_projections_filter_nesting_and_own_linear():
  x = np.random.default_rng(2).normal(size=(2, 8, 32)).astype(np.float32)

  def forward(x):
    h = hk.MultiHeadAttention(2, 16, w_init=_np_init(2))(x, x, x)
    with ta_hk.quantize(
      None, threshold=None
    ):  # an inner scope wins: this layer stays in high precision
      h = hk.Linear(32, w_init=_np_init(3), name="kept")(h)
    h = ta_hk.Linear(32, w_init=_np_init(4), recipe=None, name="own")(h)  # a te_adapters layer
    return hk.Linear(16, w_init=_np_init(5), name="head")(h)

  q = ta_hk.quantize(rules=[("head", None), (".*", CURRENT)], threshold=None)
  with q as report:
    params = jax.jit(hk.transform(forward).init)(None, x)
  assert report is q.report
  attention = [f"multi_head_attention/{n}" for n in ("query", "key", "value", "linear")]
  assert report.quantized == attention  # not "kept" (inner scope), "own" or "head" (by rule)
  assert report.skipped == {}
  assert report.high_precision == {"head": "rule 0 ('head') keeps it in high precision"}
  assert set(params) == {*attention, "kept", "own", "head"}

  # Outside any scope the same function is unquantized: the scopes only act while tracing.
  @jax.jit
  def plain_and_quantized(params, x):
    plain = hk.transform(forward).apply(params, None, x)
    with ta_hk.quantize(rules=[("head", None), (".*", CURRENT)], threshold=None):
      return plain, hk.transform(forward).apply(params, None, x)

  plain, quantized = plain_and_quantized(params, x)
  assert np.max(np.abs(np.asarray(quantized) - np.asarray(plain))) > 1e-3


def test_haiku_mixed_precision_policies():
  jmp = pytest.importorskip("jmp")
  x = jnp.ones((8, 32))
  hk.mixed_precision.set_policy(hk.Linear, jmp.get_policy("p=f32,c=bf16,o=f32"))
  try:
    f = hk.transform_with_state(ta_hk.quantize(CURRENT, threshold=None)(lambda x: hk.Linear(32)(x)))
    params, state = jax.eval_shape(f.init, jax.random.key(0), x)
    assert params["linear"]["w"].dtype == jnp.float32  # the policy's parameter dtype
    assert jax.eval_shape(f.apply, params, state, None, x)[0].dtype == jnp.float32
    # The policy's state getter would cast recipe state to bf16: refused, not silently rounded.
    f = hk.transform_with_state(ta_hk.quantize(DELAYED, threshold=None)(lambda x: hk.Linear(32)(x)))
    with pytest.raises(TypeError, match="recipe state must stay float32.*mixed_precision"):
      jax.eval_shape(f.init, jax.random.key(0), x)
  finally:
    hk.mixed_precision.clear_policy(hk.Linear)


def test_bad_arguments():
  with pytest.raises(TypeError, match="recipe must be"):
    ta_hk.quantize("fp8", threshold=None)
  with pytest.raises(TypeError, match="module_filter must be callable"):
    ta_hk.quantize(CURRENT, module_filter="head", threshold=None)


def test_report_names_the_gemms_the_threshold_kept_in_high_precision():
  """The suite's default threshold applies on every platform (tests/conftest.py)."""
  x = jnp.ones((4, 32), jnp.float32)

  def forward(x):
    return hk.Linear(64, name="small")(x)

  for threshold, expected in ((core.DEFAULT_SIZE_THRESHOLD, ["small"]), (None, [])):
    q = ta_hk.quantize(CURRENT, threshold=threshold)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
      hk.transform_with_state(q(forward)).init(jax.random.key(0), x)
    assert q.report.quantized == ["small"]
    assert list(q.report.high_precision) == expected
  assert q.report.high_precision == {}
  q = ta_hk.quantize(CURRENT)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    hk.transform_with_state(q(forward)).init(jax.random.key(0), x)
  assert q.report.high_precision["small"].startswith("M=4, K=32, N=64: below the size threshold")


def test_config_reaches_the_core(monkeypatch):
  seen = []
  original = core.dot_general

  def record(*args, config=None, **kwargs):
    seen.append(config)
    return original(*args, config=config, **kwargs)

  monkeypatch.setattr(core, "dot_general", record)
  config = ta.GemmConfig(backend="jax", fp8_gemm="xla")
  x = jnp.ones((4, 32))
  q = ta_hk.quantize(ta.Float8CurrentScaling(), threshold=None, config=config)
  hk.transform(q(lambda x: hk.Linear(16)(x))).init(jax.random.key(0), x)
  layer = lambda x: ta_hk.Linear(16, threshold=None, config=config)(x)
  hk.transform(layer).init(jax.random.key(0), x)
  assert seen == [config, config]
