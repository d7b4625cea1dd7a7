"""Data and checks shared by the adapters' SPMD tests (8 virtual CPU devices, conftest.py)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from tests.conftest import FP8_GEMM_RTOL

# Delayed scaling, so that the recipe state is compared too.
RECIPE = ta.DelayedScaling(amax_history_len=4)
DEVICES = 4
FACTORS = (1.0, 2.0)  # per step: the activations' amax changes between steps


def dp_mesh():
  return jax.make_mesh(
    (DEVICES,), ("dp",), devices=jax.devices()[:DEVICES], axis_types=(AxisType.Auto,)
  )


def exact_data(shape, seed):
  """Values in {0, ±0.875, ±1.75, ±3.5} with an amax of 3.5.

  Every per-tensor FP8 scale is then a power of two (448 / 3.5 = 2**7, 57344 / 3.5 = 2**14, and
  twice the amax halves them), so quantization and the weight gradient's sum over the batch are
  exact, and that sum split over devices equals the whole one bit for bit.
  """
  values = np.array([0.0, 0.875, 1.75, 3.5, -0.875, -1.75, -3.5], np.float32)
  data = np.random.default_rng(seed).choice(values, size=shape)
  data.flat[0] = 3.5
  return jnp.asarray(data)


def fp8_gemm_stand_in(a, b, a_scales, b_scales, out_dtype, lhs_mode, rhs_mode, **_):
  """The extension's cuBLASLt GEMM (``kernels.gemm_call``) in pure JAX, per-tensor scales only:
  the float32 sums times both scales, rounded once to the output dtype."""
  from te_adapters.core import kernels

  assert lhs_mode == rhs_mode == 0, "per-tensor scales only"
  return kernels.tensor_fallback(False, a, b, a_scales, b_scales, out_dtype)


def emulate_fp8_gemm(monkeypatch):
  """Where the extension's cuBLASLt GEMM is not built (CPU), ``fp8_gemm_stand_in`` called
  wherever the GEMM would run, so that its call sites and partitioning rule run as on an H100;
  nothing where the GEMM runs."""
  from te_adapters.core import kernels

  if kernels.cublas_gemm_available():
    return
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", fp8_gemm_stand_in)


def assert_trees_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# A sharded program against one device, on a GPU. The shards' FP8 GEMMs have other shapes than
# one device's (a shard's rows, half of K), and cuBLASLt picks its kernel (tiles, split-K) by
# shape; the extension's GEMM times its candidates and keeps the fastest, and a shard with fewer
# than 16 rows runs XLA's FP8 GEMM where one device runs the extension's. Hopper's tensor cores add
# FP8 products with fewer bits than float32 (conftest.FP8_GEMM_RTOL), so another kernel sums in
# another order: the float32 sums differ by up to about 2**-14 of the products' magnitudes, even
# for exact_data, whose sums need about 17 bits. Each element is then within
#   GPU_OUTPUT_ULPS units in the last place of its dtype at its own magnitude (XLA's FP8 GEMM
#     rounds to the output dtype, is rescaled in float32 and rounded again, where the extension's
#     rounds once: two roundings against one differ by up to 2 ulps), plus
#   FP8_GEMM_RTOL (1e-3) of the output's largest magnitude (the order of the FP8 sums).
# A missing all-reduce or a wrong shard is O(1) of the output, a wrong scale (a shard's own amax
# instead of the tensor's) percents of the large elements: both fail. The CPU sums the products in
# float32 in one order on every shape, so there the tests stay bit for bit (or to their own
# float32 tolerance).
ON_GPU = jax.default_backend() == "gpu"
GPU_OUTPUT_ULPS = 2
ERROR_LOG = "TE_ADAPTERS_SHARDING_ERROR_LOG"  # a file: each comparison's figures as a JSON line


def _ulp(values, dtype):
  """One unit in the last place of ``dtype`` at each ``|value|`` (float64)."""
  finfo = ml_dtypes.finfo(dtype)
  mag = np.maximum(np.abs(values), float(finfo.tiny))
  _, exp = np.frexp(mag)  # mag = m * 2**exp, 0.5 <= m < 1
  return float(finfo.eps) * np.ldexp(1.0, exp - 1)


def comparison_figures(got, want) -> dict:
  """Normwise error, largest error over the largest magnitude, largest error in ulps of the
  output dtype, and the share of elements that differ, of ``got`` against ``want``."""
  dtype = np.dtype(want.dtype)
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = np.abs(g - w)
  scale = float(np.max(np.abs(w))) if w.size else 0.0
  norm = float(np.linalg.norm(w))
  return dict(
    dtype=str(dtype),
    shape=list(w.shape),
    rel=float(np.linalg.norm(g - w) / norm) if norm else float(np.linalg.norm(g - w)),
    max_over_max=float(diff.max() / scale) if scale else float(diff.max(initial=0.0)),
    max_ulps=float(np.max(diff / _ulp(w, dtype), initial=0.0)),
    differ=float(np.mean(diff > 0)) if w.size else 0.0,
  )


def record(name, got, want) -> dict:
  """``comparison_figures`` of ``got`` against ``want``, written to the error log if one is set."""
  figures = comparison_figures(np.asarray(got), np.asarray(want))
  _log(name, figures)
  return figures


def _log(name, figures):
  path = os.environ.get(ERROR_LOG)
  if path:
    line = json.dumps(
      dict(
        test=os.environ.get("PYTEST_CURRENT_TEST", ""),
        name=name,
        platform=jax.default_backend(),
        **figures,
      )
    )
    with open(path, "a") as f:
      f.write(line + "\n")


def assert_close_to_one_device(got, want, name="", cpu_rel=None):
  """A sharded program's ``got`` against one device's ``want``.

  On CPU: bit for bit, or with ``cpu_rel`` a normwise relative error below it. On a GPU: each
  element within ``GPU_OUTPUT_ULPS`` ulps of its dtype at its own magnitude plus
  ``FP8_GEMM_RTOL`` of ``want``'s largest magnitude (see above).
  """
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
  figures = comparison_figures(got, want)
  _log(name, figures)
  if not ON_GPU:
    if cpu_rel is None:
      np.testing.assert_array_equal(got, want, err_msg=name)
    else:
      assert figures["rel"] < cpu_rel, (name, figures)
    return
  w = np.asarray(want, np.float64)
  bound = GPU_OUTPUT_ULPS * _ulp(w, want.dtype) + FP8_GEMM_RTOL * np.max(np.abs(w), initial=0.0)
  over = np.abs(np.asarray(got, np.float64) - w) > bound
  assert not over.any(), (
    name,
    f"{int(over.sum())} of {over.size} elements over the bound",
    figures,
  )


def is_recipe_state(path) -> bool:
  """Whether a pytree path ends at a recipe state array (an amax history or a scale)."""
  keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  keys = [k for k in keys if k != "value"]  # an NNX Variable's value
  return bool(keys) and ("amax_history" in keys[-1] or keys[-1].endswith("_scale"))


def assert_trees_match_one_device(got, want):
  """Outputs and gradients of a sharded program against one device's: recipe state (amaxes and
  scales, exact on every platform) bit for bit, the rest by ``assert_close_to_one_device``."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    assert a.dtype == b.dtype and a.shape == b.shape
    name = jax.tree_util.keystr(path)
    if is_recipe_state(path):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    else:
      assert_close_to_one_device(a, b, name)


def compare_with_one_device(loss, params, new_params, x, dy):
  """Runs ``len(FACTORS)`` steps on one device and inside ``shard_map`` over ``dp``.

  ``loss(params, x, dy) -> (loss, y)``; ``params`` is replicated, ``x`` and ``dy`` are split
  over their leading (batch) dim. ``new_params(params, grads)`` gives the next step's params (the
  recipe state replaced by its gradient). Asserts outputs, gradients and states bit-identical
  (on a GPU the outputs and gradients to the FP8 sums' order, ``assert_trees_match_one_device``).
  """

  def body(params, x, dy):
    value, y = loss(params, x, dy)
    return jax.lax.psum(value, "dp"), y

  sharded = jax.shard_map(
    body, mesh=dp_mesh(), in_specs=(P(), P("dp"), P("dp")), out_specs=(P(), P("dp"))
  )
  runs = []
  for fn in (loss, sharded):
    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    p, out = params, []
    for factor in FACTORS:
      (_, y), grads = step(p, x * factor, dy)
      p = new_params(p, grads)
      out.append((y, grads))
    runs.append(out)
  assert_trees_match_one_device(runs[1], runs[0])
  return runs[0]


def fsdp_gathers(fn, args):
  """``(compiled fn, [(dtype, shape)] of its all-gathers)`` for ``fn`` jitted over ``args``."""
  compiled = jax.jit(fn).lower(*args).compile()
  found = ta.inspect.hlo_collectives(compiled.as_text())
  return compiled, [a for c in found if c.op == "all-gather" for a in result_arrays(c)]


def result_arrays(c):
  """The arrays a collective ``c`` (``inspect.hlo_collectives``) produces: its result type's, after
  the operands in a ``-start`` op's. XLA:GPU combines collectives into one op of several arrays
  (one kernel's gathered bytes and another's), so count these, not ops."""
  return c.arrays[len(c.arrays) // 2 :] if f"{c.op}-start(" in c.line else c.arrays


def random(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def assert_spmd_keywords_reach_the_core(apply):
  """``apply(x, **keywords)`` builds a quantized model with the SPMD keywords and runs it.

  A mesh axis the mesh lacks in ``amax_axes`` (inside ``shard_map``), and ``kernel_all_gather``
  without a mesh, give the core's errors: so the adapter passed both on.
  """
  x = exact_data((16, 32), 0)
  mapped = jax.shard_map(
    lambda x: apply(x, amax_axes="nope"), mesh=dp_mesh(), in_specs=P("dp"), out_specs=P("dp")
  )
  with pytest.raises(ValueError, match=r"amax_axes for 'x' names mesh axes \['nope'\]"):
    jax.eval_shape(mapped, x)
  with pytest.raises(ValueError, match="kernel_all_gather needs a mesh"):
    jax.eval_shape(lambda x: apply(x, kernel_all_gather=P("nope", None)), x)
