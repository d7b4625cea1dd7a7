"""Rowwise FP8 scaling (``Float8RowwiseScaling``): one scale per row of each GEMM operand along
its contracting dimension, from the current tensor.

The references quantize with numpy per row (float32 arithmetic, as the format's) and multiply the
quantized values in float64.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from tests.conftest import rel_err

DN = (((1,), (0,)), ((), ()))
ON_GPU = jax.default_backend() == "gpu"
# Against float64 products of the quantized values: float32 sums on CPU; a GPU's FP8 GEMM sums
# in another order (and with fast accumulation forward). A wrong scale is off by 1e-2 or more.
EXACT = 2e-3 if ON_GPU else 1e-6
ROWWISE = ta.Float8RowwiseScaling()
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)


def gpu_only(test):
  return pytest.mark.gpu(
    pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU with FP8 GEMMs (Hopper)")(test)
  )


def _data(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def np_rows(x, q_dtype, margin=0.0):
  """The numpy model of the format's quantization of ``x (..., P, C)``: ``(data, scale_inv)``,
  one power-of-two float32 scale per row along the last axis, the largest with ``amax * scale
  <= fp8_max / 2**margin`` (from float64 logarithms, checked below)."""
  x = np.asarray(x).astype(np.float32)
  magnitudes = np.where(np.isnan(x), np.inf, np.abs(x))
  amax = np.max(magnitudes, axis=-1, keepdims=True, initial=0.0).astype(np.float32)
  limit = float(jnp.finfo(q_dtype).max)
  target = float(np.float32(limit / 2.0**margin))
  ok = (amax >= np.finfo(np.float32).tiny) & np.isfinite(amax)
  safe = np.where(ok, amax, 1.0).astype(np.float64)
  e = np.clip(np.floor(np.log2(target / safe)), -126, 126)
  scale = np.where(ok, np.exp2(e), 1.0)
  # The largest such power of two (where the clamp leaves it free).
  assert np.all(safe * scale <= target)
  assert np.all((safe * 2 * scale > target) | ~ok | (e == 126))
  scale = scale.astype(np.float32)
  data = np.clip(x * scale, -limit, limit).astype(q_dtype)
  return data, (np.float32(1.0) / scale).astype(np.float32)


def q64(x, q_dtype, margin=0.0):
  """float64 values of ``x (..., P, C)`` quantized per row along its last axis."""
  data, sinv = np_rows(x, q_dtype, margin)
  return data.astype(np.float64) * sinv.astype(np.float64)


def reference(x, w, dy, recipe=ROWWISE):
  """float64 y, dx, dW of ``x (M, K) @ w (K, N)`` with every operand quantized per row along the
  contracting dimension of the GEMM it feeds."""
  fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  y = q64(x, fwd) @ q64(w.T, fwd).T  # x per token, the kernel per output channel (over K)
  dx = q64(dy, bwd) @ q64(w, fwd).T  # the gradient per token, the kernel per input channel
  if recipe.weight_grad_high_precision:
    dw = x.astype(np.float64).T @ dy.astype(np.float64)
  else:
    dw = q64(x.T, fwd) @ q64(dy.T, bwd).T  # both per channel, over the tokens
  return y, dx, dw


def _grads(recipe=ROWWISE, **kw):
  def loss(x, w, dy):
    y = core.dot_general(x, w, DN, recipe=recipe, threshold=None, **kw)
    return jnp.sum(y * dy), y

  @jax.jit
  def step(x, w, dy):
    (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w, dy)
    return y, dx, dw

  return step


# --- the recipe --------------------------------------------------------------------------------


def test_recipe_fields_and_format():
  r = ta.Float8RowwiseScaling()
  assert (r.margin, r.fp8_format, r.weight_grad_high_precision) == (0, ta.Format.HYBRID, False)
  assert (r.fwd_dtype, r.bwd_dtype) == (E4M3, E5M2)
  assert not r.stateful and not r.block_scaled and not r.uses_rng
  assert ta.Float8RowwiseScaling(fp8_format=ta.Format.E4M3).bwd_dtype == E4M3
  fmt = core.format_of(r)
  assert fmt.recipe_type is ta.Float8RowwiseScaling and not fmt.per_tensor
  assert core.init_state(r) == {} and core.state_names(r) == ()
  assert hash(r) == hash(ta.Float8RowwiseScaling())


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"margin": -1}, ValueError, r"Float8RowwiseScaling.margin must be finite and >= 0"),
    ({"margin": float("inf")}, ValueError, r"margin must be finite"),
    ({"margin": "1"}, TypeError, r"margin must be a real number"),
    ({"fp8_format": ta.Format.E5M2}, ValueError, r"pure E5M2 training is not supported"),
    ({"fp8_format": ta.Format.E2M1}, ValueError, r"E2M1 is the FP4 format of NVFP4"),
    ({"fp8_format": "HYBRID"}, TypeError, r"fp8_format must be a te_adapters.Format"),
    ({"weight_grad_high_precision": 1}, TypeError, r"weight_grad_high_precision must be a bool"),
    ({"fp8_gemm_wgrad": True}, TypeError, r"fp8_gemm_wgrad must be a te_adapters.MMParams"),
  ],
)
def test_bad_fields_are_clear_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    ta.Float8RowwiseScaling(**kwargs)


def test_misuse_is_a_clear_error():
  x = _data((32, 64), 0)
  with pytest.raises(ValueError, match="computes its scales from x; do not pass scale"):
    ta.quantize(x, recipe=ROWWISE, scale=jnp.ones(1))
  with pytest.raises(ValueError, match="axis=5 is not valid"):
    ta.quantize(x, recipe=ROWWISE, axis=5)
  with pytest.raises(ValueError, match="does not match Float8RowwiseScaling's dtype"):
    ta.quantize(x, jnp.float8_e5m2, recipe=ROWWISE)
  with pytest.raises(ValueError, match="rng was given but Float8RowwiseScaling does not use one"):
    core.dot_general(x, x.T, DN, recipe=ROWWISE, rng=jax.random.key(0), threshold=None)
  with pytest.raises(NotImplementedError, match="per-tensor FP8 recipes"):
    core.dot_general(x, x.T, DN, recipe=ROWWISE, kernel_all_gather=P("dp"), threshold=None)
  # ragged_dot's rowwise grouped GEMM: tests/core/test_ragged_rowwise.py.


# --- quantization --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("role", ["x", "kernel", "grad"])
def test_quantization_is_the_numpy_model_bit_for_bit(dtype, role):
  """Both copies: ``rows`` per row P over C, ``cols`` the swapped operand per row C over P; the
  scales are powers of two, exact on every backend, so the codes are too."""
  recipe = ta.Float8RowwiseScaling(margin=1)
  x = _data((3, 40, 72), 1) * jnp.exp(_data((3, 40, 1), 2))  # rows of very different amaxes
  x = x.at[0, 3].set(0.0).at[1, 5, 7].set(jnp.inf).astype(dtype)
  # TE's casts (GemmConfig.non_finite="saturate"); the default differs only in the inf's row.
  saturate = ta.GemmConfig(non_finite="saturate")
  q = core.format_of(recipe).quantize(core.QuantizeRequest(x, role, recipe, config=saturate))
  q_dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  default = core.format_of(recipe).quantize(core.QuantizeRequest(x, role, recipe)).rows
  assert np.isnan(float(default.scale_inv[1, 5, 0]))
  np.testing.assert_array_equal(
    np.delete(np.asarray(default.scale_inv), 5, axis=1),
    np.delete(np.asarray(q.rows.scale_inv), 5, axis=1),
  )
  for got, operand in ((q.rows, x), (q.cols, jnp.swapaxes(x, -1, -2))):
    data, sinv = np_rows(operand, q_dtype, margin=1)
    assert got.scaling_mode == "rowwise" and got.data.dtype == q_dtype
    assert got.scale_inv.shape == operand.shape[:-1] + (1,) and got.scale_inv.dtype == jnp.float32
    np.testing.assert_array_equal(got.scale_inv, sinv)
    np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), data.view(np.uint8))
    # Powers of two.
    mantissa, _ = np.frexp(np.asarray(got.scale_inv))
    assert np.all(mantissa == 0.5)
  # A zero row and a row with an inf keep scale 1.
  assert float(q.rows.scale_inv[0, 3, 0]) == 1.0 and float(q.rows.scale_inv[1, 5, 0]) == 1.0


def test_power_of_two_scales_at_their_edges():
  """Each row's scale is the largest power of two under the limit, from the amax's bits: at and
  just past the limit's mantissa, a zero, subnormal, infinite or NaN amax (scale 1), and the
  exponent's clamp at 2**±126."""
  tiny = np.finfo(np.float32).tiny
  amax = np.array(
    [
      448,
      449,
      1,
      1.75,
      np.nextafter(np.float32(1.75), 2),
      3.5,
      224,
      0,
      1e-40,
      np.inf,
      np.nan,
      3e38,
      tiny,
      1e-37,
    ],
    np.float32,
  )
  want = np.array(
    [1, 0.5, 256, 256, 128, 128, 2, 1, 1, 1, 1, 2.0**-120, 2.0**126, 2.0**126], np.float32
  )
  t = ta.quantize(jnp.asarray(amax)[:, None], recipe=ROWWISE)
  np.testing.assert_array_equal(t.scale_inv[:, 0], np.float32(1) / want)
  # The limit's own mantissa counts: E5M2's 57344 is 1.75 * 2**15 (the gradient's format).
  t = ta.quantize(jnp.array([[1.0], [1.8], [57344.0]]), recipe=ROWWISE, role="grad")
  np.testing.assert_array_equal(t.scale_inv[:, 0], [2.0**-15, 2.0**-14, 1.0])


def test_quantize_and_dequantize_through_the_public_functions():
  x = _data((48, 80), 3, 5.0)
  t = ta.quantize(x, recipe=ROWWISE)
  data, sinv = np_rows(x, E4M3)
  np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8), data.view(np.uint8))
  np.testing.assert_array_equal(ta.dequantize(t), data.astype(np.float32) * sinv)
  # Along another axis: one scale per column.
  t0 = ta.quantize(x, recipe=ROWWISE, axis=0, role="grad")
  assert t0.scale_inv.shape == (1, 80) and t0.data.dtype == E5M2
  data, sinv = np_rows(x.T, E5M2)
  np.testing.assert_array_equal(ta.dequantize(t0), (data.astype(np.float32) * sinv).T)


# --- the GEMMs -----------------------------------------------------------------------------------


def test_three_training_steps_against_float64():
  """Forward, dx and dW equal float64 products of the rowwise-quantized values, over three SGD
  steps (stateless: each step stands alone), and the scales differ per row."""
  m, k, n = 64, 96, 48
  w = _data((k, n), 10, 0.05)
  step = _grads()
  for i in range(3):
    x = _data((m, k), 20 + i) * jnp.exp(_data((m, 1), 30 + i))
    dy = _data((m, n), 40 + i) * jnp.exp(_data((1, n), 50 + i))
    y, dx, dw = step(x, w, dy)
    for name, got, want in zip(("y", "dx", "dW"), (y, dx, dw), reference(x, w, dy), strict=True):
      assert rel_err(got, want) < EXACT, (i, name, rel_err(got, want))
    # FP8 accuracy against the unquantized products (a wrong scale is off by O(1)).
    assert rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) < 0.05
    w = w - 0.01 * dw
  # Really rowwise: every row of x and every output channel of the kernel has its own scale
  # (its own power of two: rows of amaxes in different octaves get different ones).
  for operand in (x, w.T):
    sinv = np.asarray(ta.quantize(operand, recipe=ROWWISE).scale_inv)
    np.testing.assert_array_equal(sinv, np_rows(operand, E4M3)[1])
    assert sinv.shape == (operand.shape[0], 1) and len(np.unique(sinv)) >= 4


def test_batched_and_bfloat16_operands():
  """Batch dims and a bf16 layer: the rule's (B, M, K) layout and a bf16 output rounded once."""
  x = _data((2, 3, 32, 64), 60).astype(jnp.bfloat16)
  w = _data((64, 48), 61, 0.1).astype(jnp.bfloat16)
  y = core.dot_general(x, w, (((3,), (0,)), ((), ())), recipe=ROWWISE, threshold=None)
  assert y.shape == (2, 3, 32, 48) and y.dtype == jnp.bfloat16
  want = (
    q64(np.asarray(x.astype(jnp.float32)).reshape(-1, 64), E4M3)
    @ q64(np.asarray(w.astype(jnp.float32)).T, E4M3).T
  )
  assert rel_err(np.asarray(y, np.float32).reshape(-1, 48), want) < 4e-3  # bf16 rounding


def test_planted_outlier_costs_only_its_row():
  """One row of x 1e5 times the others: per-tensor scaling pushes the other rows into E4M3's
  subnormals; rowwise keeps their resolution."""
  m, k, n, outlier = 64, 128, 64, 7
  x = _data((m, k), 70)
  x = x.at[outlier].multiply(1e5)
  w = _data((k, n), 71, 0.1)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  others = np.arange(m) != outlier

  def error(recipe):
    y = core.dot_general(x, w, DN, recipe=recipe, threshold=None)
    return rel_err(np.asarray(y)[others], exact[others])

  rowwise, current = error(ROWWISE), error(ta.Float8CurrentScaling())
  ratio = current / rowwise
  assert rowwise < 0.05, rowwise
  assert ratio >= 4, (rowwise, current, ratio)
  # As measured on CPU: current scaling 0.33 (the other rows' values land among E4M3's
  # subnormals), rowwise 0.038 (E4M3's resolution, x and kernel): a ratio of 8.7.
  assert current > 0.2, current


def test_weight_grad_high_precision():
  """Two FP8 GEMMs (forward, dgrad) and a high-precision wgrad equal to ``x^T dy``."""
  recipe = ta.Float8RowwiseScaling(weight_grad_high_precision=True)
  x, w, dy = _data((64, 96), 80), _data((96, 48), 81, 0.05), _data((64, 48), 82)
  y, dx, dw = _grads(recipe)(x, w, dy)
  ry, rdx, rdw = reference(x, w, dy, recipe)
  assert rel_err(y, ry) < EXACT and rel_err(dx, rdx) < EXACT
  # float32 operands, float32 sums (fp8_gemm_wgrad asks for HIGHEST: no TF32 on a GPU).
  assert rel_err(dw, rdw) < (1e-5 if ON_GPU else 1e-6)
  # FP8's dW is visibly further off.
  assert rel_err(_grads()(x, w, dy)[2], rdw) > 1e-2

  def grads(x, w):
    return jax.grad(
      lambda x, w: jnp.sum(core.dot_general(x, w, DN, recipe=recipe, threshold=None) * dy),
      argnums=(0, 1),
    )(x, w)

  assert inspect.count_fp8_dot_generals(grads, x, w) == (2, 3)
  dtypes = inspect.dot_general_operand_dtypes(grads, x, w)
  assert [d for d in dtypes if "float8" not in str(d[0])] == [("float32", "float32")]
  assert inspect.count_fp8_dot_generals(
    jax.grad(
      lambda x, w: jnp.sum(core.dot_general(x, w, DN, recipe=ROWWISE, threshold=None) * dy),
      argnums=(0, 1),
    ),
    x,
    w,
  ) == (3, 3)


def test_forward_only_quantizes_only_the_forward_copies():
  x, w = _data((32, 64), 90), _data((64, 32), 91)
  # XLA's FP8 dot on every platform, so the jaxpr shows the GEMM (on Hopper the extension's
  # GEMM is a custom call instead).
  xla = core.GemmConfig(fp8_gemm="xla")
  jaxpr = jax.make_jaxpr(
    lambda x, w: core.dot_general(x, w, DN, recipe=ROWWISE, threshold=None, config=xla)
  )(x, w)
  text = str(jaxpr)
  assert text.count("dot_general") == 1 and "float8_e4m3fn" in text


# --- meshes --------------------------------------------------------------------------------------


EXPLICIT_PLANS = {
  # name: x, kernel, dy shardings and dot_general's keywords
  "data": (P("dp", None), P(), P("dp", None), {}),
  "column": (P("dp", None), P(None, "tp"), P("dp", "tp"), {}),
  "row": (P("dp", "tp"), P("tp", None), P("dp", None), {"out_sharding": P("dp", None)}),
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")
@pytest.mark.parametrize("plan", list(EXPLICIT_PLANS))
def test_explicit_mesh_axes_match_one_device(plan):
  """Under jit with Explicit mesh axes a row's amax is that of the whole row, as on one device
  (data, column- and row-parallel: K split over "tp")."""
  mesh = jax.make_mesh(
    (2, 4), ("dp", "tp"), devices=jax.devices()[:8], axis_types=(AxisType.Explicit,) * 2
  )
  sx, sw, sdy, kw = EXPLICIT_PLANS[plan]
  x, w, dy = _data((64, 96), 100), _data((96, 48), 101, 0.05), _data((64, 48), 102)
  want = _grads()(x, w, dy)
  with jax.set_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    got = _grads(**kw)(put(x, sx), put(w, sw), put(dy, sdy))
  for a, b in zip(got, want, strict=True):
    assert rel_err(a, b) < 1e-6


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
def test_inside_shard_map_rows_are_scaled_per_shard():
  """Data parallel inside shard_map: y and dx equal one device's (x's and the gradient's rows are
  whole on each device); dW is summed over devices from per-shard products, each scaled per row
  of its shard (the tokens split over devices): the float64 sum of those."""
  mesh = jax.make_mesh((4,), ("dp",), devices=jax.devices()[:4], axis_types=(AxisType.Explicit,))
  x, w, dy = _data((64, 96), 110), _data((96, 48), 111, 0.05), _data((64, 48), 112)
  want = _grads()(x, w, dy)

  def body(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: core.dot_general(x, w, DN, recipe=ROWWISE, threshold=None), x, w)
    dx, dw = vjp(dy)
    return y, dx, dw  # w is replicated: its cotangent is summed over "dp"

  mapped = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("dp"), P(), P("dp")), out_specs=(P("dp"), P("dp"), P())
    )
  )
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  y, dx, dw = mapped(put(x, P("dp")), put(w, P()), put(dy, P("dp")))
  assert rel_err(y, want[0]) < 1e-6 and rel_err(dx, want[1]) < 1e-6
  parts = [
    q64(np.asarray(x[i : i + 16]).T, E4M3) @ q64(np.asarray(dy[i : i + 16]).T, E5M2).T
    for i in range(0, 64, 16)
  ]
  assert rel_err(dw, sum(parts)) < EXACT

  def with_amax_axes(x, w):
    return core.dot_general(x, w, DN, recipe=ROWWISE, threshold=None, amax_axes="dp")

  bad = jax.shard_map(with_amax_axes, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
  with pytest.raises(ValueError, match="amax_axes=.*is not supported; rowwise scales are per row"):
    jax.jit(bad)(put(x, P("dp")), put(w, P()))


# --- the adapters --------------------------------------------------------------------------------


def _regression(seed, k=64, n=32, m=64):
  x = _data((m, k), seed)
  target = x @ _data((k, n), seed + 1, 0.1)
  return x, target


def test_linen_dense_trains():
  recipe = ta.Float8RowwiseScaling(weight_grad_high_precision=True)
  model = nn.Dense(32, dot_general=ta_linen.make_dot_general_cls(recipe, threshold=None)())
  x, target = _regression(120)
  variables = model.init(jax.random.PRNGKey(0), x)
  assert sorted(variables) == ["params"]  # stateless: no recipe collection
  state = ta_linen.TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.adam(1e-2))

  @jax.jit
  def step(state):
    loss = lambda v: jnp.mean((model.apply(v, x) - target) ** 2)  # noqa: E731
    value, grads = state.value_and_grad(loss)
    return state.apply_gradients(grads=grads), value

  kernel = variables["params"]["kernel"]
  want = core.dot_general(x, kernel, DN, recipe=recipe, threshold=None)
  np.testing.assert_array_equal(model.apply(variables, x), want + variables["params"]["bias"])
  losses = []
  for _ in range(5):
    state, loss = step(state)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses


def test_nnx_linear_trains():
  model = ta_nnx.Linear(64, 32, recipe=ROWWISE, threshold=None, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _regression(130)
  want = core.dot_general(x, model.kernel[...], DN, recipe=ROWWISE, threshold=None)
  np.testing.assert_array_equal(model(x), want + model.bias[...])

  def loss_fn(model, x, target):
    return jnp.mean((model(x) - target) ** 2)

  @nnx.jit
  def step(model, optimizer, x, target):
    loss, (grads, state_grads) = ta_nnx.value_and_grad(loss_fn)(model, x, target)
    optimizer.update(model, grads)
    ta_nnx.update_recipe_state(model, state_grads)
    return loss

  losses = [float(step(model, optimizer, x, target)) for _ in range(5)]
  assert losses[-1] < 0.7 * losses[0], losses


def test_layers_keep_the_size_rule_of_every_recipe():
  """K and N multiples of 16 (cuBLASLt's FP8 GEMM), as for every recipe, with the same error."""
  with pytest.raises(ValueError, match=r"FP8 GEMMs need the contracting size K .* N=10"):
    ta_nnx.Linear(64, 10, recipe=ROWWISE, rngs=nnx.Rngs(0))
  # The core's dot_general takes any shape (XLA pads the FP8 GEMM).
  x, w = _data((5, 24), 170), _data((24, 10), 171)
  y = core.dot_general(x, w, DN, recipe=ROWWISE, threshold=None)
  assert rel_err(y, q64(x, E4M3) @ q64(w.T, E4M3).T) < EXACT


def test_haiku_linear_trains():
  model = hk.transform_with_state(lambda x: ta_hk.Linear(32, recipe=ROWWISE, threshold=None)(x))
  x, target = _regression(140)
  params, state = model.init(jax.random.PRNGKey(0), x)
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)

  def loss_fn(params, state, x):
    y, state = model.apply(params, state, None, x)
    return jnp.mean((y - target) ** 2), state

  @jax.jit
  def step(params, state, opt_state):
    loss, _, grads, state = ta_hk.value_grad_and_state(loss_fn)(params, state, x)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), state, opt_state, loss

  losses = []
  for _ in range(5):
    params, state, opt_state, loss = step(params, state, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses


def test_conversions_take_it():
  """The conversions of unedited models (NNX's quantize_model, Linen's and Haiku's quantize
  scopes) quantize their layers with rowwise scaling, no state added."""
  x = _data((32, 64), 180)

  class Model(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(64, 32, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.dense(x)

  model = Model()
  report = ta_nnx.quantize_model(model, ROWWISE, threshold=None)
  assert report.quantized == ["dense"]
  want = core.dot_general(x, model.dense.kernel[...], DN, recipe=ROWWISE, threshold=None)
  np.testing.assert_array_equal(model(x), want + model.dense.bias[...])

  dense = nn.Dense(32)
  with ta_linen.quantize(ROWWISE, threshold=None):
    variables = dense.init(jax.random.PRNGKey(0), x)
    y = dense.apply(variables, x)
  assert sorted(variables) == ["params"]
  p = variables["params"]
  np.testing.assert_array_equal(
    y, core.dot_general(x, p["kernel"], DN, recipe=ROWWISE, threshold=None) + p["bias"]
  )

  q = ta_hk.quantize(ROWWISE, threshold=None)
  f = hk.transform_with_state(q(lambda x: hk.Linear(32)(x)))
  params, state = f.init(jax.random.PRNGKey(0), x)
  assert q.report.quantized == ["linear"] and not state
  y, _ = f.apply(params, state, None, x)
  p = params["linear"]
  np.testing.assert_array_equal(
    y, core.dot_general(x, p["w"], DN, recipe=ROWWISE, threshold=None) + p["b"]
  )


# --- on a Hopper GPU -----------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize(
  "recipe, fp8_gemms",
  [(ROWWISE, 3), (ta.Float8RowwiseScaling(weight_grad_high_precision=True), 2)],
  ids=["rowwise", "weight_grad_high_precision"],
)
def test_gpu_runs_cublaslt_fp8_gemms(recipe, fp8_gemms):
  """On Hopper each FP8 GEMM is a cuBLASLt FP8 GEMM (the extension's, with unit scales; the row
  and column factors multiply its bfloat16 output, exactly, being powers of two), the operands are
  cast by the extension's two CUDA passes, and the results match the float64 reference to the FP8
  GEMM's sums and bfloat16's rounding."""
  m, k, n = 256, 512, 384
  x = _data((m, k), 150).astype(jnp.bfloat16)
  w = _data((k, n), 151, 0.05).astype(jnp.bfloat16)
  dy = _data((m, n), 152).astype(jnp.bfloat16)
  step = _grads(recipe)
  hlo = step.lower(x, w, dy).compile().as_text()
  assert inspect.count_fp8_cublas_gemms(hlo) == fp8_gemms
  assert "te_adapters_row_col_amax" in hlo and "te_adapters_rowwise_cast" in hlo
  got = step(x, w, dy)
  want = reference(*(np.asarray(a.astype(jnp.float32)) for a in (x, w, dy)), recipe)
  for name, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
    assert rel_err(np.asarray(a, np.float32), b) < 5e-3, name  # bf16 outputs


@gpu_only
def test_gpu_quantization_is_the_cpus_bit_for_bit():
  """The same codes and scales from the GPU's XLA and the CPU's, for every role, both input
  dtypes and a margin, on rows whose amaxes span many octaves (zero and infinite rows too)."""
  cpu = jax.devices("cpu")[0]
  x = _data((4, 96, 160), 170) * jnp.exp(4 * _data((4, 96, 1), 171))
  x = x.at[0, 3].set(0.0).at[1, 5, 7].set(jnp.inf).at[2, 9, 1].set(-jnp.inf)
  for recipe in (ROWWISE, ta.Float8RowwiseScaling(margin=1, fp8_format=ta.Format.E4M3)):
    fmt = core.format_of(recipe)
    for dtype in (jnp.float32, jnp.bfloat16):
      for role in ("x", "kernel", "grad"):
        quantize = jax.jit(
          lambda x, role=role, fmt=fmt, recipe=recipe: fmt.quantize(  # noqa: B023
            core.QuantizeRequest(x, role, recipe)
          )
        )
        on_gpu = quantize(x.astype(dtype))
        on_cpu = quantize(jax.device_put(x.astype(dtype), cpu))
        assert on_cpu.rows.data.devices() == {cpu}
        for g, c in ((on_gpu.rows, on_cpu.rows), (on_gpu.cols, on_cpu.cols)):
          np.testing.assert_array_equal(
            np.asarray(g.data).view(np.uint8), np.asarray(c.data).view(np.uint8)
          )
          np.testing.assert_array_equal(
            np.asarray(g.scale_inv).view(np.uint32), np.asarray(c.scale_inv).view(np.uint32)
          )


@gpu_only
@pytest.mark.parametrize("shape", [(128, 256), (2, 130, 72), (3, 37, 53)], ids=str)
@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["float32", "bfloat16", "float16"]
)
def test_gpu_kernels_quantize_as_the_pure_jax_path(shape, dtype):
  """The extension's passes (the amaxes of every row and column in one read, then the cast into
  both orientations, each row of a copy with its scale) give the pure-JAX path's codes and scales
  bit for bit: aligned and ragged shapes (the kernels' vector and scalar paths), batch dims, a
  NaN, an infinity and a zero row, one orientation or both."""
  x = _data(shape, 180) * jnp.exp(3 * _data((*shape[:-1], 1), 181))
  x = x.at[..., 1, 2].set(jnp.nan).at[..., 3, 0].set(-jnp.inf).at[..., 5, :].set(0.0)
  x = x.astype(dtype)
  fmt = core.format_of(ROWWISE)
  for role in ("x", "grad"):
    for rows, cols in ((True, True), (True, False), (False, True)):

      def quantize(x, backend, role=role, rows=rows, cols=cols):
        config = ta.GemmConfig(backend=backend)
        q = fmt.quantize(
          core.QuantizeRequest(x, role, ROWWISE, config=config, rows=rows, cols=cols)
        )
        return [(t.data, t.scale_inv, t.amax) for t in (q.rows, q.cols) if t is not None]

      ours = jax.jit(lambda x: quantize(x, "auto"))  # noqa: B023
      assert "te_adapters_rowwise_cast" in ours.lower(x).compile().as_text()
      got, want = ours(x), jax.jit(lambda x: quantize(x, "jax"))(x)  # noqa: B023
      assert len(got) == len(want) == rows + cols
      for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
          np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=(role, rows, cols)
          )


# --- the fused paths -----------------------------------------------------------------------------


def test_norm_and_mlp_fused_paths_are_the_composed_ones_in_float32():
  """``layernorm_dense`` and ``layernorm_mlp`` take rowwise on their fused paths (the norm's and
  the activation's float32 values quantized in rows as they are computed), which with float32
  activations give the composed paths' results bit for bit (nothing rounds those values on
  either path; tests/core/test_fused_every_recipe.py has the bfloat16 cases)."""
  k, f = 64, 128
  x = _data((32, k), 160)
  scale, bias = jnp.ones((k,)), jnp.zeros((k,))
  kernel = _data((k, f), 161, 0.1)
  z, _ = core.layernorm_dense(x, scale, bias, kernel, recipe=ROWWISE, threshold=None)
  h = core.layernorm(x, scale, bias)
  np.testing.assert_array_equal(z, core.dot_general(h, kernel, DN, recipe=ROWWISE, threshold=None))
  wi, wo = _data((k, 1, f), 162, 0.1), _data((f, k), 163, 0.1)

  def mlp(x, wi, wo, fuse):
    config = core.GemmConfig(fuse_activation_cast=fuse)
    return core.layernorm_mlp(
      x, scale, bias, wi, wo, recipe=ROWWISE, threshold=None, config=config
    )[0]

  jaxpr = jax.make_jaxpr(lambda x, wi, wo: mlp(x, wi, wo, None))(x, wi, wo)
  assert sum("custom_vjp" in e.primitive.name for e in jaxpr.eqns) == 1  # one fused VJP
  loss = lambda fuse: jax.grad(  # noqa: E731
    lambda *a: jnp.sum(mlp(*a, fuse) ** 2), argnums=(0, 1, 2)
  )(x, wi, wo)
  for a, b in zip(loss(None), loss(False), strict=True):
    np.testing.assert_array_equal(a, b)
  out = mlp(x, wi, wo, None)
  want = core.dot_general(
    jax.nn.gelu(core.dot_general(h, wi[:, 0], DN, recipe=ROWWISE, threshold=None)),
    wo,
    DN,
    recipe=ROWWISE,
    threshold=None,
  )
  assert rel_err(out, want) < 1e-5
