"""MXFP8 quantization, bit for bit against an independent NumPy reference of TE's rules."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_adapters as ta
from te_adapters.core import formats

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def ref_e8m0(s: np.float32) -> int:
  """Smallest e with 2**(e-127) >= s, clamped to [0, 254]; written with frexp, not bit tricks."""
  s = np.float32(s)
  if np.isnan(s):
    return 0xFF
  if np.isinf(s):
    return 0xFE
  if s == 0:
    return 0
  m, ex = np.frexp(np.float64(s))  # s = m * 2**ex, m in [0.5, 1)
  ceil_log2 = ex - 1 if m == 0.5 else ex
  return int(min(max(ceil_log2 + 127, 0), 254))


def ref_quantize_rows(x: np.ndarray, q_dtype) -> tuple[np.ndarray, np.ndarray]:
  """1x32 blocks along the last axis of a 2-D float32 array: (data as float32, E8M0 bytes)."""
  fp8_max = np.float32(ml_dtypes.finfo(q_dtype).max)
  rows, cols = x.shape
  blocks = x.reshape(rows, cols // 32, 32)
  amax = np.abs(blocks).max(axis=-1)
  e = np.vectorize(lambda a: ref_e8m0(np.float32(a) / fp8_max))(amax).astype(np.int64)
  scale = np.ldexp(np.float64(1.0), e - 127)[..., None]
  q = np.clip(blocks.astype(np.float64) / scale, -fp8_max, fp8_max).astype(np.float32)
  return q.astype(q_dtype).astype(np.float32).reshape(rows, cols), e.astype(np.uint8)


def _bytes(scale_inv) -> np.ndarray:
  return np.asarray(jax.lax.bitcast_convert_type(scale_inv, jnp.uint8))


def block_varied(seed, shape, spread=12):
  """N(0,1) data whose 32-blocks along the last axis differ in magnitude by up to 2**spread."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  exps = rng.integers(-spread, spread + 1, shape[:-1] + (shape[-1] // 32, 1))
  return (x.reshape(*shape[:-1], -1, 32) * 2.0**exps).reshape(shape).astype(np.float32)


@functools.cache
def _jit_quantize(recipe, role, axis):
  return jax.jit(lambda x: ta.core.quantize(x, recipe=recipe, role=role, axis=axis))


_dequantize = jax.jit(ta.dequantize)


# The examples of the reference spec: s = 1 -> 127, 1 + ulp -> 128, 2**-127 (subnormal,
# mantissa 0x400000) -> 0, 2**-126 -> 1, 1.5 * 2**127 -> 254 (no round up at 254).
E8M0_CASES = [
  (1.0, 127),
  (float(np.nextafter(np.float32(1), np.float32(2))), 128),
  (2.0**-127, 0),
  (2.0**-126, 1),
  (1.5 * 2.0**127, 0xFE),
  (0.0, 0),
  (float(np.inf), 0xFE),
  (float(np.nan), 0xFF),
  (0.75 * 2.0**-126, 1),  # subnormal above 2**-127: rounds up to 2**-126
  (2.0**-128, 0),
  (3.0, 129),
  (2.0**100, 227),
]


def test_e8m0_round_up_cases():
  s = np.array([c[0] for c in E8M0_CASES], np.float32)
  want = np.array([c[1] for c in E8M0_CASES], np.uint8)
  np.testing.assert_array_equal(np.asarray(jax.jit(formats.e8m0_from_scale)(s)), want)
  np.testing.assert_array_equal([ref_e8m0(v) for v in s], want)


def test_block_exponent_through_quantize_including_tiny_blocks():
  # One 32-block per row; block amax = 448 * s, so the exponent is that of s. The tiny rows
  # divide into subnormal scales, which XLA flushes to zero; the result must not change.
  amaxes = np.array(
    [448.0, 449.0, 448.0 * 2.0**-127, 448.0 * 1.5 * 2.0**-127, 448.0 * 2.0**-128, 0.0, 3e-30],
    np.float32,
  )
  x = np.zeros((len(amaxes), 32), np.float32)
  x[:, 3] = amaxes
  x[:, 4] = -amaxes / 3
  t = _jit_quantize(ta.MXFP8BlockScaling(), "x", None)(x)
  want = [ref_e8m0(a / np.float32(448)) for a in amaxes]
  assert want[:5] == [127, 128, 0, 1, 0]
  np.testing.assert_array_equal(_bytes(t.scale_inv)[:, 0], want)
  # The largest element of each nonzero block lands in (224, 448] after scaling (224 after
  # rounding), never saturated and never a binade lower.
  data = np.asarray(t.data, np.float32)[:, 3]
  assert np.all((data[amaxes > 0] >= 224) & (data[amaxes > 0] <= 448)), data
  assert data[amaxes == 0] == 0


@pytest.mark.parametrize("fmt,role", [(ta.Format.E4M3, "x"), (ta.Format.HYBRID, "grad")])
def test_quantize_rowwise_bitwise(fmt, role):
  recipe = ta.MXFP8BlockScaling(fp8_format=fmt)
  q_dtype = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
  x = block_varied(0, (48, 128))
  t = _jit_quantize(recipe, role, None)(x)
  want_data, want_e = ref_quantize_rows(x, q_dtype)
  assert t.data.dtype == q_dtype and t.scaling_mode == "mxfp8"
  assert t.scale_inv.dtype == jnp.float8_e8m0fnu and t.scale_inv.shape == (48, 4)
  np.testing.assert_array_equal(np.asarray(t.data, np.float32), want_data)
  np.testing.assert_array_equal(_bytes(t.scale_inv), want_e)
  np.testing.assert_array_equal(np.asarray(t.amax), [np.abs(x).max()])


def test_quantize_colwise_is_its_own_quantization():
  """Blocks along axis 0 equal the rowwise quantization of the transpose (not a transposed copy)."""
  xt = block_varied(1, (64, 64))  # blocks differ along xt's rows
  x = xt.T.copy()
  t = _jit_quantize(ta.MXFP8BlockScaling(), "x", 0)(x)
  want_data, want_e = ref_quantize_rows(xt, E4M3)
  assert t.data.shape == x.shape and t.scale_inv.shape == (2, 64)
  np.testing.assert_array_equal(np.asarray(t.data, np.float32), want_data.T)
  np.testing.assert_array_equal(_bytes(t.scale_inv), want_e.T)
  rowwise = _jit_quantize(ta.MXFP8BlockScaling(), "x", None)(x)
  assert not np.array_equal(np.asarray(rowwise.data, np.float32), want_data.T)


def test_dequantize_and_round_trip():
  recipe = ta.MXFP8BlockScaling()
  x = block_varied(2, (32, 96))
  q = _jit_quantize(recipe, "x", None)
  t = q(x)
  d = np.asarray(_dequantize(t))
  want_data, want_e = ref_quantize_rows(x, E4M3)
  np.testing.assert_array_equal(
    d, want_data * np.repeat(np.ldexp(1.0, want_e.astype(int) - 127), 32, axis=1)
  )
  # Quantizing the dequantized values gives the same values back (the grid is closed).
  np.testing.assert_array_equal(np.asarray(_dequantize(q(d))), d)
  # Per-element error of E4M3 is at most 2**-4 relative to the element, or a subnormal step.
  step = np.repeat(np.ldexp(1.0, want_e.astype(int) - 127 - 9), 32, axis=1)
  assert np.all(np.abs(d - x) <= np.maximum(np.abs(x) * 2.0**-4, step / 2) * (1 + 1e-6))


def test_nan_block_is_marked_and_isolated():
  x = block_varied(3, (2, 64))
  x[0, 40] = np.nan
  t = _jit_quantize(ta.MXFP8BlockScaling(), "x", None)(x)
  e = _bytes(t.scale_inv)
  assert e[0, 1] == 0xFF
  _, want_e = ref_quantize_rows(np.nan_to_num(x), E4M3)
  assert e[0, 0] == want_e[0, 0] and np.array_equal(e[1], want_e[1])
  assert np.isnan(np.asarray(_dequantize(t))[0, 32:]).all()


def test_shape_errors_name_the_dimension():
  # Shape errors come at trace time; eval_shape traces without compiling.
  dn = (((1,), (0,)), ((), ()))
  recipe = ta.MXFP8BlockScaling()
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  fwd = lambda x, w: ta.core.dot_general(x, w, dn, threshold=None, recipe=recipe)
  with pytest.raises(ValueError, match=r"contracting size K .* is 48, which is not a multiple of"):
    jax.eval_shape(fwd, f32(32, 48), f32(48, 32))
  # Forward-only (inference) needs only K; training also blocks along M and N.
  assert jax.eval_shape(fwd, f32(5, 32), f32(32, 7)).shape == (5, 7)
  grad = jax.grad(lambda x, w: fwd(x, w).sum(), argnums=(0, 1))
  with pytest.raises(ValueError, match=r"lhs free size M \(lhs dims \(0,\)\) is 5.*wgrad"):
    jax.eval_shape(grad, f32(5, 32), f32(32, 32))
  with pytest.raises(ValueError, match=r"rhs free size N \(rhs dims \(1,\)\) is 7.*dgrad"):
    jax.eval_shape(grad, f32(32, 32), f32(32, 7))
  with pytest.raises(ValueError, match="axis 1 .* size 48, which is not a multiple of the block"):
    jax.eval_shape(lambda x: ta.core.quantize(x, recipe=recipe), f32(4, 48))


def test_recipe_fields_and_errors():
  r = ta.MXFP8BlockScaling()
  assert (r.margin, r.fp8_format) == (0, ta.Format.E4M3)
  assert r.fwd_dtype == E4M3 and r.bwd_dtype == E4M3
  assert ta.MXFP8BlockScaling(fp8_format=ta.Format.HYBRID).bwd_dtype == E5M2
  assert not r.stateful and r.block_scaled and not r.uses_rng
  assert ta.core.init_state(r) == {} and hash(r) == hash(ta.MXFP8BlockScaling())
  with pytest.raises(ValueError, match="E5M2"):
    ta.MXFP8BlockScaling(fp8_format=ta.Format.E5M2)
  with pytest.raises(ValueError, match="margin"):
    ta.MXFP8BlockScaling(margin=2)
  x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  with pytest.raises(ValueError, match="rng was given"):
    jax.eval_shape(
      lambda x: ta.core.dot_general(
        x, x, (((1,), (0,)), ((), ())), threshold=None, recipe=r, rng=jax.random.key(0)
      ),
      x,
    )
  with pytest.raises(ValueError, match="does not match"):
    jax.eval_shape(lambda x: ta.core.quantize(x, jnp.float8_e5m2, recipe=r), x)
  with pytest.raises(ValueError, match="computes its block scales"):
    jax.eval_shape(lambda x: ta.core.quantize(x, recipe=r, scale=jnp.ones(1)), x)
