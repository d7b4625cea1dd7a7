"""On a GPU with FP8 GEMMs: every recipe and adapter compiles to cuBLASLt FP8 GEMMs, and the
device's numerics match float64; the default size threshold keeps small GEMMs in bf16. Skipped
elsewhere."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters import linen as ta_linen

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

RECIPES = [
  ta.Float8CurrentScaling(),
  ta.DelayedScaling(amax_history_len=16),
  ta.Float8CurrentScaling(fp8_format=ta.Format.E4M3),
]
DN = (((1,), (0,)), ((), ()))


def _data(m, k, n, dtype=jnp.bfloat16):
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  return (
    jax.random.normal(kx, (m, k)).astype(dtype),
    jax.random.normal(kw, (k, n)).astype(dtype),
    jax.random.normal(kd, (m, n)).astype(dtype),
  )


def _train_core(recipe, x, w, dy, **kwargs):
  """Three fwd+bwd steps of the core's dot_general, threading the state, after checking that the
  compiled step has three FP8 GEMMs and no other. Returns the compiled HLO and y, dx, dw."""
  state = core.init_state(recipe)

  def loss(x, w, state, dy):
    y = core.dot_general(x, w, DN, recipe=recipe, state=state or None, threshold=None, **kwargs)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  hlo = step.lower(x, w, state, dy).compile().as_text()
  assert inspect.count_fp8_gemms(hlo) == (3, 0), inspect.hlo_dot_operand_types(hlo)
  for _ in range(3):
    (_, y), (dx, dw, new_state) = step(x, w, state, dy)
    state = core.updated_state(state, new_state) if state else state
  return hlo, y, dx, dw


def _assert_fp8_errors(rel, x, w, dy, y, dx, dw):
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  errs = rel(y, x64 @ w64), rel(dx, dy64 @ w64.T), rel(dw, x64.T @ dy64)
  assert 0.01 < errs[0] < 0.05 and 0.01 < errs[1] < 0.08 and 0.01 < errs[2] < 0.08, errs


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: type(r).__name__)
def test_float32_kernel_goes_straight_into_fp8(recipe, rel):
  # A float32 Dense kernel (K, N) with bf16 activations and a bf16 output: three FP8 GEMMs, the
  # kernel gradient in float32, and no float32 transpose of the kernel before its cast.
  x, _, dy = _data(256, 512, 384)
  w = jax.random.normal(jax.random.PRNGKey(1), (512, 384), jnp.float32)
  hlo, y, dx, dw = _train_core(recipe, x, w, dy, preferred_element_type=jnp.bfloat16)
  assert not [
    ln
    for ln in hlo.splitlines()
    if "f32[384,512]" in ln and (" transpose(" in ln or " copy(" in ln)
  ]
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  _assert_fp8_errors(rel, x, w, dy, y, dx, dw)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_core_emits_three_fp8_cublas_gemms_and_matches_float64(recipe, rel):
  x, w, dy = _data(256, 512, 384)
  _, y, dx, dw = _train_core(recipe, x, w, dy)
  _assert_fp8_errors(rel, x, w, dy, y, dx, dw)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: type(r).__name__)
def test_linen_dense_emits_fp8_gemms(recipe):
  model = nn.Dense(
    256,
    use_bias=False,
    dtype=jnp.bfloat16,
    dot_general=ta_linen.make_dot_general_cls(recipe, threshold=None)(),
  )
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 64, 512)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(2), (4, 64, 256)).astype(jnp.bfloat16)
  variables = model.init(jax.random.PRNGKey(0), x)

  def loss(v, x, dy):
    return jnp.sum(model.apply(v, x).astype(jnp.float32) * dy.astype(jnp.float32))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))  # dgrad too
  hlo = step.lower(variables, x, dy).compile().as_text()
  assert inspect.count_fp8_gemms(hlo) == (3, 0), inspect.hlo_dot_operand_types(hlo)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: type(r).__name__)
def test_default_threshold_quantizes_large_gemms_only(recipe):
  state = core.init_state(recipe)

  def compiled_hlo(m, k, n):
    def loss(x, w, state, dy):
      y = core.dot_general(x, w, DN, recipe=recipe, state=state or None)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    shapes = [(m, k), (k, n), (m, n)]
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)
    return step.lower(x, w, state, dy).compile().as_text()

  assert core.runs_in_fp8((8192, 8192), (8192, 8192), DN)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.HighPrecisionGemmWarning)
    hlo = compiled_hlo(8192, 8192, 8192)
  assert inspect.count_fp8_gemms(hlo) == (3, 0), inspect.hlo_dot_operand_types(hlo)
  assert not core.runs_in_fp8((1024, 1024), (1024, 1024), DN)
  with pytest.warns(core.HighPrecisionGemmWarning, match="M=1024, K=1024, N=1024"):
    hlo = compiled_hlo(1024, 1024, 1024)
  fp8, other = inspect.count_fp8_gemms(hlo)
  assert fp8 == 0 and inspect.count_fp8_cublas_gemms(hlo) == 0 and other >= 3, (
    inspect.hlo_dot_operand_types(hlo)
  )
