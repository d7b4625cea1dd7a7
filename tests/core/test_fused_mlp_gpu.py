"""The CUDA kernels of the MLP's fused casts (csrc/act_cast_cuda.cu: the norm's, the
activation's and its gradient's) against the pure-JAX formulas on the same GPU, and
core.layernorm_mlp and core.layernorm_dense running them.

The kernels compute the sigmoid-shaped activations (gelu's tanh form as x * sigmoid(2u), silu,
quick_gelu) with the GPU's approximate 2**x and reciprocal, a few ulp of float32 from XLA's tanh
and exp, which moves a value across an FP8 rounding boundary now and then: the FP8 codes are
identical but for a small fraction, and those are one FP8 step apart. Skipped without a GPU or
without the extension's CUDA part.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import formats, fused, kernels, ops
from tests.conftest import rel_err

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]


KERNEL = core.GemmConfig(backend="ffi", fuse_activation_cast=True)
JAX = core.GemmConfig(backend="jax", fuse_activation_cast=True)
# At most this fraction of FP8 codes differs from pure JAX's (each by one step). A value within
# a few ulp of float32 of an E4M3 rounding boundary is rare (about 2**-19 per ulp); a wrong
# formula, bias or layout changes most codes.
MAX_DIFFERING = 1e-3
ACTIVATIONS = [
  ("gelu",),
  ("gelu", "linear"),
  ("silu", "linear"),
  ("relu",),
  ("quick_gelu",),
  ("squared_relu",),
]


@pytest.fixture(autouse=True)
def _needs_the_kernels():
  if not kernels.registered(kernels.ACT_CAST_TARGET, "gpu"):
    pytest.skip("the extension's CUDA part is not built")


def _ordinal(q):
  """FP8 codes as signed steps from zero (adjacent values differ by 1, +0 and -0 are 0)."""
  code = np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)).astype(np.int32)
  return np.where(code & 0x80, -(code & 0x7F), code & 0x7F)


def _assert_fp8_close(ours, ref):
  a, b = _ordinal(ours), _ordinal(ref)
  assert a.shape == b.shape
  va, vb = (np.asarray(q.astype(jnp.float32), np.float64) for q in (ours, ref))
  # Near zero a few ulp of float32 in tanh or exp are several FP8 steps (of the subnormals, or of
  # (1 - tanh**2) in the gradient) but a negligible difference: checked in absolute terms there.
  tiny = 2.0**-8 * np.max(np.abs(vb), initial=0)
  big = np.abs(vb) > tiny
  diff = np.abs(a - b)[big]
  assert diff.max(initial=0) <= 1, diff.max()
  assert np.mean(diff != 0) <= MAX_DIFFERING, np.mean(diff != 0)
  assert np.max(np.abs(va - vb)[~big], initial=0) <= tiny


def _h_and_bias(m, f, n_act, dtype, seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(m, n_act * f)) * 2.0, dtype)
  bias = jnp.asarray(rng.normal(size=(n_act, f)) * 0.5, jnp.float32)
  return h, bias


@pytest.mark.parametrize("shape", [(512, 256), (200, 96)], ids=["full-tiles", "partial-tiles"])
@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_activation_cast_matches_pure_jax(activations, shape, with_bias):
  m, f = shape
  h, bias = _h_and_bias(m, f, len(activations), jnp.bfloat16)
  bias = bias if with_bias else None
  scale = jnp.asarray([448.0 / 20.0], jnp.float32)

  def cast(config):
    return jax.jit(
      lambda h, b: fused.act_cast(h, b, activations, jnp.float8_e4m3fn, scale, True, config)
    )(h, bias)

  q, q_t, a = cast(KERNEL)
  rq, rq_t, ra = cast(JAX)
  _assert_fp8_close(q, rq)
  np.testing.assert_array_equal(_ordinal(q_t), _ordinal(q).T)  # one cast, two orientations
  np.testing.assert_allclose(a, ra, rtol=1e-6)
  np.testing.assert_array_equal(_ordinal(rq_t), _ordinal(rq).T)


@pytest.mark.parametrize("shape", [(512, 256), (200, 96)], ids=["full-tiles", "partial-tiles"])
@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
def test_activation_gradient_cast_matches_pure_jax(activations, shape):
  m, f = shape
  n_act = len(activations)
  h, bias = _h_and_bias(m, f, n_act, jnp.bfloat16)
  dz = jnp.asarray(np.random.default_rng(1).normal(size=(m, f)), jnp.bfloat16)
  scale = jnp.asarray([57344.0 / 64.0], jnp.float32)

  def cast(config):
    return jax.jit(
      lambda dz, h, b: fused.dact_cast(dz, h, b, activations, jnp.float8_e5m2, scale, True, config)
    )(dz, h, bias)

  q, q_t, a, db = cast(KERNEL)
  rq, rq_t, ra, rdb = cast(JAX)
  _assert_fp8_close(q, rq)
  np.testing.assert_array_equal(_ordinal(q_t), _ordinal(q).T)
  np.testing.assert_allclose(a, ra, rtol=1e-5)
  assert db.shape == (n_act, f) and db.dtype == jnp.float32
  # Float32 sums of M rows in another order: compared to the sum of the magnitudes.
  dh = fused.dact_f32(dz, h, bias, activations)
  atol = 1e-5 * float(jnp.max(jnp.sum(jnp.abs(dh), axis=0)))
  np.testing.assert_allclose(db, rdb, atol=atol)


@pytest.mark.parametrize("shape", [(512, 256), (200, 96)], ids=["full-tiles", "partial-tiles"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_output_gradient_cast_with_its_bias_gradient(shape, dtype):
  """dy's cast with the output bias's gradient in the same pass (the activation-gradient kernel
  with a linear activation, reading dy alone): the FP8 codes of the ordinary cast bit for bit,
  and float32 column sums against float64."""
  m, n = shape
  rng = np.random.default_rng(2)
  g = rng.normal(size=(m, n)) * 3.0
  g[5, 7], g[9, 1] = 1e6, -1e6  # saturate to the largest finite E5M2 value
  g = jnp.asarray(g, dtype)
  scale = jnp.asarray([57344.0 / 16.0], jnp.float32)

  def cast(config):
    return jax.jit(lambda g: fused.dbias_cast(g, jnp.float8_e5m2, scale, True, config))(g)

  hlo = (
    jax.jit(lambda g: fused.dbias_cast(g, jnp.float8_e5m2, scale, True, KERNEL))
    .lower(g)
    .compile()
    .as_text()
  )
  assert kernels.DACT_CAST_TARGET in hlo
  q, q_t, a, db = cast(KERNEL)
  rq, rq_t, ra, _ = cast(JAX)
  np.testing.assert_array_equal(_ordinal(q), _ordinal(rq))  # dh = dy exactly: the same cast
  np.testing.assert_array_equal(_ordinal(q_t), _ordinal(q).T)
  np.testing.assert_array_equal(a, ra)
  g64 = np.asarray(g.astype(jnp.float32), np.float64)
  assert db.shape == (n,) and db.dtype == jnp.float32
  np.testing.assert_allclose(db, g64.sum(axis=0), rtol=0, atol=1e-6 * np.abs(g64).sum(axis=0).max())


@pytest.mark.parametrize("shape", [(512, 256), (200, 96)], ids=["full-tiles", "partial-tiles"])
@pytest.mark.parametrize(
  "norm", [("layernorm", False), ("rmsnorm", True)], ids=["layernorm", "rmsnorm-zero-centered"]
)
def test_norm_cast_matches_pure_jax(norm, shape):
  # No transcendental function: the same float32 operations in the same order, so the same
  # codes unless XLA contracts a multiply and an add into one FMA.
  layernorm_type, zero_centered = norm
  m, k = shape
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(m, k)) * 3.0 + 1.0, jnp.bfloat16)
  scale = jnp.asarray(1.0 + rng.normal(size=k) * 0.1, jnp.float32)
  bias = jnp.asarray(rng.normal(size=k) * 0.1, jnp.float32)
  bias = bias if layernorm_type == "layernorm" else jnp.zeros((0,), jnp.float32)
  q_scale = jnp.asarray([448.0 / 6.0], jnp.float32)

  def cast(config):
    def f(x, scale, bias):
      mean, rsigma = ops.norm_stats(x.astype(jnp.float32), layernorm_type, 1e-6)
      return fused.norm_cast(
        x, mean, rsigma, scale, bias, zero_centered, jnp.float8_e4m3fn, q_scale, True, config
      )

    return jax.jit(f)(x, scale, bias)

  q, q_t, a = cast(KERNEL)
  rq, rq_t, ra = cast(JAX)
  _assert_fp8_close(q, rq)
  np.testing.assert_array_equal(_ordinal(q_t), _ordinal(q).T)
  np.testing.assert_allclose(a, ra, rtol=1e-6)


@pytest.mark.parametrize(
  "activations",
  [("gelu",), ("silu", "linear"), ("relu",), ("squared_relu", "linear")],
  ids="-".join,
)
def test_activation_casts_of_nan_and_inf_are_pure_jaxs(activations):
  # The tails of the kernels' sigmoid (2**x overflowing to inf, its reciprocal 0), a NaN's code
  # and the amax it turns into: as in pure JAX, in the forward and the gradient's cast. relu of
  # a NaN is NaN, as jax.nn.relu's (the kernels once gave 0, which dropped the NaN that
  # GemmConfig.non_finite="propagate" sends from GEMM 1 through the activation).
  m, f = 128, 64
  h, bias = _h_and_bias(m, f, len(activations), jnp.bfloat16)
  special = [np.nan, np.inf, -np.inf, 1e4, -1e4, 60.0, -60.0]
  h = h.at[0, : len(special)].set(jnp.asarray(special, jnp.bfloat16))
  dz = jnp.ones((m, f), jnp.bfloat16)
  scale = jnp.asarray([448.0 / 20.0], jnp.float32)

  def casts(config):
    fwd = fused.act_cast(h, bias, activations, jnp.float8_e4m3fn, scale, True, config)
    bwd = fused.dact_cast(dz, h, bias, activations, jnp.float8_e5m2, scale, True, config)
    return fwd, bwd

  (q, _, a), (dq, _, da, _) = casts(KERNEL)
  (rq, _, ra), (rdq, _, rda, _) = casts(JAX)
  row = slice(None, len(special))
  np.testing.assert_array_equal(_ordinal(q)[0, row], _ordinal(rq)[0, row])
  np.testing.assert_array_equal(_ordinal(dq)[0, row], _ordinal(rdq)[0, row])
  np.testing.assert_array_equal(a, ra)
  np.testing.assert_array_equal(da, rda)


@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
@pytest.mark.parametrize("shape", [(256, 128), (200, 96)], ids=["full-tiles", "partial-tiles"])
def test_current_scalings_amax_pass_is_the_casts_amax(activations, shape):
  # Current scaling takes the amax in a pass of its own (the kernels with no FP8 output), then
  # casts: its amax is the one the delayed-scaling cast computes of the same values, and agrees
  # with XLA's reduce over the pure-JAX formula.
  m, f = shape
  h, bias = _h_and_bias(m, f, len(activations), jnp.bfloat16)
  dz = jnp.asarray(np.random.default_rng(1).normal(size=(m, f)), jnp.bfloat16)
  one = jnp.ones(1)
  amax = jax.jit(lambda h, b: fused.act_amax(h, b, activations, KERNEL))(h, bias)
  _, _, cast_amax = fused.act_cast(h, bias, activations, jnp.float8_e4m3fn, one, True, KERNEL)
  np.testing.assert_array_equal(amax, cast_amax)
  formula = formats.tensor_amax(fused.activation_f32(h, bias, activations))
  np.testing.assert_allclose(amax, formula, rtol=1e-5)
  d_amax = jax.jit(lambda dz, h, b: fused.dact_amax(dz, h, b, activations, KERNEL))(dz, h, bias)
  _, _, d_cast_amax, _ = fused.dact_cast(
    dz, h, bias, activations, jnp.float8_e5m2, one, True, KERNEL
  )
  np.testing.assert_array_equal(d_amax, d_cast_amax)
  d_formula = formats.tensor_amax(fused.dact_f32(dz, h, bias, activations))
  np.testing.assert_allclose(d_amax, d_formula, rtol=1e-5)


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling()], ids=["current", "delayed"]
)
def test_layernorm_mlp_runs_the_kernels_with_pure_jaxs_results(recipe):
  m, k, f = 512, 256, 512
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  wi = jnp.asarray(rng.normal(size=(k, 2, f)) / np.sqrt(k), jnp.float32)
  wo = jnp.asarray(rng.normal(size=(f, k)) / np.sqrt(f), jnp.float32)
  bi = jnp.asarray(rng.normal(size=(2, f)) * 0.3, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  states = (core.init_state(recipe), core.init_state(recipe)) if core.init_state(recipe) else None

  bo = jnp.asarray(rng.normal(size=(k,)) * 0.1, jnp.float32)

  def loss(x, wi, wo, bi, bo, states, config):
    out, _ = core.layernorm_mlp(
      x,
      jnp.ones(k),
      jnp.zeros(k),
      wi,
      wo,
      bi,
      bo,
      activations=("gelu", "linear"),
      recipe=recipe,
      states=states,
      threshold=None,
      config=config,
    )
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), static_argnums=6)
  hlo = grad.lower(x, wi, wo, bi, bo, states, KERNEL).compile().as_text()
  targets = [kernels.NORM_CAST_TARGET, kernels.ACT_CAST_TARGET, kernels.DACT_CAST_TARGET]
  if isinstance(recipe, ta.Float8CurrentScaling):
    targets += [
      kernels.ACT_AMAX_TARGET,
      kernels.DACT_AMAX_TARGET,
    ]  # the amax passes before the casts
  for target in targets:
    assert target in hlo, target
  # The activation's gradient and dy with the output bias's gradient: two calls of one kernel.
  assert hlo.count(f'custom_call_target="{kernels.DACT_CAST_TARGET}"') == 2
  ours, ref = (grad(x, wi, wo, bi, bo, states, c) for c in (KERNEL, JAX))
  for a, b in zip(jax.tree.leaves(ours[:4]), jax.tree.leaves(ref[:4]), strict=True):
    assert rel_err(a, b) < 5e-3  # the rare one-step FP8 differences, through the GEMMs
  dy64 = np.asarray(dy.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(ours[4], dy64.sum(axis=0), atol=1e-6 * np.abs(dy64).sum(0).max())
  np.testing.assert_allclose(ours[4], ref[4], atol=1e-6 * np.abs(dy64).sum(0).max())
  if states is not None:
    for a, b in zip(jax.tree.leaves(ours[5]), jax.tree.leaves(ref[5]), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5)


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling()], ids=["current", "delayed"]
)
def test_layernorm_dense_runs_the_norm_cast_with_pure_jaxs_results(recipe):
  """core.layernorm_dense's fused path casts the norm's output with the CUDA norm cast (never
  written in bf16): gradients and state as with the pure-JAX casts."""
  m, k, n = 512, 256, 384
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(m, k)) * 2.0 + 0.5, jnp.bfloat16)
  g = jnp.asarray(1.0 + 0.3 * rng.normal(size=(k,)), jnp.float32)
  b = jnp.asarray(0.2 * rng.normal(size=(k,)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.float32)
  c = jnp.asarray(0.1 * rng.normal(size=(n,)), jnp.float32)
  dz = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
  state = core.init_state(recipe) or None

  def loss(x, g, b, w, c, state, config):
    z, _ = core.layernorm_dense(
      x, g, b, w, recipe=recipe, state=state, threshold=None, config=config, dense_bias=c
    )
    return jnp.sum(z.astype(jnp.float32) * dz.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), static_argnums=6)
  hlo = grad.lower(x, g, b, w, c, state, KERNEL).compile().as_text()
  assert kernels.NORM_CAST_TARGET in hlo
  # dz's cast with the dense bias's gradient: the activation-gradient kernel, linear.
  assert hlo.count(f'custom_call_target="{kernels.DACT_CAST_TARGET}"') == 1
  ours, ref = (grad(x, g, b, w, c, state, cfg) for cfg in (KERNEL, JAX))
  for a, r in zip(jax.tree.leaves(ours[:4]), jax.tree.leaves(ref[:4]), strict=True):
    assert rel_err(a, r) < 5e-3
  dz64 = np.asarray(dz.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(ours[4], dz64.sum(axis=0), atol=1e-6 * np.abs(dz64).sum(0).max())
  if state is not None:
    for a, r in zip(jax.tree.leaves(ours[5]), jax.tree.leaves(ref[5]), strict=True):
      np.testing.assert_allclose(a, r, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs a host with several GPUs")
@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling()], ids=["current", "delayed"]
)
def test_kernels_run_per_shard_on_several_gpus(recipe):
  """With the rows over two GPUs the kernels run on each GPU's rows (their partitioning rules):
  the casts' codes and amaxes as one GPU's, the bias gradients the sums of every row, and
  core.layernorm_mlp's gradients as the one-GPU program's."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
  rows = NamedSharding(mesh, P("dp"))

  def one(*args):  # on one GPU: the one-GPU program's
    return jax.device_put(args, jax.devices()[0])

  m, f, acts = 512, 256, ("gelu", "linear")
  h, bias = _h_and_bias(m, f, 2, jnp.bfloat16)
  dz = jnp.asarray(np.random.default_rng(1).normal(size=(m, f)), jnp.bfloat16)
  scale = jnp.asarray([448.0 / 20.0], jnp.float32)

  def casts(h, dz):
    fwd = fused.act_cast(h, bias, acts, jnp.float8_e4m3fn, scale, True, KERNEL)
    bwd = fused.dact_cast(dz, h, bias, acts, jnp.float8_e5m2, scale, True, KERNEL)
    return (
      fwd,
      bwd,
      fused.act_amax(h, bias, acts, KERNEL),
      fused.dact_amax(dz, h, bias, acts, KERNEL),
    )

  step = jax.jit(casts)
  hlo = step.lower(jax.device_put(h, rows), jax.device_put(dz, rows)).compile().as_text()
  for target in (kernels.ACT_CAST_TARGET, kernels.DACT_CAST_TARGET, kernels.ACT_AMAX_TARGET):
    assert target in hlo, target
  (q, q_t, a), (dq, dq_t, da, db), a2, da2 = step(jax.device_put(h, rows), jax.device_put(dz, rows))
  (rq, rq_t, ra), (rdq, rdq_t, rda, rdb), ra2, rda2 = step(*one(h, dz))
  for got, want in ((q, rq), (q_t, rq_t), (dq, rdq), (dq_t, rdq_t)):
    np.testing.assert_array_equal(_ordinal(got), _ordinal(want))
  for got, want in ((a, ra), (da, rda), (a2, ra2), (da2, rda2)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  dh = np.abs(np.asarray(fused.dact_f32(dz, h, bias, acts), np.float64)).sum(axis=0)
  np.testing.assert_allclose(db, rdb, rtol=0, atol=1e-6 * dh.max())

  k = 256
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  wi = jnp.asarray(rng.normal(size=(k, 2, f)) / np.sqrt(k), jnp.float32)
  wo = jnp.asarray(rng.normal(size=(f, k)) / np.sqrt(f), jnp.float32)
  bi = jnp.asarray(rng.normal(size=(2, f)) * 0.3, jnp.float32)
  bo = jnp.asarray(rng.normal(size=(k,)) * 0.1, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  states = (core.init_state(recipe), core.init_state(recipe)) if core.init_state(recipe) else None

  def loss(x, wi, wo, bi, bo, states, dy):
    out, _ = core.layernorm_mlp(
      x,
      jnp.ones(k),
      jnp.zeros(k),
      wi,
      wo,
      bi,
      bo,
      activations=acts,
      recipe=recipe,
      states=states,
      threshold=None,
      config=KERNEL,
    )
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
  args = (jax.device_put(x, rows), wi, wo, bi, bo, states, jax.device_put(dy, rows))
  hlo = grad.lower(*args).compile().as_text()
  for target in (kernels.NORM_CAST_TARGET, kernels.ACT_CAST_TARGET, kernels.DACT_CAST_TARGET):
    assert target in hlo, target
  ours = grad(*args)
  ref = grad(*one(x, wi, wo, bi, bo, states, dy))
  for a, b in zip(jax.tree.leaves(ours[:5]), jax.tree.leaves(ref[:5]), strict=True):
    assert rel_err(a, b) < 5e-3  # the shards' GEMMs sum in another order (a lost sum: ~1)
  if states is not None:
    for a, b in zip(jax.tree.leaves(ours[5]), jax.tree.leaves(ref[5]), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5)


# --- Float8BlockScaling: the producers cast into 1x128 blocks (csrc/block_cast_cuda.cu) ---------


def _skip_unless_block_kernels():
  if not kernels.registered(kernels.BLOCK_ACT_CAST_TARGET, "gpu"):
    pytest.skip("the extension's block casts of the MLP are not built")


# The block casts have no partitioning rule: under jit on a host with several GPUs a traced
# operand's placement is unknown, so they run only on concrete arrays (eager calls) or inside
# shard_map there (kernels.single_device), and the format quantizes the values instead.
KERNELS_RUN_UNDER_JIT = jax.device_count() == 1


def _where_kernels_run(f):
  """``f`` jitted on a one-GPU host; on a host with several GPUs ``f`` itself, called on concrete
  arrays (on the default device), where the block casts run too."""
  return jax.jit(f) if KERNELS_RUN_UNDER_JIT else f


def _skip_unless_kernels_run_under_jit():
  if not KERNELS_RUN_UNDER_JIT:
    pytest.skip("several GPUs: under jit the block casts fall back to quantizing the values")


def _assert_blocks_close(got, values, q_dtype, power_2):
  """The kernel's five outputs against ``_float8_block.quantize`` of the float32 ``values`` in
  both orientations (pure JAX on the same GPU): the scales equal but for a few ulp of float32
  in a small fraction of the blocks (XLA's division, the kernels' fast exp), the codes within
  one FP8 step (``_assert_fp8_close``), the amax within a few ulp."""
  spec = formats.OperandSpec("float8_block", (128,), np.dtype(q_dtype), power_2=power_2)
  q, s, q_t, s_t, amax = got
  m, n = values.shape
  assert q.shape == (m, n) and q_t.shape == (n, m) and q.dtype == q_dtype
  assert s.shape == (m, n // 128) and s_t.shape == (n, m // 128)
  for (code, scale), v in (((q, s), values), ((q_t, s_t), values.T)):
    want = formats.quantize_trailing(v, spec)
    want_q, want_s, want_amax = want.data, want.scale_inv, want.amax
    differing = ~np.isclose(np.asarray(scale), np.asarray(want_s), rtol=1e-5, atol=0)
    assert np.mean(differing) <= MAX_DIFFERING, np.mean(differing)
    _assert_fp8_close(code, want_q)
    np.testing.assert_allclose(amax, want_amax, rtol=1e-5)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_block_norm_cast_matches_pure_jax(norm, dtype):
  _skip_unless_block_kernels()
  m, k = 384, 256
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(m, k)) * 3.0 + 1.0, dtype)
  x = x.at[7].multiply(100.0)  # a row of another magnitude: its own blocks' scales
  scale = jnp.asarray(1.0 + rng.normal(size=k) * 0.1, jnp.float32)
  bias = jnp.asarray(rng.normal(size=k) * 0.1, jnp.float32)
  bias = bias if norm == "layernorm" else jnp.zeros((0,), jnp.float32)

  def run(x, scale, bias):
    mean, rsigma = ops.norm_stats(x.astype(jnp.float32), norm, 1e-6)
    args = (x, mean, rsigma, scale, bias, False)
    got = fused.norm_block_cast(*args, jnp.float8_e4m3fn, True, KERNEL)
    return got, ops.normalized(*args)

  got, values = _where_kernels_run(run)(x, scale, bias)
  _assert_blocks_close(got, values, jnp.float8_e4m3fn, True)


@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_block_activation_casts_match_pure_jax(activations, with_bias):
  """The activation and its gradient (with the bias gradient) cast into 1x128 blocks as they
  are computed: the blocks of the pure-JAX values, the bias gradient their float32 sums."""
  _skip_unless_block_kernels()
  m, f = 256, 384
  n_act = len(activations)
  h, bias = _h_and_bias(m, f, n_act, jnp.bfloat16)
  bias = bias if with_bias else None
  dz = jnp.asarray(np.random.default_rng(1).normal(size=(m, f)), jnp.bfloat16)
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  fwd = _where_kernels_run(lambda h, b: fused.act_block_cast(h, b, activations, e4, True, KERNEL))(
    h, bias
  )
  _assert_blocks_close(fwd, fused.activation_f32(h, bias, activations), e4, True)
  *bwd, db = _where_kernels_run(
    lambda dz, h, b: fused.dact_block_cast(dz, h, b, activations, e5, False, KERNEL)
  )(dz, h, bias)
  dh = fused.dact_f32(dz, h, bias, activations)
  _assert_blocks_close(bwd, dh.reshape(m, -1), e5, False)
  assert db.shape == (n_act, f) and db.dtype == jnp.float32
  dh64 = np.asarray(dh, np.float64)
  atol = 1e-5 * np.abs(dh64).sum(axis=0).max()
  np.testing.assert_allclose(db, dh64.sum(axis=0), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_block_output_gradient_cast_with_its_bias_gradient(dtype):
  """dy cast into 1x128 blocks with the output bias's gradient in the same pass: the block
  cast's codes and scales of dy bit for bit, its float32 column sums against float64."""
  _skip_unless_block_kernels()
  m, n = 384, 256
  rng = np.random.default_rng(2)
  g = rng.normal(size=(m, n)) * 3.0
  g[5, 7], g[9, 1] = 1e6, -1e6
  g = jnp.asarray(g, dtype)
  q, s, q_t, s_t, a, db = _where_kernels_run(
    lambda g: fused.dbias_block_cast(g, jnp.float8_e5m2, True, KERNEL)
  )(g)
  want = jax.jit(
    lambda g: kernels.block_cast_call(
      g.astype(jnp.float32), jnp.float8_e5m2, rowwise=True, colwise=True, tile=False, power_2=True
    )
  )(g)
  for got, ref in zip((q, s, q_t, s_t, a), want, strict=True):
    got, ref = np.asarray(got), np.asarray(ref)
    bits = {1: np.uint8, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(bits), ref.view(bits))
  g64 = np.asarray(g.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(db, g64.sum(axis=0), rtol=0, atol=1e-6 * np.abs(g64).sum(0).max())


def test_layernorm_mlp_under_float8_block_casts_in_the_producers():
  """core.layernorm_mlp under Float8BlockScaling on the fused path: the norm's output, the
  activation, its gradient and dy cast into blocks by the kernels that compute them (no float32
  tensor written), with the gradients of the pure-JAX casts."""
  _skip_unless_block_kernels()
  _skip_unless_kernels_run_under_jit()
  recipe = ta.Float8BlockScaling()
  m, k, f = 512, 256, 512
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  wi = jnp.asarray(rng.normal(size=(k, 2, f)) / np.sqrt(k), jnp.float32)
  wo = jnp.asarray(rng.normal(size=(f, k)) / np.sqrt(f), jnp.float32)
  bi = jnp.asarray(rng.normal(size=(2, f)) * 0.3, jnp.float32)
  bo = jnp.asarray(rng.normal(size=(k,)) * 0.1, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)

  def loss(x, wi, wo, bi, bo, config):
    out, _ = core.layernorm_mlp(
      x,
      jnp.ones(k),
      jnp.zeros(k),
      wi,
      wo,
      bi,
      bo,
      activations=("gelu", "linear"),
      recipe=recipe,
      threshold=None,
      config=config,
    )
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)
  hlo = grad.lower(x, wi, wo, bi, bo, KERNEL).compile().as_text()
  for target, count in (
    (kernels.BLOCK_NORM_CAST_TARGET, 1),
    (kernels.BLOCK_ACT_CAST_TARGET, 1),
    (kernels.BLOCK_DACT_CAST_TARGET, 2),  # the activation's gradient, and dy with its bias's
  ):
    assert hlo.count(f'custom_call_target="{target}"') == count, target
  ours, ref = (grad(x, wi, wo, bi, bo, c) for c in (KERNEL, JAX))
  for a, b in zip(jax.tree.leaves(ours[:4]), jax.tree.leaves(ref[:4]), strict=True):
    assert rel_err(a, b) < 2e-2  # a scale an ulp (a power of two) apart now and then
  dy64 = np.asarray(dy.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(ours[4], dy64.sum(axis=0), atol=1e-6 * np.abs(dy64).sum(0).max())


# --- Float8BlockScaling in the adapters' configurations ------------------------------------------
# The adapters' LayerNormMLP and LayerNormDenseGeneral tests (tests/linen, tests/haiku, tests/nnx,
# the kit, the adapters-agree files) run x (2, 64, 128) or (4, 32, 128): M = 128, one tile of
# rows, K = F = 128, float32 by default, gated gelu with both biases, Linen's init and
# forward-only applies eagerly, training steps under jit. Here the same configurations at the
# core level, against float64 and against the pure-JAX casts.

BLOCK = ta.Float8BlockScaling()
_BLOCK_TARGETS = (
  kernels.BLOCK_NORM_CAST_TARGET,
  kernels.BLOCK_ACT_CAST_TARGET,
  kernels.BLOCK_DACT_CAST_TARGET,
)


def _block_calls(compiled_text):
  return {t: compiled_text.count(f'custom_call_target="{t}"') for t in _BLOCK_TARGETS}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_block_casts_on_one_tile_of_rows(dtype):
  """Each block cast on the adapters' shapes (M = 128, K = F = 128; dy (128, 256) as
  LayerNormDenseGeneral's): layernorm with beta and rmsnorm with zero-centered gamma, one and two
  activations with and without a bias, the gradient casts, the output gradient with its bias's
  gradient."""
  _skip_unless_block_kernels()
  m, k, f = 128, 128, 128
  rng = np.random.default_rng(5)
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  x = jnp.asarray(rng.normal(size=(m, k)) * 3.0 + 1.5, dtype)
  gamma = jnp.asarray(0.5 * rng.normal(size=k), jnp.float32)
  beta = jnp.asarray(0.3 * rng.normal(size=k), jnp.float32)
  for norm, zero_centered, b in (("layernorm", False, beta), ("rmsnorm", True, beta[:0])):
    scale = gamma if zero_centered else 1.0 + gamma

    def run(x, scale, b, norm=norm, zero_centered=zero_centered):
      mean, rsigma = ops.norm_stats(x.astype(jnp.float32), norm, 1e-6)
      args = (x, mean, rsigma, scale, b, zero_centered)
      return fused.norm_block_cast(*args, e4, True, KERNEL), ops.normalized(*args)

    got, values = _where_kernels_run(run)(x, scale, b)
    assert got is not None, norm
    _assert_blocks_close(got, values, e4, True)
  for activations in (("gelu", "linear"), ("gelu",)):
    n_act = len(activations)
    h, bias = _h_and_bias(m, f, n_act, dtype, seed=6)
    dz = jnp.asarray(rng.normal(size=(m, f)), dtype)
    for b in (bias, None):
      fwd = _where_kernels_run(
        lambda h, b, a=activations: fused.act_block_cast(h, b, a, e4, True, KERNEL)
      )(h, b)
      assert fwd is not None, activations
      _assert_blocks_close(fwd, fused.activation_f32(h, b, activations), e4, True)
      bwd = _where_kernels_run(
        lambda dz, h, b, a=activations: fused.dact_block_cast(dz, h, b, a, e5, True, KERNEL)
      )(dz, h, b)
      assert bwd is not None, activations
      dh = fused.dact_f32(dz, h, b, activations)
      _assert_blocks_close(bwd[:5], dh.reshape(m, -1), e5, True)
      dh64 = np.asarray(dh, np.float64)
      atol = 1e-5 * np.abs(dh64).sum(axis=0).max()
      np.testing.assert_allclose(bwd[5], dh64.sum(axis=0), rtol=0, atol=atol)
  for n in (128, 256):
    g = jnp.asarray(rng.normal(size=(m, n)), dtype)
    out = _where_kernels_run(lambda g: fused.dbias_block_cast(g, e5, True, KERNEL))(g)
    assert out is not None, n
    g32 = g.astype(jnp.float32)
    _assert_blocks_close(out[:5], g32, e5, True)
    g64 = np.asarray(g32, np.float64)
    np.testing.assert_allclose(
      out[5], g64.sum(axis=0), rtol=0, atol=1e-6 * np.abs(g64).sum(0).max()
    )


# name: (x dtype, activations, both biases, return_layernorm_output, layernorm_type,
# zero_centered_gamma)
_MLP_CASES = {
  "f32-gated-bias": (jnp.float32, ("gelu", "linear"), True, False, "layernorm", False),
  "bf16-gated-bias": (jnp.bfloat16, ("gelu", "linear"), True, False, "layernorm", False),
  "f32-gelu-bias": (jnp.float32, ("gelu",), True, False, "layernorm", False),
  "f32-gated-no-bias": (jnp.float32, ("gelu", "linear"), False, False, "layernorm", False),
  "f32-gated-ln-out": (jnp.float32, ("gelu", "linear"), True, True, "layernorm", False),
  "f32-rmsnorm-zero-centered": (jnp.float32, ("gelu", "linear"), True, False, "rmsnorm", True),
  "bf16-silu-gated-rmsnorm": (jnp.bfloat16, ("silu", "linear"), True, False, "rmsnorm", False),
}


@pytest.mark.parametrize("case", list(_MLP_CASES))
def test_layernorm_mlp_under_float8_block_in_the_adapters_configurations(case):
  """core.layernorm_mlp under Float8BlockScaling as the adapters run it: x (2, 64, 128), K = F =
  128, three jitted training steps (SGD on every parameter) against the same steps with the
  pure-JAX casts, the first step's output and gradients against float64 (the adapters' bounds),
  and an eager forward call (Linen's init and forward-only apply) against the jitted one. On a
  one-GPU host the program holds the block casts that apply."""
  _skip_unless_block_kernels()
  from tests.core.test_mlp import _data as mlp_data
  from tests.core.test_mlp import _reference_grads

  dtype, activations, biases, ln_out, ln_type, zero_centered = _MLP_CASES[case]
  x, params, dy = mlp_data(n_act=len(activations), seed=1)
  if zero_centered:
    params = {**params, "scale": params["scale"] - 1.0}
  if not biases:
    params = {k: v for k, v in params.items() if k not in ("wi_bias", "wo_bias")}
  if ln_type != "layernorm":
    params = {k: v for k, v in params.items() if k != "ln_bias"}
  x, dy = x.astype(dtype), dy.astype(dtype)

  def forward(x, p, config):
    out, y = core.layernorm_mlp(
      x,
      p["scale"],
      p.get("ln_bias"),
      p["wi_kernel"],
      p["wo_kernel"],
      p.get("wi_bias"),
      p.get("wo_bias"),
      activations=activations,
      layernorm_type=ln_type,
      zero_centered_gamma=zero_centered,
      recipe=BLOCK,
      threshold=None,
      config=config,
      return_layernorm_output=ln_out,
    )
    assert (y is not None) == ln_out
    return out

  def step(p, config):
    def loss(p):
      out = forward(x, p, config)
      return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(p)
    return jax.tree.map(lambda a, g: a - 1e-3 * g.astype(a.dtype), p, grads), out, grads

  train = jax.jit(step, static_argnums=1)
  if KERNELS_RUN_UNDER_JIT:
    calls = _block_calls(train.lower(params, KERNEL).compile().as_text())
    want = {
      kernels.BLOCK_NORM_CAST_TARGET: 0 if ln_out else 1,
      kernels.BLOCK_ACT_CAST_TARGET: 1,
      kernels.BLOCK_DACT_CAST_TARGET: 2 if biases else 1,  # dy's cast with wo_bias's gradient
    }
    assert calls == want, calls
  runs = {}
  for name, config in (("kernels", KERNEL), ("jax", JAX)):
    p, history = params, []
    for _ in range(3):
      p, out, grads = train(p, config)
      history.append((out, grads))
    runs[name] = (p, history)
  # The first step against float64 (zero biases stand in for absent ones).
  ref_params = {"ln_bias": jnp.zeros_like(params["scale"]), **params}
  n_act = len(activations)
  ref_params.setdefault("wi_bias", jnp.zeros((n_act, 128), jnp.float32))
  ref_params.setdefault("wo_bias", jnp.zeros((128,), jnp.float32))
  ref_out, _, ref_grads = _reference_grads(
    x.astype(jnp.float32),
    ref_params,
    dy.astype(jnp.float32),
    activations,
    ln_type=ln_type,
    zero_centered=zero_centered,
  )
  out, grads = runs["kernels"][1][0]
  errs = {"out": rel_err(out, ref_out), **{k: rel_err(grads[k], ref_grads[k]) for k in grads}}
  assert errs["out"] < 0.08 and max(errs.values()) < 0.12, errs
  assert errs["out"] > 0.005 and errs["wi_kernel"] > 0.005, errs  # FP8 really ran
  # Every step's output and gradients, and the parameters after three steps, as with the
  # pure-JAX casts (a scale an ulp, so a power of two, apart now and then; with bfloat16 inputs
  # more FP8 codes one step apart where the pure-JAX path rounds the norm's output first).
  tol = 2e-2 if dtype == jnp.float32 else 5e-2
  for (o1, g1), (o2, g2) in zip(runs["kernels"][1], runs["jax"][1], strict=True):
    assert rel_err(o1, o2) < tol
    for k in g1:
      assert rel_err(g1[k], g2[k]) < tol, k
  for k in params:
    assert rel_err(runs["kernels"][0][k], runs["jax"][0][k]) < tol, k
  # Eagerly (no jit: the block casts run on the concrete arrays on any host), forward only.
  eager = forward(x, params, KERNEL)
  assert rel_err(eager, runs["jax"][1][0][0]) < tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dense_bias", [True, False], ids=["bias", "no-bias"])
def test_layernorm_dense_under_float8_block_in_the_adapters_configurations(dtype, dense_bias):
  """core.layernorm_dense under Float8BlockScaling as LayerNormDenseGeneral's tests run it: x (4,
  32, 128), kernel (128, 256), with and without the dense bias; the output and the gradients
  of x, gamma, beta, the kernel (and the bias) against float64 (the adapters' bounds) and
  against the pure-JAX casts, and an eager forward call."""
  _skip_unless_block_kernels()
  from tests.core.test_norm import _data as norm_data
  from tests.core.test_norm import _inputs
  from tests.core.test_norm import _reference as norm_reference

  x, g, b, _ = _inputs()
  w, dz, c = norm_data([(128, 256), (4, 32, 256), (256,)], seed=1)
  x, dz = x.astype(dtype), dz.astype(dtype)
  c = c if dense_bias else None

  def forward(x, g, b, w, c, config):
    z, y = core.layernorm_dense(
      x, g, b, w, recipe=BLOCK, threshold=None, config=config, dense_bias=c
    )
    assert y is None
    return z

  def grads(config):
    def loss(x, g, b, w, c):
      z = forward(x, g, b, w, c, config)
      return jnp.sum(z.astype(jnp.float32) * dz.astype(jnp.float32)), z

    argnums = (0, 1, 2, 3, 4) if dense_bias else (0, 1, 2, 3)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))

  if KERNELS_RUN_UNDER_JIT:
    text = grads(KERNEL).lower(x, g, b, w, c).compile().as_text()
    want = {
      kernels.BLOCK_NORM_CAST_TARGET: 1,
      kernels.BLOCK_ACT_CAST_TARGET: 0,
      kernels.BLOCK_DACT_CAST_TARGET: 1 if dense_bias else 0,
    }
    assert _block_calls(text) == want
  (_, z), d = grads(KERNEL)(x, g, b, w, c)
  (_, z_jax), d_jax = grads(JAX)(x, g, b, w, c)
  ref, (dx, dg, db, dw) = norm_reference(
    x.astype(jnp.float32), g, b, None, "layernorm", False, 1e-6, kernel=w, dz=dz.astype(jnp.float32)
  )
  if dense_bias:
    ref = ref + np.asarray(c, np.float64)
  errs = {
    "z": rel_err(z, ref),
    "dx": rel_err(d[0], dx),
    "dgamma": rel_err(d[1], dg),
    "dbeta": rel_err(d[2], db),
    "dkernel": rel_err(d[3], dw),
  }
  assert errs["z"] < 0.05 and max(errs.values()) < 0.08, errs
  assert errs["z"] > 0.005 and errs["dkernel"] > 0.005, errs  # FP8, not float32
  if dense_bias:
    dz64 = np.asarray(dz.astype(jnp.float32), np.float64)
    # float32 sums of dz, in the pass that casts it (bfloat16's rounding of the sums would
    # show where the path composed instead).
    assert rel_err(d[4], dz64.sum(axis=(0, 1))) < (1e-6 if dtype == jnp.float32 else 1e-2)
  tol = 2e-2 if dtype == jnp.float32 else 5e-2  # as in the MLP's test above
  assert rel_err(z, z_jax) < tol
  for a, r in zip(d, d_jax, strict=True):
    assert rel_err(a, r) < tol
  eager = forward(x, g, b, w, c, KERNEL)
  assert rel_err(eager, z_jax) < tol


def test_scanned_blocks_under_remat_match_the_unrolled_ones():
  """Two LayerNormMLP blocks under Float8BlockScaling in lax.scan with jax.checkpoint
  (save_quantized_operands), as Linen's nn.scan over nn.remat runs them, against the blocks run
  one after the other: the output and every parameter's gradient."""
  _skip_unless_block_kernels()
  from tests import mlp_reference as ref

  x, dy = ref.inputs()
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), ref.block_params(1), ref.block_params(2))

  def block(h, p):
    out, _ = core.layernorm_mlp(
      h,
      p["scale"],
      p["ln_bias"],
      p["wi_kernel"],
      p["wo_kernel"],
      p["wi_bias"],
      p["wo_bias"],
      activations=ref.GATED,
      recipe=BLOCK,
      threshold=None,
      config=KERNEL,
    )
    return out, None

  def loss(params):
    body = jax.checkpoint(block, policy=core.save_quantized_operands)
    out, _ = jax.lax.scan(body, x, params)
    return jnp.sum(out * dy), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(stacked)
  want_out, want_grads, _ = ref.unrolled(x, stacked, None, dy, BLOCK)
  assert rel_err(out, want_out) < ref.CROSS_RTOL
  for k in stacked:
    assert rel_err(grads[k], want_grads[k]) < ref.CROSS_RTOL, k
