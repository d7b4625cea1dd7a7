"""Block-scaled recipes on an NVIDIA GPU: real FP8 GEMMs, the same quantized values as on CPU.

Skipped without a GPU. The native MXFP8/NVFP4 test also needs a Blackwell GPU (compute
capability 10.0 or newer), where ``jax.nn.scaled_matmul`` runs the GEMM in cuDNN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters.core import _block_scaled
from tests.conftest import rel_err as _rel

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]

DN = (((1,), (0,)), ((), ()))
RECIPES = [
  ta.MXFP8BlockScaling(),
  ta.Float8BlockScaling(),
  ta.NVFP4BlockScaling(disable_stochastic_rounding=True),
]


def _data(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _on_cpu(x):
  return jax.device_put(x, jax.devices("cpu")[0])




def test_float8_block_gemms_are_fp8_cublas_gemms():
  recipe = ta.Float8BlockScaling()
  x = jnp.asarray(_data((256, 512), 0), jnp.bfloat16)
  w = jnp.asarray(_data((512, 256), 1), jnp.bfloat16)
  g = jnp.asarray(_data((256, 256), 2), jnp.bfloat16)

  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: ta.core.dot_general(x, w, DN, recipe=recipe), x, w)
    return (y, *vjp(g))

  compiled = jax.jit(run).lower(x, w, g).compile()
  hlo = compiled.as_text()
  assert "__cublas$lt$matmul$f8" in hlo, "no FP8 cuBLASLt GEMM in the compiled program"
  y, dx, dw = compiled(x, w, g)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  bound = 1.15 * np.sqrt(2) * 0.0265
  assert _rel(y, x64 @ w64) < bound + 0.004  # + bf16 rounding of the output
  assert _rel(dx, g64 @ w64.T) < bound + 0.004
  assert _rel(dw, x64.T @ g64) < bound + 0.004


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("role,axis", [("x", -1), ("x", 0), ("kernel", None)])
def test_gpu_quantizes_like_cpu(recipe, role, axis):
  if role == "kernel" and isinstance(recipe, ta.MXFP8BlockScaling):
    axis = 0
  x = _data((256, 256), 3) * np.exp2(np.arange(256) % 7 - 3)[:, None].astype(np.float32)
  f = lambda x: ta.core.quantize(x, recipe=recipe, role=role, axis=axis)
  gpu = jax.jit(f)(x)
  cpu = jax.jit(f)(_on_cpu(x))
  for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_nvfp4_rht_and_stochastic_rounding_on_gpu():
  recipe = ta.NVFP4BlockScaling()
  x = _data((256, 128), 4)
  rht = lambda x: ta.core.quantize(x, recipe=recipe, role="x", axis=0, rht=True)
  gpu, cpu = jax.jit(rht)(x), jax.jit(rht)(_on_cpu(x))
  for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  sr = jax.jit(lambda x, k: ta.core.quantize(x, recipe=recipe, role="grad", rng=k).data)
  a = np.asarray(sr(x, jax.random.key(0)), np.float32)
  np.testing.assert_array_equal(a, np.asarray(sr(x, jax.random.key(0)), np.float32))
  assert not np.array_equal(a, np.asarray(sr(x, jax.random.key(1)), np.float32))


@pytest.mark.skipif(
  not _block_scaled.native_gemm_available("mxfp8"),
  reason="needs jax.nn.scaled_matmul hardware (Blackwell)",
)
@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2]], ids=["mxfp8", "nvfp4"])
def test_native_scaled_matmul_matches_emulation(recipe, monkeypatch):
  x, w = _data((256, 512), 5), _data((512, 256), 6)
  f = lambda x, w: ta.core.dot_general(x, w, DN, recipe=recipe)
  native = np.asarray(jax.jit(f)(x, w))
  assert "cudnn" in jax.jit(f).lower(x, w).compile().as_text().lower()
  monkeypatch.setenv(_block_scaled.GEMM_ENV, "emulated")
  emulated = np.asarray(jax.jit(lambda x, w: f(x, w) + 0)(x, w))
  assert _rel(native, emulated) < 1e-5
