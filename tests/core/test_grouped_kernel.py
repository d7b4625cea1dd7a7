"""The layouts the native grouped GEMM reads (pure JAX, any platform), and that ``ragged_dot``
keeps XLA's path where the kernel is not built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import _grouped_kernel


def test_padded_columns_places_each_group_at_a_multiple_of_16():
  sizes = np.array([5, 0, 16, 21], np.int32)  # 42 rows in groups, 3 past them
  q = jnp.arange(45 * 3, dtype=jnp.float32).reshape(45, 3) + 1
  cols = np.asarray(_grouped_kernel.padded_columns(q, jnp.asarray(sizes)))
  width = 48 + 16 * 4
  assert cols.shape == (3, width)
  # Pads: 16 (5 rounded up), 16 (empty groups still take 16), 16, 32.
  starts, rows = [0, 16, 32, 48], [0, 5, 5, 21]
  expected = np.zeros((3, width), np.float32)
  for g, (start, row) in enumerate(zip(starts, rows, strict=True)):
    expected[:, start:start + sizes[g]] = np.asarray(q)[row:row + sizes[g]].T
  np.testing.assert_array_equal(cols, expected)


def test_clamped_sizes_follow_the_rows():
  sizes = jnp.array([4, -2, 9, 6], jnp.int32)
  np.testing.assert_array_equal(_grouped_kernel.clamped_sizes(sizes, 10), [4, 0, 6, 0])


def test_ragged_dot_keeps_the_xla_path_without_the_kernel():
  if _grouped_kernel.available():
    pytest.skip("the kernel is built here: test_grouped_kernel_gpu.py covers this device")
  x, w = jnp.ones((32, 16)), jnp.ones((2, 16, 16))
  sizes = jnp.array([8, 16], jnp.int32)
  recipe = ta.Float8CurrentScaling()
  assert _grouped_kernel.refusal(x, w, recipe, (jnp.float32,) * 3) is not None
  f = jax.jit(jax.grad(lambda x, w: core.ragged_dot(x, w, sizes, recipe=recipe).sum(), (0, 1)))
  assert "te_adapters_grouped_gemm" not in f.lower(x, w).as_text()
