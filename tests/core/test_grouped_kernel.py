"""The layouts the native grouped GEMM reads (pure JAX, any platform), and that ``ragged_dot``
keeps XLA's path where the kernel is not built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core.kernels import _ffi, _grouped_kernel


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
    expected[:, start : start + sizes[g]] = np.asarray(q)[row : row + sizes[g]].T
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


def _fp8_values(q):
  """The float32 values of FP8 ``q``, read from its bytes. Not ``q.astype(float32)``: under jit
  the GPU compiler folds a chain of conversions that ends in the dtype it started from (float32
  -> FP8 -> float32, through bfloat16 too) into nothing, which would take the quantization out
  of this model and leave it in the route it is compared with."""
  table = np.arange(256, dtype=np.uint8).view(np.dtype(q.dtype)).astype(np.float32)
  return jnp.asarray(table)[jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)]


def _values(q):
  """The float32 values of ``q``: FP8 read from its bytes, other types converted."""
  if jnp.dtype(q.dtype).itemsize == 1:
    return _fp8_values(q)
  return q.astype(jnp.float32)


def _product_magnitudes(x, w, dy, sizes):
  """For each output of the grouped forward, dgrad and wgrad, the sum of its products'
  magnitudes in float64: |x| @ |w_g| and |dy| @ |w_g|^T on group g's rows (zero past the
  groups), |x_g|^T @ |dy_g| for group g's kernel. What a difference in summation order or
  precision is bounded by."""
  ax, aw, ady = (np.abs(np.asarray(t, np.float64)) for t in (x, w, dy))
  rows, k = ax.shape
  y, dx, dw = np.zeros((rows, aw.shape[2])), np.zeros((rows, k)), np.zeros(aw.shape)
  ends = np.cumsum(np.asarray(sizes))
  for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
    y[start:end] = ax[start:end] @ aw[g]
    dx[start:end] = ady[start:end] @ aw[g].T
    dw[g] = ax[start:end].T @ ady[start:end]
  return y, dx, dw


def _rows_gemm_model(a, b, group_sizes, alpha, out_dtype, fast):
  """The kernel's rows mode as grouped_gemm.h states it: out[rows of g] = a[rows of g] @ b[g]^T
  * alpha[g] with float32 sums, zero past the groups."""
  del fast
  y = jax.lax.ragged_dot(
    _values(a),
    jnp.swapaxes(_values(b), 1, 2),
    group_sizes,
    precision=jax.lax.Precision.HIGHEST,
  )
  ids = jnp.repeat(jnp.arange(len(group_sizes)), group_sizes, total_repeat_length=a.shape[0])
  scale = jnp.where(jnp.arange(a.shape[0]) < group_sizes.sum(), alpha[ids], 0.0)
  return (y * scale[:, None]).astype(out_dtype)


def _wgrad_gemm_model(x, dy, group_sizes, alpha, out_dtype, fast):
  """The kernel's wgrad mode: dw[g] = x[rows of g]^T @ dy[rows of g] * alpha[g]."""
  del fast
  starts = np.concatenate([[0], np.cumsum(np.asarray(group_sizes))[:-1]])
  dw = [
    _values(x[s : s + n]).T @ _values(dy[s : s + n]) * alpha[g]
    for g, (s, n) in enumerate(zip(starts, np.asarray(group_sizes), strict=True))
  ]
  return jnp.stack(dw).astype(out_dtype)


def test_bf16_ragged_dot_wires_its_gemms_as_lax_ragged_dot(monkeypatch):
  """bf16_ragged_dot's forward and VJP, with the kernel's two modes replaced by models of what
  grouped_gemm.h says they compute: lax.ragged_dot's output and gradients (the GPU test runs the
  kernel itself). Catches a wrong operand, transpose or group-size handling on any machine."""
  monkeypatch.setattr(_grouped_kernel, "rows_gemm", _rows_gemm_model)
  monkeypatch.setattr(_grouped_kernel, "wgrad_gemm", _wgrad_gemm_model)
  rng = np.random.default_rng(0)
  sizes = jnp.asarray([7, 0, 20, 5], jnp.int32)  # 32 rows in groups, 4 past them
  x = jnp.asarray(rng.standard_normal((36, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 32, 48)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((36, 48)), jnp.bfloat16)

  def grads(f):
    loss = lambda x, w: jnp.sum(f(x, w, sizes).astype(jnp.float32) * dy.astype(jnp.float32))
    return f(x, w, sizes), *jax.grad(loss, argnums=(0, 1))(x, w)

  got = grads(_grouped_kernel.bf16_ragged_dot)
  want = grads(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST))
  for a, b in zip(got, want, strict=True):
    assert a.dtype == jnp.bfloat16 and a.shape == b.shape
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2
    )
  assert np.all(np.asarray(got[0][32:]) == 0) and np.all(np.asarray(got[1][32:]) == 0)
  assert np.all(np.asarray(got[2][1]) == 0)  # the empty group's kernel gradient


def test_ragged_dot_without_recipe_takes_the_bf16_kernel_where_it_runs(monkeypatch):
  """``core.ragged_dot(recipe=None)``: bfloat16 operands and result go to the native kernel where
  it runs (here it is said to, with the kernel's modes replaced by their models): forward,
  dgrad and wgrad on it, lax.ragged_dot's values; a float32 operand or result, or a K that is not
  a multiple of 16, stays on XLA's ragged dot."""
  monkeypatch.setattr(_grouped_kernel, "available", lambda: True)
  monkeypatch.setattr(_ffi, "single_device", lambda x: True)
  calls = []

  def spy(name, model):
    def run(*args, **kwargs):
      calls.append(name)
      return model(*args, **kwargs)

    return run

  monkeypatch.setattr(_grouped_kernel, "rows_gemm", spy("rows", _rows_gemm_model))
  monkeypatch.setattr(_grouped_kernel, "wgrad_gemm", spy("wgrad", _wgrad_gemm_model))
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([9, 0, 15, 6], jnp.int32)  # 30 rows in groups, 2 past them
  x = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.bfloat16)

  def grads(f, x, w):
    loss = lambda x, w: jnp.sum(f(x, w, sizes).astype(jnp.float32) ** 2)
    return f(x, w, sizes), *jax.grad(loss, argnums=(0, 1))(x, w)

  got = grads(lambda x, w, s: core.ragged_dot(x, w, s, recipe=None), x, w)
  assert calls == ["rows", "rows", "rows", "wgrad"]  # forward twice (value, then under grad)
  want = grads(
    lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST), x, w
  )
  for a, b in zip(got, want, strict=True):
    assert a.dtype == jnp.bfloat16 and a.shape == b.shape
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2
    )
  calls.clear()
  core.ragged_dot(x.astype(jnp.float32), w, sizes, recipe=None)
  core.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32, recipe=None)
  core.ragged_dot(x[:, :24], w[:, :24], sizes, recipe=None)
  assert calls == []


def test_bf16_refusal_says_why():
  x, w = jnp.ones((32, 16), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16)
  reason = _grouped_kernel.bf16_refusal(x, w, jnp.bfloat16)
  if not _grouped_kernel.available():
    assert "not built here" in reason
  else:
    assert reason is None
    assert "bfloat16 by bfloat16" in _grouped_kernel.bf16_refusal(
      x.astype(jnp.float32), w, jnp.bfloat16
    )
    assert "writes bfloat16" in _grouped_kernel.bf16_refusal(x, w, jnp.float32)
    assert "multiples of 16" in _grouped_kernel.bf16_refusal(x[:, :8], w[:, :8], jnp.bfloat16)


@pytest.mark.parametrize(
  "recipe",
  [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)],
  ids=["current", "delayed"],
)
def test_fp8_native_route_wires_its_gemms_as_the_xla_route(monkeypatch, recipe):
  """The per-tensor format's grouped GEMM on the native route, with the kernel's two modes
  replaced by their models, gives the XLA route's outputs, gradients and next state: the same FP8
  operands and per-group scales reach each GEMM in the layout the kernel reads (the GPU test runs
  the kernel itself)."""
  calls = []

  def spy(name, model):
    def run(*args, **kwargs):
      calls.append((name, str(args[0].dtype), str(args[1].dtype)))
      return model(*args, **kwargs)

    return run

  monkeypatch.setattr(core.kernels, "rows_gemm", spy("rows", _rows_gemm_model))
  monkeypatch.setattr(core.kernels, "wgrad_gemm", spy("wgrad", _wgrad_gemm_model))
  rng = np.random.default_rng(2)
  sizes = jnp.asarray([9, 0, 15, 6], jnp.int32)  # 30 rows in groups, 2 past them
  x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 32, 16)) * [[[0.01]], [[1]], [[3]], [[0.1]]], jnp.float32)
  dy = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  f32 = np.dtype(jnp.float32)

  def run(route):
    spec = core.gemm.Grouped(recipe, None, f32, (f32, f32), route)

    def loss(x, w, state):
      y = core.gemm.grouped_gemms(x, w, sizes, state, spec)
      return jnp.sum(y * dy), y

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    state = core.init_ragged_state(recipe, 4)
    for i in range(2):  # delayed scaling: the second step casts with the stored scales
      (_, y), (dx, dw, state) = step(x * (1.0 + i), w, state)
    return y, dx, dw, state

  native = run("native")
  e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
  assert calls[:3] == [("rows", e4m3, e4m3), ("rows", e5m2, e4m3), ("wgrad", e4m3, e5m2)]
  xla = run("xla")
  for a, b in zip(jax.tree.leaves(native[3]), jax.tree.leaves(xla[3]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  # The models sum the FP8 products in float32. On a GPU the XLA route's FP8 dots run on the
  # tensor cores, whose sums keep fewer bits (the forward's fast sums the fewest; on an H100 one
  # run saw 7e-6 on outputs near 0.07, another none, as XLA picked its algorithm): each output
  # may move by a small fraction of the sum of its products' magnitudes (the operands' own
  # within FP8's rounding, clipped where delayed scaling saturates): 2**-10 of it here, where
  # that run moved 2**-16 of it. A wrong operand, scale or layout moves outputs by their own size.
  bounds = _product_magnitudes(2 * x, w, dy, sizes)
  for a, b, bound in zip(native[:3], xla[:3], bounds, strict=True):
    assert a.shape == b.shape
    assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b)) <= 2.0**-10 * bound)
  assert np.all(np.asarray(native[0][30:]) == 0) and np.all(np.asarray(native[2][1]) == 0)


def test_grouped_block_scales_keep_each_groups_scales_together():
  """The scale layout of Float8BlockScaling's rows mode (grouped_block_gemm.h): group g's
  scales from o_g * S, as (S, m_g), slice after slice; the rows past the groups last."""
  sizes = np.array([5, 0, 16, 21], np.int32)  # 42 rows in groups, 3 past them
  scales = jnp.arange(45 * 3, dtype=jnp.float32).reshape(45, 3)
  flat = np.asarray(_grouped_kernel.grouped_block_scales(scales, jnp.asarray(sizes)))
  assert flat.shape == (45 * 3,)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for s, n in zip(starts, [*sizes, 3], strict=True):
    np.testing.assert_array_equal(flat[3 * s : 3 * (s + n)].reshape(3, n), scales[s : s + n].T)


def _block_call_model(a, b, sfa, sfb, group_sizes, out_shape, out_dtype, workspace, *, mode):
  """The block-scaled kernel's two modes as grouped_block_gemm.h states them, reading the scale
  layouts it reads: float32 sums of the dequantized values."""
  del workspace
  block = 128
  a32, b32 = _fp8_values(a), _fp8_values(b)
  sizes = group_sizes.astype(jnp.int32)
  if mode == 1:  # wgrad: a (K, P), b (N, P), sfa (P/128, K), sfb (P/128, N)
    a32 = a32 * jnp.repeat(sfa.T, block, axis=1)
    b32 = b32 * jnp.repeat(sfb.T, block, axis=1)
    pads = (sizes + block - 1) // block * block
    dims = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
    out = jax.lax.ragged_dot_general(a32.T, b32.T, pads, dims, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)
  rows, k = a.shape
  slices = k // block
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  row = jnp.arange(rows)
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), len(sizes) - 1)
  o, m = starts[group][:, None], sizes[group][:, None]
  idx = o * slices + jnp.arange(slices)[None, :] * m + (row[:, None] - o)
  sa = sfa[jnp.clip(idx, 0, sfa.size - 1)]
  a32 = a32 * jnp.repeat(sa, block, axis=1)
  sb = jnp.swapaxes(sfb, 1, 2)  # (G, N/128, K/128)
  b32 = b32 * jnp.repeat(jnp.repeat(sb, block, axis=1), block, axis=2)
  y = jax.lax.ragged_dot(a32, jnp.swapaxes(b32, 1, 2), sizes, precision=jax.lax.Precision.HIGHEST)
  y = jnp.where((row < ends[-1])[:, None], y, 0.0)
  assert y.shape == out_shape
  return y.astype(out_dtype)


@pytest.mark.parametrize(
  "recipe",
  [ta.Float8BlockScaling(), ta.Float8BlockScaling(fp8_format=ta.Format.HYBRID)],
  ids=["e4m3", "hybrid"],
)
def test_float8_block_native_route_wires_its_gemms_as_the_emulated_route(monkeypatch, recipe):
  """Float8BlockScaling's grouped GEMM on the native route, with the kernel replaced by a model
  of what grouped_block_gemm.h says it computes from the scales in its layouts, gives the
  emulated route's output and gradients: the same FP8 copies and scales reach each GEMM in the
  layout the kernel reads (the GPU test runs the kernel itself). ``ragged_dot`` takes that
  route where the kernel runs, and not for kernels in 1x128 blocks."""
  calls = []

  def spy(*args, **kwargs):
    calls.append((kwargs["mode"], str(args[0].dtype), str(args[1].dtype)))
    return _block_call_model(*args, **kwargs)

  monkeypatch.setattr(_ffi, "grouped_block_gemm_call", spy)
  monkeypatch.setattr(_grouped_kernel, "block_available", lambda: True)
  monkeypatch.setattr(_ffi, "single_device", lambda x: True)
  rng = np.random.default_rng(3)
  sizes = jnp.asarray([70, 0, 37, 21], jnp.int32)  # 128 rows in groups, 32 past them
  scale = np.float32(2.0) ** rng.integers(-6, 7, size=(160, 1))  # rows of different blocks
  x = jnp.asarray(rng.standard_normal((160, 256)) * scale, jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 256, 128)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((160, 128)) * scale, jnp.float32)
  f32 = np.dtype(jnp.float32)
  grouped = core.formats.format_of(recipe).grouped
  assert grouped.route(x, w, recipe, (f32,) * 3) == "native"
  one_d = ta.Float8BlockScaling(w_block_scaling_dim=1)
  assert grouped.route(x, w, one_d, (f32,) * 3) is None
  assert grouped.route(x, w, recipe, (np.dtype(jnp.float16),) * 3) is None

  def run(route):
    spec = core.gemm.Grouped(recipe, None, f32, (f32, f32), route)

    def loss(x, w):
      y = core.gemm.grouped_gemms(x, w, sizes, core.init_ragged_state(recipe, 4), spec)
      return jnp.sum(y * dy), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, dx, dw

  native = run("native")
  e4m3, grad = "float8_e4m3fn", str(np.dtype(recipe.bwd_dtype))
  assert calls == [(0, e4m3, e4m3), (0, grad, e4m3), (1, e4m3, grad)]
  emulated = run(None)
  # The two routes sum the same products in float32, in orders the compiler picks (on a GPU
  # they differ): each output may move by its sum's rounding, K * 2**-24 times the sum of the
  # products' magnitudes (the operands' own, within FP8's rounding: twice that bound). A copy or
  # a scale in the wrong place moves outputs by their own size.
  y_mag, dx_mag, dw_mag = _product_magnitudes(x, w, dy, sizes)
  lengths = np.maximum(np.asarray(sizes), 1)[:, None, None]  # wgrad sums over the group's rows
  bounds = [256 * y_mag, 128 * dx_mag, lengths * dw_mag]
  for a, b, bound in zip(native, emulated, bounds, strict=True):
    assert a.shape == b.shape
    assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b)) <= 2 * 2.0**-24 * bound)
  assert np.all(np.asarray(native[0][128:]) == 0) and np.all(np.asarray(native[2][1]) == 0)
