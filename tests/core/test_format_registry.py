"""The one format interface: a recipe maps to one registered format, and a new format added from
outside the package runs through ``dot_general``, the fused MLP and ``ragged_dot`` unchanged.

The toy format here is per-tensor E4M3 with power-of-two scales (``2**floor(log2(448 / amax))``):
a real FP8 GEMM on Hopper, and exact to check against float64 since the scales are exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core, inspect

DN = (((1,), (0,)), ((), ()))
E4M3_MAX = 448.0
# Against float64 products of the quantized values: exact to float32 sums on CPU; on a GPU the
# FP8 GEMM's own sums (fast accumulation in the forward GEMM) are off by up to about 1e-4 of
# the output. A wrong scale or a rounding that is not the format's is off by 1e-2 or more.
EXACT = 2e-3 if jax.default_backend() == "gpu" else 1e-6


@dataclasses.dataclass(frozen=True)
class PowerOfTwoScaling(core.Recipe):
  """Per-tensor E4M3 for every operand, the scale rounded down to a power of two; stateless."""

  fp8_format: core.Format = core.Format.E4M3
  fp8_gemm_fprop: core.MMParams = core.MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: core.MMParams = core.MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: core.MMParams = core.MMParams(use_split_accumulator=True)


def _pow2_scale(amax, fp8_max):
  ok = (amax > 0) & jnp.isfinite(amax)
  exponent = jnp.floor(jnp.log2(fp8_max / jnp.where(ok, amax, 1.0)))
  return jnp.where(ok, jnp.exp2(exponent), 1.0).astype(jnp.float32)


def _next_scale(recipe, amax, state, role, fp8_max):
  del recipe, state, role
  return _pow2_scale(amax, fp8_max), None


POW2 = core.TensorScaling(
  init_state=lambda recipe: {},
  state_shapes=lambda recipe: {},
  stored_scale=lambda state, role: None,
  state_varying=lambda state, role: None,
  next_scale=_next_scale,
  next_state=lambda state, roles: {},
)


@pytest.fixture
def pow2():
  core.register_format(core.tensor_format(PowerOfTwoScaling, POW2))
  yield PowerOfTwoScaling()
  core.unregister_format(PowerOfTwoScaling)


def _quantized64(x):
  """float64 values of ``x`` after the toy format's quantization."""
  x = np.asarray(x, np.float64)
  amax = np.max(np.abs(x))
  scale = 2.0 ** np.floor(np.log2(E4M3_MAX / amax))
  q = np.asarray(jnp.asarray(np.clip(x * scale, -E4M3_MAX, E4M3_MAX), jnp.float8_e4m3fn))
  return q.astype(np.float64) / scale


def _data(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def test_an_unregistered_recipe_is_an_error_not_a_fallback():
  @dataclasses.dataclass(frozen=True)
  class Unknown(core.Recipe):
    fp8_format: core.Format = core.Format.E4M3

  x = jnp.ones((16, 32))
  with pytest.raises(TypeError, match="no quantization format is registered for .*Unknown"):
    core.dot_general(x, x.T, DN, recipe=Unknown(), threshold=None)
  with pytest.raises(TypeError, match="no quantization format is registered"):
    core.init_state(Unknown())
  with pytest.raises(TypeError, match="register takes a QuantizationFormat"):
    core.register_format(POW2)
  with pytest.raises(ValueError, match="already registered"):
    core.register_format(core.format_of(ta.DelayedScaling()))


def test_every_package_recipe_has_its_format():
  recipes = [
    ta.DelayedScaling(),
    ta.Float8CurrentScaling(),
    ta.MXFP8BlockScaling(),
    ta.NVFP4BlockScaling(),
    ta.Float8BlockScaling(),
  ]
  per_tensor = [core.format_of(r).per_tensor for r in recipes]
  assert per_tensor == [True, True, False, False, False]
  assert [core.format_of(r).recipe_type for r in recipes] == [type(r) for r in recipes]


def test_toy_format_quantizes_with_power_of_two_scales(pow2):
  x = _data((32, 64), 0, 3.0)
  fmt = core.format_of(pow2)
  q = fmt.quantize(core.QuantizeRequest(x, "x", pow2))
  sinv = float(q.rows.scale_inv[0])
  assert sinv == 2.0 ** np.round(np.log2(sinv))  # a power of two
  assert q.rows.dtype == jnp.float8_e4m3fn and q.cols.shape == (64, 32)
  np.testing.assert_array_equal(
    np.asarray(fmt.dequantize(q.rows, jnp.float32), np.float64), _quantized64(x)
  )


def test_toy_format_runs_through_dot_general(pow2):
  """Forward and both gradients equal float64 products of the toy format's quantized values."""
  x, w, dy = _data((32, 64), 1, 2.0), _data((64, 48), 2, 0.1), _data((32, 48), 3)

  def loss(x, w):
    y = core.dot_general(x, w, DN, recipe=pow2, threshold=None)
    return jnp.sum(y * dy), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  xq, wq, gq = _quantized64(x), _quantized64(w), _quantized64(dy)
  for got, want in ((y, xq @ wq), (dx, gq @ wq.T), (dw, xq.T @ gq)):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < EXACT
  # And FP8 accuracy against the unquantized product (a wrong scale is off by O(1)).
  y64 = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert np.linalg.norm(np.asarray(y, np.float64) - y64) / np.linalg.norm(y64) < 0.1
  fp8, total = inspect.count_fp8_dot_generals(
    jax.grad(lambda x, w: loss(x, w)[0], argnums=(0, 1)), x, w
  )
  assert (fp8, total) == (3, 3)


def test_toy_format_runs_through_the_fused_mlp(pow2):
  """``layernorm_mlp`` takes the fused path for the new per-tensor format and agrees with the
  composed path (norm, activation and two dot_general calls) to float32 rounding."""
  k, f = 64, 128
  x = _data((32, k), 4)
  params = dict(
    ln_scale=jnp.ones((k,)),
    ln_bias=jnp.zeros((k,)),
    wi_kernel=_data((k, 1, f), 5, 0.1),
    wo_kernel=_data((f, k), 6, 0.1),
    wi_bias=jnp.zeros((1, f)),
    wo_bias=jnp.zeros((k,)),
  )
  states = ({}, {})

  def run(fused):
    config = core.GemmConfig(fuse_activation_cast=fused)

    def loss(x, p):
      out = core.layernorm_mlp(
        x,
        p["ln_scale"],
        p["ln_bias"],
        p["wi_kernel"],
        p["wo_kernel"],
        p["wi_bias"],
        p["wo_bias"],
        recipe=pow2,
        states=states,
        threshold=None,
        config=config,
      )
      return jnp.sum(out[0] ** 2), out[0]

    forward = jax.make_jaxpr(lambda x, p: loss(x, p)[1])(x, params)
    custom = [e for e in forward.eqns if "custom_vjp" in e.primitive.name]
    # The fused path is one custom VJP around both GEMMs; the composed one has one per GEMM,
    # norm and activation.
    assert (len(custom) == 1) == fused, [e.primitive.name for e in forward.eqns]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)

  (_, fused), fused_grads = run(True)
  (_, composed), composed_grads = run(False)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
  assert rel(fused, composed) < 1e-5
  for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(composed_grads), strict=True):
    if float(jnp.linalg.norm(b)) > 0:
      assert rel(a, b) < 1e-4


def test_toy_format_runs_through_ragged_dot(pow2):
  """The grouped GEMM applies the format's scaling per group: each group's rows equal
  ``dot_general`` of those rows with that group's kernel."""
  group_sizes = jnp.asarray([16, 32, 16], jnp.int32)
  x, w = _data((64, 32), 7), _data((3, 32, 48), 8, 0.1)
  y = core.ragged_dot(x, w, group_sizes, recipe=pow2)
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = x[start : start + size]
    want = _quantized64(rows) @ _quantized64(w[g])
    got = np.asarray(y[start : start + size], np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < EXACT
    start += size
