"""The quantized dot_general against float64, its dimension numbers, dtypes and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core, inspect

DN = (((1,), (0,)), ((), ()))
RECIPES = [
  ta.Float8CurrentScaling(),
  ta.DelayedScaling(amax_history_len=8),
  ta.Float8CurrentScaling(fp8_format=ta.Format.E4M3),
]


def _data(shapes, seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  pairs = zip(keys, shapes, strict=True)
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in pairs]


def _train(recipe, x, w, dy, dn=DN, steps=3):
  """Runs `steps` fwd+bwd steps threading state; returns y, dx, dw of the last."""
  state = core.init_state(recipe)

  @jax.jit
  def step(x, w, state):
    def loss(x, w, state):
      y = core.dot_general(x, w, dn, threshold=None, recipe=recipe, state=state or None)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, state)
    return y, grads

  for _ in range(steps):
    y, (dx, dw, new_state) = step(x, w, state)
    state = new_state
  return y, dx, dw


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_fwd_bwd_against_float64(recipe, rel):
  x, w, dy = _data([(64, 128), (128, 96), (64, 96)])
  y, dx, dw = _train(recipe, x, w, dy)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  errs = rel(y, x64 @ w64), rel(dx, dy64 @ w64.T), rel(dw, x64.T @ dy64)
  assert errs[0] < 0.05 and errs[1] < 0.08 and errs[2] < 0.08, errs
  # Clearly above what bf16 gives (about 0.003): quantization really happened.
  assert min(errs) > 0.01, errs
  if recipe.fp8_format is ta.Format.E4M3:  # E4M3 gradients are finer than E5M2
    assert errs[1] < 0.05 and errs[2] < 0.05


def test_bf16_error_is_far_lower(rel):
  x, w = _data([(64, 128), (128, 96)], dtype=jnp.bfloat16)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  e_bf16 = rel(core.dot_general(x, w, DN, recipe=None), ref)
  e_fp8 = rel(core.dot_general(x, w, DN, threshold=None, recipe=ta.Float8CurrentScaling()), ref)
  assert e_bf16 < 0.005 < 0.02 < e_fp8


DIMENSION_CASES = [
  # (lhs shape, rhs shape, dimension numbers, einsum)
  ((4, 16, 32), (32, 48), (((2,), (0,)), ((), ())), "bsk,kn->bsn"),
  ((32, 16), (32, 48), (((0,), (0,)), ((), ())), "km,kn->mn"),
  ((16, 32), (48, 32), (((1,), (1,)), ((), ())), "mk,nk->mn"),
  ((2, 16, 32), (2, 32, 16), (((2,), (1,)), ((0,), (0,))), "bmk,bkn->bmn"),
  ((16, 2, 32, 4), (4, 32, 16), (((2, 3), (1, 0)), ((), ())), "mbkj,jkn->mbn"),
  ((16, 3, 32), (32, 3, 16), (((2,), (0,)), ((1,), (1,))), "mbk,kbn->bmn"),
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn, spec", DIMENSION_CASES)
def test_general_dimension_numbers(lhs_shape, rhs_shape, dn, spec, rel):
  x, w = _data([lhs_shape, rhs_shape], seed=3)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), x, w).shape
  (dy,) = _data([out_shape], seed=4)
  y, dx, dw = _train(ta.Float8CurrentScaling(), x, w, dy, dn=dn, steps=1)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  ref_y = np.einsum(spec, x64, w64)
  _, vjp = jax.vjp(
    lambda a, b: jnp.einsum(spec, a, b), x64.astype(np.float32), w64.astype(np.float32)
  )
  ref_dx, ref_dw = vjp(dy64.astype(np.float32))
  assert y.shape == ref_y.shape
  assert rel(y, ref_y) < 0.05
  assert dx.shape == x.shape and rel(dx, ref_dx) < 0.08
  assert dw.shape == w.shape and rel(dw, ref_dw) < 0.08


@pytest.mark.parametrize(
  "lhs_dtype, rhs_dtype, preferred, expected",
  [
    (jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
    (jnp.float32, jnp.float32, None, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.float16, jnp.float16, None, jnp.float16),
  ],
)
def test_output_and_grad_dtypes(lhs_dtype, rhs_dtype, preferred, expected):
  (x,) = _data([(16, 32)], dtype=lhs_dtype)
  (w,) = _data([(32, 16)], dtype=rhs_dtype)
  f = functools.partial(
    core.dot_general,
    dimension_numbers=DN,
    preferred_element_type=preferred,
    threshold=None,
    recipe=ta.Float8CurrentScaling(),
  )
  y = f(x, w)
  assert y.dtype == jax.lax.dot_general(x, w, DN, preferred_element_type=preferred).dtype
  assert y.dtype == np.dtype(expected)
  dx, dw = jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), argnums=(0, 1))(x, w)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_three_gemms_get_fp8_operands():
  x, w = _data([(16, 32), (32, 16)])
  for recipe, grad_dtype in [
    (ta.Float8CurrentScaling(), "float8_e5m2"),
    (ta.Float8CurrentScaling(fp8_format=ta.Format.E4M3), "float8_e4m3fn"),
    (ta.DelayedScaling(amax_history_len=4), "float8_e5m2"),
  ]:
    state = core.init_state(recipe)

    def loss(x, w, state, recipe=recipe):
      return jnp.sum(
        core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state or None) ** 2
      )

    pairs = inspect.dot_general_operand_dtypes(jax.grad(loss, argnums=(0, 1, 2)), x, w, state)
    assert pairs[0] == ("float8_e4m3fn", "float8_e4m3fn")
    # dgrad and wgrad: the gradient in the recipe's backward dtype times an E4M3 operand.
    assert [sorted(p) for p in pairs[1:]] == [sorted((grad_dtype, "float8_e4m3fn"))] * 2
    assert inspect.count_fp8_dot_generals(jax.grad(loss), x, w, state) == (3, 3)


def test_delayed_quantizes_with_stored_scale():
  # x = 1.3 is not an E4M3 value: with stored scale 1 it rounds to 1.25; with scale 3, 3.9
  # rounds to 4, which dequantizes to 4/3.
  recipe = ta.DelayedScaling(amax_history_len=2)
  x = jnp.full((16, 16), 1.3, jnp.float32)
  w = jnp.eye(16, dtype=jnp.float32)
  state = core.init_state(recipe)
  y = core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state)
  np.testing.assert_array_equal(y, np.full((16, 16), 1.25, np.float32))
  state = dict(state, x_scale=jnp.float32([3.0]))
  y = core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state)
  expected = np.float32(4.0) * (np.float32(1.0) / np.float32(3.0))
  np.testing.assert_array_equal(y, np.full((16, 16), expected, np.float32))


def test_recipe_none_is_plain_dot_general():
  x, w = _data([(8, 16), (16, 8)])
  np.testing.assert_array_equal(
    core.dot_general(x, w, DN, recipe=None), jax.lax.dot_general(x, w, DN)
  )


def test_drops_into_functions_taking_dot_general(rel):
  x, w = _data([(4, 16, 32), (32, 16)])
  dg = functools.partial(core.dot_general, threshold=None, recipe=ta.Float8CurrentScaling())
  y = jnp.einsum("bsk,kn->bsn", x, w, _dot_general=dg)
  assert rel(y, np.einsum("bsk,kn->bsn", np.float64(x), np.float64(w))) < 0.05
  assert inspect.count_fp8_dot_generals(
    lambda a, b: jnp.einsum("bsk,kn->bsn", a, b, _dot_general=dg), x, w
  ) == (1, 1)


def test_bad_inputs_raise_clear_errors():
  x, w = _data([(16, 32), (32, 16)])
  r = ta.Float8CurrentScaling()
  with pytest.raises(TypeError, match="lhs must be a floating"):
    core.dot_general(x.astype(jnp.int32), w, DN, threshold=None, recipe=r)
  with pytest.raises(TypeError, match="rhs must be a real floating-point array, got complex"):
    core.dot_general(x, w.astype(jnp.complex64), DN, threshold=None, recipe=r)
  with pytest.raises(ValueError, match="contracting dimension sizes differ"):
    core.dot_general(x, jnp.ones((16, 16)), DN, threshold=None, recipe=r)
  with pytest.raises(ValueError, match="out of range"):
    core.dot_general(x, w, (((2,), (0,)), ((), ())), threshold=None, recipe=r)
  with pytest.raises(TypeError, match="recipe must be"):
    core.dot_general(x, w, DN, threshold=None, recipe="fp8")
  delayed = ta.DelayedScaling(amax_history_len=4)
  with pytest.raises(ValueError, match="keeps state"):
    core.dot_general(x, w, DN, threshold=None, recipe=delayed)
  other = core.init_state(ta.DelayedScaling(amax_history_len=8))
  with pytest.raises(ValueError, match="x_amax_history.*shape"):
    core.dot_general(x, w, DN, threshold=None, recipe=delayed, state=other)
  partial = {k: v for k, v in core.init_state(delayed).items() if k != "grad_scale"}
  with pytest.raises(ValueError, match="missing \\['grad_scale'\\]"):
    core.dot_general(x, w, DN, threshold=None, recipe=delayed, state=partial)
  bad_dtype = dict(core.init_state(delayed), x_scale=jnp.ones((1,), jnp.bfloat16))
  with pytest.raises(TypeError, match="x_scale.*float32"):
    core.dot_general(x, w, DN, threshold=None, recipe=delayed, state=bad_dtype)


@pytest.mark.parametrize("rows", [16, 4096])  # large tensors take XLA:CPU's vectorised reductions
def test_nan_in_operand_propagates_to_output_not_to_scale(rows):
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, w = _data([(rows, 32), (32, 16)])
  x = x.at[3, 3].set(jnp.nan)
  state = core.init_state(recipe)

  def loss(x, w, state):
    return jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state))

  y = core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state)
  assert np.isnan(np.asarray(y)).all()  # GemmConfig.non_finite: the non-finite amax's NaN scale
  saturate = ta.GemmConfig(non_finite="saturate")  # TE's cast: the NaN code, in its row alone
  y = core.dot_general(x, w, DN, threshold=None, recipe=recipe, state=state, config=saturate)
  assert np.isnan(np.asarray(y)[3]).all() and np.isfinite(np.asarray(y)[0]).all()
  new = jax.grad(loss, argnums=2)(x, w, state)
  for role in ("x", "kernel", "grad"):
    assert np.isfinite(np.asarray(new[f"{role}_scale"])).all()
  np.testing.assert_array_equal(new["x_scale"], state["x_scale"])


def _gemm_precisions(recipe, precision=None, config=None):
  """{"fwd"|"dgrad"|"wgrad": the precision each FP8 dot_general of one fwd+bwd was given}."""
  from te_adapters import inspect as _inspect

  x, w = _data([(16, 32), (32, 48)])

  def loss(x, w):
    y = core.dot_general(
      x,
      w,
      DN,
      precision,
      threshold=None,
      recipe=recipe,
      state=core.init_state(recipe) or None,
      config=config,
    )
    return jnp.sum(y.astype(jnp.float32) ** 2)

  by_shape = {(16, 48): "fwd", (16, 32): "dgrad", (32, 48): "wgrad"}
  out = {}
  for eqn in _inspect.equations(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)):
    if eqn.primitive.name == "dot_general":
      assert "float8" in str(eqn.invars[0].aval.dtype)
      p = eqn.params["precision"]
      p = None if p is None else p[0] if isinstance(p, tuple) else p
      out[by_shape[tuple(eqn.outvars[0].aval.shape)]] = p
  assert sorted(out) == ["dgrad", "fwd", "wgrad"], out
  return out


@pytest.mark.parametrize("cls", [ta.Float8CurrentScaling, ta.DelayedScaling])
def test_mm_params_choose_each_gemms_accumulation(cls):
  # XLA's FP8 dot_generals, whose precision says how they sum (on Hopper the extension's
  # cuBLASLt GEMM replaces them by default; tests/core/test_fp8_gemm_gpu.py checks its flags).
  xla = ta.GemmConfig(fp8_gemm="xla")
  highest, fast = jax.lax.Precision.HIGHEST, ta.MMParams(use_split_accumulator=False)
  # TE's recipe defaults: fast sums forward, float32-promoted sums in dgrad and wgrad.
  assert _gemm_precisions(cls(), config=xla) == {"fwd": None, "dgrad": highest, "wgrad": highest}
  assert _gemm_precisions(cls(fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast), config=xla) == {
    "fwd": None,
    "dgrad": None,
    "wgrad": None,
  }
  split_fwd = cls(fp8_gemm_fprop=ta.MMParams(), fp8_gemm_wgrad=fast)
  assert _gemm_precisions(split_fwd, config=xla) == {
    "fwd": highest,
    "dgrad": highest,
    "wgrad": None,
  }
  # Without a split accumulator the caller's precision decides.
  assert _gemm_precisions(cls(fp8_gemm_dgrad=fast), highest, xla)["dgrad"] == highest


def test_mm_params_are_checked():
  with pytest.raises(TypeError, match="fp8_gemm_wgrad must be a te_adapters.MMParams"):
    ta.Float8CurrentScaling(fp8_gemm_wgrad=True)
  with pytest.raises(TypeError, match="use_split_accumulator must be a bool"):
    ta.MMParams(use_split_accumulator=1)
  recipe = ta.DelayedScaling(fp8_gemm_dgrad=ta.MMParams(False))
  assert hash(recipe) == hash(ta.DelayedScaling(fp8_gemm_dgrad=ta.MMParams(False)))
