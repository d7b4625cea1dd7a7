"""A ``ShardingFallbackWarning`` of the extension's kernels, decided by their partitioning rules
when XLA compiles the program (away from the user's call), names the layer of each framework
and points at the user's line that called it; it is said once per layer and case.

On 4 virtual CPU devices (conftest.py) with the cuBLASLt GEMM emulated on CPU (it is built for
Hopper GPUs only), as in tests/core/test_partition.py.
"""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from te_adapters.core import kernels
from tests import spmd_checks

pytestmark = [
  pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)"),
  pytest.mark.skipif(not kernels.ffi_available("cpu"), reason="extension not built"),
]

CURRENT = ta.Float8CurrentScaling()
FFI = ta.core.GemmConfig(backend="ffi")


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ta_linen.Dense(32, recipe=CURRENT, threshold=None, config=FFI, name="linen_proj")(x)


class _NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.proj = ta_nnx.Linear(64, 32, recipe=CURRENT, threshold=None, config=FFI, rngs=rngs)

  def __call__(self, x):
    return self.proj(x)


def _hk_forward(x):
  return ta_hk.Linear(32, recipe=CURRENT, threshold=None, config=FFI, name="hk_proj")(x)


def test_a_layers_resharded_gemm_warns_naming_it_at_the_users_line(monkeypatch):
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", spmd_checks.fp8_gemm_stand_in)
  mesh = jax.make_mesh((4,), ("shared",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 64)), jnp.float32)
  # The rows of x and the kernel's columns both over one mesh axis: the output cannot use it
  # twice, so the GEMM's rule gathers one of them.
  rows, cols = NamedSharding(mesh, P("shared")), NamedSharding(mesh, P(None, "shared"))
  xs = jax.device_put(x, rows)

  linen_params = _LinenModel().init(jax.random.key(0), x)
  nnx_graph, nnx_state = nnx.split(_NnxModel(nnx.Rngs(0)))
  hk_model = hk.transform(_hk_forward)
  hk_params = hk_model.init(jax.random.key(0), x)
  # The kernels' columns sharded, the biases replicated.
  shard = lambda tree: jax.tree.map(lambda p: jax.device_put(p, cols) if p.ndim == 2 else p, tree)

  def nnx_apply(state, x):
    return nnx.merge(nnx_graph, state)(x)

  runs = {  # the step, its parameters, and how the warnings name the layer
    "linen": (_LinenModel().apply, linen_params, "layer 'linen_proj'"),
    "nnx": (nnx_apply, nnx_state, "Linear layer (kernel (64, 32))"),
    "haiku": (lambda p, x: hk_model.apply(p, None, x), hk_params, "layer 'hk_proj'"),
  }
  for framework, (step, params, name) in runs.items():
    want = jax.jit(step)(params, x)  # one device
    with pytest.warns(ta.core.ShardingFallbackWarning) as record:
      y = jax.jit(step)(shard(params), xs)
    said = [w for w in record if issubclass(w.category, ta.core.ShardingFallbackWarning)]
    # The gather, and XLA's GEMM on the (8, 64) shards the kernel refuses: each names the layer
    # and points at the line of the model that called it, not at the partitioning rule.
    assert len(said) == 2, (framework, [str(w.message) for w in said])
    for warning in said:
      assert str(warning.message).startswith(f"{name}: the per-tensor FP8 GEMM: "), framework
      assert warning.filename == __file__, (framework, warning.filename)
    assert "are resharded to P('shared', None) and P(None, None)" in str(said[0].message)
    assert "XLA's GEMM runs on the shards instead" in str(said[1].message)
    # Each device's rows of the GEMM are one device's rows: the same values (on a GPU, XLA's GEMM
    # of the (8, 64) shards may be another kernel than one device's: spmd_checks' bound).
    spmd_checks.assert_close_to_one_device(np.asarray(y), np.asarray(want), framework)
  # Said once per layer and case: the same model compiled again is silent.
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    jax.jit(lambda p, x: _LinenModel().apply(p, x) + 1)(shard(linen_params), xs)


class _LinenGradModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ta_linen.Dense(32, recipe=CURRENT, threshold=None, config=FFI, name="grad_proj")(x)


def test_the_backward_gemms_warnings_name_the_layer_at_the_users_line(monkeypatch):
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", spmd_checks.fp8_gemm_stand_in)
  mesh = jax.make_mesh((4,), ("shared",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  x = jnp.asarray(np.random.default_rng(1).normal(size=(32, 64)), jnp.float32)
  cols = NamedSharding(mesh, P(None, "shared"))
  params = _LinenGradModel().init(jax.random.key(0), x)
  loss = lambda p, x: jnp.sum(_LinenGradModel().apply(p, x) ** 2)
  want = jax.jit(jax.grad(loss))(params, x)  # one device
  sharded = jax.tree.map(lambda p: jax.device_put(p, cols) if p.ndim == 2 else p, params)
  xs = jax.device_put(x, NamedSharding(mesh, P("shared")))
  with pytest.warns(ta.core.ShardingFallbackWarning) as record:
    got = jax.jit(jax.grad(loss))(sharded, xs)
  said = [w for w in record if issubclass(w.category, ta.core.ShardingFallbackWarning)]
  # The forward GEMM's and those of dgrad and wgrad: more than the forward's two cases.
  assert len(said) > 2, [str(w.message) for w in said]
  for warning in said:
    assert str(warning.message).startswith("layer 'grad_proj': the per-tensor FP8 GEMM: ")
    assert warning.filename == __file__, warning.filename
  # One device's gradients, up to the order of the float32 sums over the rows' shards.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    w = np.asarray(w)
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5 * np.abs(w).max())


def _gated_cast_stand_in(h, bias, scale):
  """A gated activation cast's contract in pure JAX (the CUDA kernel's): ``relu(h1) * h2`` of
  the two F-wide halves of ``h``, cast to FP8 as is and transposed, with its amax."""
  del bias  # a (0,) placeholder: no bias
  f = h.shape[-1] // 2
  v = jax.nn.relu(h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)
  q = (v * scale[0]).astype(jnp.float8_e4m3fn)
  return q, q.T, jnp.max(jnp.abs(v)).reshape(1)


def test_a_direct_kernel_call_warns_naming_the_function_and_shapes_at_the_users_line():
  """Outside the core's GEMMs (no layer to name), a kernel's rule names the kernels' function
  and its operands' shapes, at the line of the program that called it."""
  mesh = jax.make_mesh((4,), ("direct",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.normal(size=(32, 64)), jnp.float8_e4m3fn)
  b = jnp.asarray(rng.normal(size=(32, 64)), jnp.float8_e4m3fn)
  scale = jnp.full((1,), 0.5, jnp.float32)

  def gemm(a, b, a_scale, b_scale):
    return kernels.tensor_scaled_gemm(
      spmd_checks.fp8_gemm_stand_in, a, b, a_scale, b_scale, jnp.float32, False
    )

  # M of a and N of b both over one mesh axis: the output cannot take it twice (a gather), and
  # the (8, 64) rows left to each device are fewer than the kernel takes (XLA's GEMM).
  rows = NamedSharding(mesh, P("direct"))
  with pytest.warns(ta.core.ShardingFallbackWarning) as record:
    y = jax.jit(gemm)(jax.device_put(a, rows), jax.device_put(b, rows), scale, scale)
  said = [w for w in record if issubclass(w.category, ta.core.ShardingFallbackWarning)]
  assert len(said) == 2, [str(w.message) for w in said]
  for warning in said:
    assert str(warning.message).startswith(
      "te_adapters.core.kernels.tensor_scaled_gemm on (32, 64) float8_e4m3fn, (32, 64) "
      "float8_e4m3fn, (1,) float32, (1,) float32: the per-tensor FP8 GEMM: "
    ), str(warning.message)
    assert warning.filename == __file__, warning.filename
  assert "are resharded to" in str(said[0].message)
  assert "XLA's GEMM runs on the shards instead" in str(said[1].message)
  want = kernels.tensor_fallback(False, a, b, scale, scale, jnp.float32)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))

  # An activation cast with two activations, its columns sharded: a shard would not hold both
  # halves of its columns, so they are gathered.
  h = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)
  rule = kernels.act_cast(_gated_cast_stand_in, 2, False, True)
  args = (jnp.zeros((0,), jnp.float32), jnp.full((1,), 4.0, jnp.float32))
  h_cols = jax.device_put(h, NamedSharding(mesh, P(None, "direct")))
  with pytest.warns(ta.core.ShardingFallbackWarning) as record:
    q, q_t, amax = jax.jit(rule)(h_cols, *args)
  said = [w for w in record if issubclass(w.category, ta.core.ShardingFallbackWarning)]
  assert len(said) == 1, [str(w.message) for w in said]
  assert str(said[0].message).startswith(
    "te_adapters.core.kernels.act_cast on (64, 64) bfloat16, (0,) float32, (1,) float32: the "
    "activation cast: h's columns (two activations' slices side by side) are sharded over "
    "('direct',)"
  ), str(said[0].message)
  assert said[0].filename == __file__, said[0].filename
  for got, want in zip((q, q_t, amax), _gated_cast_stand_in(h, *args), strict=True):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
