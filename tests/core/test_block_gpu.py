"""Block-scaled recipes on an NVIDIA GPU: real FP8 GEMMs, the same quantized values as on CPU.

Skipped without a GPU. The native MXFP8/NVFP4 test also needs a Blackwell GPU (compute
capability 10.0 or newer), where ``jax.nn.scaled_matmul`` runs the GEMM in cuDNN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import inspect
from te_adapters.core import formats, kernels
from te_adapters.core.formats import _float8_block
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


def _skip_unless_cublas_runs_under_jit():
  if not kernels.cublas_gemm_available():
    pytest.skip("cuBLASLt's block-scaled GEMM is not built or the GPU is not a Hopper GPU")
  if jax.device_count() > 1:
    # A traced operand's placement is unknown under jit when the host has several devices, so
    # the kernel (which has no partitioning rule) runs only inside shard_map there.
    pytest.skip("several devices: under jit the block GEMM falls back to the XLA formulation")


@pytest.mark.parametrize("gemm", ["native", "xla"])
def test_float8_block_gemms_are_fp8_gemms(gemm):
  if gemm == "native":
    _skip_unless_cublas_runs_under_jit()
  config = ta.GemmConfig(block_gemm=gemm)
  recipe = ta.Float8BlockScaling()
  x = jnp.asarray(_data((256, 512), 0), jnp.bfloat16)
  w = jnp.asarray(_data((512, 256), 1), jnp.bfloat16)
  g = jnp.asarray(_data((256, 256), 2), jnp.bfloat16)

  def run(x, w, g):
    y, vjp = jax.vjp(
      lambda x, w: ta.core.dot_general(x, w, DN, recipe=recipe, threshold=None, config=config),
      x,
      w,
    )
    return (y, *vjp(g))

  compiled = jax.jit(run).lower(x, w, g).compile()
  hlo = compiled.as_text()
  if gemm == "native":
    # fwd (1x128 x 128x128), dgrad (1x128 x 128x128), wgrad (1x128 x 1x128): one kernel each.
    assert hlo.count('custom_call_target="te_adapters_block_gemm"') == 3, hlo
  else:
    # XLA's formulation: FP8 cuBLASLt calls, or FP8 dots in Triton fusions where XLA's Triton
    # GEMMs are on (its default); no dot of other operand types.
    fp8, other = inspect.count_fp8_gemms(hlo)
    assert fp8 >= 3 and other == 0, (fp8, other, inspect.hlo_dot_operand_types(hlo))
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


@pytest.mark.xfail(
  strict=True,
  reason="XLA's GPU code computes NVFP4's S_enc = 2688 / amax one ulp away from the correctly "
  "rounded quotient for this tensor (646.73688 against 646.73682; seen on H200s, jax 0.11.2), "
  "which moves 8 of 32768 E2M1 values that sit on a rounding tie",
)
def test_nvfp4_rht_on_gpu_matches_cpu():
  recipe = ta.NVFP4BlockScaling()
  x = _data((256, 128), 4)
  rht = lambda x: ta.core.quantize(x, recipe=recipe, role="x", axis=0, rht=True)
  gpu, cpu = jax.jit(rht)(x), jax.jit(rht)(_on_cpu(x))
  for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_nvfp4_stochastic_rounding_on_gpu():
  recipe = ta.NVFP4BlockScaling()
  x = _data((256, 128), 4)
  sr = jax.jit(lambda x, k: ta.core.quantize(x, recipe=recipe, role="grad", rng=k).data)
  a = np.asarray(sr(x, jax.random.key(0)), np.float32)
  np.testing.assert_array_equal(a, np.asarray(sr(x, jax.random.key(0)), np.float32))
  assert not np.array_equal(a, np.asarray(sr(x, jax.random.key(1)), np.float32))
  # Unbiased: the mean over keys is closer to x than round-to-nearest is.
  keys = [jax.random.key(i) for i in range(16)]
  mean = np.mean(
    [
      np.asarray(
        ta.core.dequantize(ta.core.quantize(x, recipe=recipe, role="grad", rng=k)), np.float64
      )
      for k in keys
    ],
    axis=0,
  )
  nearest = np.asarray(
    ta.core.dequantize(
      ta.core.quantize(
        x, recipe=ta.NVFP4BlockScaling(disable_stochastic_rounding=True), role="grad"
      )
    ),
    np.float64,
  )
  assert np.abs(mean - x).mean() < np.abs(nearest - x).mean()


@pytest.mark.skipif(
  not formats.native_gemm_available("mxfp8"),
  reason="needs jax.nn.scaled_matmul hardware (Blackwell)",
)
@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2]], ids=["mxfp8", "nvfp4"])
def test_native_scaled_matmul_matches_emulation(recipe):
  x, w = _data((256, 512), 5), _data((512, 256), 6)
  f = lambda x, w, config=None: ta.core.dot_general(
    x, w, DN, recipe=recipe, threshold=None, config=config
  )
  native = np.asarray(jax.jit(f)(x, w))
  assert "cudnn" in jax.jit(f).lower(x, w).compile().as_text().lower()
  xla = ta.GemmConfig(block_gemm="xla")
  emulated = np.asarray(jax.jit(lambda x, w: f(x, w, xla))(x, w))
  assert _rel(native, emulated) < 1e-5


@pytest.mark.skipif(
  not kernels.cublas_gemm_available(), reason="needs cuBLASLt's block-scaled GEMM (Hopper)"
)
@pytest.mark.parametrize("blocks", [(1, 2), (1, 1), (2, 1)], ids=["1dx2d", "1dx1d", "2dx1d"])
def test_float8_block_cublas_gemm_matches_the_xla_formulation(blocks):
  _skip_unless_cublas_runs_under_jit()
  # Scales that are not powers of two, blocks whose amaxes differ, two batch entries, and an M
  # that is not a multiple of 128 where the lhs has 1-D blocks.
  m = 272 if blocks[0] == 1 else 256
  n, k = 384, 640
  rng = np.random.default_rng(7)
  a = rng.standard_normal((2, m, k)) * np.exp2(rng.integers(-6, 6, (2, m, k // 128))).repeat(128, 2)
  b = rng.standard_normal((2, n, k)) * np.exp2(rng.integers(-6, 6, (2, n, 1)))
  shapes = {1: (128,), 2: (128, 128)}
  qa = _float8_block.quantize(
    jnp.asarray(a, jnp.float32), shapes[blocks[0]], jnp.float8_e4m3fn, False
  )
  qb = _float8_block.quantize(
    jnp.asarray(b, jnp.float32), shapes[blocks[1]], jnp.float8_e5m2, False
  )
  args = (qa[0], qa[1], qb[0], qb[1])

  def compiled(choice="auto"):
    f = lambda a, sa, b, sb: _float8_block.gemm(
      a, sa, shapes[blocks[0]], b, sb, shapes[blocks[1]], choice=choice
    )
    return jax.jit(f).lower(*args).compile()

  cublas = compiled()
  assert "te_adapters_block_gemm" in cublas.as_text()
  got = np.asarray(cublas(*args), np.float64)
  # A bfloat16 output is written by the kernel: the float32 sums rounded once.
  as_bf16 = jax.jit(
    lambda a, sa, b, sb: _float8_block.gemm(
      a, sa, shapes[blocks[0]], b, sb, shapes[blocks[1]], jnp.bfloat16
    )
  )(*args)
  assert as_bf16.dtype == jnp.bfloat16
  assert _rel(np.asarray(as_bf16, np.float64), got) < 2e-3
  xla = compiled("xla")
  assert "te_adapters_block_gemm" not in xla.as_text()
  want = np.asarray(xla(*args), np.float64)
  # The same FP8 products, summed in float32 in another order.
  assert _rel(got, want) < 1e-5
  # And against float64 of the dequantized operands: Hopper's FP8 tensor cores sum each 128-wide
  # block in reduced precision (1.0e-4 measured on an H100); a wrong scale layout is off by O(1).
  da = np.asarray(_float8_block.dequantize_values(qa[0], qa[1], shapes[blocks[0]]), np.float64)
  db = np.asarray(_float8_block.dequantize_values(qb[0], qb[1], shapes[blocks[1]]), np.float64)
  assert _rel(got, np.einsum("bmk,bnk->bmn", da, db)) < 1e-3


def test_float8_block_cublas_refusals():
  t = jnp.zeros((1, 256, 256), jnp.float8_e4m3fn)
  s2 = jnp.ones((1, 2, 2), jnp.float32)
  # Without the extension (a pure-JAX install) cuBLASLt is refused before the tiles are looked at.
  why = "128x128 tiles on both operands" if kernels.cublas_gemm_available() else "not built"
  with pytest.raises(RuntimeError, match=why):
    _float8_block.gemm(t, s2, (128, 128), t, s2, (128, 128), choice="native")
  with pytest.raises(ValueError, match="block_gemm must be"):
    _float8_block.gemm(t, s2, (128, 128), t, s2, (128, 128), choice="cublas")


def _skip_unless_block_cast():
  if not kernels.registered(kernels.BLOCK_CAST_TARGET):
    pytest.skip("the extension's CUDA block cast is not built here")


def _block_cast_input(dtype):
  """Blocks of very different magnitudes, a zero block, an overflowing value, and blocks whose
  amax is 1.75 * 2**j: there fp8_max / amax (448 / amax) is a power of two exactly, where a
  division one ulp low would halve the power-of-two scale. (No NaN: XLA's CPU max drops a NaN in
  some reduction layouts and keeps it in others, so the CPU is no reference there; see
  test_block_cast_kernel_nan.)"""
  rng = np.random.default_rng(11)
  x = rng.standard_normal((2, 256, 384)) * np.exp2(rng.integers(-8, 8, (2, 256, 3))).repeat(128, 2)
  x[0, :128, :128] = 0.0
  x[1, 200, 7] = 6e4 if dtype == jnp.float16 else 3e38
  x[1, 128:, 128:256] = np.clip(x[1, 128:, 128:256], -1.0, 1.0)
  x[1, 130, 140] = 1.75
  x[0, 128:, 256] = 1.75 * 2.0**-3
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=str)
@pytest.mark.parametrize("tile", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize(
  "q_dtype,power_2",
  [(jnp.float8_e4m3fn, True), (jnp.float8_e5m2, False)],
  ids=["e4m3-pow2", "e5m2-f32"],
)
def test_block_cast_kernel_quantizes_like_cpu(dtype, tile, q_dtype, power_2):
  """The CUDA block cast gives, bit for bit, the CPU's pure-JAX quantization of both copies."""
  _skip_unless_block_cast()
  x = _block_cast_input(dtype)
  q, s, q_t, s_t, amax = jax.jit(
    lambda x: kernels.block_cast_call(
      x, q_dtype, rowwise=True, colwise=True, tile=tile, power_2=power_2
    )
  )(x)
  block = (128, 128) if tile else (128,)
  cpu_x = _on_cpu(x)
  want_q, want_s, want_amax = jax.jit(lambda x: _float8_block.quantize(x, block, q_dtype, power_2))(
    cpu_x
  )
  if tile:
    want_qt, want_st = jnp.swapaxes(want_q, -1, -2), None
    assert s_t.size == 0
  else:
    want_qt, want_st, _ = jax.jit(
      lambda x: _float8_block.quantize(jnp.swapaxes(x, -1, -2), block, q_dtype, power_2)
    )(cpu_x)
  pairs = [(q, want_q), (s, want_s), (q_t, want_qt), (amax, want_amax)]
  if not tile:
    pairs.append((s_t, want_st))
  for got, want in pairs:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = {1: np.uint8, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize(
  "tile,rows,cols",
  [
    (False, True, True),
    (False, True, False),
    (False, False, True),
    (True, True, True),
    (True, True, False),
  ],
  ids=["1x128-both", "1x128-rows", "1x128-cols", "128x128-both", "128x128-rows"],
)
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "plain"])
def test_block_cast_kernel_gathers_source_rows(tile, rows, cols, gather):
  """With source rows the CUDA block cast quantizes the gathered rows (zero rows where a source
  is negative; the input's row count need not be a multiple of 128), bit for bit the CPU's
  pure-JAX quantization of the gathered copy, in every batch entry, amax included; so does each
  copy asked for alone (the kernel's separate instantiations), gathered or not."""
  _skip_unless_block_cast()
  x = _block_cast_input(jnp.bfloat16)
  rng = np.random.default_rng(3)
  src = rng.integers(0, 200, 256).astype(np.int32)
  src[rng.random(256) < 0.2] = -1
  src[:8] = [199, 0, -1, 199, 5, 5, -1, 130]
  src = jnp.asarray(src) if gather else None
  if gather:
    x = x[:, :200]
  q, s, q_t, s_t, amax = jax.jit(
    lambda x, src: kernels.block_cast_call(
      x, jnp.float8_e4m3fn, rowwise=rows, colwise=cols, tile=tile, power_2=True, source_rows=src
    )
  )(x, src)
  cpu_x = _on_cpu(x)
  gathered = cpu_x
  if gather:
    cpu_src = _on_cpu(src)
    gathered = jnp.where((cpu_src >= 0)[:, None], cpu_x[:, jnp.maximum(cpu_src, 0)], 0)
  block = (128, 128) if tile else (128,)
  quantize = jax.jit(lambda x: _float8_block.quantize(x, block, jnp.float8_e4m3fn, True))
  want_q, want_s, want_amax = quantize(gathered)
  pairs = [(amax, want_amax)]
  if rows:
    pairs += [(q, want_q), (s, want_s)]
  if cols and tile:
    pairs.append((q_t, jnp.swapaxes(want_q, -1, -2)))
  elif cols:
    want_qt, want_st, _ = quantize(jnp.swapaxes(gathered, -1, -2))
    pairs += [(q_t, want_qt), (s_t, want_st)]
  for empty in ([] if rows else [q, s]) + ([] if cols else [q_t, s_t]):
    assert empty.size == 0
  for got, want in pairs:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = {1: np.uint8, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


def test_block_cast_kernel_nan():
  """A block holding a NaN gets the scale 1 (TE's rule for a non-finite amax) in both copies,
  the NaN stays NaN, the other blocks keep their scales, and the amax is NaN."""
  _skip_unless_block_cast()
  x = np.full((128, 256), 3.0, np.float32)
  x[5, 200] = np.nan
  q, s, q_t, s_t, amax = jax.jit(
    lambda x: kernels.block_cast_call(
      x, jnp.float8_e4m3fn, rowwise=True, colwise=True, tile=False, power_2=True
    )
  )(x)
  s, s_t = np.asarray(s), np.asarray(s_t)
  q, q_t = np.asarray(q, np.float32), np.asarray(q_t, np.float32)
  third = 0.0078125  # 1 / 128: 448 / 3 rounded down to a power of two
  assert s[5, 1] == 1.0 and (np.delete(s[:, 1], 5) == third).all() and (s[:, 0] == third).all()
  assert s_t[200, 0] == 1.0 and (np.delete(s_t[:, 0], 200) == third).all()
  assert np.isnan(q[5, 200]) and np.isnan(q_t[200, 5])
  assert q[5, 0] == 384.0 and q[5, 199] == 3.0 and q_t[199, 5] == 384.0
  assert np.isnan(np.asarray(amax)).all()


def test_block_cast_kernel_runs_in_the_float8_block_dot_general():
  """Under Float8BlockScaling the GPU step casts x, the kernel and the output gradient with one
  CUDA pass each (both orientations), and computes what the pure-JAX casts give."""
  _skip_unless_block_cast()
  _skip_unless_cublas_runs_under_jit()
  recipe = ta.Float8BlockScaling()
  x = jnp.asarray(_data((256, 512), 0), jnp.bfloat16)
  w = jnp.asarray(_data((512, 384), 1), jnp.bfloat16)
  g = jnp.asarray(_data((256, 384), 2), jnp.bfloat16)

  def step(config):
    def run(x, w, g):
      y, vjp = jax.vjp(
        lambda x, w: ta.core.dot_general(x, w, DN, recipe=recipe, threshold=None, config=config),
        x,
        w,
      )
      return (y, *vjp(g))

    return jax.jit(run).lower(x, w, g).compile()

  fused, plain = step(ta.GemmConfig()), step(ta.GemmConfig(backend="jax"))
  assert fused.as_text().count('custom_call_target="te_adapters_block_cast"') == 3
  assert "te_adapters_block_cast" not in plain.as_text()
  for a, b in zip(fused(x, w, g), plain(x, w, g), strict=True):
    # XLA's GPU division can put a scale one ulp (so a power of two one step) away from the
    # kernel's correctly rounded one; the GEMM's inputs are otherwise the same.
    assert _rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 2e-2


def test_block_cast_kernel_non_finite_input_reaches_the_output():
  """The CUDA block cast gives a non-finite block the scale 1 (TE's rule) and a NaN amax for a
  NaN; an infinity gives an infinite amax. Either makes the copies' inverse scales NaN
  (GemmConfig.non_finite="propagate"), so the cuBLASLt block GEMMs write NaN; "saturate" keeps
  TE's finite result for the infinity."""
  _skip_unless_block_cast()
  _skip_unless_cublas_runs_under_jit()
  recipe = ta.Float8BlockScaling()
  x = jnp.asarray(_data((256, 512), 0), jnp.bfloat16)
  w = jnp.asarray(_data((512, 384), 1), jnp.bfloat16)
  g = jnp.asarray(_data((256, 384), 2), jnp.bfloat16)

  def step(config, x):
    def run(x, w, g):
      y, vjp = jax.vjp(
        lambda x, w: ta.core.dot_general(x, w, DN, recipe=recipe, threshold=None, config=config),
        x,
        w,
      )
      return (y, *vjp(g))

    compiled = jax.jit(run).lower(x, w, g).compile()
    # The forward and both gradient GEMMs read the CUDA cast's copies (one pass per operand).
    assert compiled.as_text().count('custom_call_target="te_adapters_block_cast"') == 3
    return [np.asarray(a, np.float32) for a in compiled(x, w, g)]

  for bad in (np.inf, np.nan):
    y, dx, dw = step(ta.GemmConfig(), x.at[5, 200].set(bad))
    assert np.isnan(y).all() and np.isnan(dw).all()  # the GEMMs that read x's copies
    assert np.isfinite(dx).all()  # dgrad reads the gradient and the kernel only
  y, dx, dw = step(ta.GemmConfig(non_finite="saturate"), x.at[5, 200].set(np.inf))
  assert np.isfinite(y).all() and np.isfinite(dw).all()
