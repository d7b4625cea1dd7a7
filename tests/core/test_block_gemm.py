"""Block-scaled ``dot_general`` and its VJP against float64, for every block recipe.

Error model. Quantizing an operand multiplies each element by ``(1 + d)`` with a small relative
error ``d``; its normwise size ``eps = ||dq(q(a)) - a|| / ||a||`` is measured on the very copy the
GEMM uses. To first order a product's error is ``sum_k a_k b_k (d_a + d_b)``; the two operands'
errors are independent of each other and of the other operand's values, so the normwise error of
the product is ``sqrt(eps_a**2 + eps_b**2)``. We assert the measured GEMM error within 15% of that
prediction: a GEMM that used other quantized values than its operands' (a transposed copy
quantized twice, scales applied to the wrong rows or K slices, a missing NVFP4 tensor factor, the
RHT on one operand only) breaks it.

Absolute sizes, for N(0,1) data: a format with ``p`` mantissa bits and round-to-nearest has
per-element relative error uniform in +-2**-(p+1) of the binade, so over log-uniform mantissas
``eps = 2**-p / sqrt(12) * sqrt(E[1/m**2]) = 2**-p * 0.2123``: 0.0265 for E4M3 (p = 3), 0.053
for E5M2 (p = 2). Block scales keep every block's largest value near the top of the range, so
N(0,1) data stay out of the subnormals and the forward error is ``sqrt(2) * 0.0265 = 0.0375``
(MXFP8 and FP8 blocks), dgrad/wgrad with an E5M2 gradient ``0.059``. E2M1 (p = 1, values
0..6) gives about 0.1 per operand and 0.14 to 0.18 per GEMM; stochastic rounding doubles the
gradient's error variance (``spacing**2 / 6`` instead of ``/ 12``). bf16 (p = 7) gives 0.003, so
an error above 5x bf16's proves the operands were really quantized.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_adapters as ta
from tests.conftest import rel_err as rel

M, K, N = 128, 256, 128
DN = (((1,), (0,)), ((), ()))

RECIPES = {
  "mxfp8": ta.MXFP8BlockScaling(),
  "mxfp8_hybrid": ta.MXFP8BlockScaling(fp8_format=ta.Format.HYBRID),
  "float8_block": ta.Float8BlockScaling(),
  "float8_block_f32_scales": ta.Float8BlockScaling(use_f32_scales=True),
  "nvfp4": ta.NVFP4BlockScaling(),
  "nvfp4_1d_rn": ta.NVFP4BlockScaling(
    disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
  ),
}

# Derived absolute upper bounds (fwd, dgrad, wgrad): 1.15 x the model above.
E4M3_GEMM = 1.15 * np.sqrt(2) * 0.0265
E5M2_GEMM = 1.15 * np.hypot(0.0265, 0.053)
ABSOLUTE_BOUNDS = {
  "mxfp8": (E4M3_GEMM,) * 3,
  "mxfp8_hybrid": (E4M3_GEMM, E5M2_GEMM, E5M2_GEMM),
  "float8_block": (E4M3_GEMM,) * 3,
  "float8_block_f32_scales": (E4M3_GEMM,) * 3,
  "nvfp4": (0.17, 0.21, 0.2),
  "nvfp4_1d_rn": (0.16, 0.16, 0.16),
}


@functools.cache
def _data():
  rng = np.random.default_rng(0)
  return tuple(rng.standard_normal(s).astype(np.float32) for s in ((M, K), (K, N), (M, N)))


def _copy_error(a, recipe, role, axis, key=None, rht=False):
  t = ta.core.quantize(a, recipe=recipe, role=role, axis=axis, rng=key, rht=rht)
  d = ta.dequantize(t, jnp.float32)
  return jnp.linalg.norm(d - a) / jnp.linalg.norm(a)


@functools.cache
def _run(name):
  """Forward, VJP and the quantization error of every operand copy, in one compiled call."""
  recipe = RECIPES[name]
  key = jax.random.key(7) if recipe.uses_rng else None
  two_d_w = name.startswith("float8_block") or name == "nvfp4"
  w_axes = ((0, 1), (0, 1)) if two_d_w else (0, 1)
  rht = name == "nvfp4"

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(
      lambda x, w: ta.core.dot_general(x, w, DN, threshold=None, recipe=recipe, rng=key), x, w
    )
    dx, dw = vjp(g)
    eps = {
      "x": _copy_error(x, recipe, "x", 1),
      "w_fwd": _copy_error(w, recipe, "kernel", w_axes[0]),
      "g": _copy_error(g, recipe, "grad", 1, key),
      "w_dgrad": _copy_error(w, recipe, "kernel", w_axes[1]),
      "x_wgrad": _copy_error(x, recipe, "x", 0, rht=rht),
      "g_wgrad": _copy_error(g, recipe, "grad", 0, key, rht=rht),
    }
    return y, dx, dw, eps

  x, w, g = _data()
  return jax.tree.map(np.asarray, run(x, w, g))


@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_vjp_against_float64(name):
  x, w, g = (a.astype(np.float64) for a in _data())
  y, dx, dw, eps = _run(name)
  errors = (rel(y, x @ w), rel(dx, g @ w.T), rel(dw, x.T @ g))
  predicted = (
    np.hypot(eps["x"], eps["w_fwd"]),
    np.hypot(eps["g"], eps["w_dgrad"]),
    np.hypot(eps["x_wgrad"], eps["g_wgrad"]),
  )
  xb, wb, gb = (a.astype(jnp.bfloat16).astype(np.float64) for a in _data())
  bf16 = (rel(xb @ wb, x @ w), rel(gb @ wb.T, g @ w.T), rel(xb.T @ gb, x.T @ g))
  for what, err, pred, bound, low in zip(
    ("forward", "dgrad", "wgrad"), errors, predicted, ABSOLUTE_BOUNDS[name], bf16, strict=True
  ):
    assert 0.85 * pred < err < 1.15 * pred, (what, err, pred, eps)
    assert err < bound, (what, err, bound)
    assert err > 5 * low, (what, err, low)


def test_hybrid_gradient_is_e5m2():
  # The E5M2 gradient copies are coarser than E4M3 ones by one mantissa bit (2x error).
  e4 = _run("mxfp8")[3]
  e5 = _run("mxfp8_hybrid")[3]
  for copy in ("g", "g_wgrad"):
    assert 1.7 < e5[copy] / e4[copy] < 2.3
  assert e5["x"] == e4["x"]


def test_general_dimension_numbers_match_the_plain_layout():
  """Batch dims, contracting dims not last, kernel transposed: same quantized values."""
  recipe = RECIPES["mxfp8"]
  rng = np.random.default_rng(1)
  xs = rng.standard_normal((2, 64, 32)).astype(np.float32)  # (batch, K, M)
  ws = rng.standard_normal((2, 32, 64)).astype(np.float32)  # (batch, N, K)
  gs = rng.standard_normal((2, 32, 32)).astype(np.float32)  # (batch, M, N)
  dn = (((1,), (2,)), ((0,), (0,)))

  @jax.jit
  def both(xs, ws, gs):
    general = jax.vjp(
      lambda a, b: ta.core.dot_general(a, b, dn, threshold=None, recipe=recipe), xs, ws
    )
    plain = lambda a, b: ta.core.dot_general(a.T, b.T, DN, threshold=None, recipe=recipe)
    per_batch = [jax.vjp(plain, xs[i], ws[i]) for i in range(2)]
    out_general = (general[0], *general[1](gs))
    out_plain = [(y, *vjp(gs[i])) for i, (y, vjp) in enumerate(per_batch)]
    return out_general, out_plain

  (y, dx, dw), plain = both(xs, ws, gs)
  assert y.shape == (2, 32, 32) and dx.shape == xs.shape and dw.shape == ws.shape
  for i in range(2):
    np.testing.assert_array_equal(y[i], plain[i][0])
    np.testing.assert_array_equal(dx[i], plain[i][1])
    np.testing.assert_array_equal(dw[i], plain[i][2])
  assert rel(y, np.einsum("bkm,bnk->bmn", xs, ws)) < E4M3_GEMM


def test_bf16_operands_and_preferred_element_type():
  recipe = RECIPES["mxfp8"]
  x, w, _ = _data()
  xb, wb = jnp.asarray(x[:64, :64], jnp.bfloat16), jnp.asarray(w[:64, :64], jnp.bfloat16)
  out = jax.eval_shape(
    lambda a, b: ta.core.dot_general(a, b, DN, threshold=None, recipe=recipe), xb, wb
  )
  assert out.dtype == jnp.bfloat16
  f = lambda a, b: ta.core.dot_general(
    a, b, DN, preferred_element_type=jnp.float32, threshold=None, recipe=recipe
  )
  out = jax.eval_shape(f, xb, wb)
  assert out.dtype == jnp.float32
  grads = jax.eval_shape(jax.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1)), xb, wb)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


# -- training ------------------------------------------------------------------------------------

TRAIN = {
  "mxfp8": RECIPES["mxfp8"],
  "float8_block": RECIPES["float8_block"],
  "nvfp4": RECIPES["nvfp4"],
}
STEPS = 8


def _mlp_loss(params, batch, recipe, key):
  x, target = batch
  keys = jax.random.split(key, 2) if recipe is not None and recipe.uses_rng else (None, None)
  h = jnp.tanh(ta.core.dot_general(x, params["w1"], DN, threshold=None, recipe=recipe, rng=keys[0]))
  y = ta.core.dot_general(h, params["w2"], DN, threshold=None, recipe=recipe, rng=keys[1])
  return jnp.mean((y - target) ** 2)


@functools.cache
def _train(name):
  recipe = None if name == "float32" else TRAIN[name]
  rng = np.random.default_rng(3)
  x = rng.standard_normal((128, 128)).astype(np.float32)
  teacher = rng.standard_normal((128, 128)).astype(np.float32) / np.sqrt(128)
  target = np.tanh(x @ teacher) * 2
  params = {
    "w1": jnp.asarray(rng.standard_normal((128, 128)) / np.sqrt(128), jnp.float32),
    "w2": jnp.asarray(rng.standard_normal((128, 128)) / np.sqrt(128), jnp.float32),
  }
  tx = optax.adam(3e-2)

  @jax.jit
  def step(params, opt_state, key):
    loss, grads = jax.value_and_grad(_mlp_loss)(params, (x, target), recipe, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  losses = []
  for i in range(STEPS):
    params, opt_state, loss = step(params, opt_state, jax.random.key(i))
    losses.append(float(loss))
  return np.array(losses)


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_steps_track_float32(name):
  ref = _train("float32")
  losses = _train(name)
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.6 * losses[0], losses
  # Same data, init and optimizer: the quantized run follows the float32 one (FP8 within a few
  # percent; FP4's ~10x larger gradient noise makes NVFP4 drift further over the steps).
  tol = 0.03 if name != "nvfp4" else 0.3
  np.testing.assert_allclose(losses, ref, rtol=tol)
