"""The fused activation casts of core.layernorm_mlp (one custom VJP around both per-tensor FP8
GEMMs): against float64, against the composed path (GemmConfig(fuse_activation_cast=False)),
the recipe state of both GEMMs after several steps, what the compiled forward writes, remat, and
the fallbacks to the composed path."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from bench.layernorm_fusion import _activation_buffers
from te_adapters import core
from tests.conftest import FP8_GEMM_RTOL, rel_err

from .test_mlp import _reference_grads, _states

ON_CPU = jax.default_backend() == "cpu"


def _assert_same(a, b, rtol=FP8_GEMM_RTOL, err_msg=""):
  """Bit for bit on CPU. Two compiled programs on a GPU are fused differently by XLA and round
  their float32 reductions and GEMM outputs differently: there, within ``rtol``."""
  if ON_CPU:
    np.testing.assert_array_equal(a, b, err_msg=err_msg)
  else:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(
      a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b), initial=0)), err_msg=err_msg
    )


B, S, K, F = 2, 64, 128, 256  # multiples of 128 for Float8BlockScaling
RECIPES = {"current": ta.Float8CurrentScaling(), "delayed": ta.DelayedScaling(amax_history_len=4)}
FUSED = core.GemmConfig(fuse_activation_cast=True)
COMPOSED = core.GemmConfig(fuse_activation_cast=False)


def _data(activations, seed=0, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  n_act = len(activations)

  def r(*shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  params = {
    "scale": 1.0 + r(K, scale=0.1),
    "ln_bias": r(K, scale=0.1),
    "wi_kernel": r(K, n_act, F, scale=K**-0.5),
    "wo_kernel": r(F, K, scale=F**-0.5),
    "wi_bias": r(n_act, F, scale=0.3),
    "wo_bias": r(K, scale=0.1),
  }
  return r(B, S, K).astype(dtype), params, r(B, S, K).astype(dtype)


def _block(x, p, states, activations, recipe, config, **kw):
  return core.layernorm_mlp(
    x,
    p["scale"],
    p["ln_bias"],
    p["wi_kernel"],
    p["wo_kernel"],
    p["wi_bias"],
    p["wo_bias"],
    activations=activations,
    recipe=recipe,
    states=states,
    config=config,
    **kw,
  )[0]


def _step_fn(recipe, activations, config, **kw):
  @jax.jit
  def step(x, params, states, dy):
    def loss(x, params, states):
      out = _block(x, params, states, activations, recipe, config, threshold=None, **kw)
      return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, params, states)
    return out, grads

  return step


def _takes_fused(x, p, activations, recipe, config, **kw):
  jaxpr = jax.make_jaxpr(lambda x, p, s: _block(x, p, s, activations, recipe, config, **kw))(
    x, p, _states(recipe)
  )
  # Fused: both GEMMs and the activation in one run of the quantized GEMM rule.
  text = str(jaxpr)
  return text.count("name=_quantized_gemms") == 1 and "name=_activation" not in text


def _run(recipe, activations, config, steps=3, seed=0, dtype=jnp.bfloat16):
  x, params, dy = _data(activations, seed, dtype)
  step = _step_fn(recipe, activations, config)
  states = _states(recipe)
  for _ in range(steps):  # delayed scaling: scales from the previous steps' amaxes
    out, (dx, dp, states) = step(x, params, states, dy)
  return out, dx, dp, states


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("name", RECIPES)
def test_fused_block_against_float64(name, activations, rel):
  recipe = RECIPES[name]
  x, params, dy = _data(activations)
  assert _takes_fused(x, params, activations, recipe, FUSED, threshold=None)
  out, dx, dp, _ = _run(recipe, activations, FUSED)
  ref_out, ref_dx, ref_dp = _reference_grads(x, params, dy, activations)
  errs = {"out": rel(out, ref_out), "dx": rel(dx, ref_dx)}
  errs.update({f"d{k}": rel(dp[k], ref_dp[k]) for k in params})
  # FP8 through two GEMMs: a few percent; a bug (a lost scale, a wrong transpose, the bias
  # gradient of the wrong slice) gives O(1). The output bias's gradient is exact.
  assert errs["out"] < 0.08, errs
  assert max(errs.values()) < 0.12, errs
  assert min(errs["out"], errs["dx"], errs["dwi_kernel"], errs["dwo_kernel"]) > 0.005, errs
  # The bias gradient sums dh over the 128 rows: FP8's error in dz averages out somewhat.
  assert errs["dwi_bias"] < 0.1, errs
  # The output bias's gradient is dy's column sums, in float32 in the pass that casts dy (not
  # rounded to dy's bfloat16 as XLA's reduce of the bias add's gradient did: about 2e-3).
  assert errs["dwo_bias"] < 1e-5, errs


@pytest.mark.parametrize("name", RECIPES)
def test_fused_equals_composed_within_fp8_rounding(name, rel):
  # bfloat16 activations: the composed path rounds the norm's output, act(h + b) and dh to
  # bfloat16 before their FP8 casts, the fused path casts the float32 values; the results differ
  # by that alone.
  recipe, acts = RECIPES[name], ("gelu", "linear")
  fused = _run(recipe, acts, FUSED)
  composed = _run(recipe, acts, COMPOSED)
  for a, b in zip(jax.tree.leaves(fused[:3]), jax.tree.leaves(composed[:3]), strict=True):
    # 0.02 to 0.05 seen: each bfloat16 rounding moves about 3% of the values across an FP8
    # rounding boundary. Each path is 0.06 to 0.1 from float64, so unrelated quantizations would
    # differ by 0.09 to 0.14; a bug gives O(1).
    assert rel(a, b) < 0.07


@pytest.mark.parametrize("name", RECIPES)
def test_float32_fused_is_the_composed_path(name):
  # float32 activations: no rounding between the activation and its cast on either path, so the
  # same quantized tensors, GEMMs and states (the recipe state contract of layernorm_mlp).
  recipe, acts = RECIPES[name], ("silu", "linear")
  config = dict(backend="jax")  # the extension's kernels' fast exp is a few ulp off XLA's
  fused = _run(
    recipe, acts, core.GemmConfig(fuse_activation_cast=True, **config), dtype=jnp.float32
  )
  composed = _run(
    recipe, acts, core.GemmConfig(fuse_activation_cast=False, **config), dtype=jnp.float32
  )
  _assert_same(fused[0], composed[0])
  for a, b in zip(jax.tree.leaves(fused[1:3]), jax.tree.leaves(composed[1:3]), strict=True):
    np.testing.assert_allclose(a, b, rtol=max(1e-5, FP8_GEMM_RTOL), atol=1e-6)  # sums reordered
  for a, b in zip(jax.tree.leaves(fused[3]), jax.tree.leaves(composed[3]), strict=True):
    _assert_same(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_delayed_state_after_several_steps_is_the_composed_paths(dtype):
  recipe, acts = RECIPES["delayed"], ("gelu", "linear")
  jax_casts = dict(backend="jax")  # the extension's kernels' fast exp is a few ulp off XLA's
  step_f = _step_fn(recipe, acts, core.GemmConfig(fuse_activation_cast=True, **jax_casts))
  step_c = _step_fn(recipe, acts, core.GemmConfig(fuse_activation_cast=False, **jax_casts))
  sf = sc = _states(recipe)
  for seed in range(5):  # more steps than the history holds: the roll and the window's max
    x, params, dy = _data(acts, seed=seed, dtype=dtype)
    _, (_, _, sf) = step_f(x, params, sf, dy)
    _, (_, _, sc) = step_c(x, params, sc, dy)
    for gemm in range(2):
      for role in ("x", "kernel", "grad"):
        hist_f = np.asarray(sf[gemm][f"{role}_amax_history"])
        hist_c = np.asarray(sc[gemm][f"{role}_amax_history"])
        scale_f, scale_c = sf[gemm][f"{role}_scale"], sc[gemm][f"{role}_scale"]
        assert hist_f[-1] > 0, (gemm, role)
        if dtype == jnp.bfloat16 and (gemm, role) in ((0, "x"), (1, "x"), (0, "grad")):
          # The norm's output, the activation and its gradient: float32 amaxes against those of
          # values rounded to bfloat16, and after the first step quantized with scales that
          # differ as much: under 1% seen.
          np.testing.assert_allclose(hist_f, hist_c, rtol=0.02)
          np.testing.assert_allclose(scale_f, scale_c, rtol=0.02)
        else:
          # The same tensors quantized the same way: the same amaxes and scales, bit for bit
          # (on a GPU, to the rounding of two differently fused programs, over several steps).
          _assert_same(hist_f, hist_c, rtol=0.02)
          _assert_same(scale_f, scale_c, rtol=0.02)
  # TE's rule after 5 steps of a 4-slot history: the scale from the last 4 amaxes' max.
  hist = np.asarray(sf[1]["grad_amax_history"])
  np.testing.assert_allclose(sf[1]["grad_scale"], [57344.0 / hist.max()], rtol=1e-6)


@pytest.mark.parametrize("name", RECIPES)
def test_the_switch_drops_the_bfloat16_activation_buffer(name):
  # Gated pair: GEMM 1's output is (M, 2F), so an (M, F) buffer is the activation's output.
  recipe, acts = RECIPES[name], ("gelu", "linear")
  m, k, f = 192, 64, 320
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  wi = jax.random.normal(jax.random.key(1), (k, 2, f)) / math.sqrt(k)
  wo = jax.random.normal(jax.random.key(2), (f, k)) / math.sqrt(f)
  bias = jnp.zeros((2, f))
  counts = {}
  for fuse in (True, False):
    config = core.GemmConfig(fuse_activation_cast=fuse)

    def fwd(x, wi, wo, states, config=config):
      def f(x, wi, wo, states):
        return core.layernorm_mlp(
          x,
          jnp.ones(k),
          jnp.zeros(k),
          wi,
          wo,
          bias,
          activations=acts,
          recipe=recipe,
          states=states,
          threshold=None,
          config=config,
        )[0]

      return jax.vjp(f, x, wi, wo, states)

    hlo = jax.jit(fwd).lower(x, wi, wo, _states(recipe)).compile().as_text()
    counts[fuse] = [b for b in _activation_buffers(hlo, m * f) if b.startswith("bf16")]
  assert counts[True] == [], counts
  assert counts[False], counts  # the composed path writes act(h + b) in bfloat16


def test_fallbacks_give_the_composed_results():
  acts = ("gelu", "linear")
  x, p, _ = _data(acts)
  current = RECIPES["current"]
  cases = {
    "dropout": (current, dict(dropout_rate=0.5, dropout_rng=jax.random.key(0), threshold=None)),
    # M = 2 x 48 rows: 128-row blocks cannot tile the weight gradients' M.
    "block rows": (ta.Float8BlockScaling(), dict(threshold=None)),
    "threshold": (current, {}),  # the suite's size threshold keeps these GEMMs in bf16
  }
  for what, (recipe, kw) in cases.items():
    xs = x[:, :48] if what == "block rows" else x
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
      assert not _takes_fused(xs, p, acts, recipe, FUSED, **kw), what
      ours, composed = (
        jax.jit(functools.partial(_block, activations=acts, recipe=recipe, config=c, **kw))(
          xs, p, _states(recipe)
        )
        for c in (FUSED, COMPOSED)
      )
    np.testing.assert_array_equal(ours, composed, err_msg=what)
  # Sharding constraints stay on the fused path (tests/core/test_fused_sharding.py).
  constrained = dict(
    dot_1_input_constraint=lambda y: y, dot_2_input_constraint=lambda z: z, threshold=None
  )
  assert _takes_fused(x, p, acts, current, FUSED, **constrained)
  # Deterministic dropout is no dropout: fused.
  assert _takes_fused(
    x, p, acts, current, FUSED, dropout_rate=0.5, deterministic=True, threshold=None
  )
  with pytest.warns(core.HighPrecisionGemmWarning):
    _block(x, p, None, acts, current, FUSED)


def test_remat_gives_the_same_gradients_and_state():
  recipe, acts = RECIPES["delayed"], ("silu", "linear")
  x, params, dy = _data(acts)

  def loss(x, params, states):
    out = _block(x, params, states, acts, recipe, FUSED, threshold=None)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))
  policy = jax.jit(
    jax.grad(jax.checkpoint(loss, policy=core.save_quantized_operands), argnums=(0, 1, 2))
  )
  states = _states(recipe)
  want = grads(x, params, states)
  for fn in (remat, policy):
    got = fn(x, params, states)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
      _assert_same(a, b)
    # The recomputed forward may be fused differently by XLA: float32 sums an ulp apart (on a
    # GPU, now and then an FP8 value one step apart, through the GEMMs: normwise there; the
    # H100 gave 6.4e-3 for one gradient, from flips of single FP8 codes, each up to 1/8 of its
    # value, where a gradient computed wrong is off by far more than 1.5e-2).
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
      if ON_CPU:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
      else:
        assert rel_err(a, b) < 1.5e-2


@pytest.mark.parametrize("name", RECIPES)
def test_default_fuses_both_per_tensor_recipes(name):
  # None: the faster path of each recipe on an H100 (GemmConfig's docstring).
  recipe, acts = RECIPES[name], ("gelu",)
  x, p, _ = _data(acts)
  assert _takes_fused(x, p, acts, recipe, core.GemmConfig(), threshold=None)
  assert _takes_fused(x, p, acts, recipe, FUSED, threshold=None)
  assert not _takes_fused(x, p, acts, recipe, COMPOSED, threshold=None)


def test_bad_switch_value_is_a_clear_error():
  with pytest.raises(ValueError, match="fuse_activation_cast must be True, False or None"):
    core.GemmConfig(fuse_activation_cast="yes")


def test_norm_output_on_request_keeps_the_norm_outside(rel):
  # The fused path casts the norm's float32 output to FP8 unless the caller wants that output.
  acts = ("silu", "linear")
  x, p, _ = _data(acts)
  recipe = RECIPES["current"]
  args = (x, p["scale"], p["ln_bias"], p["wi_kernel"], p["wo_kernel"], p["wi_bias"], p["wo_bias"])
  inside, none = core.layernorm_mlp(
    *args, activations=acts, recipe=recipe, threshold=None, config=FUSED
  )
  outside, ln = core.layernorm_mlp(
    *args,
    activations=acts,
    recipe=recipe,
    threshold=None,
    config=FUSED,
    return_layernorm_output=True,
  )
  assert none is None
  _assert_same(ln, core.layernorm(x, p["scale"], p["ln_bias"]), rtol=1e-2)  # bf16 ulp
  assert 0 < rel(inside, outside) < 0.07  # the bfloat16 rounding of the norm's output alone
  assert _takes_fused(x, p, acts, recipe, FUSED, threshold=None, return_layernorm_output=True)


@pytest.mark.parametrize(
  "how",
  ["vmap", "no-norm"],
)
def test_float32_fused_is_the_composed_path_under_vmap_and_without_norm(how):
  # vmap over a leading batch axis with one shared state (the new state reduced over the batch),
  # and enable_layernorm=False (GEMM 1's input cast as it is).
  recipe, acts = RECIPES["delayed"], ("gelu",)
  x, p, dy = _data(acts, dtype=jnp.float32)
  kw = dict(enable_layernorm=False) if how == "no-norm" else {}

  def grads(config):
    def loss(x, p, states, dy):
      out = _block(x, p, states, acts, recipe, config, threshold=None, **kw)
      return jnp.sum(out * dy)

    g = jax.grad(loss, argnums=(0, 1, 2))
    if how == "vmap":
      g = jax.vmap(g, in_axes=(0, None, None, 0))
    return jax.jit(g)(x, p, _states(recipe), dy)

  fused = grads(core.GemmConfig(backend="jax", fuse_activation_cast=True))
  composed = grads(core.GemmConfig(backend="jax", fuse_activation_cast=False))
  assert _takes_fused(x, p, acts, recipe, FUSED, threshold=None, **kw)
  for a, b in zip(jax.tree.leaves(fused[:2]), jax.tree.leaves(composed[:2]), strict=True):
    np.testing.assert_allclose(a, b, rtol=max(1e-5, FP8_GEMM_RTOL), atol=1e-6)
  for a, b in zip(jax.tree.leaves(fused[2]), jax.tree.leaves(composed[2]), strict=True):
    assert a.shape == b.shape  # unbatched, like the state it replaces
    _assert_same(a, b)
