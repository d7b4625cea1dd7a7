"""On a Hopper GPU: the CUDA cast kernels match the pure-JAX path bit for bit (else skipped)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters.core import formats, kernels
from tests.conftest import rel_err as _rel

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


@pytest.fixture(autouse=True)
def _needs_cuda_ext():
  if not kernels.ffi_available("gpu"):
    pytest.skip("te_adapters built without its CUDA kernels")


@pytest.mark.parametrize(
  "dtype", (jnp.bfloat16, np.float16, np.float32), ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize(
  "q_dtype", (jnp.float8_e4m3fn, jnp.float8_e5m2), ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize(
  "shape", [(1001,), (64, 128), (33, 65), (3, 100, 37), (2, 3, 64, 136), (1024, 2048)], ids=str
)
@pytest.mark.parametrize("specials", (False, True), ids=("finite", "naninf"))
def test_cuda_bit_identical(dtype, q_dtype, shape, specials):
  rng = np.random.default_rng(len(shape))
  x = rng.standard_normal(shape) * rng.choice([1e-4, 1.0, 300.0, 1e5], shape)
  if specials:
    x.reshape(-1)[[0, 3, 5, x.size - 1]] = [np.inf, -np.inf, np.nan, -np.nan]
  x = jnp.asarray(x.astype(dtype))
  s = jnp.array([3.5], jnp.float32)
  kw = dict(colwise=len(shape) >= 2, with_amax=True)
  f = jax.jit(lambda x, s: formats.cast_transpose(x, s, q_dtype, backend="ffi", **kw))
  g = jax.jit(lambda x, s: formats.cast_transpose(x, s, q_dtype, backend="jax", **kw))
  assert "te_adapters_cast_transpose" in f.lower(x, s).as_text()
  (q, q_t, a), (rq, rq_t, ra) = f(x, s), g(x, s)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  if q_t is not None:
    np.testing.assert_array_equal(_bits(q_t), _bits(rq_t))
  np.testing.assert_array_equal(_bits(a), _bits(ra))
  if specials:  # a NaN or inf input gives amax inf on both paths
    assert np.isposinf(a[0]) and np.isposinf(formats.amax(x, backend="ffi")[0])
    np.testing.assert_array_equal(_bits(formats.amax(x, backend="ffi")), _bits(ra))


@pytest.mark.parametrize(
  "dtype", (jnp.bfloat16, np.float16, np.float32), ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize(
  "q_dtype", (jnp.float8_e4m3fn, jnp.float8_e5m2), ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("shape", [(3, 100, 37), (8, 256, 192), (5, 64, 64)], ids=str)
def test_cuda_per_batch_scales_bit_identical(dtype, q_dtype, shape):
  """One scale and one amax per leading index (the grouped GEMM's kernels): the CUDA kernel
  equals the pure-JAX path; the amax of a batch with a NaN or inf is inf, of the others its own."""
  rng = np.random.default_rng(shape[0])
  big = 1e4 if dtype is np.float16 else 1e5  # float16 ends at 65504: only the planted inf is inf
  x = rng.standard_normal(shape) * rng.choice([1e-4, 1.0, 300.0, big], shape)
  x = np.clip(x, -6e4, 6e4) if dtype is np.float16 else x
  x[0, 1, 2], x[2, 3, 4] = np.inf, np.nan
  x = jnp.asarray(x.astype(dtype))
  scales = jnp.asarray(np.geomspace(1e-3, 30.0, shape[0]), jnp.float32)
  f = jax.jit(
    lambda x, s: formats.cast_transpose_per_batch(x, s, q_dtype, with_amax=True, backend="ffi")
  )
  g = jax.jit(
    lambda x, s: formats.cast_transpose_per_batch(x, s, q_dtype, with_amax=True, backend="jax")
  )
  assert "te_adapters_cast_transpose" in f.lower(x, scales).as_text()
  (q, q_t, a), (rq, rq_t, ra) = f(x, scales), g(x, scales)
  for got, want in ((q, rq), (q_t, rq_t), (a, ra)):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  assert np.isposinf(a[0]) and np.isposinf(a[2]) and np.all(np.isfinite(a[3:]))


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)], ids=str
)
def test_cuda_dense_grad_identical(recipe):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 128, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)

  def run(be):
    state = ta.core.init_state(recipe)

    def loss(w, state):
      y = ta.core.dot_general(
        x,
        w,
        (((2,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        recipe=recipe,
        state=state,
        threshold=None,
        config=ta.GemmConfig(backend=be),
      )
      return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    hlo = step.lower(w, state).compile().as_text()
    out = step(w, state)
    return out, hlo

  (l1, (g1, s1)), hlo_ffi = run("ffi")
  (l2, (g2, s2)), hlo_jax = run("jax")
  assert "te_adapters_cast_transpose" in hlo_ffi and "te_adapters_cast_transpose" not in hlo_jax
  # Forward and wgrad (x is a constant here, so no dgrad GEMM), both FP8.
  assert ta.inspect.count_fp8_gemms(hlo_ffi) == (2, 0)
  # The quantized operands are bit-identical (test_cuda_bit_identical); the two programs are
  # compiled separately, and cuBLAS autotuning may pick GEMM algorithms that sum in another order
  # (with float32 promotion, HIGHEST: ~1e-4 from the exact sum on an H100; without it, the fast
  # accumulation of DEFAULT, two algorithms' losses differed by 0.4%).
  np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-4)
  assert _rel(np.asarray(g1, np.float32), np.asarray(g2, np.float64)) < 3e-4
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=3e-4), s1, s2
  )
