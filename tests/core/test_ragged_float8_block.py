"""core.ragged_dot under Float8BlockScaling: 1x128 blocks of x and the gradient that never cross
a group, 128x128 tiles of each expert's kernel, against a float64 product of the same quantized
values (each group quantized on its own with ``core.quantize``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import kernels
from tests.core.test_ragged import reference

# The per-group reference helpers of MXFP8's grouped GEMM serve any block recipe.
from tests.core.test_ragged_mxfp8 import alone, group_scaled, qdq, train_step

BLOCK = 128
RECIPE = ta.Float8BlockScaling()  # x and the gradient 1x128, the kernel 128x128 (TE's default)
# Against float64 products of the same quantized values: the emulated GEMMs sum in float32; on
# a Hopper GPU with the extension's grouped GEMM the FP8 tensor cores keep their own sums within
# each 128-wide slice (tests/core/test_grouped_block_gpu.py bounds that kernel alone).
TOL = 3e-4 if kernels.block_available() else 1e-5


def block_reference(x, w, dy, sizes, recipe=RECIPE):
  """Forward, dgrad and wgrad with every group quantized on its own, in float64."""
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  rows = -(-len(x) // BLOCK) * BLOCK
  ends = np.cumsum(sizes)
  y, dx, dw = np.zeros((len(x), w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
  for g, (s, e) in enumerate(zip(ends - sizes, ends, strict=True)):
    if s == e:
      continue
    x_g, dy_g = alone(x[s:e], rows), alone(dy[s:e], rows)
    # The kernel's 128x128 tiles are the same in either orientation.
    w_q = qdq(w[g], recipe, "kernel", (0, 1))
    y[s:e] = (qdq(x_g, recipe, "x", 1) @ w_q)[: e - s]
    dx[s:e] = (qdq(dy_g, recipe, "grad", 1) @ w_q.T)[: e - s]
    dw[g] = qdq(x_g, recipe, "x", 0).T @ qdq(dy_g, recipe, "grad", 0)
  return y, dx, dw


def test_forward_and_gradients_equal_the_per_group_reference(rel):
  rng = np.random.default_rng(20)
  sizes = np.array([37, 0, 150, 21], np.int32)  # an empty group; rows 208..255 in no group
  g, m, k, n, used = len(sizes), 256, 256, 128, int(sizes.sum())
  # Groups 2**8 apart: a block of rows straddling two groups would flush the smaller one.
  x = group_scaled(rng, (m, k), sizes, [8, 0, -8, 4])
  dy = group_scaled(rng, (m, n), sizes, [-6, 0, 6, 0])
  x[used:], dy[used:] = 1e30, -1e30  # rows past the groups must reach nothing
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  w[-1] *= 2.0**-10

  y, (dx, dw) = jax.tree.map(np.asarray, train_step(x, w, jnp.asarray(sizes), dy, RECIPE))

  assert y.dtype == dx.dtype == dw.dtype == np.float32
  want = block_reference(x, w, dy, sizes)
  ends = np.cumsum(sizes)
  for i, (s, e) in enumerate(zip(ends - sizes, ends, strict=True)):
    if s == e:
      np.testing.assert_array_equal(dw[i], 0.0)  # the empty group's expert
      continue
    for got, ref, rows in zip((y, dx, dw), want, (slice(s, e), slice(s, e), i), strict=True):
      assert rel(got[rows], ref[rows]) < TOL, (i, rel(got[rows], ref[rows]))
  np.testing.assert_array_equal(y[used:], 0.0)
  np.testing.assert_array_equal(dx[used:], 0.0)
  # Against the exact product: FP8's error (E5M2 gradients), not O(1) and not none.
  exact = reference(x[:used], w, dy[:used], sizes)
  for got, ref, bound in zip((y[:used], dx[:used], dw), exact, (0.05, 0.1, 0.1), strict=True):
    assert 0.01 < rel(got, ref) < bound, rel(got, ref)


def test_sizes_and_tiles_it_cannot_take_are_clear_errors():
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  gs = jnp.array([16, 16], jnp.int32)
  fwd = lambda x, w, recipe=RECIPE: core.ragged_dot(x, w, gs, recipe=recipe)
  with pytest.raises(ValueError, match=r"contracting size K is 64, which is not a multiple of 128"):
    jax.eval_shape(fwd, f32(32, 64), f32(2, 64, 128))
  # The kernel's 128x128 tiles cover N in the forward GEMM already.
  with pytest.raises(ValueError, match=r"N \(rhs dim 2\) is 64.*128x128 tiles"):
    jax.eval_shape(fwd, f32(32, 128), f32(2, 128, 64))
  one_d = ta.Float8BlockScaling(w_block_scaling_dim=1)
  assert jax.eval_shape(
    functools.partial(fwd, recipe=one_d), f32(40, 128), f32(2, 128, 64)
  ).shape == (40, 64)
  tiled_x = ta.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
  with pytest.raises(NotImplementedError, match=r"x in 128x128 tiles.*cross"):
    core.ragged_dot(jnp.ones((32, 128)), jnp.ones((2, 128, 128)), gs, recipe=tiled_x)


def test_nnx_expert_layer_trains_with_it_as_the_core_computes():
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")
  from te_adapters.nnx import GroupedLinear

  rng = np.random.default_rng(3)
  sizes = jnp.array([100, 0, 28], jnp.int32)
  x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
  layer = GroupedLinear(3, 128, 256, recipe=RECIPE, rngs=nnx.Rngs(0))
  w0 = layer.kernel[...]
  optimizer = nnx.Optimizer(layer, optax.sgd(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(layer, optimizer):
    def loss(layer):
      return jnp.vdot(layer(x, sizes), dy)

    value, grads = nnx.value_and_grad(loss)(layer)
    optimizer.update(layer, grads)
    return value

  value = step(layer, optimizer)
  y, (_, dw) = train_step(x, w0, sizes, dy, RECIPE)
  np.testing.assert_allclose(float(value), float(jnp.vdot(y, dy)), rtol=1e-6)
  np.testing.assert_allclose(
    np.asarray(layer.kernel[...]), np.asarray(w0 - 1e-2 * dw), rtol=1e-6, atol=1e-7
  )
  np.testing.assert_array_equal(np.asarray(layer.kernel[...])[1], np.asarray(w0)[1])  # no tokens


def _block_cast_stand_in(calls):
  """The extension's CUDA block cast (kernels.block_cast_call) made of the pure-JAX quantization,
  which it equals bit for bit on a GPU (tests/core/test_block_gpu.py); records what it is asked:
  the shape of the rows it quantizes (those of ``source_rows`` where given), the copies, tile
  mode and whether it gathered the rows."""

  def cast(x, q_dtype, *, rowwise, colwise, tile, power_2, source_rows=None):
    if source_rows is not None:
      valid = (source_rows >= 0)[:, None]
      x = jnp.where(valid, x[..., jnp.maximum(source_rows, 0), :], jnp.zeros((), x.dtype))
    calls.append((x.shape, rowwise, colwise, tile, source_rows is not None))
    block = (BLOCK, BLOCK) if tile else (BLOCK,)
    spec = core.formats.OperandSpec("float8_block", block, np.dtype(q_dtype), False, False, power_2)
    q = core.formats.quantize_trailing(x, spec)
    q_t = core.formats.quantize_trailing(jnp.swapaxes(x, -1, -2), spec)
    empty_q, empty_s = jnp.zeros((0,), q_dtype), jnp.zeros((0,), jnp.float32)
    return (
      q.data if rowwise else empty_q,
      q.scale_inv if rowwise else empty_s,
      q_t.data if colwise else empty_q,
      q_t.scale_inv if colwise and not tile else empty_s,
      q.amax,
    )

  return cast


@pytest.mark.parametrize("fmt", [ta.Format.E4M3, ta.Format.HYBRID], ids=str)
def test_grouped_copies_come_from_the_block_cast_where_it_runs(monkeypatch, fmt):
  """Where the extension's block cast runs (a GPU), the grouped quantization asks it for x's and
  the gradient's rows (rows in no group zeroed) and padded columns, one copy per call, each
  gathering its rows from the unpadded operand as it reads, and for both tiled copies of the
  kernels in one call; each copy equals, bit for bit, the pure-JAX one the CPU makes. Rows that
  are not a multiple of 128 keep the pure-JAX quantization."""
  recipe = ta.Float8BlockScaling(fp8_format=fmt)
  grouped = core.formats.format_of(recipe).grouped
  rng = np.random.default_rng(5)
  sizes = jnp.asarray([100, 0, 120, 20], jnp.int32)  # 240 rows in groups, 16 past them
  scale = np.exp2(rng.integers(-6, 7, size=(256, 1)))
  operands = {
    "x": jnp.asarray(rng.standard_normal((256, 256)) * scale, jnp.bfloat16),
    "grad": jnp.asarray(rng.standard_normal((256, 384)) * scale, jnp.bfloat16),
    "kernel": jnp.asarray(rng.standard_normal((4, 256, 384)), jnp.bfloat16),
  }

  def copies():
    out = {}
    for role, x in operands.items():
      request = functools.partial(core.formats.GroupedRequest, role=role, recipe=recipe)
      q = jax.jit(lambda x, r=request: grouped.quantize(r(x, group_sizes=sizes)))(x)
      out[role] = (q.rows, q.cols)
    return out

  want = copies()
  calls = []
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(kernels, "registered", lambda target: True)
  monkeypatch.setattr(kernels, "single_device", lambda x: True)  # the test runs on 8 CPUs
  monkeypatch.setattr(kernels, "block_cast_call", _block_cast_stand_in(calls))
  got = copies()
  padded = BLOCK * ((256 + (BLOCK - 1) * 4) // BLOCK)  # group_padding's static width
  assert calls == [
    ((1, 256, 256), True, False, False, True),
    ((1, padded, 256), False, True, False, True),
    ((1, 256, 384), True, False, False, True),
    ((1, padded, 384), False, True, False, True),
    ((4, 256, 384), True, True, True, False),
  ]
  for role in operands:
    for w, g in zip(want[role], got[role], strict=True):
      assert g.data.shape == w.data.shape and g.scale_inv.shape == w.scale_inv.shape, role
      bits = [np.asarray(t.data).view(np.uint8) for t in (g, w)]
      np.testing.assert_array_equal(*bits)
      np.testing.assert_array_equal(np.asarray(g.scale_inv), np.asarray(w.scale_inv))
  calls.clear()
  odd = core.formats.GroupedRequest(operands["x"][:200], "x", recipe, sizes)
  grouped.quantize(odd)
  # The rows (200) by pure JAX; the padded columns are 128 * ((200 + 127 * 4) // 128) wide.
  assert calls == [((1, 640, 256), False, True, False, True)]
