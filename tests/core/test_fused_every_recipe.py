"""The fused norm and MLP paths under the block and rowwise recipes: their producers hand the
format the operand's float32 values (``Producer.value``), which it quantizes in its own blocks or
rows. Against float64 (forward, dx, every parameter's gradient, after 3 steps), bit for bit
against the composed path where no rounding separates them (float32 activations), and the
report when a format takes no producer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import formats
from tests.conftest import FP8_GEMM_RTOL

from .test_fused_mlp import _block, _data, _run, _takes_fused
from .test_mlp import _reference_grads

ON_CPU = jax.default_backend() == "cpu"
ACTS = ("gelu", "linear")
FUSED = core.GemmConfig(fuse_activation_cast=True)
RECIPES = {
  "float8_block": ta.Float8BlockScaling(),
  "rowwise": ta.Float8RowwiseScaling(),
  "rowwise_gw_hp": ta.Float8RowwiseScaling(weight_grad_high_precision=True),
}
# Every recipe that is not per-tensor, for the bit-for-bit comparison with the composed path.
ALL = {
  **RECIPES,
  "mxfp8": ta.MXFP8BlockScaling(),
  "nvfp4": ta.NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _same(a, b, err_msg=""):
  """Bit for bit on CPU; on a GPU two programs fused differently round float32 sums apart."""
  if ON_CPU:
    np.testing.assert_array_equal(a, b, err_msg=err_msg)
  else:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(
      a, b, rtol=FP8_GEMM_RTOL, atol=1e-2 * float(np.max(np.abs(b), initial=0)), err_msg=err_msg
    )


@pytest.mark.parametrize("name", RECIPES)
def test_fused_mlp_against_float64(name, rel):
  recipe = RECIPES[name]
  x, params, dy = _data(ACTS)
  assert _takes_fused(x, params, ACTS, recipe, FUSED, threshold=None)
  ref_out, ref_dx, ref_dp = _reference_grads(x, params, dy, ACTS)

  def errors(config):
    out, dx, dp, _ = _run(recipe, ACTS, config)  # 3 steps (stateless: each the same)
    errs = {"out": rel(out, ref_out), "dx": rel(dx, ref_dx)}
    errs.update({f"d{k}": rel(dp[k], ref_dp[k]) for k in params})
    return errs

  errs = errors(FUSED)
  # Per-block or per-row scales through two FP8 GEMMs: 5-11% seen (bfloat16 activations, the
  # gradients in E5M2); a lost scale, a wrong transpose or blocks along the wrong dim give O(1).
  assert errs["out"] < 0.08, errs
  assert max(errs.values()) < 0.12, errs
  assert min(errs["out"], errs["dx"], errs["dwi_kernel"]) > 0.005, errs
  # The output bias's gradient: dy's float32 column sums, no FP8 on the way.
  assert errs["dwo_bias"] < 1e-5, errs
  # As accurate as the composed path (whose bfloat16 roundings of the norm's output, the
  # activation and its gradient the fused path skips): each error within 8% of the composed
  # path's seen, either way (the two quantize values a bfloat16 rounding apart, so different
  # FP8 codes, each path's errors drawn from the same spread).
  composed = errors(core.GemmConfig(fuse_activation_cast=False))
  for k, err in errs.items():
    assert err <= 1.15 * composed[k] + 1e-4, (k, errs, composed)


def _dense_reference(x, scale, bias, w, b, dz):
  """LayerNorm then the dense GEMM and its bias in float64: ``(z, grads of sum(z * dz))``."""
  with jax.enable_x64(True):
    args = [jnp.float64(a) for a in (x, scale, bias, w, b)]

    def f(x, scale, bias, w, b):
      mean = x.mean(-1, keepdims=True)
      var = ((x - mean) ** 2).mean(-1, keepdims=True)
      y = (x - mean) / jnp.sqrt(var + 1e-6) * scale + bias
      return y @ w + b

    z = f(*args)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * jnp.float64(dz)), argnums=range(5))(*args)
    return np.asarray(z), [np.asarray(g) for g in grads]


@functools.cache
def _dense_step(recipe, config):
  @jax.jit
  def step(x, scale, bias, w, b, dz):
    def loss(*args):
      z, _ = core.layernorm_dense(
        *args[:4], dense_bias=args[4], recipe=recipe, threshold=None, config=config
      )
      return jnp.sum(z.astype(jnp.float32) * dz.astype(jnp.float32)), z

    (_, z), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(x, scale, bias, w, b)
    return z, grads

  return step


def _dense_data(dtype):
  x, p, _ = _data(("gelu",), dtype=dtype)
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.normal(size=(128, 256)) / np.sqrt(128), jnp.float32)
  b = jnp.asarray(rng.normal(size=(256,)) * 0.1, jnp.float32)
  dz = jnp.asarray(rng.normal(size=(*x.shape[:-1], 256)), dtype)
  return x, p["scale"], p["ln_bias"], w, b, dz


def _dense_fused(recipe, *args):
  jaxpr = str(
    jax.make_jaxpr(
      lambda x, s, b, w: core.layernorm_dense(
        x, s, b, w, recipe=recipe, threshold=None, config=FUSED
      )[0]
    )(*args[:4])
  )
  return jaxpr.count("name=_quantized_gemms") == 1 and "name=_norm" not in jaxpr


@pytest.mark.parametrize("name", RECIPES)
def test_fused_layernorm_dense_against_float64(name, rel):
  recipe = RECIPES[name]
  args = _dense_data(jnp.bfloat16)
  assert _dense_fused(recipe, *args)
  step = _dense_step(recipe, FUSED)
  for _ in range(3):
    z, grads = step(*args)
  ref_z, ref_grads = _dense_reference(*args)
  errs = {"z": rel(z, ref_z)}
  errs.update(
    {
      n: rel(g, r)
      for n, g, r in zip(("dx", "dgamma", "dbeta", "dw", "db"), grads, ref_grads, strict=True)
    }
  )
  # One FP8 GEMM: 4-7% seen; a bug gives O(1).
  assert errs["z"] < 0.05, errs
  assert max(errs.values()) < 0.1, errs
  assert min(errs["z"], errs["dx"]) > 0.002, errs
  assert errs["db"] < 1e-5, errs  # dz's column sums in float32
  if name == "rowwise_gw_hp":
    assert errs["dw"] < 1e-5, errs  # the weight gradient's GEMM in high precision
  else:
    assert errs["dw"] > 0.002, errs


@pytest.mark.parametrize("name", ALL)
def test_float32_fused_is_the_composed_path(name):
  # float32 activations: nothing rounds the norm's output, the activation or its gradient
  # between them and their quantization on either path, so the fused producers' values are
  # quantized into the same blocks or rows as the composed path's tensors: the same outputs and
  # gradients, bit for bit on CPU, after 3 steps.
  recipe = ALL[name]
  jax_casts = dict(backend="jax")  # the extension's kernels' fast exp is a few ulp off XLA's
  fused = _run(
    recipe, ACTS, core.GemmConfig(fuse_activation_cast=True, **jax_casts), dtype=jnp.float32
  )
  composed = _run(
    recipe, ACTS, core.GemmConfig(fuse_activation_cast=False, **jax_casts), dtype=jnp.float32
  )
  for a, b in zip(jax.tree.leaves(fused[:3]), jax.tree.leaves(composed[:3]), strict=True):
    _same(a, b, err_msg=name)
  args = _dense_data(jnp.float32)
  zf, gf = _dense_step(recipe, core.GemmConfig(fuse_activation_cast=True, **jax_casts))(*args)
  zc, gc = _dense_step(recipe, core.GemmConfig(fuse_activation_cast=False, **jax_casts))(*args)
  for a, b in zip((zf, *gf), (zc, *gc), strict=True):
    _same(a, b, err_msg=f"{name} layernorm_dense")


def test_stochastic_rounding_keys_reach_each_fused_gemm():
  # NVFP4 rounds each GEMM's output gradient with that GEMM's key: fused as composed.
  recipe = ta.NVFP4BlockScaling()
  x, p, dy = _data(ACTS, dtype=jnp.float32)
  keys = (jax.random.key(1), jax.random.key(2))
  assert _takes_fused(x, p, ACTS, recipe, FUSED, threshold=None, rngs=keys)
  # Without keys the composed path runs (and its GEMMs ask for them under differentiation).
  assert not _takes_fused(x, p, ACTS, recipe, FUSED, threshold=None)

  def grads(config, keys):
    def loss(x, p):
      return jnp.sum(_block(x, p, None, ACTS, recipe, config, threshold=None, rngs=keys) * dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)

  cfg = dict(backend="jax")
  fused = grads(core.GemmConfig(fuse_activation_cast=True, **cfg), keys)
  composed = grads(core.GemmConfig(fuse_activation_cast=False, **cfg), keys)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(composed), strict=True):
    _same(a, b)
  # Another key for GEMM 1 moves GEMM 1's gradients (its dh rounds differently), not GEMM 2's.
  other = grads(core.GemmConfig(fuse_activation_cast=True, **cfg), (jax.random.key(7), keys[1]))
  assert not np.array_equal(other[1]["wi_kernel"], fused[1]["wi_kernel"])
  np.testing.assert_array_equal(other[1]["wo_kernel"], fused[1]["wo_kernel"])
  with pytest.raises(ValueError, match="rounds the gradient stochastically"):
    jax.grad(lambda x: jnp.sum(_block(x, p, None, ACTS, recipe, FUSED, threshold=None)))(x)


@dataclasses.dataclass(frozen=True)
class _NoProducerScaling(ta.Float8CurrentScaling):
  """Current scaling through a format that takes no producer."""


def test_a_format_without_producers_composes_with_a_warning():
  fmt = core.format_of(ta.Float8CurrentScaling())
  core.register_format(fmt._replace(recipe_type=_NoProducerScaling, takes_producer=False))
  try:
    recipe = _NoProducerScaling()
    x, p, _ = _data(ACTS)
    with pytest.warns(core.FusedPathFallbackWarning, match="takes no producer"):
      assert not _takes_fused(x, p, ACTS, recipe, FUSED, threshold=None)
    with pytest.warns(core.FusedPathFallbackWarning, match="takes no producer") as record:
      ours = _block(x, p, None, ACTS, recipe, FUSED, threshold=None)
    # At the line calling the core (the helper's, in its test file), not inside the package.
    (warning,) = [w for w in record if w.category is core.FusedPathFallbackWarning]
    assert warning.filename == _block.__code__.co_filename
    want = _block(
      x,
      p,
      None,
      ACTS,
      ta.Float8CurrentScaling(),
      core.GemmConfig(fuse_activation_cast=False),
      threshold=None,
    )
    np.testing.assert_array_equal(ours, want)
    # Through a layer of each adapter: naming the layer, at the line that runs the model, not
    # inside the adapter.
    import haiku as hk
    from flax import linen as nn
    from flax import nnx

    from te_adapters import haiku as ta_hk
    from te_adapters import linen as ta_linen
    from te_adapters import nnx as ta_nnx

    class LinenBlock(nn.Module):
      @nn.compact
      def __call__(self, x):
        mlp = ta_linen.LayerNormMLP(
          64, recipe=recipe, threshold=None, intermediate_dropout_rate=0.0, name="mlp"
        )
        return mlp(x, deterministic=True)

    def haiku_block(x):
      return ta_hk.LayerNormMLP(64, recipe=recipe, threshold=None, name="mlp")(x)

    k = x.shape[-1]
    runs = [
      ("linen", "layer 'mlp'", lambda: LinenBlock().init(jax.random.key(0), x)),
      (
        "nnx",
        f"LayerNormMLP layer (wi_kernel ({k}, 1, 64))",
        lambda: ta_nnx.LayerNormMLP(k, 64, recipe=recipe, threshold=None, rngs=nnx.Rngs(0))(x),
      ),
      (
        "haiku",
        "layer 'mlp'",
        lambda: hk.transform_with_state(haiku_block).init(jax.random.key(0), x),
      ),
    ]
    for adapter, name, run in runs:
      with pytest.warns(core.FusedPathFallbackWarning) as record:
        run()
      (warning,) = [w for w in record if w.category is core.FusedPathFallbackWarning]
      assert str(warning.message).startswith(f"{name}: _NoProducerScaling: its quantization"), (
        adapter,
        str(warning.message),
      )
      assert warning.filename == __file__, adapter
  finally:
    core.unregister_format(_NoProducerScaling)


def _blocks(v, q_dtype, power_2):
  """FP8 block scaling's 1x128 blocks of ``v`` (P, C) in both orientations, as a
  ``Producer.block_cast`` returns them."""
  spec = formats.OperandSpec("float8_block", (128,), np.dtype(q_dtype), power_2=power_2)
  rows, cols = formats.quantize_trailing(v, spec), formats.quantize_trailing(v.T, spec)
  return rows.data, rows.scale_inv, cols.data, cols.scale_inv, rows.amax


def test_float8_block_takes_a_producers_block_cast():
  """A producer whose kernel casts into 1x128 blocks as it computes the operand
  (``Producer.block_cast``, the fused MLP's on Hopper GPUs) gives FP8 block scaling both copies,
  with the role's FP8 dtype and the recipe's power-of-two rule; the format quantizes ``value``
  instead with the pure-JAX casts asked for, one copy asked for, 128x128 tiles, or a block cast
  that does not run (None)."""
  rng = np.random.default_rng(0)
  v = jnp.asarray(rng.normal(size=(256, 384)), jnp.float32)
  calls = []

  def block_cast(q_dtype, power_2, runs=True):
    calls.append((np.dtype(q_dtype), power_2))
    return _blocks(2 * v, q_dtype, power_2) if runs else None  # 2 * v: told from value's

  def quantize(recipe, role="x", config=FUSED, cols=True, runs=True):
    def cast(scale, with_amax):
      raise AssertionError("a block format takes no per-tensor cast")

    producer = core.Producer(
      cast, value=lambda: v, block_cast=lambda d, p: block_cast(d, p, runs=runs)
    )
    request = core.QuantizeRequest(
      jnp.zeros(v.shape, jnp.bfloat16), role, recipe, config=config, cols=cols, producer=producer
    )
    return core.format_of(recipe).quantize(request)

  def codes(t):
    return np.asarray(jax.lax.bitcast_convert_type(t.data, jnp.uint8))

  recipe = ta.Float8BlockScaling()
  for role, q_dtype in (("x", recipe.fwd_dtype), ("grad", recipe.bwd_dtype)):
    calls.clear()
    q = quantize(recipe, role)
    assert calls == [(np.dtype(q_dtype), recipe.power_2_scale)]
    rows, scales, cols, col_scales, _ = _blocks(2 * v, q_dtype, recipe.power_2_scale)
    np.testing.assert_array_equal(
      codes(q.rows), np.asarray(jax.lax.bitcast_convert_type(rows, jnp.uint8))
    )
    np.testing.assert_array_equal(q.rows.scale_inv, scales)
    np.testing.assert_array_equal(
      codes(q.cols), np.asarray(jax.lax.bitcast_convert_type(cols, jnp.uint8))
    )
    np.testing.assert_array_equal(q.cols.scale_inv, col_scales)
    assert q.rows.dq_dtype == np.dtype(jnp.float32)  # the producers' values are float32
  # Otherwise value's blocks (of v, not 2 * v), as with the pure-JAX casts asked for.
  want = quantize(recipe, config=core.GemmConfig(backend="jax"))
  np.testing.assert_array_equal(want.rows.scale_inv, _blocks(v, recipe.fwd_dtype, True)[1])
  calls.clear()
  for got in (quantize(recipe, cols=False), quantize(recipe, runs=False)):
    np.testing.assert_array_equal(codes(got.rows), codes(want.rows))
    np.testing.assert_array_equal(got.rows.scale_inv, want.rows.scale_inv)
  assert calls == [(np.dtype(recipe.fwd_dtype), True)]  # asked once, and it did not run
  calls.clear()
  tiled = quantize(ta.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1))
  assert calls == [] and tiled.rows.scale_inv.shape == (2, 3)
