"""The partitioning rules of the per-batch cast, the MLP's activation kernels and the rowwise
passes, and every rule under ``vmap``, on virtual CPU devices (conftest.py), against the same
calls on one device.

The per-batch cast is the extension's CPU kernel (the CUDA one has the same contract). The
activation kernels and the rowwise passes are CUDA only, so their rules wrap pure-JAX stand-ins
of the kernels' contract (as the norm cast's rule is tested in test_fused_sharding.py): what is
tested here is what the rule adds, each shard's call and the reductions that make its results
one device's; the GPU suite runs the kernels themselves through the rules (test_fused_mlp_gpu.py,
test_rowwise.py).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core
from te_adapters.core import formats, fused, kernels
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")

SPECS = {"rows": P("a", None), "cols": P(None, "a"), "both": P("a", "b")}


def _mesh(spec):
  names = tuple(n for n in tuple(spec) if n is not None)
  shape = (2,) * len(names)
  return jax.make_mesh(
    shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[: 2 ** len(names)]
  )


def _codes(q):
  return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _assert_equal(got, want):
  for a, b in zip(got, want, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.itemsize == 1:
      np.testing.assert_array_equal(_codes(a), _codes(b))
    else:
      np.testing.assert_array_equal(a, b)


# --- the per-batch cast (the extension's CPU kernel) ----------------------------------------------


@pytest.mark.skipif(not kernels.ffi_available("cpu"), reason="extension not built")
@pytest.mark.parametrize(
  "spec", [P("a"), P(None, "a"), P(None, None, "a"), P("a", "b"), P(None, "a", "b")], ids=str
)
def test_per_batch_cast_runs_per_shard_like_one_device(spec):
  """Each x[b] with its own scale: sharded over B, R, C or two of them, the kernel runs on the
  shards (no gather: the outputs keep the input's sharding) and gives one device's codes; each
  amax is its whole x[b]'s, an inf in one shard of x[1] included."""
  b, r, c = 4, 32, 48
  x = spmd_checks.random((b, r, c), 0) * 3
  x = x.at[1, r - 1, c - 1].set(jnp.inf).astype(jnp.bfloat16)  # in x[1]'s last shard
  scales = jnp.asarray([0.5, 2.0, 8.0, 32.0], jnp.float32)

  def cast(x, s):
    return formats.cast_transpose_per_batch(x, s, jnp.float8_e4m3fn, with_amax=True, backend="ffi")

  want = jax.jit(cast)(x, scales)
  mesh = _mesh(spec)
  sharded = jax.device_put(x, NamedSharding(mesh, spec))
  scales_sharded = jax.device_put(scales, NamedSharding(mesh, P(*tuple(spec)[:1])))
  step = jax.jit(cast)
  assert kernels.CAST_TRANSPOSE_TARGET in step.lower(sharded, scales_sharded).compile().as_text()
  got = step(sharded, scales_sharded)
  _assert_equal(got, want)
  full = tuple(spec) + (None,) * (3 - len(spec))
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(*full)), 3)
  assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(full[0], full[2], full[1])), 3)
  amax = np.asarray(got[2])
  assert np.isposinf(amax[1]) and np.isfinite(np.delete(amax, 1)).all()
  np.testing.assert_array_equal(
    np.delete(amax, 1), np.max(np.abs(np.asarray(x, np.float32)), axis=(1, 2))[[0, 2, 3]]
  )


# --- the activation kernels' rules, with stand-ins of the kernels ---------------------------------

# Activations of exact float32 arithmetic (one rounding per operation, nothing XLA would contract
# into a fused multiply-add or approximate), so that the stand-ins give the same codes in every
# program XLA compiles them into.
NAMES = {1: ("relu",), 2: ("squared_relu", "linear")}


def _bias(bias, n_act):
  return bias.reshape(n_act, -1) if bias.size else None


def _act_stand_in(names, h, bias, scale):
  """The activation cast's contract in pure JAX: ``(q, q_t, amax)`` of this shard."""
  q, q_t, a = fused.act_cast(
    h,
    _bias(bias, len(names)),
    names,
    jnp.float8_e4m3fn,
    scale,
    True,
    core.GemmConfig(backend="jax"),
  )
  return q, q_t, a


def _dact_stand_in(names, dz, h, bias, scale):
  """The activation-gradient cast's contract: ``(q, q_t, amax, dbias (n_act * F,))``."""
  q, q_t, a, db = fused.dact_cast(
    dz,
    h,
    _bias(bias, len(names)),
    names,
    jnp.float8_e5m2,
    scale,
    True,
    core.GemmConfig(backend="jax"),
  )
  return q, q_t, a, db.reshape(-1)


def _act_amax_stand_in(names, h, bias):
  return fused.act_amax(h, _bias(bias, len(names)), names, core.GemmConfig(backend="jax"))


def _dact_amax_stand_in(names, dz, h, bias):
  return fused.dact_amax(dz, h, _bias(bias, len(names)), names, core.GemmConfig(backend="jax"))


def _act_operands(n_act, has_bias):
  m, f = 64, 32
  h = (spmd_checks.random((m, n_act * f), 0) * 3).astype(jnp.bfloat16)
  h = h.at[m - 1, 1].set(40.0)  # the amax in the last shard of rows and of columns
  dz = spmd_checks.random((m, f), 1).astype(jnp.bfloat16)
  bias = spmd_checks.random((n_act * f,), 2) * 0.3 if has_bias else jnp.zeros((0,))
  return h, dz, bias, jnp.full((1,), 4.0)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("n_act", [1, 2], ids=["one", "gated"])
@pytest.mark.parametrize("where", SPECS)
def test_activation_rules_give_one_devices_results(where, n_act, has_bias):
  """Under jit, with h's (and dz's) rows, columns or both sharded: the FP8 codes as one device's,
  the amaxes the whole tensor's, the bias gradient the sum over every row (float32 sums in
  another order). Rows keep their sharding; one activation's columns too, a gated pair's
  columns are gathered (the slices of both activations are needed together), said once."""
  names = NAMES[n_act]
  h, dz, bias, scale = _act_operands(n_act, has_bias)
  act = functools.partial(_act_stand_in, names)
  dact = functools.partial(_dact_stand_in, names)
  act_amax = functools.partial(_act_amax_stand_in, names)
  dact_amax = functools.partial(_dact_amax_stand_in, names)
  want = (act(h, bias, scale), dact(dz, h, bias, scale), act_amax(h, bias), dact_amax(dz, h, bias))
  rules = (
    kernels.act_cast(act, n_act, has_bias, True),
    kernels.dact_cast(dact, n_act, has_bias, True),
    kernels.act_amax(act_amax, n_act, has_bias),
    kernels.dact_amax(dact_amax, n_act, has_bias),
  )
  # Mesh axes named for the case: a reshard is said once per case (its axes name it).
  spec = P(*(None if a is None else f"{a}{n_act}{int(has_bias)}" for a in SPECS[where]))
  mesh = _mesh(spec)
  rows, cols = spec
  h_s = jax.device_put(h, NamedSharding(mesh, spec))
  dz_s = jax.device_put(dz, NamedSharding(mesh, spec))
  bias_s = jax.device_put(bias, NamedSharding(mesh, P(cols) if has_bias else P()))

  def run(h, dz, bias, scale):
    return (
      rules[0](h, bias, scale),
      rules[1](dz, h, bias, scale),
      rules[2](h, bias),
      rules[3](dz, h, bias),
    )

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = jax.jit(run)(h_s, dz_s, bias_s, scale)
  gathers = [w for w in caught if issubclass(w.category, kernels.ShardingFallbackWarning)]
  assert bool(gathers) == (n_act == 2 and cols is not None)
  if gathers:
    assert "all-gathered" in str(gathers[0].message)
  (q, q_t, a), (dq, dq_t, da, db), a2, da2 = got
  (rq, rq_t, ra), (rdq, rdq_t, rda, rdb), ra2, rda2 = want
  _assert_equal((q, q_t, a, dq, dq_t, da, a2, da2), (rq, rq_t, ra, rdq, rdq_t, rda, ra2, rda2))
  assert float(ra[0]) >= 39.0 or n_act == 2  # the planted amax is the last shard's
  dh = np.abs(np.asarray(fused.dact_f32(dz, h, _bias(bias, n_act), names), np.float64))
  bound = 1e-6 * dh.reshape(dh.shape[0], -1).sum(axis=0).max()
  np.testing.assert_allclose(db, rdb, rtol=0, atol=bound)
  if n_act == 1:  # nothing gathered: the outputs sharded as h
    for out, want_spec in ((q, spec), (q_t, P(cols, rows)), (dq, spec), (dq_t, P(cols, rows))):
      assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2)


@pytest.mark.skipif(not kernels.ffi_available("cpu"), reason="extension not built")
def test_casts_without_an_amax_under_jit():
  """Current scaling's casts (its amax comes from a pass before): the amax output is the (0,)
  placeholder, the codes as one device's (the per-batch cast's kernel; the activation cast's
  stand-in)."""
  names = NAMES[2]
  h, _, bias, scale = _act_operands(2, True)

  def act(h, bias, scale):
    q, q_t, _ = _act_stand_in(names, h, bias, scale)
    return q, q_t, jnp.zeros((0,), jnp.float32)

  x = (spmd_checks.random((4, 32, 48), 3) * 3).astype(jnp.bfloat16)
  scales = jnp.asarray([0.5, 2.0, 8.0, 32.0], jnp.float32)

  def run(h, x):
    per_batch = formats.cast_transpose_per_batch(x, scales, jnp.float8_e5m2, backend="ffi")
    return kernels.act_cast(act, 2, True, False)(h, bias, scale), per_batch

  mesh = _mesh(P("a"))
  rows = NamedSharding(mesh, P("a"))
  (q, q_t, a), (p, p_t, none) = jax.jit(run)(jax.device_put(h, rows), jax.device_put(x, rows))
  (rq, rq_t, _), (rp, rp_t, _) = run(h, x)
  _assert_equal((q, q_t, p, p_t), (rq, rq_t, rp, rp_t))
  assert a.shape == (0,) and none is None


def test_activation_gradient_rule_inside_shard_map_keeps_each_shards_sums():
  """Inside shard_map the kernel runs on the shard as it is: its own amax and column sums (the
  format and the GEMM rule reduce them, as for the pure-JAX casts there)."""
  names = NAMES[1]
  h, dz, bias, scale = _act_operands(1, True)
  dact = functools.partial(_dact_stand_in, names)
  rule = kernels.dact_cast(dact, 1, True, True)
  mesh = _mesh(P("a"))
  mapped = jax.shard_map(
    rule,
    mesh=mesh,
    in_specs=(P("a"), P("a"), P(), P()),
    out_specs=(P("a"), P(None, "a"), P("a"), P("a")),
  )
  q, q_t, amaxes, sums = jax.jit(mapped)(dz, h, bias, scale)
  rq, rq_t, ra, rdb = dact(dz, h, bias, scale)
  _assert_equal((q, q_t), (rq, rq_t))
  assert amaxes.shape == (2,) and float(np.max(amaxes)) == float(ra[0])
  half = [dact(dz[i * 32 : (i + 1) * 32], h[i * 32 : (i + 1) * 32], bias, scale)[3] for i in (0, 1)]
  np.testing.assert_array_equal(np.asarray(sums).reshape(2, -1), np.stack(half))


# --- the rowwise passes (CUDA only: pure-JAX stand-ins of their contract) ----------------------


def _row_amax(x):
  return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=-1).astype(jnp.float32)


def _row_col_amax_stand_in(rows, cols, x):
  """``(row_amax (.., P), col_amax (.., C))`` of this shard, inf where a NaN is."""
  empty = jnp.zeros((0,), jnp.float32)
  return (
    _row_amax(x) if rows else empty,
    _row_amax(jnp.swapaxes(x, -1, -2)) if cols else empty,
  )


def _power_of_two_scale(a):
  """A power-of-two scale per amax (1 where it is zero or not finite), as the format's."""
  usable = jnp.isfinite(a) & (a > 0)
  return jnp.where(usable, jnp.exp2(jnp.floor(jnp.log2(448.0 / jnp.where(usable, a, 1.0)))), 1.0)


def _rowwise_cast_stand_in(rows, cols, x, row_scale, col_scale):
  """``(q, q_t)`` of this shard, each row of a copy times its scale."""

  def cast(v, scale):
    return jnp.clip(v.astype(jnp.float32) * scale[..., None], -448.0, 448.0).astype(E4M3)

  empty = jnp.zeros((0,), E4M3)
  return (
    cast(x, row_scale) if rows else empty,
    cast(jnp.swapaxes(x, -1, -2), col_scale) if cols else empty,
  )


E4M3 = jnp.float8_e4m3fn
ROWWISE_SPECS = {
  "rows": P("a", None),
  "cols": P(None, "a"),
  "both": P("a", "b"),
  "batch-and-cols": P("a", None, "b"),
}


@pytest.mark.parametrize(
  "rows, cols", [(True, True), (True, False), (False, True)], ids=["both", "rows", "cols"]
)
@pytest.mark.parametrize("where", ROWWISE_SPECS)
def test_rowwise_rules_give_one_devices_results(where, rows, cols):
  """The rowwise format's two passes (amaxes of every row and column, then the cast with their
  power-of-two scales) under jit on a sharded x: the codes and amaxes of one device bit for bit,
  each amax its whole row's or column's (a row's infinity and a column's NaN in the last shard),
  with no gather (every output keeps x's sharding: q_t's last two swapped, the amaxes those of
  x's rows or columns)."""
  spec = ROWWISE_SPECS[where]
  shape = (2, 64, 48) if len(spec) == 3 else (64, 48)
  x = spmd_checks.random(shape, 4) * jnp.exp(3 * spmd_checks.random((*shape[:-1], 1), 5))
  x = x.at[..., 60, 40].set(jnp.inf).at[..., 50, 47].set(jnp.nan).astype(jnp.bfloat16)
  x = x.at[..., 7, :].set(0.0)
  ndim = len(shape)
  rules = (
    kernels.row_col_amax(functools.partial(_row_col_amax_stand_in, rows, cols), ndim, rows, cols),
    kernels.rowwise_cast(functools.partial(_rowwise_cast_stand_in, rows, cols), ndim, rows, cols),
  )
  stand_ins = (
    functools.partial(_row_col_amax_stand_in, rows, cols),
    functools.partial(_rowwise_cast_stand_in, rows, cols),
  )

  def quantize(x, amax, cast):
    a_rows, a_cols = amax(x)
    s_rows = _power_of_two_scale(a_rows) if rows else a_rows
    s_cols = _power_of_two_scale(a_cols) if cols else a_cols
    return (*cast(x, s_rows, s_cols), a_rows, a_cols)

  want = jax.jit(lambda x: quantize(x, *stand_ins))(x)
  mesh = _mesh(spec)
  got = jax.jit(lambda x: quantize(x, *rules))(jax.device_put(x, NamedSharding(mesh, spec)))
  _assert_equal(got, want)
  if rows:
    assert float(want[2][..., 60].min()) == np.inf and float(want[2][..., 7].max()) == 0.0
  if cols:
    assert float(want[3][..., 47].min()) == np.inf
  lead, p, c = tuple(spec)[:-2], spec[-2], spec[-1]
  outs = [(got[0], spec), (got[2], P(*lead, p))] if rows else []
  outs += [(got[1], P(*lead, c, p)), (got[3], P(*lead, c))] if cols else []
  for out, want_spec in outs:
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), out.ndim)


# --- vmap over the rules --------------------------------------------------------------------------


def test_rules_run_under_vmap_like_one_device():
  """custom_partitioning has no batching rule; the rules loop over a vmapped batch, each call
  partitioned: the norm cast's and the activation cast's results, each element's amax its own."""
  names = NAMES[2]
  h, _, bias, scale = _act_operands(2, True)
  hs = jnp.stack([h, 2 * h, h * 0.5])
  act = functools.partial(_act_stand_in, names)
  rule = kernels.act_cast(act, 2, True, True)
  mesh = _mesh(P("a"))
  hs_sharded = jax.device_put(hs, NamedSharding(mesh, P(None, "a")))
  got = jax.jit(jax.vmap(rule, in_axes=(0, None, None)))(hs_sharded, bias, scale)
  want = jax.vmap(act, in_axes=(0, None, None))(hs, bias, scale)
  _assert_equal(got, want)
  assert len(set(np.asarray(got[2]).ravel().tolist())) == 3  # one amax per element


def _norm_stand_in(x, mean, rsigma, gamma, beta, scale):
  y = (x.astype(jnp.float32) - mean[:, None]) * rsigma[:, None] * gamma
  y = y + beta if beta.size else y
  q = jnp.clip(y * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
  return q, q.T, jnp.max(jnp.abs(y)).reshape(1)


def test_norm_cast_rule_under_vmap_with_batched_statistics():
  m, k = 32, 64
  xs = (spmd_checks.random((3, m, k), 0) * 3).astype(jnp.bfloat16)
  means = jnp.mean(xs.astype(jnp.float32), -1)
  rsigmas = jax.lax.rsqrt(jnp.var(xs.astype(jnp.float32), -1) + 1e-6)
  gamma, beta, scale = spmd_checks.random((k,), 1), jnp.zeros((0,)), jnp.full((1,), 16.0)
  rule = kernels.norm_cast(_norm_stand_in, False, True)
  mesh = _mesh(P("a"))
  xs_sharded = jax.device_put(xs, NamedSharding(mesh, P(None, "a")))
  axes = (0, 0, 0, None, None, None)
  got = jax.jit(jax.vmap(rule, in_axes=axes))(xs_sharded, means, rsigmas, gamma, beta, scale)
  _assert_equal(got, jax.vmap(_norm_stand_in, in_axes=axes)(xs, means, rsigmas, gamma, beta, scale))


def test_vmapped_gradient_with_amaxes_folded_over_the_mesh_matches_each_example():
  """A user's per-example gradients (vmap over a batch of inputs) of a quantized GEMM in a
  program sharded over the mesh, with the amaxes reduced through their partitioning rule
  (``GemmConfig.fold_amax``): each example's gradient as computed alone."""
  recipe = ta.Float8CurrentScaling()
  config = core.GemmConfig(fold_amax=True)
  xs = spmd_checks.random((3, 16, 64), 0)
  w = spmd_checks.random((64, 32), 1) * 0.125
  dn = (((1,), (0,)), ((), ()))

  def loss(x, w):
    y = core.dot_general(x, w, dn, recipe=recipe, threshold=None, config=config)
    return jnp.sum(y * y)

  grad = jax.grad(loss, argnums=(0, 1))
  mesh = _mesh(P("a"))
  xs_sharded = jax.device_put(xs, NamedSharding(mesh, P(None, "a")))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.vmap(grad, in_axes=(0, None)))(xs_sharded, w)
  for i in range(3):
    want = jax.jit(grad)(xs[i], w)
    for a, b in zip(got, want, strict=True):
      # The sharded, vmapped program's GEMMs have other shapes than one example's: on a GPU they
      # may sum in another order (spmd_checks' bound); one batch amax for all examples would move
      # every element by a share of an FP8 step (~1e-2 of the largest), far over it.
      spmd_checks.assert_close_to_one_device(np.asarray(a[i]), np.asarray(b), f"{i}", cpu_rel=1e-6)
