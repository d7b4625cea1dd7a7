import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_adapters import core


@pytest.mark.parametrize("q_dtype, bound", [(jnp.float8_e4m3fn, 2**-4), (jnp.float8_e5m2, 2**-3)])
@pytest.mark.parametrize("shape", [(32, 64), (2, 64, 32), (7,)])
def test_round_trip_against_float64(q_dtype, bound, shape):
  x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32) * 3
  t = core.quantize(x, q_dtype)
  assert t.data.dtype == np.dtype(q_dtype) and t.data.shape == x.shape
  x64 = np.asarray(x, np.float64)
  amax = np.abs(x64).max()
  np.testing.assert_array_equal(t.amax, [np.float32(amax)])
  np.testing.assert_allclose(t.scale_inv[0], amax / core.fp8_max(q_dtype), rtol=1e-6)
  back = np.asarray(core.dequantize(t), np.float64)
  # Relative rounding error of an FP8 value is at most half an ulp: 2**-4 (E4M3), 2**-3 (E5M2);
  # values near zero fall in subnormals, so bound relative to amax there.
  err = np.abs(back - x64) / np.maximum(np.abs(x64), amax * 2**-6)
  assert err.max() <= bound
  assert np.linalg.norm(back - x64) / np.linalg.norm(x64) > 1e-3  # really quantized


def test_given_scale_and_clipping():
  x = jnp.array([1.0, -3.0, 1000.0], jnp.float32)
  t = core.quantize(x, jnp.float8_e4m3fn, scale=jnp.float32([2.0]))
  np.testing.assert_array_equal(np.asarray(t.data, np.float32), [2.0, -6.0, 448.0])
  np.testing.assert_array_equal(t.scale_inv, [0.5])
  np.testing.assert_array_equal(core.dequantize(t), [1.0, -3.0, 224.0])


def test_zero_tensor_scale_one():
  t = core.quantize(jnp.zeros((4, 4)), jnp.float8_e4m3fn)
  np.testing.assert_array_equal(t.scale_inv, [1.0])


def test_pytree_and_jit():
  t = jax.jit(lambda x: core.quantize(x, jnp.float8_e4m3fn))(jnp.ones((4, 4), jnp.bfloat16))
  leaves = jax.tree_util.tree_leaves(t)
  assert len(leaves) == 3
  assert core.dequantize(t).dtype == jnp.bfloat16


def test_bad_inputs():
  with pytest.raises(ValueError, match="float8"):
    core.quantize(jnp.ones(4), jnp.int8)
  with pytest.raises(TypeError, match="floating"):
    core.quantize(jnp.ones(4, jnp.int32), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="one element"):
    core.quantize(jnp.ones(4), jnp.float8_e4m3fn, scale=jnp.ones(2))
  with pytest.raises(TypeError, match="ScaledTensor"):
    core.dequantize(jnp.ones(4))
