"""The quantized dot_general on two or more GPUs: FP8 GEMMs and FP8 all-gathers in compiled HLO.

Skipped without at least two GPUs. The CPU suite (test_sharding.py) covers the numerics on
virtual devices; this checks what only a GPU build shows: FP8 GEMMs on sharded operands,
and an FSDP all-gather that moves one byte per kernel element next to them.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters.core import formats, kernels
from tests import spmd_checks
from tests.conftest import rel_err as _rel

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs two GPUs"
  ),
]

DN = (((2,), (0,)), ((), ()))
X_SHAPE, W_SHAPE = (8, 128, 256), (256, 512)
# The tests that hold a sharded program to one device's bound sum the partial products of a split
# K in float32 (GemmConfig.partial_sums); the default, bf16 sums, has its own test and bound.
FLOAT32_SUMS = core.GemmConfig(partial_sums="float32")


def _data():
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, X_SHAPE, jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, W_SHAPE, jnp.float32)
  dy = jax.random.normal(kd, X_SHAPE[:2] + W_SHAPE[1:], jnp.float32).astype(jnp.bfloat16)
  return x, w, dy


def _step(recipe, config=FLOAT32_SUMS, **kw):
  def step(x, w, state, dy):
    def layer(x, w, state):
      return core.dot_general(
        x,
        w.astype(jnp.bfloat16),
        DN,
        recipe=recipe,
        state=state or None,
        threshold=None,
        config=config,
        **kw,
      )

    y, vjp = jax.vjp(layer, x, w, state)
    return (y, *vjp(dy))

  return jax.jit(step)


@pytest.mark.parametrize(
  "specs",
  [("dp", P("dp"), P(), P("dp")), ("tp", P(), P(None, "tp"), P(None, None, "tp"))],
  ids=["dp2", "tp2"],
)
def test_dp_and_tp_match_one_gpu_with_fp8_gemms(specs):
  axis, x_spec, w_spec, dy_spec = specs
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, w, dy = _data()
  state = core.init_state(recipe)
  ref = _step(recipe)(x, w, state, dy)
  mesh = jax.make_mesh((2,), (axis,), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, x_spec), put(w, w_spec), put(state, P()), put(dy, dy_spec))
  with jax.set_mesh(mesh):
    compiled = _step(recipe).lower(*args).compile()
  got = compiled(*args)
  text = compiled.as_text()
  assert inspect.count_fp8_gemms(text)[0] >= 3  # fprop, dgrad, wgrad
  # The extension's kernels run on the shards (their partitioning rules, core/_partition.py).
  if formats.backend() == "ffi":
    assert text.count('custom_call_target="te_adapters_cast_transpose"') >= 3
  if kernels.cublas_gemm_available():
    assert text.count('custom_call_target="te_adapters_block_gemm"') >= 3
  # The same FP8 operands; the GEMMs may sum in another order and y, dx are bfloat16, rounded
  # twice (GEMM output, then the float32 rescale): they may differ by a bfloat16 ulp (2**-8) in
  # places (2.9e-3 normwise measured for tp2 on two H200s), against 0.04 for FP8 itself.
  for name, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
    spmd_checks.record(name, a, b)
  for a, b in zip(got[:3], ref[:3], strict=True):
    assert _rel(a, b) < 4e-3
  for name in ref[3]:  # the next step's scales and histories: identical
    np.testing.assert_array_equal(np.asarray(got[3][name]), np.asarray(ref[3][name]))


@pytest.mark.parametrize(
  "specs",
  [("dp", P("dp"), P(), P("dp")), ("tp", P(), P(None, "tp"), P(None, None, "tp"))],
  ids=["dp2", "tp2"],
)
def test_partial_products_are_summed_in_bf16_by_default(specs):
  """``GemmConfig.partial_sums="output"`` (the default): the GEMM whose K is split (wgrad over
  dp, whose K is the rows; dgrad over tp, whose K is the features) writes bf16 partial products
  on each GPU and the all-reduce sums bf16, half the bytes of float32.

  Bound, per element of that output, against one GPU: each of the n = 2 partials p_i is
  rounded to bf16 (at most u |p_i|, u = 2**-8), their sum once (at most u (|p_1| + |p_2|) to
  first order), and one GPU's output at most u |y| (dx is bf16; dW, float32 there, is closer);
  |y| and |p_1| + |p_2| are at most (|qa| |qb|)_ij, the product of the absolute dequantized FP8
  operands, and |qa| <= (1 + 2**-4) |a| for E4M3, |qg| <= (1 + 2**-3) |g| for E5M2: at most
  2 n u (1 + 2u) 1.2 (|a| |b|)_ij, plus the bound of spmd_checks for the FP8 sums' order. A
  missing all-reduce or a wrong shard is O(1) of the output and fails.
  """
  axis, x_spec, w_spec, dy_spec = specs
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, w, dy = _data()
  state = core.init_state(recipe)
  ref = _step(recipe, config=None)(x, w, state, dy)
  mesh = jax.make_mesh((2,), (axis,), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, x_spec), put(w, w_spec), put(state, P()), put(dy, dy_spec))
  with jax.set_mesh(mesh):
    compiled = _step(recipe, config=None).lower(*args).compile()
  got = compiled(*args)
  text = compiled.as_text()
  assert inspect.count_fp8_gemms(text)[0] >= 3
  # The gradient's sum (the amaxes' max reductions, which XLA may combine, are a few floats).
  sums = [
    c
    for c in inspect.hlo_collectives(text)
    if c.op.startswith("all-reduce") and any(int(np.prod(s)) >= 1024 for _, s in c.arrays)
  ]
  assert sums and all(d == "bf16" for c in sums for d, s in c.arrays if int(np.prod(s)) >= 1024), [
    (c.arrays, c.line[:120]) for c in sums
  ]
  a64 = lambda t: np.abs(np.asarray(t, np.float64))
  rows_x, rows_dy = a64(x).reshape(-1, X_SHAPE[-1]), a64(dy).reshape(-1, W_SHAPE[-1])
  summed = "dW" if axis == "dp" else "dx"
  products = {
    "dW": rows_x.T @ rows_dy,
    "dx": (rows_dy @ a64(w.astype(jnp.bfloat16)).T).reshape(X_SHAPE),
  }
  n, u = 2, 2.0**-8
  for name, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
    spmd_checks.record(name, a, b)
    if name != summed:
      spmd_checks.assert_close_to_one_device(a, b, name)
      continue
    b64 = np.asarray(b, np.float64)
    bound = (
      2 * n * u * (1 + 2 * u) * 1.2 * products[name]
      + spmd_checks.GPU_OUTPUT_ULPS * spmd_checks._ulp(b64, np.asarray(b).dtype)
      + spmd_checks.FP8_GEMM_RTOL * np.max(np.abs(b64))
    )
    over = np.abs(np.asarray(a, np.float64) - b64) > bound
    assert not over.any(), (name, int(over.sum()), spmd_checks.comparison_figures(a, b))
  for name in ref[3]:  # the next step's scales and histories: identical
    np.testing.assert_array_equal(np.asarray(got[3][name]), np.asarray(ref[3][name]))


def _operands(collective):
  """The arrays a collective reduces: an asynchronous start's type lists its operands, then its
  results."""
  arrays = collective.arrays
  if "-start(" in collective.line and len(arrays) % 2 == 0:
    return arrays[: len(arrays) // 2]
  return arrays


def test_chunked_sums_beside_an_sm_margin_match_the_whole_gemm():
  """``GemmConfig(sum_chunks=4, comm_sm_margin=8)`` under data parallelism on two GPUs: wgrad
  (its K, the rows, split over dp) runs as 4 cuBLASLt GEMMs of a quarter of its output rows each
  with cuBLASLt's SM count target 8 below the GPU's, each all-reduced on its own. The result is
  the default program's up to the order of the FP8 sums (another kernel may run for a quarter of
  the rows or fewer SMs): within the bound of ``spmd_checks`` (2 bf16 ulps plus 1e-3 of the
  largest magnitude); y and dx (K whole, every SM) bit for bit, the state identical."""
  recipe = ta.DelayedScaling(amax_history_len=4)
  x, w, dy = _data()
  state = core.init_state(recipe)
  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, P("dp")), put(w, P()), put(state, P()), put(dy, P("dp")))
  levers = core.GemmConfig(sum_chunks=4, comm_sm_margin=8)
  with jax.set_mesh(mesh):
    whole = _step(recipe, config=None).lower(*args).compile()
    chunked = _step(recipe, config=levers).lower(*args).compile()
  text = chunked.as_text()
  if kernels.cublas_gemm_available():
    calls = [
      line for line in text.splitlines() if 'custom_call_target="te_adapters_block_gemm"' in line
    ]
    margins = sorted(int(m) for line in calls for m in re.findall(r"sm_margin\s*=\s*(\d+)", line))
    assert margins == [0, 0, 8, 8, 8, 8], [line[:200] for line in calls]  # fprop, dgrad; wgrad x4
  # The gradient's sums carry dW (256, 512) once, in bf16: XLA combines the chunks' all-reduces
  # of a GEMM this small back into one (under its combine threshold; seen on two H100s, as one
  # all-reduce of dW flattened); at seed 000's sizes they stay apart (bench/RESULTS.md).
  summed = [
    (d, int(np.prod(s)))
    for c in inspect.hlo_collectives(text)
    if c.op == "all-reduce"
    for d, s in _operands(c)
    if int(np.prod(s)) >= 1024
  ]
  assert {d for d, _ in summed} == {"bf16"} and sum(n for _, n in summed) == 256 * 512, summed
  got, ref = chunked(*args), whole(*args)
  for name, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
    spmd_checks.record(name, a, b)
    if name == "dW":
      spmd_checks.assert_close_to_one_device(a, b, name)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  for name in ref[3]:
    np.testing.assert_array_equal(np.asarray(got[3][name]), np.asarray(ref[3][name]))


def test_fsdp_fp8_gather_moves_fp8_bytes_into_fp8_gemms():
  recipe = ta.Float8CurrentScaling()
  x, w, dy = _data()
  ref = _step(recipe)(x, w, {}, dy)
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, P("fsdp")), put(w, P("fsdp", None)), {}, put(dy, P("fsdp")))
  with jax.set_mesh(mesh):
    compiled = _step(recipe, kernel_all_gather=P("fsdp", None)).lower(*args).compile()
  got = compiled(*args)
  text = compiled.as_text()
  assert inspect.count_fp8_gemms(text)[0] >= 3
  gathers = [c for c in inspect.hlo_collectives(text) if c.op == "all-gather"]
  assert gathers
  for c in gathers:  # one byte per element: the FP8 kernel, not a widened copy
    dtype, shape = c.arrays[-1]
    # Either orientation: the contracting-last layout gathers the kernel as (features, hidden).
    assert dtype in ("u8", "f8e4m3fn") and shape in (W_SHAPE, W_SHAPE[::-1]), c.line
  # The same FP8 operands as one device's: to the order of the FP8 sums (spmd_checks).
  for name, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
    spmd_checks.assert_close_to_one_device(a, b, name)
