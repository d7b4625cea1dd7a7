"""FP8 block scaling (1x128 / 128x128): scales, tiles and the per-K-slice FP8 GEMM."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_adapters as ta
from te_adapters.core.formats import _float8_block
from tests.conftest import SCALE_ULPS, assert_scales_equal

E4M3 = np.dtype(jnp.float8_e4m3fn)
DN = (((1,), (0,)), ((), ()))


F32_MAX = float(np.finfo(np.float32).max)


def ref_scale(amax, power_2, value_for_inf=F32_MAX):
  """TE's compute_scale_from_amax (epsilon 0), in NumPy float32, rounding down with frexp."""
  amax = np.float32(amax)
  if amax == 0 or not np.isfinite(amax):
    return np.float32(1.0)
  with np.errstate(over="ignore"):
    scale = np.float32(448.0) / amax
  if np.isinf(scale):
    scale = np.float32(value_for_inf)
  if power_2:
    m, e = np.frexp(scale)  # scale = m * 2**e with m in [0.5, 1)
    scale = np.float32(np.ldexp(1.0, e - 1))
  return scale


def ref_quantize(x, block_shape, power_2):
  """Blocks over the trailing axes of a 2-D array: (data as float32, scale_inv per block)."""
  br, bc = block_shape if len(block_shape) == 2 else (1, block_shape[0])
  rows, cols = x.shape
  tiles = x.reshape(rows // br, br, cols // bc, bc)
  amax = np.abs(tiles).max(axis=(1, 3))
  scale = np.vectorize(lambda a: ref_scale(a, power_2), otypes=[np.float32])(amax)
  q = np.clip(tiles * scale[:, None, :, None], -448, 448).astype(E4M3).astype(np.float32)
  return q.reshape(rows, cols), (np.float32(1) / scale)


def varied(seed, shape, block_shape, spread=10):
  """N(0,1) data whose blocks (1-D or 2-D over the trailing axes) differ in magnitude."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  br, bc = block_shape if len(block_shape) == 2 else (1, block_shape[0])
  exps = rng.integers(-spread, spread + 1, (shape[0] // br, 1, shape[1] // bc, 1))
  tiles = x.reshape(shape[0] // br, br, shape[1] // bc, bc) * 2.0**exps
  return tiles.reshape(shape).astype(np.float32)


@functools.cache
def _jit_quantize(recipe, role):
  return jax.jit(lambda x: ta.core.quantize(x, recipe=recipe, role=role))


def test_scale_rule():
  amax = np.array([448.0, 3.0, 0.0, np.inf, np.nan, 1e-37, 1000.0], np.float32)
  f = jax.jit(_float8_block.compute_scale, static_argnums=(1, 2, 3))
  pow2 = np.asarray(f(amax, 448.0, True, F32_MAX))
  exact = np.asarray(f(amax, 448.0, False, F32_MAX))
  # 448/3 = 149.3 rounds down to 128; 0, inf and NaN give 1; an overflowing 448/1e-37 becomes
  # the input dtype's largest value (and 2**127 once its mantissa is cleared).
  np.testing.assert_array_equal(pow2, [1.0, 128.0, 1.0, 1.0, 1.0, 2.0**127, 0.25])
  assert_scales_equal(
    exact, [1, np.float32(448) / np.float32(3), 1, 1, 1, F32_MAX, np.float32(0.448)]
  )
  np.testing.assert_array_equal(pow2, [ref_scale(a, True) for a in amax])
  assert_scales_equal(exact, [ref_scale(a, False) for a in amax])


@pytest.mark.parametrize("use_f32_scales", [False, True])
def test_1x128_blocks_bitwise(use_f32_scales):
  recipe = ta.Float8BlockScaling(use_f32_scales=use_f32_scales)
  x = varied(0, (16, 384), (128,))
  t = _jit_quantize(recipe, "x")(x)
  data, scale_inv = ref_quantize(x, (128,), not use_f32_scales)
  assert t.scaling_mode == "float8_block" and t.data.dtype == E4M3
  assert t.scale_inv.dtype == np.float32 and t.scale_inv.shape == (16, 3)
  np.testing.assert_array_equal(np.asarray(t.data, np.float32), data)
  # The inverse of a scale up to 1 ulp off, by a division up to 1 ulp off. Powers of two are
  # exact on every platform.
  assert_scales_equal(t.scale_inv, scale_inv, ulps=2 * SCALE_ULPS)
  if not use_f32_scales:
    np.testing.assert_array_equal(np.asarray(t.scale_inv), scale_inv)
    assert np.all(np.frexp(np.asarray(t.scale_inv))[0] == 0.5)  # powers of two


def test_128x128_tiles_have_one_scale_each():
  """Tile amaxes differ between tile rows and columns; tile (i, j) covers rows 128i..128i+127."""
  x = varied(1, (384, 256), (128, 128))
  t = _jit_quantize(ta.Float8BlockScaling(), "kernel")(x)
  data, scale_inv = ref_quantize(x, (128, 128), True)
  assert t.scale_inv.shape == (3, 2)
  assert len(np.unique(np.asarray(t.scale_inv))) > 3
  np.testing.assert_array_equal(np.asarray(t.scale_inv), scale_inv)
  np.testing.assert_array_equal(np.asarray(t.data, np.float32), data)
  d = np.asarray(jax.jit(ta.dequantize)(t))
  np.testing.assert_array_equal(d, data * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1))
  # The largest element of every tile reaches (224, 448] (power-of-two scales never saturate).
  top = np.abs(data).reshape(3, 128, 2, 128).max(axis=(1, 3))
  assert np.all((top >= 224) & (top <= 448)), top


def _gemm_parts(x_spec_dims, w_spec_dims, m, k, n, seed=2):
  x = varied(seed, (m, k), (128,) * x_spec_dims)
  w = varied(seed + 1, (n, k), (128,) * w_spec_dims)
  return x, w


def test_gemm_applies_scales_to_each_k_slice(monkeypatch):
  """The per-slice FP8 GEMM equals the float64 product of the dequantized operands."""
  recipe = ta.Float8BlockScaling()
  x, w = _gemm_parts(1, 2, 128, 512, 256)

  def gemm(x, w):
    qx = ta.core.quantize(x, recipe=recipe, role="x")
    qw = ta.core.quantize(w, recipe=recipe, role="kernel")
    out = _float8_block.gemm(
      qx.data[None], qx.scale_inv[None], (128,), qw.data[None], qw.scale_inv[None], (128, 128)
    )[0]
    return out, ta.dequantize(qx), ta.dequantize(qw)

  out, dx, dw = jax.tree.map(np.asarray, jax.jit(gemm)(x, w))
  ref = dx.astype(np.float64) @ dw.T.astype(np.float64)
  # Float32 sums on CPU; Hopper's tensor cores sum each 128-wide K block in fewer bits before
  # the block's scales promote it (1.3e-4 seen on an H100). A scale on the wrong slice is O(1).
  bound = 1e-6 if jax.default_backend() == "cpu" else 1e-3
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < bound
  # Block magnitudes differ by up to 2**20 across K slices: a scale on the wrong slice is O(1).
  assert np.linalg.norm(ref - x.astype(np.float64) @ w.T) / np.linalg.norm(ref) < 0.05
  # Forming the partial sums a few K slices at a time (large GEMMs) gives the same result.
  monkeypatch.setattr(_float8_block, "_PARTIALS_BUDGET", 128 * 256 * 2)
  chunked = np.asarray(jax.jit(gemm)(x, w)[0])
  np.testing.assert_allclose(chunked, out, rtol=1e-5, atol=1e-5 * np.abs(out).max())


def test_fp8_operands_reach_the_dot():
  """The lowered program multiplies FP8 arrays (no dequantize-then-dot pattern)."""
  # XLA's path (on Hopper the extension's cuBLASLt block-scaled GEMM replaces its dots).
  config = ta.GemmConfig(block_gemm="xla")
  recipe = ta.Float8BlockScaling()
  f = lambda x, w: ta.core.dot_general(x, w, DN, threshold=None, recipe=recipe, config=config)
  x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  text = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))).lower(x, w).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert dots and all("f8E4M3FN" in line for line in dots), dots


def test_2d_activation_tiles_train():
  """x in 128x128 tiles (w then in 1x128 blocks): the transposed tile copy feeds the wgrad."""
  recipe = ta.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
  rng = np.random.default_rng(4)
  x, w, g = (
    rng.standard_normal(s).astype(np.float32) for s in ((128, 256), (256, 128), (128, 128))
  )

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(
      lambda x, w: ta.core.dot_general(x, w, DN, threshold=None, recipe=recipe), x, w
    )
    return (y, *vjp(g))

  y, dx, dw = (np.asarray(a, np.float64) for a in run(x, w, g))
  x, w, g = (a.astype(np.float64) for a in (x, w, g))
  for out, ref in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 0.03 < err < 1.15 * np.sqrt(2) * 0.0265, err


def test_recipe_fields_and_errors():
  r = ta.Float8BlockScaling()
  assert (r.use_f32_scales, r.fp8_format) == (False, ta.Format.E4M3)
  assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
  assert r.power_2_scale and not ta.Float8BlockScaling(use_f32_scales=True).power_2_scale
  assert ta.core.init_state(r) == {} and not r.uses_rng
  with pytest.raises(ValueError, match="both 2"):
    ta.Float8BlockScaling(x_block_scaling_dim=2)
  with pytest.raises(ValueError, match="both 2"):
    ta.Float8BlockScaling(w_block_scaling_dim=1, x_block_scaling_dim=2, grad_block_scaling_dim=2)
  with pytest.raises(ValueError, match="must be 1 or 2"):
    ta.Float8BlockScaling(grad_block_scaling_dim=3)
  with pytest.raises(TypeError, match="use_f32_scales must be a bool"):
    ta.Float8BlockScaling(use_f32_scales=1)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  fwd = lambda x, w: ta.core.dot_general(x, w, DN, threshold=None, recipe=r)
  with pytest.raises(ValueError, match=r"contracting size K .* is 64, which is not a multiple"):
    jax.eval_shape(fwd, f32(128, 64), f32(64, 128))
  # The kernel's 128x128 tiles need N = 128k even for inference; M only for training.
  with pytest.raises(ValueError, match=r"rhs free size N .* is 64"):
    jax.eval_shape(fwd, f32(128, 128), f32(128, 64))
  assert jax.eval_shape(fwd, f32(8, 128), f32(128, 128)).shape == (8, 128)
  with pytest.raises(ValueError, match=r"lhs free size M .* is 8.*wgrad"):
    jax.eval_shape(jax.grad(lambda x, w: fwd(x, w).sum()), f32(8, 128), f32(128, 128))
  with pytest.raises(ValueError, match="need 2 axis"):
    jax.eval_shape(lambda w: ta.core.quantize(w, recipe=r, role="kernel", axis=0), f32(128, 128))
  assert ml_dtypes.finfo(E4M3).max == 448
