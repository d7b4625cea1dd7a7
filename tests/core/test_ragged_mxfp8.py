"""core.ragged_dot under MXFP8BlockScaling: per-group MXFP8 numerics, group boundaries, no sync.

The reference quantizes every group on its own with ``core.quantize`` (the MXFP8 quantizer of
``core.dot_general``) and multiplies in float64: forward and dgrad blocks along K and N, wgrad
blocks of 32 rows of one group (the group padded with zero rows to a multiple of 32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from tests.core.test_ragged import host_traffic, reference

E4M3 = ta.MXFP8BlockScaling()
HYBRID = ta.MXFP8BlockScaling(fp8_format=ta.Format.HYBRID)


def alone(a, rows):
  """[rows, F]: the rows of one group first, zero rows after (``rows`` a multiple of 32).

  Zero rows change no block amax, so 32-row blocks of this array are the group's blocks
  starting at its first row, its last block completed with zeros. One shape for every group
  keeps the reference's compilations few.
  """
  return np.concatenate([a, np.zeros((rows - len(a),) + a.shape[1:], a.dtype)])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(a, recipe, role, axis):
  return core.quantize(a.astype(jnp.float32), recipe=recipe, role=role, axis=axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _qdq(a, recipe, role, axis):
  return core.dequantize(_quantize(a, recipe, role, axis), jnp.float32)


def qdq(a, recipe, role, axis):
  """float64 values of ``a`` after ``core.quantize``'s MXFP8 blocks along ``axis``."""
  return np.asarray(_qdq(a, recipe, role, axis), np.float64)


def mxfp8_reference(x, w, dy, sizes, recipe):
  """Forward, dgrad and wgrad with every group quantized on its own, in float64."""
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  rows = -(-len(x) // 32) * 32
  ends = np.cumsum(sizes)
  y, dx, dw = np.zeros((len(x), w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
  for g, (s, e) in enumerate(zip(ends - sizes, ends, strict=True)):
    if s == e:
      continue
    x_g, dy_g = alone(x[s:e], rows), alone(dy[s:e], rows)
    y[s:e] = (qdq(x_g, recipe, "x", 1) @ qdq(w[g], recipe, "kernel", 0))[: e - s]
    dx[s:e] = (qdq(dy_g, recipe, "grad", 1) @ qdq(w[g], recipe, "kernel", 1).T)[: e - s]
    dw[g] = qdq(x_g, recipe, "x", 0).T @ qdq(dy_g, recipe, "grad", 0)
  return y, dx, dw


@functools.partial(jax.jit, static_argnames="recipe")
def train_step(x, w, group_sizes, dy, recipe):
  def loss(x, w):
    y = core.ragged_dot(x, w, group_sizes, recipe=recipe)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
  return y, grads


def group_scaled(rng, shape, sizes, exponents):
  """N(0,1) rows times 2**exponents[g] for group g, so that blocks mixing groups show."""
  a = rng.standard_normal(shape).astype(np.float32)
  ends = np.cumsum(sizes)
  for s, e, k in zip(ends - sizes, ends, exponents, strict=True):
    a[s:e] *= np.float32(2.0**k)
  return a


def test_forward_and_gradients_equal_the_per_group_reference(rel):
  recipe = HYBRID
  rng = np.random.default_rng(10)
  sizes = np.array([37, 0, 70, 21], np.int32)  # an empty group; rows 128..159 in no group
  g, m, k, n, used = len(sizes), 160, 64, 96, int(sizes.sum())
  # Groups 2**8 apart: a block of rows straddling two groups would flush the smaller one.
  x = group_scaled(rng, (m, k), sizes, [8, 0, -8, 4])
  dy = group_scaled(rng, (m, n), sizes, [-6, 0, 6, 0])
  x[used:], dy[used:] = 1e30, -1e30  # rows past the groups must reach nothing
  x[used + 1, 3], dy[used + 2, 5] = np.nan, np.nan
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  w[-1] *= 2.0**-10

  y, (dx, dw) = jax.tree.map(np.asarray, train_step(x, w, jnp.asarray(sizes), dy, recipe))

  assert y.dtype == dx.dtype == dw.dtype == np.float32
  want = mxfp8_reference(x, w, dy, sizes, recipe)
  # The same quantized values: only the float32 accumulation differs. Per group, so that a
  # small group's error is not hidden by a large one.
  ends = np.cumsum(sizes)
  for i, (s, e) in enumerate(zip(ends - sizes, ends, strict=True)):
    if s == e:
      np.testing.assert_array_equal(dw[i], 0.0)  # the empty group's expert
      continue
    for got, ref, rows in zip((y, dx, dw), want, (slice(s, e), slice(s, e), i), strict=True):
      assert rel(got[rows], ref[rows]) < 1e-5, (i, rel(got[rows], ref[rows]))
  np.testing.assert_array_equal(y[used:], 0.0)
  np.testing.assert_array_equal(dx[used:], 0.0)
  assert np.all(np.isfinite(dw))
  # Against the exact product: MXFP8's error (E5M2 gradients), not O(1) and not none.
  exact = reference(x[:used], w, dy[:used], sizes)
  for got, ref, bound in zip((y[:used], dx[:used], dw), exact, (0.05, 0.1, 0.1), strict=True):
    assert 0.01 < rel(got, ref) < bound, rel(got, ref)


def _numpy(t):
  """(data as float32, its dtype, E8M0 scale bytes) of a quantized tensor, in NumPy."""
  return np.asarray(t.data, np.float32), t.data.dtype, np.asarray(t.scale_inv).view(np.uint8)


def _assert_same(got, want):
  """Two ``_numpy`` triples are equal bit for bit: data, dtype and scale bytes."""
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


def test_quantized_operands_are_core_quantize_per_group():
  recipe = HYBRID  # E4M3 for x and the kernel, E5M2 for the gradient
  rng = np.random.default_rng(11)
  sizes = np.array([33, 0, 64, 5, 20], np.int32)  # sum 122 of 128 rows
  g, m, k, n = len(sizes), 128, 64, 32
  x = group_scaled(rng, (m, k), sizes, [3, 0, -5, 9, 0])
  dy = group_scaled(rng, (m, n), sizes, [-4, 0, 2, 0, 7])
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  x[122:], dy[122:] = 1e30, -1e30

  @jax.jit
  def operands(x, w, dy, sizes):
    # The copies the grouped GEMM's rule asks the format for, and the padded layout's sizes.
    grouped = core.format_of(recipe).grouped
    quantize = lambda a, role: grouped.quantize(core.formats.GroupedRequest(a, role, recipe, sizes))
    qx, qw, qg = quantize(x, "x"), quantize(w, "kernel"), quantize(dy, "grad")
    padding = core.formats.group_padding(sizes, m, 32)
    return qx.rows, qw.rows, qx.cols, qw.cols, padding.padded_sizes, qg.rows, qg.cols

  out = operands(x, w, dy, jnp.asarray(sizes))
  qx, qw, qx_t, qw_t, padded, qg, qg_t = (
    np.asarray(a) if isinstance(a, jax.Array) else _numpy(a) for a in out
  )
  np.testing.assert_array_equal(padded, [64, 0, 64, 32, 32])
  # Static size: room for 31 padding rows per group.
  assert qx_t[0].shape == (k, 32 * ((m + 31 * g) // 32)) and qg_t[0].shape[0] == n
  assert qx[1] == qx_t[1] == qw[1] == jnp.float8_e4m3fn and qg[1] == qg_t[1] == jnp.float8_e5m2

  def quantize(a, role, axis, rows=None, transpose=False):
    data, dtype, scales = _numpy(_quantize(a, recipe, role, axis))
    if rows is not None:
      data, scales = data[:rows], scales[: rows // 32]
    return (data.T, dtype, scales.T) if transpose else (data, dtype, scales)

  ends, starts = np.cumsum(sizes), np.cumsum(padded) - padded
  for i, (s, e, p) in enumerate(zip(ends - sizes, ends, starts, strict=True)):
    # Group i's rows in the padded layout ([F, P]): group i quantized on its own by core.
    cols, blocks = slice(p, p + padded[i]), slice(p // 32, (p + padded[i]) // 32)
    for (data, dtype, scales), a, role in ((qx_t, x, "x"), (qg_t, dy, "grad")):
      want = quantize(alone(a[s:e], m), role, 0, rows=padded[i], transpose=True)
      _assert_same((data[:, cols], dtype, scales[:, blocks]), want)
    # The kernel of expert i: blocks along K (forward, transposed) and along N (dgrad).
    _assert_same((qw[0][i], qw[1], qw[2][i]), quantize(w[i], "kernel", 0, transpose=True))
    _assert_same((qw_t[0][i], qw_t[1], qw_t[2][i]), quantize(w[i], "kernel", 1))
  # The padding past the last group: zero data, the smallest E8M0 scale.
  end = starts[-1] + padded[-1]
  for data, _, scales in (qx_t, qg_t):
    np.testing.assert_array_equal(data[:, end:], 0.0)
    np.testing.assert_array_equal(scales[:, end // 32 :], 0)
  # Rows: blocks along the features, row by row; rows in no group are zeros.
  x[122:], dy[122:] = 0.0, 0.0
  _assert_same(qx, quantize(x, "x", 1))
  _assert_same(qg, quantize(dy, "grad", 1))


def test_on_device_router_under_jit_without_host_transfer(rel):
  """Tokens routed on the device; the routed group sizes are not multiples of 32."""
  recipe = E4M3
  rng = np.random.default_rng(12)
  g, m, k, n = 4, 96, 32, 64
  router, w, x, dy = (
    rng.standard_normal(s).astype(np.float32) for s in ((k, g), (g, k, n), (m, k), (m, n))
  )
  # Each expert's tokens (and their gradients, in sorted order) 2**8 apart in size from the
  # next expert's: blocks of rows that are not one group's would quantize them otherwise.
  experts = np.argmax(x @ router, axis=-1)  # positive row factors do not change the routing
  x *= 2.0 ** np.array([8, -8, 0, 8])[experts][:, None]
  dy *= 2.0 ** np.array([-8, 0, 8, -8])[np.sort(experts)][:, None]

  def routed(router, w, x, dy):
    experts = jnp.argmax(x @ router, axis=-1)
    order = jnp.argsort(experts)
    sizes = jnp.bincount(experts, length=g).astype(jnp.int32)
    y, grads = train_step.__wrapped__(x[order], w, sizes, dy, recipe)
    return y, grads, sizes, order

  prims, ops, compiled = host_traffic(routed, router, w, x, dy)
  assert prims == [] and ops == []
  y, (dx, dw), sizes, order = jax.tree.map(np.asarray, compiled(router, w, x, dy))
  assert np.any(sizes % 32) and sizes.sum() == m, sizes
  want = mxfp8_reference(x[order], w, dy, sizes, recipe)
  for got, ref in zip((y, dx, dw), want, strict=True):
    assert rel(got, ref) < 1e-5


def test_remat_saves_the_quantized_operands_intact():
  """Saved MXFP8 data hold values up to 448 and E8M0 scales; remat must not change them."""
  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((48, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2, 32, 32)), jnp.bfloat16)
  sizes = jnp.array([10, 30], jnp.int32)

  def loss(x, w):
    return jnp.sum(jnp.sin(core.ragged_dot(x, w, sizes, recipe=E4M3)))

  plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  remat = jax.checkpoint(loss, policy=core.save_quantized_operands)
  again = jax.jit(jax.grad(remat, argnums=(0, 1)))(x, w)
  assert again[0].dtype == again[1].dtype == jnp.bfloat16
  assert not np.any(np.isnan(again[0])) and not np.any(np.isnan(again[1]))
  jax.tree.map(np.testing.assert_array_equal, plain, again)


def test_vmap_is_the_per_example_result():
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((2, 40, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 3, 32, 32)), jnp.float32)
  sizes = jnp.array([[10, 0, 25], [0, 40, 0]], jnp.int32)
  f = functools.partial(core.ragged_dot, recipe=E4M3)
  batched = jax.jit(jax.vmap(f))(x, w, sizes)
  for i in range(2):
    np.testing.assert_array_equal(batched[i], jax.jit(f)(x[i], w[i], sizes[i]))


def test_shape_and_recipe_errors_are_clear():
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  gs = jnp.array([16, 16], jnp.int32)
  fwd = lambda x, w: core.ragged_dot(x, w, gs, recipe=E4M3)
  grad = jax.grad(lambda x, w: fwd(x, w).sum(), argnums=(0, 1))
  k_error = r"MXFP8BlockScaling: the contracting size K is 48, which is not a multiple of 32"
  with pytest.raises(ValueError, match=k_error + r"; the forward GEMM"):
    jax.eval_shape(fwd, f32(32, 48), f32(2, 48, 32))
  # Inference needs only K; training also blocks along N (dgrad). M is free (groups are padded).
  assert jax.eval_shape(fwd, f32(40, 32), f32(2, 32, 48)).shape == (40, 48)
  with pytest.raises(ValueError, match=r"the output size N \(rhs dim 2\) is 48.*dgrad"):
    jax.eval_shape(grad, f32(40, 32), f32(2, 32, 48))
  # Below the blocks, the layers' size rule (tests/core/test_size_rule.py).
  with pytest.raises(ValueError, match=r"multiples of 16, got N=40"):
    jax.eval_shape(fwd, f32(40, 32), f32(2, 32, 40))
  assert jax.eval_shape(grad, f32(40, 32), f32(2, 32, 32))[1].shape == (2, 32, 32)
  supported = (
    r"support DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
    r"Float8BlockScaling and Float8RowwiseScaling"
  )
  for recipe in (ta.NVFP4BlockScaling(),):
    name = type(recipe).__name__
    with pytest.raises(NotImplementedError, match=rf"does not implement {name}; .*{supported}"):
      core.ragged_dot(jnp.ones((32, 128)), jnp.ones((2, 128, 128)), gs, recipe=recipe)
    with pytest.raises(NotImplementedError, match=name):
      core.init_ragged_state(recipe, 2)
  assert core.init_ragged_state(E4M3, 2) == {}
  with pytest.raises(ValueError, match=r"unexpected \['x_scale'\]"):
    state = {"x_scale": jnp.ones((2, 1))}
    core.ragged_dot(jnp.ones((32, 32)), jnp.ones((2, 32, 32)), gs, recipe=E4M3, state=state)
