"""The native grouped FP8 GEMM (CUTLASS's Hopper grouped GEMM) on a Hopper GPU: each of its GEMMs
against a per-group float64 product of the same FP8 operands, with an empty group, a group
larger than a tile and rows past the groups; and ``ragged_dot`` running it under ``jit``."""

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
    jax.default_backend() != "gpu" or not kernels.available(),
    reason="needs a Hopper GPU and the extension built with TE_ADAPTERS_CUTLASS_DIR",
  ),
]

SIZES = np.array([150, 0, 37, 83], np.int32)  # 270 rows in groups, 30 past them
M, K, N = 300, 128, 96
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _fp8(key, shape, dtype, scale):
  return (scale * jax.random.normal(key, shape)).astype(dtype)


def _norm_err(actual, reference):
  actual = np.asarray(actual, np.float64)
  return np.linalg.norm(actual - reference) / np.linalg.norm(reference)


def _starts():
  return np.concatenate([[0], np.cumsum(SIZES)[:-1]])


# (sums promoted to float32 or fast, output dtype) -> normwise tolerance against float64. One
# rounding to bfloat16 is about 2e-3. The tensor cores keep their own sums for a few FP8 MMAs
# before CUTLASS promotes them to float32 (measured: 1e-4 with float32 output); fast sums lose
# more.
TOL = {
  (False, jnp.float32): 3e-4,
  (True, jnp.float32): 3e-3,
  (False, jnp.bfloat16): 4e-3,
  (True, jnp.bfloat16): 5e-3,
}


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("types", [(E4M3, E4M3), (E5M2, E4M3)])
def test_rows_gemm_matches_float64(fast, out_dtype, types):
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a = _fp8(ka, (M, K), types[0], 3.0)
  b = _fp8(kb, (len(SIZES), N, K), types[1], 2.0)
  alpha = jnp.array([0.5, 3.0, 0.013, 1.7], jnp.float32)
  y = jax.jit(functools.partial(kernels.rows_gemm, out_dtype=out_dtype, fast=fast))(
    a, b, jnp.asarray(SIZES), alpha
  )
  assert y.dtype == out_dtype and y.shape == (M, N)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ref = np.zeros((M, N))
  for g, (s, n) in enumerate(zip(_starts(), SIZES, strict=True)):
    ref[s : s + n] = a64[s : s + n] @ b64[g].T * float(alpha[g])
  y = np.asarray(y, np.float64)
  assert np.all(y[SIZES.sum() :] == 0), "rows past the groups must be zero"
  for g, (s, n) in enumerate(zip(_starts(), SIZES, strict=True)):
    if n:
      assert _norm_err(y[s : s + n], ref[s : s + n]) < TOL[(fast, out_dtype)], f"group {g}"


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("types", [(E4M3, E4M3), (E4M3, E5M2)])
def test_wgrad_gemm_matches_float64(fast, out_dtype, types):
  kx, kg = jax.random.split(jax.random.PRNGKey(1))
  x = _fp8(kx, (M, K), types[0], 3.0)
  dy = _fp8(kg, (M, N), types[1], 2.0)
  alpha = jnp.array([0.25, 9.0, 0.031, 1.1], jnp.float32)
  dw = jax.jit(functools.partial(kernels.wgrad_gemm, out_dtype=out_dtype, fast=fast))(
    x, dy, jnp.asarray(SIZES), alpha
  )
  assert dw.dtype == out_dtype and dw.shape == (len(SIZES), K, N)
  x64, g64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  dw = np.asarray(dw, np.float64)
  for g, (s, n) in enumerate(zip(_starts(), SIZES, strict=True)):
    ref = x64[s : s + n].T @ g64[s : s + n] * float(alpha[g])
    if n == 0:
      assert np.all(dw[g] == 0), "an empty group's weight gradient must be zero"
    else:
      assert _norm_err(dw[g], ref) < TOL[(fast, out_dtype)], f"group {g}"


@pytest.mark.parametrize("dtype", [E4M3, E5M2, jnp.bfloat16])
def test_padded_columns_kernel_equals_xla(dtype):
  q = _fp8(jax.random.PRNGKey(4), (M, K), dtype, 3.0)
  sizes = jnp.asarray(SIZES)
  native = jax.jit(lambda q, s: kernels.padded_columns(q, s, native=True))(q, sizes)
  xla = jax.jit(lambda q, s: kernels.padded_columns(q, s, native=False))(q, sizes)
  assert native.shape == xla.shape and native.dtype == xla.dtype
  np.testing.assert_array_equal(np.asarray(native).view(np.uint8), np.asarray(xla).view(np.uint8))


def test_bf16_ragged_dot_matches_float64_and_lax():
  """bfloat16 operands on the native kernel: forward, dgrad and wgrad against float64 per group
  (one bfloat16 rounding of float32 sums), zeros past the groups and for the empty group, and
  lax.ragged_dot's own VJP to bfloat16 rounding."""
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(5), 3)
  x = (2.0 * jax.random.normal(kx, (M, K))).astype(jnp.bfloat16)
  w = (0.2 * jax.random.normal(kw, (len(SIZES), K, N))).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (M, N)).astype(jnp.bfloat16)
  sizes = jnp.asarray(SIZES)
  assert kernels.bf16_refusal(x, w, jnp.bfloat16) is None

  def step(f):
    def loss(x, w):
      y = f(x, w, sizes)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  native = step(kernels.bf16_ragged_dot)
  assert native.lower(x, w).as_text().count("te_adapters_grouped_gemm") == 3
  (_, y), (dx, dw) = native(x, w)
  assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  ry, rdx, rdw = _reference(x, w, dy)
  rows = int(SIZES.sum())
  assert np.all(np.asarray(y[rows:]) == 0) and np.all(np.asarray(dx[rows:]) == 0)
  assert np.all(np.asarray(dw[1]) == 0)  # the empty group
  assert _norm_err(y[:rows], ry[:rows]) < 4e-3
  assert _norm_err(dx[:rows], rdx[:rows]) < 4e-3
  for g in (0, 2, 3):
    assert _norm_err(dw[g], rdw[g]) < 4e-3, f"group {g}"
  (_, ly), (ldx, ldw) = step(jax.lax.ragged_dot)(x, w)
  for a, b in ((y, ly), (dx, ldx), (dw, ldw)):
    assert _norm_err(a, np.asarray(b, np.float64)) < 8e-3


def test_ragged_dot_without_recipe_runs_bf16_on_the_kernel():
  """``core.ragged_dot(recipe=None)`` with bfloat16 operands and result takes the native kernel
  (three grouped GEMMs in the step, the same values as ``bf16_ragged_dot``); a float32 result
  asked for keeps XLA's ragged dot."""
  kx, kw = jax.random.split(jax.random.PRNGKey(6))
  x = jax.random.normal(kx, (M, K)).astype(jnp.bfloat16)
  w = (0.2 * jax.random.normal(kw, (len(SIZES), K, N))).astype(jnp.bfloat16)
  sizes = jnp.asarray(SIZES)

  def step(f):
    return jax.jit(
      jax.value_and_grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))
    )

  ours = step(lambda x, w: core.ragged_dot(x, w, sizes, recipe=None))
  assert ours.lower(x, w).as_text().count("te_adapters_grouped_gemm") == 3
  direct = step(lambda x, w: kernels.bf16_ragged_dot(x, w, sizes))
  for a, b in zip(jax.tree.leaves(ours(x, w)), jax.tree.leaves(direct(x, w)), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  wide = step(
    lambda x, w: core.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32, recipe=None)
  )
  assert "te_adapters_grouped_gemm" not in wide.lower(x, w).as_text()


def _reference(x, w, dy):
  """Per-group float64 forward, dgrad and wgrad of the unquantized values."""
  x, w, dy = (np.asarray(t, np.float64) for t in (x, w, dy))
  y, dx, dw = np.zeros((M, N)), np.zeros((M, K)), np.zeros_like(w)
  for g, (s, n) in enumerate(zip(_starts(), SIZES, strict=True)):
    y[s : s + n] = x[s : s + n] @ w[g]
    dx[s : s + n] = dy[s : s + n] @ w[g].T
    dw[g] = x[s : s + n].T @ dy[s : s + n]
  return y, dx, dw


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling()], ids=["current", "delayed"]
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ragged_dot_runs_the_kernel(recipe, dtype):
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(2), 3)
  x = (2.3 * jax.random.normal(kx, (M, K))).astype(dtype)
  w = (0.11 * jax.random.normal(kw, (len(SIZES), K, N))).astype(dtype)
  dy = jax.random.normal(kd, (M, N)).astype(dtype)
  state = core.init_ragged_state(recipe, len(SIZES)) or None

  @jax.jit
  def step(x, w, sizes, state):
    def loss(x, w, state):
      y = core.ragged_dot(x, w, sizes, recipe=recipe, state=state)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, state)

  sizes = jnp.asarray(SIZES)
  hlo = step.lower(x, w, sizes, state).as_text()
  assert hlo.count("te_adapters_grouped_gemm") >= 3, "forward, dgrad and wgrad must be native"
  for _ in range(3):  # delayed scaling: the second and third steps use the updated scales
    (_, y), (dx, dw, new_state) = step(x, w, sizes, state)
    state = new_state
  assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
  ry, rdx, rdw = _reference(x, w, dy)
  rows = int(SIZES.sum())
  assert np.all(np.asarray(y[rows:]) == 0) and np.all(np.asarray(dx[rows:]) == 0)
  assert np.all(np.asarray(dw[1]) == 0)  # the empty group
  # E4M3 forward (two roundings of 2^-4), E5M2 gradients (2^-3): normwise errors of a few %.
  assert _norm_err(y[:rows], ry[:rows]) < 0.05
  assert _norm_err(dx[:rows], rdx[:rows]) < 0.1
  for g in (0, 2, 3):
    assert _norm_err(dw[g], rdw[g]) < 0.1, f"group {g}"


@pytest.mark.parametrize(
  "recipe",
  [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)],
  ids=["current", "delayed"],
)
def test_ragged_dot_matches_the_xla_path(recipe):
  """The kernel and XLA's ragged dot multiply the same FP8 operands: they agree to rounding. The
  native path casts the kernels in one pass (both orientations, and with delayed scaling the
  amax for the history); over three steps its recipe state equals the XLA path's exactly."""
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(3), 3)
  x = jax.random.normal(kx, (M, K), jnp.float32)
  w = 0.1 * jax.random.normal(kw, (len(SIZES), K, N), jnp.float32)
  dy = jax.random.normal(kd, (M, N), jnp.float32)
  sizes = jnp.asarray(SIZES)

  def run(native):
    def loss(x, w, state):
      f32 = np.dtype(jnp.float32)
      # The one grouped rule on the per-tensor format's native route or XLA's.
      spec = core.gemm.Grouped(recipe, None, f32, (f32, f32), "native" if native else "xla")
      y = core.gemm.grouped_gemms(x, w, sizes, state, spec)
      return jnp.sum(y * dy), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    state = core.init_ragged_state(recipe, len(SIZES))
    for i in range(3):
      (_, y), (dx, dw, new_state) = step(x * (1.0 + i), w, state)
      state = new_state
    return y, dx, dw, state

  y1, dx1, dw1, state1 = run(True)
  y0, dx0, dw0, state0 = run(False)
  for a, b in ((y1, y0), (dx1, dx0), (dw1, dw0)):
    assert _norm_err(a, np.asarray(b, np.float64)) < 5e-3
  for a, b in zip(jax.tree.leaves(state1), jax.tree.leaves(state0), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
