"""The extension's kernels inside sharded ``jit`` programs: partitioning rules (core/_partition.py).

On 8 virtual CPU devices (conftest.py) with ``GemmConfig(backend="ffi")``, so the per-tensor cast
and amax are the extension's CPU FFI kernels. Each plan places x, the kernel and dy with
``NamedSharding`` on a 2x2 (dp, tp) mesh and runs three training steps under ``jit``; the
compiled program must call the kernels on the shards, and outputs, gradients and DelayedScaling
state must equal those of the one-device program.

The GEMM rule is for the extension's cuBLASLt GEMMs, which are built for Hopper GPUs only; here
it wraps a CPU GEMM of the same contract, so the rule's plans, reductions and warnings are
tested on CPU and the GPU suite tests the kernel itself.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters.core import formats, kernels
from tests import spmd_checks

pytestmark = [
  pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)"),
  pytest.mark.skipif(not kernels.ffi_available("cpu"), reason="extension not built"),
]

DN = (((2,), (0,)), ((), ()))  # x (batch, seq, hidden) . kernel (hidden, features)
X_SHAPE, W_SHAPE, Y_SHAPE = (8, 16, 64), (64, 32), (8, 16, 32)
FACTORS = (1.0, 2.0, 1.0)  # per step: the activations' amax changes between steps
DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT_SCALING = ta.Float8CurrentScaling()


@dataclasses.dataclass(frozen=True)
class Plan:
  name: str
  x: P
  w: P
  dy: P
  # Outputs that XLA sums over devices from bf16 partial products (a contracting dim split over
  # tp, in XLA's own GEMM): one device's value to bf16 rounding, not bit for bit.
  bf16_sums: tuple[str, ...] = ()


PLANS = [
  Plan("dp", P("dp"), P(), P("dp")),
  Plan("tp_column", P(), P(None, "tp"), P(None, None, "tp"), bf16_sums=("dx",)),
  Plan("tp_row", P(None, None, "tp"), P("tp", None), P(), bf16_sums=("y",)),
  Plan("fsdp", P("dp"), P("dp", None), P("dp")),
  Plan("dp_tp", P("dp"), P(None, "tp"), P("dp", None, "tp"), bf16_sums=("dx",)),
]


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh(
    (2, 2), ("dp", "tp"), devices=jax.devices()[:4], axis_types=(axis_type, axis_type)
  )


# Float32 sums of partial products over a split K (GemmConfig.partial_sums), so that with the
# extension's GEMM (a GPU) the sharded programs equal one device's; the default, bf16 sums, has
# its own test below.
FFI = core.GemmConfig(backend="ffi", partial_sums="float32")


def _data():
  """Exact data (spmd_checks.exact_data) whose amax, 7.0, lies in the last shard only, so that a
  shard's own amax differs from the tensor's (7.0 keeps every scale a power of two)."""
  x, w, dy = (spmd_checks.exact_data(s, i) for i, s in enumerate((X_SHAPE, W_SHAPE, Y_SHAPE)))
  x, w, dy = (t.at[(-1,) * t.ndim].set(7.0) for t in (x, w, dy))
  return x.astype(jnp.bfloat16), w, dy.astype(jnp.bfloat16)


def _step(recipe, config=FFI):
  def loss(x, w, state, dy, factor):
    y = core.dot_general(
      x * factor.astype(x.dtype),
      w.astype(jnp.bfloat16),
      DN,
      recipe=recipe,
      state=state or None,
      threshold=None,
      config=config,
    )
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  def step(x, w, state, dy, factor):
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, dy, factor
    )
    return y, grads

  return jax.jit(step)


def _run(recipe, x, w, dy, put, step=None):
  """Three steps, the state fed back; returns [(y, (dx, dw, state))] and the compiled HLO."""
  step = step or _step(recipe)
  state = put(core.init_state(recipe))
  compiled = step.lower(x, w, state, dy, put(jnp.float32(1))).compile()
  out = []
  for factor in FACTORS:
    y, grads = compiled(x, w, state, dy, put(jnp.float32(factor)))
    state = grads[2]
    out.append(jax.tree.map(np.asarray, (y, grads)))
  return out, compiled.as_text()


@functools.cache
def _one_device(recipe):
  device = jax.devices()[0]
  put = lambda a: jax.device_put(a, device)
  x, w, dy = (put(a) for a in _data())
  return _run(recipe, x, w, dy, put)[0]


def _sharded(recipe, plan, axis_type=AxisType.Auto, step=None):
  mesh = _mesh(axis_type)
  put = lambda a, spec=None: jax.device_put(a, NamedSharding(mesh, spec or P()))
  x, w, dy = _data()
  return _run(recipe, put(x, plan.x), put(w, plan.w), put(dy, plan.dy), put, step)


def _cast_calls(text):
  """The operand shapes of the extension's cast custom calls in compiled HLO."""
  shapes = []
  for line in text.splitlines():
    if 'custom_call_target="te_adapters_cast_transpose"' in line:
      operand = re.search(r"operand_layout_constraints=\{[a-z0-9]+\[([0-9,]*)\]", line)
      shapes.append(tuple(int(n) for n in operand.group(1).split(",")))
  return shapes


def _assert_equal_to_one_device(got, want, plan):
  for step, ((y, (dx, dw, state)), (ry, (rdx, rdw, rstate))) in enumerate(
    zip(got, want, strict=True)
  ):
    for name, a, b in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
      if name in plan.bf16_sums:
        assert np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) <= 1e-2 * np.linalg.norm(
          b.astype(np.float64)
        ), (step, name)
      else:
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}: {name}")
    for name in rstate:  # the recipe state: exactly
      np.testing.assert_array_equal(state[name], rstate[name], err_msg=f"step {step}: {name}")


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_delayed_scaling_step_runs_the_cast_per_shard(plan):
  got, text = _sharded(DELAYED, plan)
  _assert_equal_to_one_device(got, _one_device(DELAYED), plan)
  # The casts of x, the kernel and the output gradient are the extension's, on shards.
  shapes = _cast_calls(text)
  assert len(shapes) >= 3, text
  if plan.x != P():  # x's cast runs on its half
    assert any(int(np.prod(s)) == int(np.prod(X_SHAPE)) // 2 for s in shapes), shapes
  if plan.w != P():  # and the kernel's
    assert any(int(np.prod(s)) == int(np.prod(W_SHAPE)) // 2 for s in shapes), shapes
  # The amaxes of the state changed with the data (the state is not frozen).
  history = got[-1][1][2]["x_amax_history"]
  assert history[-3:].tolist() == [7.0, 14.0, 7.0]


def test_explicit_mesh_axes_run_the_cast_per_shard():
  plan = PLANS[-1]
  got, text = _sharded(DELAYED, plan, AxisType.Explicit)
  _assert_equal_to_one_device(got, _one_device(DELAYED), plan)
  assert len(_cast_calls(text)) >= 3


def test_inside_shard_map_the_kernels_outputs_vary_like_their_inputs():
  """In a shard_map body the kernels run on the shards as they are; their outputs must be typed
  as varying over the mesh axes of their inputs, or the backward pass skips the sums over tp
  (dx) and dp (dW) that the custom VJP does for varying operands (O(1) errors)."""
  plan = PLANS[-1]
  mesh = _mesh()

  def body(x, w, state, dy, factor):
    y = core.dot_general(
      x * factor.astype(x.dtype),
      w.astype(jnp.bfloat16),
      DN,
      recipe=DELAYED,
      state=state,
      threshold=None,
      config=FFI,
    )
    return lax.psum(jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), ("dp", "tp")), y

  mapped = jax.shard_map(
    body, mesh=mesh, in_specs=(plan.x, plan.w, P(), plan.dy, P()), out_specs=(P(), plan.dy)
  )

  @jax.jit
  def step(x, w, state, dy, factor):
    (_, y), grads = jax.value_and_grad(mapped, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, dy, factor
    )
    return y, grads

  put = lambda a, spec=None: jax.device_put(a, NamedSharding(mesh, spec or P()))
  x, w, dy = _data()
  got, text = _run(DELAYED, put(x, plan.x), put(w, plan.w), put(dy, plan.dy), put, step)
  # dx: the sum over tp of bf16 partial products, as XLA's under jit.
  _assert_equal_to_one_device(got, _one_device(DELAYED), plan)
  assert len(_cast_calls(text)) >= 3


def test_amax_of_a_sharded_tensor_is_global_on_every_device():
  mesh = _mesh()
  x = np.zeros((8, 32), np.float32)
  x[5, 3] = -9.0  # on one device's shard only
  x[1, 30] = 2.0
  xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("dp", "tp")))
  a = jax.jit(lambda v: formats.amax(v, backend="ffi"))(xs)
  assert [float(s.data[0]) for s in a.addressable_shards] == [9.0] * 4
  x[0, 0] = np.nan  # NaN on another shard: inf everywhere
  xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("dp", "tp")))
  _, _, a = jax.jit(
    lambda v: formats.cast_transpose(
      v, jnp.ones((1,)), jnp.float8_e4m3fn, with_amax=True, backend="ffi"
    )
  )(xs)
  assert [float(s.data[0]) for s in a.addressable_shards] == [np.inf] * 4


def test_nnx_linear_with_sharded_kernel_matches_one_device():
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  layer = ta_nnx.Linear(64, 32, threshold=None, recipe=DELAYED, config=FFI, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  params, recipe_state = nnx.split_state(state, nnx.Param, ta_nnx.RecipeState)
  x, _, dy = _data()
  x, dy = x.reshape(-1, 64), dy.reshape(-1, 32)

  @jax.jit
  def step(params, recipe_state, x, dy):
    def loss(params, recipe_state):
      y = nnx.merge(graphdef, params, recipe_state)(x)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, recipe_state)

  def run(params, recipe_state, x, dy, put):
    out = []
    for factor in FACTORS:
      (_, y), (g_params, recipe_state) = step(params, recipe_state, x * factor, dy)
      out.append(jax.tree.map(np.asarray, (y, g_params, recipe_state)))
      recipe_state = put(recipe_state)
    return out

  device = jax.devices()[0]
  want = run(
    *jax.device_put((params, recipe_state, x, dy), device), lambda t: jax.device_put(t, device)
  )
  mesh = _mesh()
  shard = lambda spec: NamedSharding(mesh, spec)
  # Column-parallel: the kernel (64, 32) and the bias over tp.
  params_s = jax.tree.map(
    lambda v: jax.device_put(v, shard(P(None, "tp") if v.ndim == 2 else P("tp"))), params
  )
  recipe_s = jax.device_put(recipe_state, shard(P()))
  x_s, dy_s = jax.device_put(x, shard(P("dp"))), jax.device_put(dy, shard(P("dp", "tp")))
  got = run(params_s, recipe_s, x_s, dy_s, lambda t: jax.device_put(t, shard(P())))
  spmd_checks.assert_trees_identical(got, want)
  text = step.lower(params_s, recipe_s, x_s, dy_s).compile().as_text()
  assert len(_cast_calls(text)) >= 3


# --------------------------------------------------------------------------- GEMM rule


def _cpu_gemm(a, b, sa, sb, dtype):
  """The per-tensor FP8 GEMM's contract, ``a . b^T * sa * sb`` in float32, on XLA:CPU."""
  batch = tuple(range(a.ndim - 2))
  y = lax.dot_general(
    a, b, (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch)), preferred_element_type=jnp.float32
  )
  return (y * (sa * sb).reshape(())).astype(dtype)


def _quantized(shape, seed):
  x = spmd_checks.exact_data(shape, seed)
  return (x * 64).astype(jnp.float8_e4m3fn), jnp.array([1 / 64], jnp.float32)


GEMM_CASES = [
  # name, a spec, b spec, whether K is summed over devices
  ("rows", P("dp"), P(), False),
  ("columns", P(), P("tp"), False),
  ("rows_and_columns", P("dp"), P("tp"), False),
  ("contracting", P(None, "tp"), P(None, "tp"), True),
  ("contracting_and_rows", P("dp", "tp"), P(None, "tp"), True),
]


@pytest.mark.parametrize("name, a_spec, b_spec, summed", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm_rule_runs_the_kernel_on_shards(name, a_spec, b_spec, summed):
  (a, sa), (b, sb) = _quantized((32, 64), 3), _quantized((48, 64), 4)
  want = _cpu_gemm(a, b, sa, sb, jnp.float32)
  mesh = _mesh()
  a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
  b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
  calls = []

  def kernel(a, b, sa, sb, dtype):
    calls.append((a.shape, b.shape, np.dtype(dtype)))
    return _cpu_gemm(a, b, sa, sb, dtype)

  f = jax.jit(lambda a, b: kernels.gemm("test GEMM", kernel, _cpu_gemm, a, b, sa, sb, jnp.bfloat16))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    compiled = f.lower(a_s, b_s).compile()
  y = compiled(a_s, b_s)
  # Exact data: every partial sum is exact, so the split sum equals the whole one.
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want.astype(jnp.bfloat16)))
  entries = tuple(a_spec) + (None,) * (2 - len(a_spec))
  a_local = tuple(n // (2 if e else 1) for n, e in zip(a.shape, entries, strict=True))
  assert (a_local, np.dtype(jnp.float32 if summed else jnp.bfloat16)) in [
    (c[0], c[2]) for c in calls
  ], calls
  ops = [c.op for c in inspect.hlo_collectives(compiled.as_text())]
  assert ("all-reduce" in ops) == summed and "all-gather" not in ops, ops
  if summed:  # summed in float32, rounded once after
    reduces = [c for c in inspect.hlo_collectives(compiled.as_text()) if c.op == "all-reduce"]
    assert all(dtype == "f32" for c in reduces for dtype, _ in c.arrays), reduces


def test_gemm_rule_warns_once_where_it_reshards():
  (a, sa), (b, sb) = _quantized((32, 64), 3), _quantized((48, 64), 4)
  mesh = _mesh()
  # The same mesh axis on the rows of a and the columns of b: the output cannot use it twice.
  a_s = jax.device_put(a, NamedSharding(mesh, P("dp")))
  b_s = jax.device_put(b, NamedSharding(mesh, P("dp")))
  f = lambda a, b: kernels.gemm("reshard GEMM", _cpu_gemm, _cpu_gemm, a, b, sa, sb, jnp.float32)
  with pytest.warns(ta.core.ShardingFallbackWarning, match=r"reshard GEMM.*'dp'.*gathered"):
    y = jax.jit(f)(a_s, b_s)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(_cpu_gemm(a, b, sa, sb, jnp.float32)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    jax.jit(lambda a, b: f(a, b) + 1)(a_s, b_s)  # the same case again: said once


def test_gemm_rule_falls_back_to_xla_on_shards_the_kernel_refuses():
  (a, sa), (b, sb) = _quantized((32, 64), 3), _quantized((48, 64), 4)
  mesh = _mesh()
  a_s = jax.device_put(a, NamedSharding(mesh, P("dp")))

  calls = {"kernel": [], "fallback": []}

  def traced(which):
    def gemm(a, b, sa, sb, dtype):
      calls[which].append(a.shape)
      return _cpu_gemm(a, b, sa, sb, dtype)

    return gemm

  refusal = lambda a_shape, b_shape: "M must be a multiple of 32" if a_shape[0] % 32 else None
  f = lambda a, b: kernels.gemm(
    "picky GEMM", traced("kernel"), traced("fallback"), a, b, sa, sb, jnp.float32, refusal=refusal
  )
  with pytest.warns(
    ta.core.ShardingFallbackWarning,
    match=r"picky GEMM.*\(16, 64\).*M must be a multiple of 32.*XLA's GEMM",
  ):
    y = jax.jit(f)(a_s, b)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(_cpu_gemm(a, b, sa, sb, jnp.float32)))
  # The kernel was only traced for the global shapes; the shards ran the fallback.
  assert (16, 64) not in calls["kernel"] and calls["fallback"] == [(16, 64)], calls


# --------------------------------------------------------------------------- the GEMMs' call sites


def _emulated_cublas(calls, margins=None):
  """``cublas_call`` with per-tensor scales (mode 0), emulated on CPU; records operand shapes
  (and each call's ``sm_margin`` in ``margins``)."""
  margins = [] if margins is None else margins

  def cublas_call(
    a, b, a_scales, b_scales, out_dtype, lhs_mode, rhs_mode, fast_accum=False, sm_margin=0
  ):
    calls.append((a.shape, b.shape, np.dtype(out_dtype)))
    margins.append(sm_margin)
    return spmd_checks.fp8_gemm_stand_in(a, b, a_scales, b_scales, out_dtype, lhs_mode, rhs_mode)

  return cublas_call


def test_fp8_gemm_call_site_runs_per_shard_with_float32_sums(monkeypatch):
  """Through core.dot_general with the GEMM kernel emulated (the real one is cuBLASLt, GPU only):
  DP x column-parallel TP, whose dgrad contracts the tp-sharded features and wgrad the dp-sharded
  rows. With ``partial_sums="float32"`` the float32 partial products are summed, then rounded
  once, so even those GEMMs equal one device bit for bit."""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  plan = dataclasses.replace(PLANS[-1], bf16_sums=())
  got, text = _sharded(DELAYED, plan)
  sharded_calls, calls[:] = list(calls), []
  _assert_equal_to_one_device(got, _one_device_uncached(DELAYED), plan)
  # Shards: x3 (128, 64) split over dp, the kernel (32, 64) over tp.
  assert ((64, 64), (16, 64), np.dtype(jnp.bfloat16)) in sharded_calls, sharded_calls
  # dgrad contracts N (tp) and wgrad M (dp): float32 partial products, summed in float32.
  assert ((64, 16), (64, 16), np.dtype(jnp.float32)) in sharded_calls, sharded_calls
  reduces = [c for c in inspect.hlo_collectives(text) if c.op == "all-reduce"]
  assert any(("f32", (64, 64)) in c.arrays for c in reduces), reduces  # dx
  assert any(("f32", (64, 16)) in c.arrays for c in reduces), reduces  # dW (K, N/tp)
  assert not any(d == "bf16" for c in reduces for d, _ in c.arrays), reduces


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[3], PLANS[4]], ids=lambda p: p.name)
def test_explicit_mesh_axes_run_every_gemm_on_the_kernel_per_shard(monkeypatch, plan):
  """On Explicit mesh axes each backward GEMM is given its output's sharding (its primal's, as
  JAX's own dot_general transpose does): the extension's GEMM takes it through its rule, per
  shard, as under Auto axes, not XLA's FP8 dot. XLA's dot rounds to bf16 before the scales and
  the kernel after, so a program mixing them differs from one device's by a bf16 rounding, and
  a current-scaling amax taken from such a gradient moves every FP8 code of the next GEMM's
  operand (a 2.8e-2 gradient error on two H100s). With float32 partial sums: one device's bit for
  bit, forward and both backward GEMMs on every device's shards."""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  plan = dataclasses.replace(plan, bf16_sums=())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ta.core.ShardingFallbackWarning)
    got, text = _sharded(DELAYED, plan, AxisType.Explicit)
  sharded_calls, calls[:] = list(calls), []
  _assert_equal_to_one_device(got, _one_device_uncached(DELAYED), plan)
  # x3 (128, 64), the kernel (32, 64), dy (128, 32): rows over dp, the features over tp in dp_tp.
  # dgrad contracts the features: split over tp in dp_tp, its partial products float32 there.
  n, dgrad = (16, np.dtype(jnp.float32)) if plan.name == "dp_tp" else (32, np.dtype(jnp.bfloat16))
  assert ((64, 64), (n, 64), np.dtype(jnp.bfloat16)) in sharded_calls, sharded_calls  # forward
  assert ((64, n), (64, n), dgrad) in sharded_calls, sharded_calls  # dgrad
  assert ((64, 64), (n, 64), np.dtype(jnp.float32)) in sharded_calls, sharded_calls  # wgrad
  # No FP8 dot of XLA's: the kernel's stand-in writes float32 sums, XLA's dgrad wrote bf16.
  assert not [line for line in text.splitlines() if " dot(" in line and "= bf16[" in line]


def test_explicit_out_sharding_of_a_row_parallel_gemm_runs_the_kernel_per_shard(monkeypatch):
  """Row-parallel TP on Explicit axes: K split over tp needs ``out_sharding`` (JAX's rule), which
  the extension's GEMM takes: each device multiplies its K slice into float32 partials, summed
  over tp and rounded once, so y, dx and dW are one device's bit for bit. (A named sharding
  sent the GEMM to XLA's FP8 dot before, whose bf16 partial sums put y 2.9e-3 off one device's
  for normal random data; this exact data sums exactly, the calls tell the two apart.)"""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  mesh = _mesh(AxisType.Explicit)
  x, w, dy = _data()

  def step(x, w, dy, out_sharding=None):
    def loss(x, w):
      y = core.dot_general(
        x, w, DN, recipe=CURRENT_SCALING, threshold=None, config=FFI, out_sharding=out_sharding
      )
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return y, grads

  want = jax.jit(step)(x, w, dy)
  with jax.set_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    rows = P("dp", None, None)
    got = jax.jit(functools.partial(step, out_sharding=rows))(
      put(x, P("dp", None, "tp")), put(w, P("tp", None)), put(dy, rows)
    )
  assert got[0].sharding.spec == rows
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The forward GEMM's shards: x3 (64, 32) . w (32, 32)^T, K halved, float32 partial products.
  assert ((64, 32), (32, 32), np.dtype(jnp.float32)) in calls, calls


def test_fp8_gemm_call_site_sums_partial_products_in_the_output_dtype(monkeypatch):
  """The default ``partial_sums="output"``: the shards of dgrad and wgrad (the kernel is passed
  in bf16, so dW's dtype there is bf16) write bf16 partial products and the all-reduces sum
  bf16, as XLA's program of the same dot does.

  The bound: with n = 2 devices each partial p_i is rounded to bf16 (at most u |p_i|, u = 2**-8
  the unit roundoff) and their sum once more (at most u (|p_1| + |p_2|) to first order), and one
  device's output is rounded once (at most u |y|); |y| and |p_1| + |p_2| are at most
  (|A| |B|)_ij, the product of the absolute operands (exact here: exact_data quantizes without
  error), so the two differ by at most 2 n u (|A| |B|)_ij (1 + 2u for the second-order terms)."""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  assert core.GemmConfig().partial_sums == "output"
  plan = PLANS[-1]
  got, text = _sharded(DELAYED, plan, step=_step(DELAYED, core.GemmConfig(backend="ffi")))
  sharded_calls, calls[:] = list(calls), []
  want = _one_device_uncached(DELAYED)
  # dgrad's and wgrad's shards write bf16.
  assert ((64, 16), (64, 16), np.dtype(jnp.bfloat16)) in sharded_calls, sharded_calls
  # (The kernel is traced once with the global shapes too: wgrad's in float32 there.)
  assert not any(c[2] == np.dtype(jnp.float32) and c[0][-1] < 128 for c in sharded_calls), (
    sharded_calls
  )
  reduces = [c for c in inspect.hlo_collectives(text) if c.op == "all-reduce"]
  sums = [c for c in reduces if any(int(np.prod(s)) > 1 for _, s in c.arrays)]
  # dx (64, 64) over tp and dW (64, 16) over dp. XLA:CPU widens bf16 all-reduces to float32
  # (its reduction computation renamed "..._promoted"); a GPU's sum bf16 (bench/RESULTS.md).
  assert len(sums) == 2, sums
  for c in sums:
    assert all(d == "bf16" for d, _ in c.arrays) or "_promoted" in c.line, c.line
  x, w, dy = (np.abs(np.asarray(a, np.float64)) for a in _data())
  x, dy, w = x.reshape(-1, X_SHAPE[-1]), dy.reshape(-1, Y_SHAPE[-1]), w
  n, u = 2, 2.0**-8
  for step, factor, (y, (dx, dw, state)), (ry, (rdx, rdw, rstate)) in zip(
    range(len(FACTORS)), FACTORS, got, want, strict=True
  ):
    np.testing.assert_array_equal(y, ry, err_msg=f"step {step}: y")  # K whole: as one device
    bounds = {"dx": factor * dy @ w.T, "dw": factor * x.T @ dy}
    for name, a, b in (("dx", dx, rdx), ("dw", dw, rdw)):
      a = np.asarray(a, np.float64).reshape(bounds[name].shape)
      b = np.asarray(b, np.float64).reshape(bounds[name].shape)
      err = np.abs(a - b)
      assert np.all(err <= 2 * n * u * (1 + 2 * u) * bounds[name]), (step, name, err.max())
      assert err.max() > 0  # the bf16 sums do round here
    for key in rstate:
      np.testing.assert_array_equal(state[key], rstate[key], err_msg=f"step {step}: {key}")


def _one_device_uncached(recipe):
  device = jax.devices()[0]
  put = lambda a: jax.device_put(a, device)
  x, w, dy = (put(a) for a in _data())
  return _run(recipe, x, w, dy, put)[0]


def _block_operands():
  from te_adapters.core.formats import _float8_block

  rng = np.random.default_rng(5)
  a = jnp.asarray(rng.standard_normal((1, 64, 256)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((1, 128, 256)), jnp.float32)
  qa = _float8_block.quantize(a, (128,), jnp.float8_e4m3fn, True)[:2]
  qb = _float8_block.quantize(b, (128, 128), jnp.float8_e4m3fn, True)[:2]
  return qa, qb


def _block_kernel(calls):
  from te_adapters.core.formats import _float8_block

  def kernel(a, sa, a_block, b, sb, b_block, dtype):
    calls.append((a.shape, sa.shape, b.shape, sb.shape))
    return _float8_block._xla_gemm(a, sa, a_block, b, sb, b_block).astype(dtype)

  return kernel


def test_block_scaled_gemm_rule_shards_the_scales_with_their_blocks():
  from te_adapters.core.formats import _float8_block

  (a, sa), (b, sb) = _block_operands()
  want = _float8_block._xla_gemm(a, sa, (128,), b, sb, (128, 128))
  mesh = _mesh()
  put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
  calls = []
  f = jax.jit(
    lambda a, sa, b, sb: kernels.block_scaled_gemm(
      _block_kernel(calls), _float8_block._xla_gemm, a, sa, (128,), b, sb, (128, 128), jnp.float32
    )
  )
  # Rows over dp, K over tp: 128 of K per device, one whole block (and tile) each.
  args = (
    put(a, P(None, "dp", "tp")),
    put(sa, P(None, "dp", "tp")),
    put(b, P(None, None, "tp")),
    put(sb, P(None, None, "tp")),
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    y = f(*args)
  assert ((1, 32, 128), (1, 32, 1), (1, 128, 128), (1, 1, 1)) in calls, calls
  # One device sums both K slices' GEMMs in one call, a device here one slice: float32
  # reassociation on CPU, and on a GPU XLA's FP8 GEMM of another shape, summing in another
  # order (spmd_checks.assert_close_to_one_device).
  if spmd_checks.ON_GPU:
    spmd_checks.assert_close_to_one_device(y, want, "y")
  else:
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_block_scaled_gemm_rule_gathers_a_dim_whose_tiles_would_split():
  from te_adapters.core.formats import _float8_block

  (a, sa), (b, sb) = _block_operands()
  mesh = _mesh()
  put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
  calls = []
  f = jax.jit(
    lambda a, sa, b, sb: kernels.block_scaled_gemm(
      _block_kernel(calls), _float8_block._xla_gemm, a, sa, (128,), b, sb, (128, 128), jnp.float32
    )
  )
  # N (128 rows: one row of 128x128 tiles) cannot be split over tp: it is gathered.
  args = (put(a, P()), put(sa, P()), put(b, P(None, "tp")), put(sb, P()))
  with pytest.warns(ta.core.ShardingFallbackWarning, match="block-scaled FP8 GEMM.*gathered"):
    y = f(*args)
  assert ((1, 64, 256), (1, 64, 2), (1, 128, 256), (1, 1, 2)) in calls, calls
  want = _float8_block._xla_gemm(a, sa, (128,), b, sb, (128, 128))
  # Each device runs the whole GEMM, bit for bit one device's on CPU; on a GPU XLA autotunes its
  # FP8 GEMM per compiled program (this one and the eager one of ``want``), and two kernels sum
  # the FP8 products in different orders (spmd_checks.assert_close_to_one_device).
  spmd_checks.assert_close_to_one_device(y, want, "y")


def test_gemm_rule_slices_a_replicated_operand_without_a_warning():
  """K sharded in a only (b replicated): b is sliced where it lies, and K summed over tp."""
  (a, sa), (b, sb) = _quantized((32, 64), 3), _quantized((48, 64), 4)
  mesh = _mesh()
  a_s = jax.device_put(a, NamedSharding(mesh, P(None, "tp")))
  f = jax.jit(
    lambda a, b: kernels.gemm("slicing GEMM", _cpu_gemm, _cpu_gemm, a, b, sa, sb, jnp.float32)
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    compiled = f.lower(a_s, b).compile()
  np.testing.assert_array_equal(
    np.asarray(compiled(a_s, b)), np.asarray(_cpu_gemm(a, b, sa, sb, jnp.float32))
  )
  ops = [c.op for c in inspect.hlo_collectives(compiled.as_text())]
  assert "all-gather" not in ops and "all-reduce" in ops, ops


def test_gemm_rule_sums_in_chunks_beside_a_sm_margin(monkeypatch):
  """``GemmConfig(sum_chunks=2, comm_sm_margin=8)`` on DP x column-parallel TP: the shards of
  dgrad (K over tp) and wgrad (K over dp) run in two chunks of their output rows, each
  all-reduced on its own, with the margin passed to the kernel; the forward GEMM (K whole) runs
  whole with every SM. The result equals the unchunked program's bit for bit (each output row
  is the same sum either way; the emulated kernel's rows do not depend on their neighbours)."""
  calls, margins = [], []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls, margins))
  plan = PLANS[-1]
  chunked = core.GemmConfig(backend="ffi", sum_chunks=2, comm_sm_margin=8)
  got, text = _sharded(DELAYED, plan, step=_step(DELAYED, chunked))
  by_call = list(zip(calls, margins, strict=True))
  calls[:], margins[:] = [], []
  want, base_text = _sharded(DELAYED, plan, step=_step(DELAYED, core.GemmConfig(backend="ffi")))
  bf16 = np.dtype(jnp.bfloat16)
  # Shards: x3 (128, 64) over dp, the kernel (32, 64) over tp; dgrad's output (64, 64) and
  # wgrad's (64, 16) in chunks of 32 rows.
  assert (((32, 16), (64, 16), bf16), 8) in by_call, by_call  # dgrad
  assert (((32, 64), (16, 64), bf16), 8) in by_call, by_call  # wgrad
  assert (((64, 64), (16, 64), bf16), 0) in by_call, by_call  # forward: K whole, every SM
  assert not any(m and c[0][0] == 64 for c, m in by_call), by_call  # no unchunked summed GEMM

  def grad_sums(hlo):
    """Elements of each array the gradient all-reduces sum (a GPU's async start lists its
    operands, then its results)."""
    out = []
    for c in inspect.hlo_collectives(hlo):
      arrays = [int(np.prod(s)) for _, s in c.arrays if int(np.prod(s)) >= 256]
      if c.op == "all-reduce":
        out += arrays[: len(arrays) // 2] if "-start(" in c.line else arrays
    return sorted(out)

  # dx (64, 64) and dW (64, 16), each once; chunked, in halves. XLA combines the halves of GEMMs
  # this small into one all-reduce (under its combine threshold: XLA:CPU as a tuple of the
  # halves, XLA:GPU flattened into one array); at seed 000's sizes they stay apart on the GPU.
  assert sum(grad_sums(text)) == sum(grad_sums(base_text)) == 64 * 64 + 64 * 16
  if jax.default_backend() == "cpu":
    assert grad_sums(text) == [32 * 16] * 2 + [32 * 64] * 2, grad_sums(text)
  for step, (g, w) in enumerate(zip(got, want, strict=True)):
    for name, a, b in zip(
      ("y", "dx", "dw", "state"), jax.tree.leaves(g), jax.tree.leaves(w), strict=False
    ):
      np.testing.assert_array_equal(a, b, err_msg=f"step {step}: {name}")


def _big_collectives(hlo, ops):
  """The collectives of ``ops`` in compiled HLO that move arrays of 256 elements or more (the
  partial products, not the amaxes)."""
  return [
    c
    for c in inspect.hlo_collectives(hlo)
    if c.op in ops and any(int(np.prod(s)) >= 256 for _, s in c.arrays)
  ]


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT_SCALING], ids=["delayed", "current"])
def test_device_sums_exchange_sums_dgrad_and_wgrad_by_collective_permutes(monkeypatch, recipe):
  """``GemmConfig(device_sums="exchange")`` on DP x column-parallel TP: dgrad's partial products
  (K over tp) and wgrad's (K over dp) are summed by one exchange and an add each (two devices
  per sum), with no all-reduce of a partial product left; outputs, gradients and the recipe
  state equal one device's bit for bit over three steps (float32 partial sums of exact data)."""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  plan = dataclasses.replace(PLANS[-1], bf16_sums=())
  exchange = dataclasses.replace(FFI, device_sums="exchange")
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    got, text = _sharded(recipe, plan, step=_step(recipe, exchange))
  _assert_equal_to_one_device(got, _one_device_uncached(recipe), plan)
  assert ((64, 16), (64, 16), np.dtype(jnp.float32)) in calls, calls  # dgrad's shards, summed
  permutes = _big_collectives(text, ("collective-permute",))
  # dx (64, 64) (its rows split over dp) and dW (64, 16) float32 per device, each exchanged once.
  assert sorted(tuple(s) for c in permutes for _, s in c.arrays[:1]) == [(64, 16), (64, 64)], [
    c.line[:160] for c in permutes
  ]
  assert not _big_collectives(text, ("all-reduce", "reduce-scatter")), text


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")
def test_device_sums_exchange_over_eight_devices_is_psum(monkeypatch):
  """The rule with K over both axes of a (2, 4) mesh: each device's partial product is summed
  over 8 devices in 3 exchanges (recursive doubling); over a 3-device axis, which cannot be
  paired, XLA's all-reduce sums it, said once by a ShardingFallbackWarning."""
  (a, sa), (b, sb) = _quantized((32, 64), 3), _quantized((48, 64), 4)
  want = np.asarray(_cpu_gemm(a, b, sa, sb, jnp.float32).astype(jnp.bfloat16))
  rule = lambda a, b: kernels.gemm(  # noqa: E731
    "test GEMM", _cpu_gemm, _cpu_gemm, a, b, sa, sb, jnp.bfloat16, device_sums="exchange"
  )
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
  spec = NamedSharding(mesh, P(None, ("dp", "tp")))
  a_s, b_s = jax.device_put(a, spec), jax.device_put(b, spec)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    compiled = jax.jit(rule).lower(a_s, b_s).compile()
  np.testing.assert_array_equal(np.asarray(compiled(a_s, b_s)), want)  # exact data
  text = compiled.as_text()
  assert len(_big_collectives(text, ("collective-permute",))) == 3
  assert not _big_collectives(text, ("all-reduce",))

  odd = jax.make_mesh((3, 2), ("dp", "tp"), devices=jax.devices()[:6])
  a3, sa3 = _quantized((32, 96), 5)
  b3, sb3 = _quantized((48, 96), 6)
  spec3 = NamedSharding(odd, P(None, "dp"))
  a3_s, b3_s = jax.device_put(a3, spec3), jax.device_put(b3, spec3)
  rule3 = lambda a, b: kernels.gemm(  # noqa: E731
    "odd GEMM", _cpu_gemm, _cpu_gemm, a, b, sa3, sb3, jnp.bfloat16, device_sums="exchange"
  )
  with pytest.warns(ta.core.ShardingFallbackWarning, match="summed over 3 devices") as seen:
    compiled3 = jax.jit(rule3).lower(a3_s, b3_s).compile()
  assert sum("summed over 3 devices" in str(w.message) for w in seen) == 1
  want3 = np.asarray(_cpu_gemm(a3, b3, sa3, sb3, jnp.float32).astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(compiled3(a3_s, b3_s)), want3)
  assert _big_collectives(compiled3.as_text(), ("all-reduce",))


@pytest.mark.parametrize(
  ("rows", "chunks", "want"),
  [(8192, 4, 2048), (64, 2, 32), (64, 4, 16), (64, 8, 64), (48, 2, 48), (100, 1, 100)],
)
def test_sum_chunk_rows_keeps_the_kernels_multiples_of_16(rows, chunks, want):
  assert kernels.sum_chunk_rows(rows, chunks) == want


@pytest.mark.parametrize("recipe", [DELAYED, ta.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fold_amax_reduces_every_amax_over_the_mesh_in_one_all_reduce(recipe):
  """``GemmConfig(fold_amax=True)`` on DP x column-parallel TP: x's amax (over dp), the
  kernel's (over tp) and the gradient's (over both) are each reduced over all four devices, so
  XLA combines them into one all-reduce of three amaxes; every output and the recipe state are
  the unfolded program's bit for bit (a max over devices holding the same data changes
  nothing). Unfolded, the amaxes take an all-reduce per group of devices."""

  def amax_reduces(hlo):
    """The all-reduces whose reduction is a max (the amaxes)."""
    maxes, name = set(), None
    for line in hlo.splitlines():
      if head := re.match(r"^%?([\w.\-]+) \(.*\{\s*$", line):
        name = head.group(1)
      elif name and "ROOT" in line and " maximum(" in line:
        maxes.add(name)
    return [
      c
      for c in inspect.hlo_collectives(hlo)
      if c.op == "all-reduce"
      and (m := re.search(r"to_apply=%?([\w.\-]+)", c.line))
      and m.group(1) in maxes
    ]

  every_device = re.compile(
    r"replica_groups=(\{\{0,1,2,3\}\}|\[1,4\]<=\[4\]|mesh\[[^\]]*\] \{'dp','tp'\})"
  )
  plan = PLANS[-1]
  got, text = _sharded(recipe, plan, step=_step(recipe, dataclasses.replace(FFI, fold_amax=True)))
  want, base_text = _sharded(recipe, plan)
  folded, unfolded = amax_reduces(text), amax_reduces(base_text)
  lines = lambda cs: [c.line[:200] for c in cs]
  assert folded and all(every_device.search(c.line) for c in folded), lines(folded)
  assert len(folded) < len(unfolded), (lines(folded), lines(unfolded))
  # XLA:CPU combines all three (dy is an input here, so its amax is ready at the start); XLA:GPU
  # the two of the forward GEMM (current) or all three (delayed), as bench/mesh2x2.py shows.
  if jax.default_backend() == "cpu":
    assert len(folded) == 1 and len(folded[0].arrays) == 3, lines(folded)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sums", ["collective", "exchange"])
@pytest.mark.parametrize("gather", [False, True], ids=["cast_then_gather", "kernel_all_gather"])
def test_fsdp_weight_gradient_is_reduce_scattered_onto_the_kernels_shards(
  monkeypatch, gather, sums
):
  """FSDP with the GEMM kernel emulated: the kernel sharded over dp on its input dim and its
  gradient kept so (as an optimizer holding sharded parameters needs it). wgrad contracts the
  dp-sharded rows, and the output's users want it sharded over dp on the kernel's dim: the rule
  reduce-scatters the partial products onto that dim (each device receives its half) instead of
  all-reducing the whole gradient and slicing it after, and the result is one device's bit for
  bit (float32 partial sums: each element is the same two partials summed either way). With
  ``device_sums="exchange"`` the reduce-scatter is one exchange of the half each device does
  not keep, and an add."""
  calls = []
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)
  monkeypatch.setattr(kernels, "gemm_call", _emulated_cublas(calls))
  plan = PLANS[3]
  assert plan.name == "fsdp"
  mesh = _mesh()
  kw = {"kernel_all_gather": NamedSharding(mesh, plan.w)} if gather else {}

  def loss(x, w, state, dy, factor):
    y = core.dot_general(
      x * factor.astype(x.dtype),
      w.astype(jnp.bfloat16),
      DN,
      recipe=DELAYED,
      state=state,
      threshold=None,
      config=dataclasses.replace(FFI, device_sums=sums),
      **kw,
    )
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  def step(x, w, state, dy, factor):
    (_, y), (dx, dw, new) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, dy, factor
    )
    return y, (dx, lax.with_sharding_constraint(dw, NamedSharding(mesh, plan.w)), new)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ta.core.ShardingFallbackWarning)
    got, text = _sharded(DELAYED, plan, step=jax.jit(step))
  _assert_equal_to_one_device(got, _one_device(DELAYED), plan)
  # wgrad's shards: x^T (64, 64) . dy^T (32, 64)^T over the rows' halves, float32 partials.
  assert ((64, 64), (32, 64), np.dtype(jnp.float32)) in calls, calls
  big = lambda c: [s for _, s in c.arrays if int(np.prod(s)) >= 256]  # noqa: E731
  collectives = list(inspect.hlo_collectives(text))
  scatters = [c for c in collectives if c.op == "reduce-scatter"]
  if sums == "collective":
    # dW (64, 32) float32, scattered over dp onto (32, 32) per device.
    assert any((32, 32) in big(c) for c in scatters), [c.line[:160] for c in collectives]
  else:  # the half of dW (64, 32) a device sends: (32, 32); no reduce-scatter
    permutes = [c for c in collectives if c.op == "collective-permute"]
    assert any((32, 32) in big(c) for c in permutes), [c.line[:160] for c in collectives]
    assert not any(big(c) for c in scatters), [c.line[:160] for c in scatters]
  assert not any(c.op == "all-reduce" and big(c) for c in collectives), [
    c.line[:160] for c in collectives if c.op == "all-reduce"
  ]
