"""The FFI cast kernels against the pure-JAX reference: bit-identical, under jit, vmap and grad."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters.core import formats, kernels
from tests.conftest import assert_scales_equal, rel_err

needs_ext = pytest.mark.skipif(
  not kernels.ffi_available("cpu"), reason="te_adapters extension not built (pure-JAX install)"
)
IN_DTYPES = (np.float32, jnp.bfloat16, np.float16)
Q_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _nasty(shape, dtype, seed):
  """N(0,1) at mixed magnitudes, plus +-inf, NaN, zeros, values past the FP8 range, tiny values."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * rng.choice([1e-6, 1e-2, 1.0, 300.0, 1e5], shape)
  flat = x.reshape(-1)
  specials = [np.inf, -np.inf, 0.0, -0.0, 7e4, -7e4, 1e-30]
  flat[: min(len(specials), flat.size)] = specials[: flat.size]
  return x.astype(dtype)


def _both(x, scale, q_dtype, **kw):
  f = lambda be: jax.jit(lambda x, s: formats.cast_transpose(x, s, q_dtype, backend=be, **kw))(
    x, scale
  )
  return f("ffi"), f("jax")


@needs_ext
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37,), (5, 3), (2, 33, 65), (2, 3, 17, 40)], ids=str)
def test_bit_identical_to_jax(dtype, q_dtype, shape):
  x = _nasty(shape, dtype, seed=len(shape))
  scale = jnp.array([3.7], jnp.float32)
  colwise = len(shape) >= 2
  (q, q_t, a), (rq, rq_t, ra) = _both(x, scale, q_dtype, colwise=colwise, with_amax=True)
  assert q.dtype == q_dtype and q.shape == x.shape
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  if colwise:
    assert q_t.shape == np.swapaxes(x, -1, -2).shape
    np.testing.assert_array_equal(_bits(q_t), _bits(rq_t))
  np.testing.assert_array_equal(_bits(a), _bits(ra))
  assert float(a[0]) == np.inf  # the +inf planted in x
  # The same values through the stand-alone amax kernel.
  np.testing.assert_array_equal(_bits(formats.amax(x, backend="ffi")), _bits(ra))


@needs_ext
@pytest.mark.parametrize("dtype", (jnp.bfloat16, np.float16), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_16_bit_input(dtype, q_dtype):
  """All 65536 bit patterns (subnormals, NaNs, infs included) at scales that hit every rounding."""
  x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dtype).reshape(256, 256)
  for s in (1.0, 448.0 / 3.0, 2.0**-7, 1e6):
    (q, q_t, _), (rq, rq_t, _) = _both(x, jnp.array([s], jnp.float32), q_dtype)
    np.testing.assert_array_equal(_bits(q), _bits(rq))
    np.testing.assert_array_equal(_bits(q_t), _bits(rq_t))


@needs_ext
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: np.dtype(d).name)
def test_float32_rounding_ties_and_subnormals(q_dtype):
  """Float32 at, just off and around every FP8 midpoint, and in the FP8 subnormal range."""
  codes = np.arange(256, dtype=np.uint8).view(q_dtype).astype(np.float64)
  codes = np.unique(codes[np.isfinite(codes)])
  mids = ((codes[:-1] + codes[1:]) / 2).astype(np.float32)
  near = [mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), -mids]
  rng = np.random.default_rng(0)
  rand = (rng.uniform(-1, 1, 40000) * 2.0 ** rng.integers(-24, 17, 40000)).astype(np.float32)
  x = np.concatenate([*near, rand, np.array([1e-40, -1e-40, 2e-38], np.float32)])
  x = np.pad(x, (0, (-x.size) % 64)).reshape(-1, 64)
  (q, q_t, a), (rq, rq_t, ra) = _both(x, jnp.ones((1,), jnp.float32), q_dtype, with_amax=True)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(q_t), _bits(rq_t))
  np.testing.assert_array_equal(_bits(a), _bits(ra))
  # And both are round-to-nearest-even (ml_dtypes' cast) inside the FP8 range, away from the
  # float32 denormals that XLA:CPU flushes to zero.
  limit = float(jnp.finfo(q_dtype).max)
  normal = (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) <= limit)
  np.testing.assert_array_equal(_bits(q)[normal], _bits(x.astype(q_dtype))[normal])


@needs_ext
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: np.dtype(d).name)
def test_nan_propagates(dtype):
  """A NaN gives NaN data (encoded as XLA does on the platform) and an infinite amax, like the
  pure-JAX path."""
  x = _nasty((3, 40, 48), dtype, seed=5)
  x[1, 7, 9] = np.nan
  x[2, 0, 1] = -np.nan
  scale = jnp.array([0.5], jnp.float32)
  (q, q_t, a), (rq, rq_t, ra) = _both(x, scale, jnp.float8_e4m3fn, with_amax=True)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(q_t), _bits(rq_t))
  # XLA:CPU keeps a NaN's sign (-NaN is 0xFF); on the GPU both XLA's convert and the CUDA
  # kernel's conversion give every NaN as 0x7F (seen on an H100). Either way it stays a NaN.
  negative_nan = 0xFF if jax.default_backend() == "cpu" else 0x7F
  assert _bits(q)[1, 7, 9] == 0x7F and _bits(q)[2, 0, 1] == negative_nan
  np.testing.assert_array_equal(a, ra)
  assert np.isposinf(a[0]) and np.isposinf(formats.amax(x, backend="ffi")[0])
  np.testing.assert_array_equal(formats.amax(x, backend="jax"), a)


@needs_ext
def test_rowwise_colwise_amax_subsets():
  x = _nasty((4, 24, 40), jnp.bfloat16, seed=1)
  s = jnp.array([2.0], jnp.float32)
  q, q_t, a = formats.cast_transpose(x, s, jnp.float8_e5m2, rowwise=False, backend="ffi")
  assert q is None and a is None
  np.testing.assert_array_equal(_bits(q_t), _bits(_both(x, s, jnp.float8_e5m2)[1][1]))
  q, q_t, a = formats.cast_transpose(x, s, jnp.float8_e5m2, colwise=False, backend="ffi")
  assert q_t is None and a is None and q.shape == x.shape


@needs_ext
def test_vmap_matches_per_example_calls():
  x = _nasty((3, 8, 24, 16), jnp.bfloat16, seed=2)
  scales = jnp.array([[1.0], [4.0], [0.25]], jnp.float32)
  one = jnp.array([2.0], jnp.float32)
  f = lambda be, amax: (
    lambda x, s: formats.cast_transpose(x, s, jnp.float8_e4m3fn, with_amax=amax, backend=be)
  )
  for be_ax, args in (((0, None), (x, one)), ((0, 0), (x, scales)), ((None, 0), (x[0], scales))):
    for with_amax in (False, True):
      got = jax.jit(jax.vmap(f("ffi", with_amax), in_axes=be_ax))(*args)
      want = jax.vmap(f("jax", with_amax), in_axes=be_ax)(*args)
      for g, w in zip(got, want, strict=False):
        if w is not None:
          np.testing.assert_array_equal(_bits(g), _bits(w))
  got = jax.vmap(lambda v: formats.amax(v, backend="ffi"))(x)
  np.testing.assert_array_equal(
    _bits(got), _bits(jax.vmap(lambda v: formats.amax(v, backend="jax"))(x))
  )


@needs_ext
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(3, 33, 65), (4, 64, 48), (1, 5, 3)], ids=str)
def test_per_batch_scales_bit_identical_to_jax(dtype, q_dtype, shape):
  """One scale and one amax per leading index (the grouped GEMM's kernels, one per expert): the
  kernel equals the pure-JAX path and, batch by batch, the one-scale cast with that scale."""
  x = _nasty(shape, dtype, seed=7 + len(shape))
  if shape[0] > 2:
    x[1] = np.where(np.abs(x[1]) < np.inf, x[1], 0.0)  # finite: its own amax, not inf
    x[2, 3, 4] = np.nan
  scales = jnp.asarray(np.geomspace(0.01, 40.0, shape[0]), jnp.float32)
  f = lambda be: jax.jit(
    lambda x, s: formats.cast_transpose_per_batch(x, s, q_dtype, with_amax=True, backend=be)
  )(x, scales)
  (q, q_t, a), (rq, rq_t, ra) = f("ffi"), f("jax")
  assert q.shape == x.shape and q_t.shape == np.swapaxes(x, 1, 2).shape and a.shape == shape[:1]
  for got, want in ((q, rq), (q_t, rq_t), (a, ra)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  for b in range(shape[0]):
    one = formats.cast_transpose(x[b], scales[b : b + 1], q_dtype, with_amax=True, backend="jax")
    np.testing.assert_array_equal(_bits(q[b]), _bits(one[0]))
    np.testing.assert_array_equal(_bits(q_t[b]), _bits(one[1]))
    np.testing.assert_array_equal(_bits(a[b : b + 1]), _bits(one[2]))
  if shape[0] > 2:
    assert np.isposinf(a[0]) and np.isfinite(a[1]) and np.isposinf(a[2])  # inf, finite, NaN
    assert float(a[1]) == float(np.max(np.abs(np.asarray(x[1], np.float32))))
  q2, q2_t, none = formats.cast_transpose_per_batch(x, scales, q_dtype, backend="ffi")
  assert none is None
  np.testing.assert_array_equal(_bits(q2), _bits(q))
  np.testing.assert_array_equal(_bits(q2_t), _bits(q_t))


def test_per_batch_bad_input_errors():
  x = jnp.ones((3, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"scales must have shape \(3,\)"):
    formats.cast_transpose_per_batch(x, jnp.ones((1,)), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"needs a \(B, R, C\) array"):
    formats.cast_transpose_per_batch(x[0], jnp.ones((4,)), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
    formats.cast_transpose_per_batch(x, jnp.ones((3,)), jnp.bfloat16)


def _dense_step(recipe, backend, monkeypatch):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
  state = ta.core.init_state(recipe)

  def loss_fn(w, state, x):
    state = ta.core.with_max_grad(state)
    y = ta.core.dot_general(
      x,
      w.astype(x.dtype),
      (((2,), (0,)), ((), ())),
      threshold=None,
      recipe=recipe,
      state=state,
      config=ta.GemmConfig(backend=backend),
    )
    return jnp.sum(y.astype(jnp.float32) ** 2) / y.size

  @jax.jit
  def step(w, state, x):
    loss, (gw, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, state, x)
    return loss, gw, ta.core.updated_state(state, gs)

  out = []
  for _ in range(3):
    loss, gw, state = step(w, state, x)
    out.append((loss, gw, state))
    x = x * 1.5
  hlo = step.lower(w, state, x).as_text()
  return out, hlo


@needs_ext
@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)], ids=str
)
def test_dot_general_grad_identical_through_ffi(recipe, monkeypatch):
  """A jitted value_and_grad step of the core GEMM: same loss, grads and state on both paths."""
  ffi_out, ffi_hlo = _dense_step(recipe, "ffi", monkeypatch)
  jax_out, jax_hlo = _dense_step(recipe, "jax", monkeypatch)
  assert "te_adapters_cast_transpose" in ffi_hlo
  assert "te_adapters_cast_transpose" not in jax_hlo
  for (l1, g1, s1), (l2, g2, s2) in zip(ffi_out, jax_out, strict=False):
    if jax.default_backend() == "cpu":
      np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
      np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), s1, s2)
      continue
    # On the GPU the two programs differ in their last bits (loss 6.6e-4 and 2.4e-5 relative seen
    # on an H100), and the E5M2 gradient (2 mantissa bits) turns that into steps of up to 25% at
    # a few elements (weight gradient 1.7e-2 and 2.5e-2). Not traced to its source: the casts
    # themselves are bit-identical on the GPU (test_bit_identical_to_jax, test_every_16_bit_input).
    # A wrong cast or scale is O(1).
    assert rel_err(l1, l2) < 5e-3 and rel_err(g1, g2) < 1e-1, (rel_err(l1, l2), rel_err(g1, g2))
    for name in s1:
      if name.endswith("_scale"):
        assert_scales_equal(s1[name], s2[name])
      else:
        np.testing.assert_allclose(np.asarray(s1[name]), np.asarray(s2[name]), rtol=1e-3)
  if isinstance(recipe, ta.DelayedScaling):
    hist = np.asarray(ffi_out[-1][2]["x_amax_history"])
    assert hist[-1] > hist[-2] > hist[-3] > 0  # x grew by 1.5x each step


def test_bad_input_errors():
  x = jnp.ones((4, 8), jnp.float32)
  with pytest.raises(ValueError, match="one element"):
    formats.cast_transpose(x, jnp.ones((2,)), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="rank >= 2"):
    formats.cast_transpose(jnp.ones((8,)), jnp.ones((1,)), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
    formats.cast_transpose(x, jnp.ones((1,)), jnp.bfloat16)
  with pytest.raises(TypeError, match="floating-point"):
    formats.cast_transpose(jnp.ones((4, 8), jnp.int32), jnp.ones((1,)), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="backend must be"):
    formats.cast_transpose(x, jnp.ones((1,)), jnp.float8_e4m3fn, backend="cuda")


def test_backend_choice():
  with pytest.raises(ValueError, match="GemmConfig.backend must be"):
    ta.GemmConfig(backend="triton")
  with pytest.raises(ValueError, match="backend must be"):
    formats.backend("cpu", "triton")
  assert formats.backend("cpu", "jax") == "jax"
  assert formats.backend("cpu") == "jax"  # FFI by default only on GPU
  assert formats.backend("tpu") == "jax"
  if kernels.ffi_available("cpu"):
    assert formats.backend("cpu", "ffi") == "ffi"


def test_config_is_checked():
  x = jnp.ones((16, 32))
  with pytest.raises(TypeError, match="config must be a GemmConfig"):
    ta.core.dot_general(
      x, x.T, (((1,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling(), config={"backend": "jax"}
    )
  with pytest.raises(ValueError, match="GemmConfig.fp8_gemm must be"):
    ta.GemmConfig(fp8_gemm="cublas")


def _run(code, env_extra):
  # The checkout first, then the caller's path (where an installed te_adapters may be).
  path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", **env_extra}
  proc = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def test_pure_jax_fallback_without_extension():
  """The package with its extension modules hidden: imports, computes, and says why ffi fails."""
  out = _run(
    """
      import sys, importlib.abc
      class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
          if name.startswith("te_adapters._csrc"):
            raise ImportError("hidden")
      sys.meta_path.insert(0, Hide())
      import jax, jax.numpy as jnp, numpy as np, te_adapters as ta
      from te_adapters.core import formats, kernels
      assert not kernels.ffi_available("cpu") and not kernels.ffi_available("gpu")
      assert formats.backend("cpu") == "jax" and formats.backend("gpu") == "jax"
      x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.float32)
      w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 16)), jnp.float32)
      f = lambda w: ta.core.dot_general(x, w, (((1,), (0,)), ((), ())),
                                        threshold=None, recipe=ta.Float8CurrentScaling()).sum()
      y, g = jax.value_and_grad(f)(w)
      ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
      assert abs(float(y) - ref.sum()) / np.abs(ref).sum() < 0.05, (float(y), ref.sum())
      assert "custom_call" not in jax.jit(jax.grad(f)).lower(w).as_text()
      try:
        formats.backend("cpu", "ffi")
        raise SystemExit("forcing ffi without the extension did not fail")
      except RuntimeError as e:
        assert "not built" in str(e), e
      print("fallback-ok")
      """,
    {},
  )
  assert "fallback-ok" in out


@needs_ext
def test_sharded_operands_run_the_kernel_per_shard():
  """Under jit on 4 devices, sharded inputs run the kernel on each shard: no all-gather, same
  bits, the global amax on every device."""
  out = _run(
    """
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import NamedSharding, PartitionSpec as P
      from te_adapters.core import formats, kernels
      mesh = jax.make_mesh((4,), ("d",))
      x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64, 32)), jnp.bfloat16)
      x = jax.device_put(x, NamedSharding(mesh, P("d")))
      s = jnp.array([2.0], jnp.float32)
      f = jax.jit(lambda x, s: formats.cast_transpose(x, s, jnp.float8_e4m3fn, with_amax=True,
                                                  backend="ffi"))
      hlo = f.lower(x, s).compile().as_text()
      assert "all-gather" not in hlo, hlo
      assert "te_adapters_cast_transpose" in hlo, hlo
      got = f(x, s)
      want = formats.cast_transpose(np.asarray(x), s, jnp.float8_e4m3fn, with_amax=True,
                                    backend="jax")
      for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
      assert got[0].sharding.spec[0] == "d"
      # Outside jit too, a sharded array stays sharded.
      q, _, _ = formats.cast_transpose(x, s, jnp.float8_e4m3fn, backend="ffi")
      assert q.sharding.spec[0] == "d"
      print("sharded-ok")
      """,
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
  )
  assert "sharded-ok" in out
