"""The extension's per-tensor FP8 GEMM (cuBLASLt, both scales in the epilogue) on a Hopper GPU:
one rounding of the exact product, the recipe's accumulation per GEMM, and the XLA fallback."""

import re

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
    jax.default_backend() != "gpu" or not kernels.cublas_gemm_available(),
    reason="needs a Hopper GPU and the extension's CUDA part",
  ),
]

DN = (((1,), (0,)), ((), ()))


def _step(recipe, x, w, dy, config=None):
  state = core.init_state(recipe) or None

  def loss(x, w):
    y = core.dot_general(x, w, DN, recipe=recipe, state=state, threshold=None, config=config)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _data(m, k, n, seed=0):
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
  # Non-power-of-two amaxes, so the scales are not powers of two either.
  x = (3.3 * jax.random.normal(kx, (m, k))).astype(jnp.bfloat16)
  w = (0.07 * jax.random.normal(kw, (k, n))).astype(jnp.bfloat16)
  return x, w, jax.random.normal(kd, (m, n)).astype(jnp.bfloat16)


def test_forward_is_the_exact_product_rounded_once(monkeypatch):
  # Operands of +-amax and 0 quantize to +-448 and 0, so every sum of K=64 products is an
  # integer multiple of 448**2 that any accumulator holds exactly; the scales (amax / 448) are
  # not powers of two. The output must then be the exact product, scaled, rounded once to bf16.
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(5), 3)
  x = (1.3 * jax.random.randint(kx, (256, 64), -1, 2)).astype(jnp.bfloat16)
  w = (0.7 * jax.random.randint(kw, (64, 384), -1, 2)).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (256, 384)).astype(jnp.bfloat16)
  recipe = ta.Float8CurrentScaling(fp8_format=ta.Format.E4M3)
  step = _step(recipe, x, w, dy)
  hlo = step.lower(x, w).compile().as_text()
  assert hlo.count('custom_call_target="te_adapters_block_gemm"') == 3, hlo
  (_, y), _ = step(x, w)
  qx = core.quantize(x, recipe=recipe, role="x")
  qw = core.quantize(w, recipe=recipe, role="kernel")
  assert set(np.unique(np.asarray(qx.data, np.float32))) == {-448.0, 0.0, 448.0}
  sums = np.asarray(qx.data, np.float64) @ np.asarray(qw.data, np.float64)
  exact = sums * np.float64(qx.scale_inv.reshape(-1)[0]) * np.float64(qw.scale_inv.reshape(-1)[0])
  bf16 = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16), np.float64)
  ref = bf16(exact)
  # cuBLASLt multiplies the sums by the two float32 scales in float32: leave out the outputs
  # that those two roundings (2**-23 of the value) could move across a bf16 rounding boundary.
  safe = (bf16(exact * (1 + 2.0**-21)) == ref) & (bf16(exact * (1 - 2.0**-21)) == ref)
  assert safe.mean() > 0.99, safe.mean()
  got = np.asarray(y, np.float64)
  assert np.array_equal(got[safe], ref[safe]), np.mean(got[safe] == ref[safe])
  # The XLA path rounds the GEMM's bf16 output a second time after scaling it (on CPU 11% of
  # these outputs then differ from the correctly rounded product).
  (_, y_xla), _ = _step(recipe, x, w, dy, ta.GemmConfig(fp8_gemm="xla"))(x, w)
  assert np.mean(np.asarray(y_xla, np.float64)[safe] == ref[safe]) < 0.99


def test_each_gemm_gets_the_recipes_accumulation():
  x, w, dy = _data(256, 512, 384)
  fast = ta.MMParams(use_split_accumulator=False)
  for recipe, expected in [
    (ta.Float8CurrentScaling(), [0, 0, 1]),
    (ta.DelayedScaling(fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast), [1, 1, 1]),
  ]:
    hlo = _step(recipe, x, w, dy).lower(x, w).compile().as_text()
    flags = sorted(int(v) for v in re.findall(r"fast_accum\s*=\s*(\d)", hlo))
    assert flags == expected, re.findall(r"fast_accum[^,}]*", hlo)


def test_matches_the_xla_formulation(rel):
  x, w, dy = _data(512, 1024, 768, seed=3)
  recipe = ta.DelayedScaling(amax_history_len=4)
  state = core.init_state(recipe)

  def run(config=None):
    def loss(x, w, state):
      y = core.dot_general(x, w, DN, recipe=recipe, state=state, threshold=None, config=config)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    s, outs = state, None
    for _ in range(3):
      outs = step(x, w, s)
      s = core.updated_state(s, outs[1][2])
    return outs[0][1], outs[1][0], outs[1][1], s

  cublas = run()
  xla = run(ta.GemmConfig(fp8_gemm="xla"))
  # The same quantized operands and state; the outputs differ by the XLA path's second rounding.
  for a, b in zip(cublas[:3], xla[:3], strict=True):
    assert rel(a, b) < 4e-3
  for k in state:
    np.testing.assert_array_equal(cublas[3][k], xla[3][k])


def test_native_choice_refuses_what_it_cannot_run():
  native = ta.GemmConfig(fp8_gemm="native")
  x, w, dy = _data(200, 512, 384)  # M = 200 is not a multiple of 16
  with pytest.raises(RuntimeError, match="multiples of 16"):
    _step(ta.Float8CurrentScaling(), x, w, dy, native)(x, w)


@pytest.mark.parametrize(
  "recipe", [ta.DelayedScaling(), ta.Float8CurrentScaling()], ids=["delayed", "current"]
)
def test_a_non_finite_operand_reaches_the_output_of_the_cublas_gemm(recipe):
  """The extension's cast saturates an infinity as TE's does; the NaN inverse scale of the
  operand whose amax is not finite (GemmConfig.non_finite="propagate") makes the cuBLASLt GEMM's
  epilogue write NaN, in the forward GEMM and both gradient GEMMs. "saturate" stays finite."""
  x, w, dy = _data(256, 512, 384, seed=4)
  x = x.at[3, 5].set(jnp.inf)
  step = _step(recipe, x, w, dy)
  hlo = step.lower(x, w).compile().as_text()
  assert hlo.count('custom_call_target="te_adapters_block_gemm"') == 3, hlo
  (_, y), (gx, gw) = step(x, w)
  assert np.isnan(np.asarray(y, np.float32)).all()
  assert np.isnan(np.asarray(gw, np.float32)).all()  # wgrad reads x's copy
  (_, y), (gx, gw) = _step(recipe, x, w, dy, ta.GemmConfig(non_finite="saturate"))(x, w)
  assert np.isfinite(np.asarray(y, np.float32)).all()
  dy = dy.at[7, 9].set(jnp.nan)
  (_, y), (gx, gw) = _step(recipe, x.at[3, 5].set(1.0), w, dy)(x.at[3, 5].set(1.0), w)
  assert np.isfinite(np.asarray(y, np.float32)).all()
  assert np.isnan(np.asarray(gx, np.float32)).all() and np.isnan(np.asarray(gw, np.float32)).all()
