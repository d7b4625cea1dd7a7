"""The size threshold: small GEMMs run as exact lax.dot_general, say so, and keep the state."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from tests import conftest
from tests.conftest import rel_err

DN = (((1,), (0,)), ((), ()))
DELAYED = ta.DelayedScaling(amax_history_len=4)
BACKEND = jax.default_backend()
# The default rule, applied on the platform the tests run on.
HERE = dataclasses.replace(core.DEFAULT_SIZE_THRESHOLD, platforms=(BACKEND,))
# The default rule, applied only on a platform the tests do not run on.
ELSEWHERE = dataclasses.replace(
  core.DEFAULT_SIZE_THRESHOLD, platforms=("tpu" if BACKEND != "tpu" else "cpu",)
)
# The default threshold as the package ships it (the suite's conftest extends it to CPU).
SHIPPED = dataclasses.replace(core.DEFAULT_SIZE_THRESHOLD, platforms=conftest.GPU_PLATFORMS)


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    yield


def _data(*shapes, dtype=jnp.bfloat16, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  pairs = zip(keys, shapes, strict=True)
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in pairs]


@pytest.mark.parametrize(
  "recipe, preferred",
  [(DELAYED, None), (ta.Float8CurrentScaling(), jnp.float32)],
  ids=["delayed", "current-preferred_f32"],
)
def test_below_threshold_is_exactly_lax_dot_general(recipe, preferred):
  x, w, dy = _data((16, 32), (32, 48), (16, 48))
  state = core.init_state(recipe)

  def ours(x, w, state):
    return core.dot_general(
      x, w, DN, preferred_element_type=preferred, recipe=recipe, state=state or None, threshold=HERE
    )

  def ref(x, w, state):
    del state
    return lax.dot_general(x, w, DN, preferred_element_type=preferred)

  @jax.jit
  def run(x, w, state, dy):
    results = []
    for f in (ours, ref):
      y, vjp = jax.vjp(f, x, w, state)
      results.append((y, *vjp(dy.astype(y.dtype))[:2]))
    return results

  results = run(x, w, state, dy)
  for a, b in zip(*results, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert results[0][0].dtype == (preferred or jnp.bfloat16)
  loss = lambda x, w, s: jnp.sum(ours(x, w, s).astype(jnp.float32))
  assert inspect.count_fp8_dot_generals(jax.grad(loss, argnums=(0, 1)), x, w, state) == (0, 3)
  # threshold=None quantizes the same GEMM.
  forced = lambda x, w, s: jnp.sum(
    core.dot_general(x, w, DN, recipe=recipe, state=s or None, threshold=None).astype(jnp.float32)
  )
  assert inspect.count_fp8_dot_generals(jax.grad(forced, argnums=(0, 1)), x, w, state) == (3, 3)


def test_warning_names_the_gemm_the_rule_and_the_way_out():
  x, w = _data((16, 32), (32, 48))
  with pytest.warns(core.HighPrecisionGemmWarning) as record:
    core.dot_general(x, w, DN, recipe=ta.Float8CurrentScaling(), threshold=HERE)
  assert len(record) == 1 and issubclass(core.HighPrecisionGemmWarning, UserWarning)
  message = str(record[0].message)
  for part in (
    "M=16, K=32, N=48",
    "high precision (bfloat16)",
    "Float8CurrentScaling",
    f"M*K*N >= 68719476736 = 4096**3 and min(M, K, N) >= 2048, on {BACKEND}",
    "threshold=None",
  ):
    assert part in message, (part, message)
  assert record[0].filename == __file__  # points at the caller
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for threshold in (None, ELSEWHERE):
      jax.eval_shape(
        lambda x, w, t=threshold: core.dot_general(
          x, w, DN, recipe=ta.Float8CurrentScaling(), threshold=t
        ),
        x,
        w,
      )


@pytest.mark.parametrize("max_grad", [False, True], ids=["plain", "with_max_grad"])
def test_delayed_state_unchanged_over_three_steps(max_grad):
  x, w, dy = _data((16, 32), (32, 16), (16, 16))
  state = dict(
    core.init_state(DELAYED),
    x_scale=jnp.float32([3.0]),
    x_amax_history=jnp.float32([1.0, 2.0, 0.0, 5.0]),
  )
  before = jax.tree.map(np.asarray, state)

  @jax.jit
  def step(w, state):
    def loss(w, state):
      if max_grad:
        state = core.with_max_grad(state)
      y = core.dot_general(x, w, DN, recipe=DELAYED, state=state, threshold=HERE)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1))(w, state)

  for _ in range(3):
    _, state_grad = step(w, state)
    if not max_grad:  # the raw gradient is the old state
      jax.tree.map(np.testing.assert_array_equal, state_grad, before)
    state = core.updated_state(state, state_grad)
  jax.tree.map(np.testing.assert_array_equal, state, before)


def test_high_precision_use_leaves_max_combination_to_the_fp8_use():
  x, w = _data((16, 32), (32, 16), dtype=jnp.float32)
  state = core.init_state(DELAYED)

  def loss(w, state, uses):
    state = core.with_max_grad(state)
    return sum(
      jnp.sum(core.dot_general(x * scale, w, DN, recipe=DELAYED, state=state, threshold=threshold))
      for scale, threshold in uses
    )

  # A large high-precision use (its amax would win) next to an FP8 use: the FP8 use alone counts.
  grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=2)
  mixed = grad(w, state, ((4.0, HERE), (1.0, None)))
  alone = grad(w, state, ((1.0, None),))
  for name in alone:
    np.testing.assert_array_equal(mixed[name], alone[name], err_msg=name)
  assert float(mixed["x_amax_history"][-1]) == float(jnp.max(jnp.abs(x)))


def test_vmap_and_remat_keep_the_state():
  x, w = _data((3, 16, 32), (32, 16), dtype=jnp.float32)
  state = core.init_state(DELAYED)

  highest = lax.Precision.HIGHEST  # float32 sums on GPUs too (their default is TF32)

  def loss(w, state):
    f = lambda x: core.dot_general(x, w, DN, highest, recipe=DELAYED, state=state, threshold=HERE)
    return jnp.sum(jax.vmap(jax.checkpoint(f))(x) ** 2)

  g_w, g_state = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, state)
  jax.tree.map(np.testing.assert_array_equal, g_state, state)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ref = 2 * np.einsum("bmk,bmn->kn", x64, np.einsum("bmk,kn->bmn", x64, w64))
  # float32 sums of 32 and then 48 products, in whatever order XLA picks: a normwise error of a
  # few units of 2**-24 times the sum lengths; a wrong gradient is O(1).
  assert rel_err(g_w, ref) < 80 * 2.0**-24


@pytest.mark.parametrize(
  "recipe, rng",
  [
    (ta.MXFP8BlockScaling(), None),
    (ta.Float8BlockScaling(), None),
    (ta.NVFP4BlockScaling(), jax.random.key(0)),
  ],
  ids=["mxfp8", "float8_block", "nvfp4_with_rng"],
)
def test_block_recipes_below_threshold(recipe, rng):
  x, w = _data((128, 128), (128, 256))  # shapes every block recipe can tile
  f = lambda x, w: core.dot_general(x, w, DN, recipe=recipe, rng=rng, threshold=HERE)
  run = jax.jit(lambda f, x, w: (lambda y, vjp: (y, *vjp(y)))(*jax.vjp(f, x, w)), static_argnums=0)
  got, want = run(f, x, w), run(lambda x, w: lax.dot_general(x, w, DN), x, w)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with pytest.raises(ValueError, match="does not use one"):  # still validated
    core.dot_general(x, w, DN, recipe=ta.MXFP8BlockScaling(), rng=jax.random.key(0), threshold=HERE)


MKN_CASES = [
  # lhs shape, rhs shape, dimension numbers, (M, K, N)
  ((16, 32), (32, 48), DN, (16, 32, 48)),
  ((4, 16, 32), (32, 48), (((2,), (0,)), ((), ())), (64, 32, 48)),
  ((2, 16, 32), (2, 32, 8), (((2,), (1,)), ((0,), (0,))), (32, 32, 8)),  # batch dims
  ((16, 2, 32, 4), (4, 32, 16), (((2, 3), (1, 0)), ((), ())), (32, 128, 16)),  # two contracting
  ((16, 3, 32), (32, 3, 16), (((2,), (0,)), ((1,), (1,))), (48, 32, 16)),
]


@pytest.mark.parametrize("lhs, rhs, dn, mkn", MKN_CASES)
def test_runs_in_fp8_counts_m_k_n(lhs, rhs, dn, mkn):
  m, k, n = mkn
  at = lambda **kw: core.SizeThreshold(
    **{"min_mkn": 1, "min_dim": 1, "platforms": (BACKEND,), **kw}
  )
  assert core.runs_in_fp8(lhs, rhs, dn, at(min_mkn=m * k * n))
  assert not core.runs_in_fp8(lhs, rhs, dn, at(min_mkn=m * k * n + 1))
  assert core.runs_in_fp8(lhs, rhs, dn, at(min_dim=min(m, k, n)))
  assert not core.runs_in_fp8(lhs, rhs, dn, at(min_dim=min(m, k, n) + 1))
  assert core.runs_in_fp8(lhs, rhs, dn, at(min_mkn=m * k * n + 1), backend=ELSEWHERE.platforms[0])
  assert core.runs_in_fp8(lhs, rhs, dn, at(min_mkn=m * k * n + 1)) == (
    core.runs_in_fp8(jnp.zeros(lhs), jnp.zeros(rhs), dn, at(min_mkn=m * k * n + 1))
  )


def test_default_rule_on_gpu_and_not_on_cpu():
  assert SHIPPED.platforms == ("gpu",)
  fp8 = lambda m, k, n, **kw: core.runs_in_fp8((m, k), (k, n), DN, **{"threshold": SHIPPED, **kw})
  for shape in [
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (4096, 4096, 1024),
    (4096, 4096, 2048),
    (1024, 8192, 8192),
    (8192, 2048, 2048),
  ]:
    assert not fp8(*shape, backend="gpu"), shape
    assert fp8(*shape, backend="cpu") and fp8(*shape, backend="gpu", threshold=None), shape
  for shape in [(4096, 4096, 4096), (2048, 8192, 8192), (8192, 4096, 14336), (16384,) * 3]:
    assert fp8(*shape, backend="gpu"), shape
  assert fp8(16, 16, 16) == (BACKEND != "gpu")
  # The suite's default applies here, whatever the platform.
  assert not core.runs_in_fp8((16, 16), (16, 16), DN)


def test_default_threshold_applies_where_the_backend_is_gpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x, w = _data((16, 32), (32, 48))
  assert not core.runs_in_fp8(x, w, DN)
  loss = lambda x, w: jnp.sum(core.dot_general(x, w, DN, recipe=ta.Float8CurrentScaling()))
  with pytest.warns(core.HighPrecisionGemmWarning, match=r"on (cpu, )?gpu\)"):
    assert inspect.count_fp8_dot_generals(jax.grad(loss, argnums=(0, 1)), x, w) == (0, 3)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"min_mkn": 0, "min_dim": 1}, ValueError, "SizeThreshold.min_mkn must be >= 1, got 0"),
    ({"min_mkn": 1, "min_dim": -2}, ValueError, "SizeThreshold.min_dim must be >= 1"),
    ({"min_mkn": 1.5, "min_dim": 1}, TypeError, "SizeThreshold.min_mkn must be an int"),
    ({"min_mkn": 1, "min_dim": True}, TypeError, "SizeThreshold.min_dim must be an int"),
    (
      {"min_mkn": 1, "min_dim": 1, "platforms": "gpu"},
      TypeError,
      r"SizeThreshold.platforms must be a tuple of platform names such as \('gpu',\)",
    ),
    (
      {"min_mkn": 1, "min_dim": 1, "platforms": ("cuda",)},
      ValueError,
      r"SizeThreshold.platforms: unknown platform\(s\) \['cuda'\]",
    ),
  ],
)
def test_invalid_thresholds_are_refused(kwargs, error, match):
  with pytest.raises(error, match=match):
    core.SizeThreshold(**kwargs)


def test_threshold_is_hashable_and_checked_by_dot_general():
  t = core.SizeThreshold(min_mkn=np.int64(8), min_dim=2, platforms=["cpu", "gpu"])
  assert t.platforms == ("cpu", "gpu") and type(t.min_mkn) is int
  assert hash(t) == hash(core.SizeThreshold(8, 2, ("cpu", "gpu")))
  x, w = _data((16, 32), (32, 16))
  f = jax.jit(
    lambda x, w, state, threshold: core.dot_general(
      x, w, DN, recipe=DELAYED, state=state, threshold=threshold
    ),
    static_argnums=3,
  )
  np.testing.assert_array_equal(f(x, w, core.init_state(DELAYED), HERE), lax.dot_general(x, w, DN))
  for bad in (4096**3, "default"):
    with pytest.raises(TypeError, match="threshold must be a te_adapters.core.SizeThreshold"):
      core.dot_general(x, w, DN, recipe=ta.Float8CurrentScaling(), threshold=bad)
    with pytest.raises(TypeError, match="threshold must be"):
      core.runs_in_fp8(x, w, DN, threshold=bad)


def _mesh(names_sizes):
  names, sizes = zip(*names_sizes, strict=True)
  devices = jax.devices()[: int(np.prod(sizes))]
  return jax.make_mesh(sizes, names, devices=devices, axis_types=(AxisType.Explicit,) * len(sizes))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices")
def test_spmd_keywords_below_threshold():
  x, w, dy = _data((8, 16, 64), (64, 32), (8, 16, 32), dtype=jnp.float32)
  dn = (((2,), (0,)), ((), ()))
  state = core.init_state(DELAYED)
  ref = lambda x, w: jnp.sum(lax.dot_general(x, w, dn) * dy)
  r_loss, (r_dx, r_dw) = jax.value_and_grad(ref, argnums=(0, 1))(x, w)

  def check(loss, x, w):
    value, (dx, dw, new_state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, state)
    np.testing.assert_allclose(value, r_loss, rtol=1e-5)
    np.testing.assert_allclose(dx, r_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, r_dw, rtol=1e-5, atol=1e-4)
    jax.tree.map(np.testing.assert_array_equal, new_state, state)

  # FSDP inside shard_map: the kernel shard is gathered (in float32) for the GEMM.
  mesh = _mesh((("fsdp", 4),))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  xs, ws, dys = put(x, P("fsdp")), put(w, P("fsdp", None)), put(dy, P("fsdp"))

  def body(x, w, state, dy):
    y = core.dot_general(
      x,
      w,
      dn,
      recipe=DELAYED,
      state=state,
      threshold=HERE,
      kernel_all_gather=P("fsdp", None),
      amax_axes="fsdp",
    )
    return lax.psum(jnp.sum(y * dy), "fsdp")

  mapped = jax.shard_map(
    body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp", None), P(), P("fsdp")), out_specs=P()
  )
  check(lambda x, w, s: mapped(x, w, s, dys), xs, ws)
  # Row-parallel TP with Explicit axes: out_sharding names the sum over the contracting dim.
  mesh = _mesh((("dp", 2), ("tp", 2)))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  xs, ws = put(x, P("dp", None, "tp")), put(w, P("tp", None))
  with jax.set_mesh(mesh):
    loss = lambda x, w, s: jnp.sum(
      core.dot_general(
        x, w, dn, recipe=DELAYED, state=s, threshold=HERE, out_sharding=P("dp", None, None)
      )
      * put(dy, P("dp"))
    )
    check(loss, xs, ws)


def _error_of(f, *args):
  """The (type, message) that ``f(*args)`` raises, or None."""
  try:
    jax.eval_shape(f, *args)
  except (ValueError, TypeError) as e:
    return type(e), str(e)
  return None


BAD_INPUTS = [
  # recipe, lhs shape, rhs shape, differentiate, extra keywords, what the message names
  (ta.Float8BlockScaling(), (128, 64), (64, 128), False, {}, "K .* is 64"),
  (ta.Float8BlockScaling(), (8, 128), (128, 128), True, {}, "M .* is 8"),
  (ta.MXFP8BlockScaling(), (32, 48), (48, 32), False, {}, "K .* is 48"),
  (ta.MXFP8BlockScaling(), (32, 32), (32, 7), True, {}, "N .* is 7"),
  (ta.NVFP4BlockScaling(), (16, 16), (16, 16), True, {}, "pass rng="),
  (ta.NVFP4BlockScaling(), (24, 16), (16, 16), True, {"rng": jax.random.key(0)}, "M .* is 24"),
  (
    ta.MXFP8BlockScaling(),
    (32, 32),
    (32, 32),
    False,
    {"rng": jax.random.key(0)},
    "does not use one",
  ),
  (DELAYED, (16, 32), (32, 16), False, {"state": {"x_scale": jnp.ones(1)}}, "state"),
  (ta.Float8CurrentScaling(), (16, 32), (32, 16), False, {"dtype": jnp.int32}, "float"),
  ("fp8", (16, 32), (32, 16), False, {}, "recipe"),
]


@pytest.mark.parametrize("recipe, lhs, rhs, differentiate, extra, match", BAD_INPUTS)
def test_bad_input_gets_the_same_error_below_and_above_the_threshold(
  recipe, lhs, rhs, differentiate, extra, match
):
  extra = dict(extra)
  dtype = extra.pop("dtype", jnp.float32)
  x, w = jnp.ones(lhs, dtype), jnp.ones(rhs, jnp.float32)

  def errors(threshold):
    f = lambda x, w: core.dot_general(x, w, DN, recipe=recipe, threshold=threshold, **extra)
    if differentiate:
      return _error_of(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)), x, w)
    return _error_of(f, x, w)

  # HERE keeps these small GEMMs in high precision; None quantizes them.
  assert not core.runs_in_fp8(lhs, rhs, DN, HERE)
  below, above = errors(HERE), errors(None)
  assert above is not None, "no error with threshold=None"
  assert below == above
  assert re.search(match, above[1]), above


def test_high_precision_reason_for_a_layer_and_for_a_gemm():
  t = core.SizeThreshold(min_mkn=2**30, min_dim=256, platforms=("gpu",))
  why = core.high_precision_reason
  assert why(t, 128, 4096, backend="gpu").startswith("K=128, N=4096: below the size threshold")
  assert why(t, 1024, 1024, backend="gpu") is None  # a large enough M runs in FP8
  assert why(t, 1024, 1024, m=1024, backend="gpu") is None  # M*K*N = 2**30
  assert "M=1023, K=1024, N=1024" in why(t, 1024, 1024, m=1023, backend="gpu")
  assert why(t, 128, 4096, backend="cpu") is None and why(None, 16, 16, m=16) is None
  assert core.runs_in_fp8((1024, 1024), (1024, 1024), DN, t, backend="gpu")
  assert not core.runs_in_fp8((1023, 1024), (1024, 1024), DN, t, backend="gpu")
