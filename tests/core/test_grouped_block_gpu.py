"""Float8BlockScaling's grouped FP8 GEMM (CUTLASS's Hopper grouped GEMM with blockwise scaling) on
a Hopper GPU: each of its two modes against a per-group float64 product of the same FP8 values
and scales, with an empty group, a group over a tile and rows past the groups; and
``ragged_dot`` under ``Float8BlockScaling`` running it for its three GEMMs, against the emulated
route on the same quantized copies and against float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import kernels

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(
    jax.default_backend() != "gpu" or not kernels.block_available(),
    reason="needs a Hopper GPU and the extension built with TE_ADAPTERS_CUTLASS_DIR",
  ),
]

SIZES = np.array([150, 0, 37, 83], np.int32)  # 270 rows in groups, 30 past them
M, K, N = 300, 256, 384
B = 128
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Normwise error against float64 of the same FP8 values and scales: the tensor cores' own sums
# within a 128-wide slice (then float32), and one bfloat16 rounding of the output (about 2e-3).
TOL = {jnp.float32: 3e-4, jnp.bfloat16: 4e-3}


def _fp8(key, shape, dtype, scale):
  return (scale * jax.random.normal(key, shape)).astype(dtype)


def _scales(key, shape):
  """Inverse scales spread over 2**-6 .. 2**6, so that a scale applied to the wrong block shows."""
  return 2.0 ** jax.random.uniform(key, shape, jnp.float32, -6.0, 6.0)


def _norm_err(actual, reference):
  actual = np.asarray(actual, np.float64)
  return np.linalg.norm(actual - reference) / np.linalg.norm(reference)


def _starts(sizes):
  return np.concatenate([[0], np.cumsum(sizes)[:-1]])


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("types", [(E4M3, E4M3), (E5M2, E4M3)])
def test_block_rows_gemm_matches_float64(out_dtype, types):
  ka, kb, ksa, ksb = jax.random.split(jax.random.PRNGKey(0), 4)
  a = _fp8(ka, (M, K), types[0], 3.0)
  b = _fp8(kb, (len(SIZES), N, K), types[1], 2.0)
  sa = _scales(ksa, (M, K // B))  # one per row and 128-wide slice of K
  sb = _scales(ksb, (len(SIZES), N // B, K // B))  # one per 128x128 tile
  y = jax.jit(functools.partial(kernels.block_rows_gemm, out_dtype=out_dtype))(
    a, sa, b, sb, jnp.asarray(SIZES)
  )
  assert y.dtype == out_dtype and y.shape == (M, N)
  a64 = np.asarray(a, np.float64) * np.repeat(np.asarray(sa, np.float64), B, axis=1)
  b64 = np.asarray(b, np.float64) * np.repeat(
    np.repeat(np.asarray(sb, np.float64), B, axis=1), B, axis=2
  )
  y = np.asarray(y, np.float64)
  assert np.all(y[SIZES.sum() :] == 0), "rows past the groups must be zero"
  for g, (s, n) in enumerate(zip(_starts(SIZES), SIZES, strict=True)):
    if n:
      ref = a64[s : s + n] @ b64[g].T
      assert _norm_err(y[s : s + n], ref) < TOL[out_dtype], f"group {g}"


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("types", [(E4M3, E4M3), (E4M3, E5M2)])
def test_block_wgrad_gemm_matches_float64(out_dtype, types):
  kx, kg, ksx, ksg = jax.random.split(jax.random.PRNGKey(1), 4)
  kf, nf = 256, 384
  # The padded layout: each group from a multiple of 128 columns, zeros past its size.
  pads = -(-SIZES // B) * B
  width = B * ((M + (B - 1) * len(SIZES)) // B)
  mask = np.zeros(width, bool)
  for start, n in zip(_starts(pads), SIZES, strict=True):
    mask[start : start + n] = True
  x = jnp.where(mask, _fp8(kx, (kf, width), types[0], 3.0), jnp.zeros((), types[0]))
  dy = jnp.where(mask, _fp8(kg, (nf, width), types[1], 2.0), jnp.zeros((), types[1]))
  sx = _scales(ksx, (kf, width // B))  # one per row and 128 columns
  sg = _scales(ksg, (nf, width // B))
  dw = jax.jit(functools.partial(kernels.block_wgrad_gemm, out_dtype=out_dtype))(
    x, sx, dy, sg, jnp.asarray(SIZES)
  )
  assert dw.dtype == out_dtype and dw.shape == (len(SIZES), kf, nf)
  x64 = np.asarray(x, np.float64) * np.repeat(np.asarray(sx, np.float64), B, axis=1)
  g64 = np.asarray(dy, np.float64) * np.repeat(np.asarray(sg, np.float64), B, axis=1)
  dw = np.asarray(dw, np.float64)
  for g, (start, pad) in enumerate(zip(_starts(pads), pads, strict=True)):
    if pad == 0:
      assert np.all(dw[g] == 0), "an empty group's weight gradient must be zero"
      continue
    ref = x64[:, start : start + pad] @ g64[:, start : start + pad].T
    assert _norm_err(dw[g], ref) < TOL[out_dtype], f"group {g}"


@pytest.mark.parametrize(
  "recipe",
  [ta.Float8BlockScaling(), ta.Float8BlockScaling(fp8_format=ta.Format.HYBRID)],
  ids=["e4m3", "hybrid"],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ragged_dot_runs_the_block_scaled_kernel(recipe, dtype):
  """``ragged_dot`` under Float8BlockScaling: its forward, dgrad and wgrad on the kernel, with
  the values of the emulated route on the same quantized copies (to the kernel's rounding), and
  FP8's error against the float64 product of the unquantized values."""
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(2), 3)
  x = (2.3 * jax.random.normal(kx, (M, K))).astype(dtype)
  w = (0.11 * jax.random.normal(kw, (len(SIZES), K, N))).astype(dtype)
  dy = jax.random.normal(kd, (M, N)).astype(dtype)
  sizes = jnp.asarray(SIZES)

  def step(route):
    def loss(x, w):
      dtypes = (np.dtype(dtype), np.dtype(dtype))
      spec = core.gemm.Grouped(recipe, None, np.dtype(dtype), dtypes, route)
      y = core.gemm.grouped_gemms(x, w, sizes, core.init_ragged_state(recipe, 4), spec)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  # The loss's value keeps the forward GEMM (jax.grad alone drops it: its output is unused).
  public = jax.jit(
    jax.value_and_grad(
      lambda x, w: jnp.sum(core.ragged_dot(x, w, sizes, recipe=recipe)), argnums=(0, 1)
    )
  )
  assert public.lower(x, w).as_text().count("te_adapters_grouped_block_gemm") == 3
  native = step("native")
  assert native.lower(x, w).as_text().count("te_adapters_grouped_block_gemm") == 3
  (_, y), (dx, dw) = native(x, w)
  (_, ey), (edx, edw) = step(None)(x, w)
  assert y.dtype == dx.dtype == dw.dtype == dtype
  rows = int(SIZES.sum())
  assert np.all(np.asarray(y[rows:]) == 0) and np.all(np.asarray(dx[rows:]) == 0)
  assert np.all(np.asarray(dw[1]) == 0)  # the empty group
  tol = TOL[dtype]
  assert _norm_err(y[:rows], np.asarray(ey[:rows], np.float64)) < tol
  assert _norm_err(dx[:rows], np.asarray(edx[:rows], np.float64)) < tol
  for g in (0, 2, 3):
    assert _norm_err(dw[g], np.asarray(edw[g], np.float64)) < tol, f"group {g}"
  # Against the exact product: E4M3 (or E5M2 gradients) blocks, a few % normwise.
  x64, w64, d64 = (np.asarray(t, np.float64) for t in (x, w, dy))
  bound = 0.1 if recipe.fp8_format == ta.Format.HYBRID else 0.05
  for g, (s, n) in enumerate(zip(_starts(SIZES), SIZES, strict=True)):
    if n:
      assert _norm_err(y[s : s + n], x64[s : s + n] @ w64[g]) < 0.05, f"y group {g}"
      assert _norm_err(dx[s : s + n], d64[s : s + n] @ w64[g].T) < bound, f"dx group {g}"
      assert _norm_err(dw[g], x64[s : s + n].T @ d64[s : s + n]) < bound, f"dw group {g}"
