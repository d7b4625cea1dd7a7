"""The quantized dot_general on meshes: sharded against single-device, collectives, FSDP FP8 gather.

Runs on 8 virtual CPU devices (``tests/conftest.py`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts). Seed 000's section 4
plans, scaled down: DP x TP column-parallel, row-parallel TP, FSDP (kernel sharded over the data
axis, gathered for the GEMM), and DP x FSDP x TP on 8 devices; each under ``jax.jit`` with
``NamedSharding``-placed arrays (Auto and Explicit mesh axes) and inside ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters.core import gemm as core_gemm
from te_adapters.core import sharding
from tests import spmd_checks

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
)

DN = (((2,), (0,)), ((), ()))  # x (batch, seq, hidden) . kernel (hidden, features)
X_SHAPE, W_SHAPE = (8, 16, 64), (64, 64)
Y_SHAPE = (8, 16, 64)
FACTORS = (1.0, 2.0, 1.0)  # per step; powers of two are exact in bf16
DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
RECIPES = [DELAYED, CURRENT]


@dataclasses.dataclass(frozen=True)
class Plan:
  """A sharding plan: mesh axes, the specs of x, kernel and dy, and the GEMM's SPMD keywords."""

  name: str
  axes: tuple[tuple[str, int], ...]
  x: P
  w: P
  dy: P
  gather: P | None = None  # kernel_all_gather
  row_parallel: bool = False  # kernel's contracting dim is sharded: y needs a sum over it
  # Outputs summed over devices from bf16 partial products (the forward and dgrad GEMMs emit
  # bf16): these match one device only to bf16 rounding.
  bf16_sums: tuple[str, ...] = ()

  def mesh(self, axis_type=AxisType.Explicit):
    names = tuple(n for n, _ in self.axes)
    shape = tuple(s for _, s in self.axes)
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, devices=devices, axis_types=(axis_type,) * len(names))


COLUMN = Plan(
  "dp2_tp2_column",
  (("dp", 2), ("tp", 2)),
  P("dp"),
  P(None, "tp"),
  P("dp", None, "tp"),
  bf16_sums=("dx",),
)
ROW = Plan(
  "dp2_tp2_row",
  (("dp", 2), ("tp", 2)),
  P("dp", None, "tp"),
  P("tp", None),
  P("dp"),
  row_parallel=True,
  bf16_sums=("y",),
)
FSDP = Plan("fsdp4", (("fsdp", 4),), P("fsdp"), P("fsdp", None), P("fsdp"), gather=P("fsdp", None))
FSDP_TP = Plan(
  "dp2_fsdp2_tp2",
  (("dp", 2), ("fsdp", 2), ("tp", 2)),
  P(("dp", "fsdp")),
  P("fsdp", "tp"),
  P(("dp", "fsdp"), None, "tp"),
  gather=P("fsdp", None),
  bf16_sums=("dx",),
)


def _data():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  shapes = (X_SHAPE, W_SHAPE, Y_SHAPE)
  x, w, dy = (jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True))
  return x.astype(jnp.bfloat16), w, dy.astype(jnp.bfloat16)


def _loss_terms(x, w, state, dy, factor, **kw):
  recipe = kw.pop("recipe")
  # The step factor changes the activations' amax between steps.
  y = core.dot_general(
    x * factor.astype(x.dtype),
    w.astype(jnp.bfloat16),
    DN,
    threshold=None,
    recipe=recipe,
    state=state or None,
    **kw,
  )
  return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y


def _run(step, x, w, dy, recipe, put=lambda a: a):
  """Runs one step per factor, threading the state; returns (y, dx, dw, states after each step).

  ``put`` places the state and the factor (replicated on a mesh).
  """
  state = put(core.init_state(recipe))
  states = []
  for factor in FACTORS:
    y, (dx, dw, state) = step(x, w, state, dy, put(jnp.float32(factor)))
    states.append(state)
  return y, dx, dw, states


def _compile_and_run(step, mesh, args, recipe):
  """Compiles ``step`` once for the placed ``args``; returns (results of _run, compiled HLO)."""
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P()))
  compiled = step.lower(
    args[0], args[1], put(core.init_state(recipe)), args[2], put(jnp.float32(1))
  ).compile()
  return _run(compiled, *args, recipe, put=put), compiled.as_text()


@functools.cache
def _reference(recipe):
  """The single-device run, as numpy."""
  x, w, dy = _data()

  @jax.jit
  def step(x, w, state, dy, factor):
    fn = functools.partial(_loss_terms, recipe=recipe)
    (_, y), grads = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)(x, w, state, dy, factor)
    return y, grads

  y, dx, dw, states = _run(step, x, w, dy, recipe)
  return jax.tree_util.tree_map(np.asarray, (y, dx, dw, states))


def _jit_step(plan, mesh, recipe, use_gather):
  kw = {"recipe": recipe}
  if use_gather:
    kw["kernel_all_gather"] = plan.gather
  explicit = mesh.axis_types[0] == AxisType.Explicit
  if plan.row_parallel and explicit:
    kw["out_sharding"] = P(plan.x[0], None, None)  # Explicit axes: the sum over tp is named

  def step(x, w, state, dy, factor):
    fn = functools.partial(_loss_terms, **kw)
    (_, y), grads = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)(x, w, state, dy, factor)
    return y, grads

  return jax.jit(step)


def _shard_map_step(plan, mesh, recipe, use_gather=True, amax_axes=None):
  kw = {"recipe": recipe, "amax_axes": amax_axes}
  if use_gather:
    kw["kernel_all_gather"] = plan.gather
  if plan.row_parallel:
    kw["preferred_element_type"] = jnp.float32  # partial sums add up in float32, as under jit

  def body(x, w, state, dy, factor):
    _, y = _loss_terms(x, w, state, dy, factor, **kw)
    if plan.row_parallel:
      y = lax.psum(y, "tp").astype(jnp.bfloat16)
    loss = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return lax.psum(loss, tuple(sorted(sharding.varying_axes(loss)))), y

  y_spec = P(plan.dy[0]) if plan.row_parallel else plan.dy
  mapped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(plan.x, plan.w, P(), plan.dy, P()),
    out_specs=(P(), y_spec),
  )

  def step(x, w, state, dy, factor):
    (_, y), grads = jax.value_and_grad(mapped, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, dy, factor
    )
    return y, grads

  return jax.jit(step)


def _put(mesh, plan, x, w, dy):
  return (
    jax.device_put(x, NamedSharding(mesh, plan.x)),
    jax.device_put(w, NamedSharding(mesh, plan.w)),
    jax.device_put(dy, NamedSharding(mesh, plan.dy)),
  )


def _check_against_reference(recipe, result, rel, plan):
  y, dx, dw, states = result
  ref_y, ref_dx, ref_dw, ref_states = _reference(recipe)
  # Outputs within float tolerance: bf16 where partial products are summed across devices in
  # bf16 (about 0.003 here; FP8 quantization itself costs 0.04), float32 rounding elsewhere
  # (dW is float32, and the rest is computed as on one device).
  tol = lambda name: 1e-2 if name in plan.bf16_sums else 1e-5
  assert rel(y, ref_y) < tol("y") and rel(dx, ref_dx) < tol("dx") and rel(dw, ref_dw) < 1e-5
  # Scales and amax histories after every step: bit-identical.
  for got, want in zip(states, ref_states, strict=True):
    for name in want:
      np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)
  # And quantization really happened (bf16 alone gives about 0.003).
  x, w, dy = _data()
  x64 = np.asarray(x, np.float64) * FACTORS[-1]
  assert 0.01 < rel(y, x64 @ np.asarray(w.astype(jnp.bfloat16), np.float64)) < 0.06


def _ops(compiled_text):
  return [c.op for c in inspect.hlo_collectives(compiled_text)]


def _check_collectives(plan, text, use_gather):
  cols = inspect.hlo_collectives(text)
  gathers = [c for c in cols if c.op == "all-gather"]
  assert not [c for c in cols if c.op in ("all-to-all", "collective-permute")], cols
  if plan.gather is None:
    assert not gathers, gathers  # TP plans gather nothing: no activation all-gather
    return
  # FSDP: the only all-gathers are of the kernel, whole on the gathered (hidden) dim, in either
  # orientation (the contracting-last layout gathers it as (features, hidden)); no activations.
  kernel_sizes = (W_SHAPE[0] * W_SHAPE[1], W_SHAPE[0] * W_SHAPE[1] // 2)  # // 2: TP on features
  for c in gathers:
    dtype, shape = c.arrays[-1]
    assert W_SHAPE[0] in shape and int(np.prod(shape)) in kernel_sizes, c.line
    if use_gather:
      assert dtype == "u8", c.line  # FP8 bytes on the wire, not a widened copy
  assert gathers


MESH_CASES = [
  (COLUMN, AxisType.Explicit),
  (COLUMN, AxisType.Auto),
  (ROW, AxisType.Explicit),
  (ROW, AxisType.Auto),
  (FSDP, AxisType.Explicit),
  (FSDP, AxisType.Auto),
  (FSDP_TP, AxisType.Auto),
]
# Every case for DelayedScaling; for current scaling, whose amaxes take the same path, one mesh
# axis type per plan (keeps the file's CPU time down).
JIT_CASES = [(p, t, DELAYED) for p, t in MESH_CASES] + [
  (p, t, CURRENT) for p, t in MESH_CASES if t == AxisType.Explicit or p is FSDP_TP
]


@pytest.mark.parametrize(
  "plan, axis_type, recipe",
  JIT_CASES,
  ids=[f"{p.name}-{t.name}-{type(r).__name__}" for p, t, r in JIT_CASES],
)
def test_jit_with_named_sharding_matches_single_device(plan, axis_type, recipe, rel):
  mesh = plan.mesh(axis_type)
  args = _put(mesh, plan, *_data())
  use_gather = plan.gather is not None
  with jax.set_mesh(mesh):
    result, text = _compile_and_run(_jit_step(plan, mesh, recipe, use_gather), mesh, args, recipe)
  _check_against_reference(recipe, result, rel, plan)
  y, dx, dw, _ = result
  # Output shardings as the user placed them.
  y_spec = P(plan.x[0], None, None) if plan.row_parallel else plan.dy
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), 3), y.sharding
  assert dx.sharding.is_equivalent_to(NamedSharding(mesh, plan.x), 3), dx.sharding
  if axis_type == AxisType.Explicit or use_gather:
    assert dw.sharding.is_equivalent_to(NamedSharding(mesh, plan.w), 2), dw.sharding
  _check_collectives(plan, text, use_gather)


SHARD_MAP_CASES = [COLUMN, ROW, FSDP, FSDP_TP]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("plan", SHARD_MAP_CASES, ids=lambda p: p.name)
def test_shard_map_matches_single_device(plan, recipe, rel):
  mesh = plan.mesh()
  args = _put(mesh, plan, *_data())
  use_gather = plan.gather is not None
  step = _shard_map_step(plan, mesh, recipe)
  result, text = _compile_and_run(step, mesh, args, recipe)
  _check_against_reference(recipe, result, rel, plan)
  assert result[2].sharding.is_equivalent_to(NamedSharding(mesh, plan.w), 2)
  _check_collectives(plan, text, use_gather)


def test_shard_map_with_amax_axes_by_role_matches_single_device(rel):
  """Explicit amax_axes, one entry per role, naming the axes each operand is sharded over."""
  plan = ROW
  mesh = plan.mesh()
  args = _put(mesh, plan, *_data())
  amax_axes = {"x": ("dp", "tp"), "kernel": "tp", "grad": ("dp", "tp")}
  step = _shard_map_step(plan, mesh, DELAYED, amax_axes=amax_axes)
  result, _ = _compile_and_run(step, mesh, args, DELAYED)
  _check_against_reference(DELAYED, result, rel, plan)


def test_shard_map_with_partly_manual_mesh_matches_single_device(rel):
  """DP manual inside shard_map, TP left to XLA (``axis_names={"dp"}``)."""
  plan = COLUMN
  mesh = plan.mesh(AxisType.Auto)
  args = _put(mesh, plan, *_data())

  def body(x, w, state, dy, factor):
    loss, y = _loss_terms(x, w, state, dy, factor, recipe=DELAYED)
    return lax.psum(loss, "dp"), y

  mapped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P("dp"), P(), P(), P("dp"), P()),
    out_specs=(P(), P("dp")),
    axis_names={"dp"},
  )

  def step(x, w, state, dy, factor):
    (_, y), grads = jax.value_and_grad(mapped, argnums=(0, 1, 2), has_aux=True)(
      x, w, state, dy, factor
    )
    return y, grads

  with jax.set_mesh(mesh):
    result, text = _compile_and_run(jax.jit(step), mesh, args, DELAYED)
  _check_against_reference(DELAYED, result, rel, plan)
  _check_collectives(plan, text, False)


# --------------------------------------------------------------------------- block recipes

BLOCK_RECIPES = [
  ta.MXFP8BlockScaling(),
  ta.NVFP4BlockScaling(disable_stochastic_rounding=True),
  ta.Float8BlockScaling(),
]
# Multiples of 128 (FP8 1x128/128x128 blocks), also per device: M = 256, K = N = 256.
BLOCK_X, BLOCK_W = (4, 64, 256), (256, 256)


def _block_data():
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  x = jax.random.normal(keys[0], BLOCK_X, jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(keys[1], BLOCK_W, jnp.float32)
  dy = jax.random.normal(keys[2], BLOCK_X[:2] + BLOCK_W[1:], jnp.float32).astype(jnp.bfloat16)
  return x, w, dy


def _block_grads(x, w, dy, recipe):
  y, vjp = jax.vjp(
    lambda x, w: core.dot_general(x, w.astype(jnp.bfloat16), DN, threshold=None, recipe=recipe),
    x,
    w,
  )
  return (y, *vjp(dy))


def _check_block(recipe, got, rel):
  x, w, dy = _block_data()
  ref = jax.jit(functools.partial(_block_grads, recipe=recipe))(x, w, dy)
  # dx sums bf16 partial products over tp; dW (float32) may add block products in another order.
  for name, a, b, tol in zip(("y", "dx", "dW"), got, ref, (1e-5, 1e-2, 5e-3), strict=True):
    assert rel(a, b) < tol, (name, rel(a, b))
  y64 = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
  assert rel(got[0], y64) > 0.01  # quantized


@pytest.mark.parametrize("recipe", BLOCK_RECIPES, ids=lambda r: type(r).__name__)
def test_block_scaled_under_jit_matches_single_device(recipe, rel):
  """Block scales are local to their blocks: under jit XLA lays the blocks over the shards."""
  plan = COLUMN
  mesh = plan.mesh(AxisType.Auto)
  args = _put(mesh, plan, *_block_data())
  with jax.set_mesh(mesh):
    compiled = jax.jit(functools.partial(_block_grads, recipe=recipe)).lower(*args).compile()
  _check_block(recipe, compiled(*args), rel)
  assert not [c for c in inspect.hlo_collectives(compiled.as_text()) if c.op == "all-gather"]


@pytest.mark.parametrize(
  "recipe", [BLOCK_RECIPES[0], BLOCK_RECIPES[2]], ids=lambda r: type(r).__name__
)
def test_block_scaled_inside_shard_map_matches_single_device(recipe, rel):
  plan = COLUMN
  mesh = plan.mesh()

  def body(x, w, dy):
    return _block_grads(x, w, dy, recipe)

  mapped = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(plan.x, plan.w, plan.dy), out_specs=(plan.dy, plan.x, plan.w)
    )
  )
  _check_block(recipe, mapped(*_put(mesh, plan, *_block_data())), rel)


DP = Plan("dp2", (("dp", 2),), P("dp"), P(), P("dp"))  # data parallel: only dW sums over devices


def _block_grads_f32_kernel(x, w, dy, rng=None, *, recipe, **kw):
  """y, dx, dW with a float32 kernel (float32 dW, so sums over devices show at full precision)."""
  y, vjp = jax.vjp(
    lambda x, w: core.dot_general(x, w, DN, threshold=None, recipe=recipe, rng=rng, **kw), x, w
  )
  return (y, *vjp(dy.astype(y.dtype)))


def _assert_same(got, want, names, rel):
  """Bit-identical, except ``names`` that sum partial products over devices (float32 order)."""
  for name, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
    if name in names:
      assert rel(a, b) < 1e-6, (name, rel(a, b))
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


EXPLICIT_BLOCK_CASES = [(r, DP) for r in BLOCK_RECIPES] + [(BLOCK_RECIPES[2], ROW)]


@pytest.mark.parametrize(
  "recipe, plan",
  EXPLICIT_BLOCK_CASES,
  ids=[f"{type(r).__name__}-{p.name}" for r, p in EXPLICIT_BLOCK_CASES],
)
def test_block_scaled_with_explicit_axes_matches_single_device(recipe, plan, rel):
  """The block layout's reshapes name their shardings under Explicit axes (JAX requires it)."""
  mesh = plan.mesh(AxisType.Explicit)
  x, w, dy = _block_data()
  kw = {"out_sharding": P("dp", None, None)} if plan.row_parallel else {}
  fn = functools.partial(_block_grads_f32_kernel, recipe=recipe)
  ref = jax.jit(fn)(x, w, dy)
  with jax.set_mesh(mesh):
    got = jax.jit(functools.partial(fn, **kw))(*_put(mesh, plan, x, w, dy))
  # Data parallel: y and dx are computed row by row as on one device; dW sums over dp.
  # Row parallel: y sums over tp, dW over dp.
  _assert_same(got, ref, ("y", "dW") if plan.row_parallel else ("dW",), rel)
  y_spec = P("dp", None, None) if plan.row_parallel else plan.dy
  for a, spec in zip(got, (y_spec, plan.x, plan.w), strict=True):
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), (a.sharding, spec)


def test_block_scaled_with_explicit_axes_needs_whole_blocks_per_device():
  plan = Plan("dp4", (("dp", 4),), P("dp"), P(), P("dp"))
  mesh = plan.mesh(AxisType.Explicit)
  x, w, dy = _put(mesh, plan, *_block_data())
  fn = functools.partial(_block_grads_f32_kernel, recipe=BLOCK_RECIPES[2])
  # M = 256 over 4 devices: 64 rows each, but the wgrad copies have blocks of 128 along M.
  with (
    jax.set_mesh(mesh),
    pytest.raises(
      ValueError,
      match=(
        r"Float8BlockScaling: the lhs free size M .* is 256, split over 4 devices \(mesh axes "
        r"\('dp',\)\): 64 per device, which is not a multiple of 128"
      ),
    ),
  ):
    jax.eval_shape(fn, x, w, dy)


def test_reshape_spec_keeps_each_group_s_major_sharding():
  sizes = {"dp": 2, "tp": 4}
  spec = sharding.reshape_spec((4, 64, 256), P("dp", None, "tp"), (1, 256, 8, 32), sizes)
  assert spec == P(None, "dp", "tp", None)
  assert sharding.reshape_spec((1, 256, 8), P(None, "dp", "tp"), (4, 64, 8), sizes) == P(
    "dp", None, "tp"
  )
  with pytest.raises(ValueError, match=r"only the first of them may be sharded"):
    sharding.reshape_spec((4, 64, 256), P(None, "dp"), (256, 256), sizes)
  with pytest.raises(ValueError, match=r"cannot hold the 4 shards"):
    sharding.reshape_spec((8, 16), P("tp"), (2, 64), sizes)


NVFP4_RN = BLOCK_RECIPES[1]
NVFP4_SR = ta.NVFP4BlockScaling()


def _nvfp4_shard_map(plan, recipe, **kw):
  mesh = plan.mesh()
  fn = functools.partial(_block_grads_f32_kernel, recipe=recipe, **kw)
  if recipe.uses_rng:
    body, in_specs = fn, (plan.x, plan.w, plan.dy, P())
  else:
    body, in_specs = (lambda x, w, dy: fn(x, w, dy)), (plan.x, plan.w, plan.dy)
  mapped = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(plan.dy, plan.x, plan.w))
  )
  return mesh, mapped


@pytest.mark.parametrize("plan", [DP, COLUMN], ids=lambda p: p.name)
def test_nvfp4_inside_shard_map_matches_single_device(plan, rel):
  """The per-tensor amax of NVFP4's two-level scaling is max-reduced over the devices."""
  x, w, dy = _block_data()
  # Outliers on one shard only: without the reduction that shard would scale differently.
  x = x.at[0, 3, 5].set(40.0)
  dy = dy.at[3, 60, 200].set(-30.0)
  ref = jax.jit(functools.partial(_block_grads_f32_kernel, recipe=NVFP4_RN))(x, w, dy)
  mesh, mapped = _nvfp4_shard_map(plan, NVFP4_RN, amax_axes=tuple(n for n, _ in plan.axes))
  got = mapped(*_put(mesh, plan, x, w, dy))
  # Sums over devices: dW over dp; with TP also dx over tp.
  _assert_same(got, ref, ("dW",) if plan is DP else ("dx", "dW"), rel)


def test_nvfp4_stochastic_rounding_inside_shard_map_uses_a_key_per_shard():
  """Each shard folds its index into the key: same data on two shards rounds differently, and
  a given key always gives the same result."""
  plan = DP
  x, w, dy = _block_data()
  half = lambda a: jnp.concatenate([a[:1]] * a.shape[0])  # every dp shard holds the same rows
  x, dy = half(x), half(dy)
  args = _put(plan.mesh(), plan, x, w, dy)
  _, mapped = _nvfp4_shard_map(plan, NVFP4_SR)
  key = jax.random.key(7)
  first, again, other = mapped(*args, key), mapped(*args, key), mapped(*args, jax.random.key(8))
  for a, b in zip(first, again, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  dx = np.asarray(first[1], np.float32)
  assert np.all(np.isfinite(dx)) and not np.array_equal(dx[0], dx[1])  # shards 0 and 1 differ
  assert not np.array_equal(dx, np.asarray(other[1], np.float32))  # another key, other bits
  # Round to nearest: the shards agree, so only the keys made them differ.
  _, mapped_rn = _nvfp4_shard_map(plan, NVFP4_RN)
  dx_rn = np.asarray(mapped_rn(*args)[1], np.float32)
  np.testing.assert_array_equal(dx_rn[0], dx_rn[1])


# --------------------------------------------------------------------------- quantized operands


def test_quantized_data_and_scales_are_bit_identical():
  """Inside shard_map each device quantizes its shard with the global scale, like one device."""
  mesh = COLUMN.mesh()
  x = _data()[0].at[3, 5, 40].set(-50.0)  # the global amax sits on one shard only
  plan = sharding.make_plan(rhs_ndim=2)
  local_plan = sharding.make_plan(amax_axes=(), rhs_ndim=2)
  e4m3 = jnp.dtype(jnp.float8_e4m3fn)

  def quantize(x, plan):
    fmt = core.format_of(CURRENT)
    request = core.QuantizeRequest(x, "x", CURRENT, {}, plan, core.GemmConfig(), cols=False)
    q = fmt.quantize(request).rows
    assert q.dtype == e4m3
    return lax.bitcast_convert_type(q.data, jnp.uint8), q.scale_inv

  ref_data, ref_scale_inv = jax.jit(functools.partial(quantize, plan=plan))(x)
  spec = P("dp", None, "tp")
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  for p, same in ((plan, True), (local_plan, False)):
    # Per-device scale_inv is returned stacked along a new leading axis.
    mapped = jax.jit(
      jax.shard_map(
        lambda x, p=p: jax.tree_util.tree_map(lambda a: a[None], quantize(x, p)),
        mesh=mesh,
        in_specs=spec,
        out_specs=(P(("dp", "tp")), P(("dp", "tp"))),
      )
    )
    data, scale_inv = mapped(xs)
    scale_inv = np.asarray(scale_inv)
    if same:
      np.testing.assert_array_equal(scale_inv, np.broadcast_to(ref_scale_inv, scale_inv.shape))
      # Reassemble the per-device FP8 shards and compare the bytes.
      blocks = np.asarray(data).reshape(2, 2, 4, 16, 32)
      whole = np.concatenate([np.concatenate(list(row), axis=-1) for row in blocks], axis=0)
      np.testing.assert_array_equal(whole, np.asarray(ref_data))
    else:  # amax_axes=(): per-shard scales, so they differ between devices
      assert len(np.unique(scale_inv)) > 1
  # Under jit with a sharded input the amax is global too.
  jit_data, jit_scale_inv = jax.jit(functools.partial(quantize, plan=plan))(xs)
  np.testing.assert_array_equal(np.asarray(jit_data), np.asarray(ref_data))
  np.testing.assert_array_equal(np.asarray(jit_scale_inv), np.asarray(ref_scale_inv))


def test_nan_on_one_shard_reaches_every_device():
  """A NaN in one shard makes the global amax non-finite, so every device keeps the old scale."""
  mesh = COLUMN.mesh()
  x = _data()[0].at[6, 0, 0].set(jnp.nan)
  state = core.init_state(DELAYED)
  e4m3 = jnp.dtype(jnp.float8_e4m3fn)
  plan = sharding.make_plan(rhs_ndim=2)

  def new_x_state(x, state):
    request = core.QuantizeRequest(x, "x", DELAYED, state, plan, core.GemmConfig(), cols=False)
    q = core.format_of(DELAYED).quantize(request)
    assert q.rows.dtype == e4m3
    new = q.state
    return {"x_scale": new.scale, "x_amax_history": new.amax_history}

  ref = jax.jit(new_x_state)(x, state)
  got = jax.jit(jax.shard_map(new_x_state, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P()))(
    jax.device_put(x, NamedSharding(mesh, P("dp"))), state
  )
  assert not np.isfinite(np.asarray(ref["x_amax_history"])[-1])
  np.testing.assert_array_equal(np.asarray(got["x_scale"]), [1.0])
  np.testing.assert_array_equal(
    np.asarray(got["x_amax_history"]), np.asarray(ref["x_amax_history"])
  )


# --------------------------------------------------------------------------- FSDP FP8 gather


def _fsdp_grads(x, w, dy, recipe, gather, policy=None):
  def loss(x, w):
    kw = {"recipe": recipe, "kernel_all_gather": FSDP.gather} if gather else {"recipe": recipe}
    y = core.dot_general(x, w.astype(jnp.bfloat16), DN, threshold=None, **kw)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  if policy is not None:
    loss = jax.checkpoint(loss, policy=policy)
  return jax.value_and_grad(loss, argnums=(0, 1))(x, w)


def _all_gathers(fn, *args):
  """``[(dtype name, bytes)]`` of the all-gathers in ``fn``'s compiled HLO."""
  itemsize = {"u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4}
  out = []
  for c in inspect.hlo_collectives(jax.jit(fn).lower(*args).compile().as_text()):
    if c.op == "all-gather":
      dtype, shape = c.arrays[-1]
      out.append((dtype, itemsize[dtype] * int(np.prod(shape))))
  return out


def test_fsdp_fp8_gather_moves_fp8_bytes():
  """With kernel_all_gather the only all-gather moves one byte per kernel element."""
  mesh = FSDP.mesh(AxisType.Auto)
  x, w, dy = _put(mesh, FSDP, *_data())
  kernel_elements = W_SHAPE[0] * W_SHAPE[1]
  with jax.set_mesh(mesh):
    fp8 = _all_gathers(functools.partial(_fsdp_grads, recipe=CURRENT, gather=True), x, w, dy)
    bf16 = _all_gathers(functools.partial(_fsdp_grads, recipe=None, gather=False), x, w, dy)
    remat = _all_gathers(
      functools.partial(
        _fsdp_grads, recipe=CURRENT, gather=True, policy=core.save_quantized_operands
      ),
      x,
      w,
      dy,
    )
  # FP8 bytes (uint8 on the wire), one gather per step: the gathered kernel is kept for the
  # backward pass.
  assert fp8 == [("u8", kernel_elements)]
  # The bf16 baseline gathers the kernel at two bytes or more per element (XLA's CPU backend
  # even gathers it in float32, since it computes bf16 dots in float32).
  assert sum(b for _, b in bf16) >= 2 * kernel_elements
  # A remat policy that saves only the FP8 operands keeps the shard and gathers again.
  assert remat == [("u8", kernel_elements)] * 2


def test_fsdp_fp8_gather_with_explicit_axes_needs_no_mesh_context():
  """With Explicit axes the kernel's type carries its mesh; jax.set_mesh is not needed."""
  mesh = FSDP.mesh(AxisType.Explicit)
  x, w, dy = _put(mesh, FSDP, *_data())
  out = jax.eval_shape(functools.partial(_fsdp_grads, recipe=CURRENT, gather=True), x, w, dy)
  _, (dx, dw) = out
  assert dw.sharding.spec == P("fsdp", None) and dx.sharding.spec == P("fsdp", None, None)


# --------------------------------------------------------------------------- with_max_grad


def test_state_used_twice_inside_shard_map_combines_by_max():
  mesh = COLUMN.mesh()
  x, w, _ = _data()

  def twice(x, w, state):
    state = core.with_max_grad(state)
    y1 = core.dot_general(x, w, DN, threshold=None, recipe=DELAYED, state=state)
    y2 = core.dot_general(x * jnp.bfloat16(4), w, DN, threshold=None, recipe=DELAYED, state=state)
    return jnp.sum(y1.astype(jnp.float32)) + jnp.sum(y2.astype(jnp.float32))

  def body(x, w, state):
    return lax.psum(twice(x, w, state), ("dp", "tp"))

  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(None, "tp"), P()), out_specs=P())
  state = core.init_state(DELAYED)
  ref = jax.jit(jax.grad(twice, argnums=2))(x, w, state)
  got = jax.jit(jax.grad(mapped, argnums=2))(
    jax.device_put(x, NamedSharding(mesh, P("dp"))),
    jax.device_put(w, NamedSharding(mesh, P(None, "tp"))),
    state,
  )
  amax_x = float(jnp.max(jnp.abs(x.astype(jnp.float32)))) * 4
  assert float(ref["x_amax_history"][-1]) == amax_x  # the larger use, not the sum
  for name in ref:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ref[name]), err_msg=name)


# --------------------------------------------------------------------------- errors


def _trace_in_shard_map(fn, mesh, in_specs, args, check_vma=True):
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=check_vma)
  return jax.make_jaxpr(mapped)(*args)


def _sum_gemm(**kw):
  def fn(x, w, state=None):
    y = core.dot_general(x, w, DN, state=state or None, threshold=None, **kw)
    return lax.psum(jnp.sum(y), tuple(sorted(sharding.varying_axes(jnp.sum(y)))))

  return fn


def test_error_unknown_amax_axis():
  mesh = COLUMN.mesh(AxisType.Auto)
  x, w, _ = _data()
  with pytest.raises(ValueError, match=r"amax_axes for 'x' names mesh axes \['data'\]"):
    _trace_in_shard_map(_sum_gemm(recipe=CURRENT, amax_axes="data"), mesh, (P("dp"), P()), (x, w))


def test_error_delayed_scaling_without_reduction_over_a_varying_axis():
  mesh = COLUMN.mesh(AxisType.Auto)
  x, w, _ = _data()
  state = core.init_state(DELAYED)
  with pytest.raises(ValueError, match=r"amax_axes for 'x' leaves out mesh axes \['dp'\]"):
    _trace_in_shard_map(
      jax.grad(_sum_gemm(recipe=DELAYED, amax_axes=()), argnums=2),
      mesh,
      (P("dp"), P(), P()),
      (x, w, state),
    )


def test_error_delayed_scaling_in_shard_map_without_check_vma():
  mesh = COLUMN.mesh(AxisType.Auto)
  x, w, _ = _data()
  state = core.init_state(DELAYED)

  def fn(x, w, state):
    return jnp.sum(core.dot_general(x, w, DN, threshold=None, recipe=DELAYED, state=state))

  with pytest.raises(ValueError, match="check_vma=False"):
    _trace_in_shard_map(fn, mesh, (P("dp"), P(), P()), (x, w, state), check_vma=False)


def test_error_kernel_all_gather_without_mesh():
  x, w, _ = _data()
  with pytest.raises(ValueError, match="kernel_all_gather needs a mesh"):
    jax.make_jaxpr(
      lambda x, w: core.dot_general(
        x, w, DN, threshold=None, recipe=CURRENT, kernel_all_gather=P("fsdp")
      )
    )(x, w)


def test_error_kernel_all_gather_over_an_axis_the_kernel_is_not_sharded_over():
  x, w, _ = _data()
  mesh = FSDP.mesh(AxisType.Auto)
  with pytest.raises(ValueError, match="the kernel varies only over"):
    _trace_in_shard_map(
      _sum_gemm(recipe=CURRENT, kernel_all_gather=P("fsdp", None)),
      mesh,
      (P("fsdp"), P()),
      (x, w),
    )
  mesh = FSDP.mesh()
  with jax.set_mesh(mesh):  # Explicit axes: the kernel's type names its sharding
    ws = jax.device_put(w, NamedSharding(mesh, P("fsdp", None)))
    with pytest.raises(ValueError, match="kernel's sharding on that dim is None"):
      jax.make_jaxpr(
        lambda x, w: core.dot_general(
          x, w, DN, threshold=None, recipe=CURRENT, kernel_all_gather=P(None, "fsdp")
        )
      )(jax.device_put(x, NamedSharding(mesh, P("fsdp"))), ws)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"kernel_all_gather": P("fsdp", None, None)}, ValueError, "has 3 entries"),
    ({"kernel_all_gather": P(None, None)}, ValueError, "names no mesh axis"),
    ({"kernel_all_gather": "fsdp"}, TypeError, "must be a PartitionSpec"),
    ({"amax_axes": 3}, TypeError, "amax_axes must be a mesh axis name"),
    ({"amax_axes": {"y": "dp"}}, ValueError, "amax_axes keys must be among"),
    ({"recipe": None, "amax_axes": "dp"}, ValueError, "need a recipe"),
    (
      {"recipe": ta.MXFP8BlockScaling(), "kernel_all_gather": P("fsdp", None)},
      NotImplementedError,
      "per-tensor FP8 recipes",
    ),
  ],
)
def test_bad_spmd_arguments(kwargs, error, match):
  x, w, _ = _data()
  kwargs = {"recipe": CURRENT, **kwargs}
  with pytest.raises(error, match=match):
    core.dot_general(x, w, DN, **kwargs)


def test_explicit_merge_of_two_sharded_dims_gathers_one_with_a_warning_naming_the_gemm():
  # x's batch and sequence dims are both sharded; the GEMM merges them into M, which can keep
  # only one dim's shards: x is all-gathered over the other (sequence, "tp") with a
  # ShardingFallbackWarning that names the GEMM and the cost, and the result is unchanged.
  mesh = jax.make_mesh(
    (2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
  )
  x = spmd_checks.exact_data((4, 8, 64), 0)
  w = spmd_checks.exact_data((64, 32), 1)
  gemm = lambda x, w: core.dot_general(
    x,
    w,
    (((2,), (0,)), ((), ())),
    threshold=None,  # noqa: E731
    recipe=CURRENT,
  )
  want = jax.jit(gemm)(x, w)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    with pytest.warns(
      core.ShardingFallbackWarning,
      match=r"the GEMM \(4, 8, 64\) \. \(64, 32\).*all-gathered over dims \[1\]",
    ):
      got = jax.jit(gemm)(xs, ws)
  assert got.sharding.spec == P("dp", None, None)
  spmd_checks.assert_close_to_one_device(got, want, "y")


# Gemma's qkv_einsum (BTD,SNDH->SBTNH) and kv_einsum (BTD,CKDH->CBTKH) as dot_general: the kernel's
# free dims (S|C, N|K, H) are flattened into N, with the heads (not the first of them) sharded.
GEMMA_DN = (((2,), (2,)), ((), ()))


@pytest.mark.parametrize("kernel_shape", [(3, 4, 32, 16), (2, 2, 32, 16)], ids=["qkv", "kv"])
@pytest.mark.parametrize("annotated", [False, True], ids=["inferred", "out_sharding"])
def test_gemma_einsum_dimension_numbers_with_heads_sharded_match_one_device(
  kernel_shape, annotated
):
  """The layout orders the sharded heads first within the flattened free dims and the output's
  split and transpose put them back: outputs, gradients and the next state as on one device."""
  x = spmd_checks.exact_data((2, 8, 32), 0)
  w = spmd_checks.exact_data(kernel_shape, 1)
  dy = spmd_checks.exact_data((2, 8, kernel_shape[0], kernel_shape[1], 16), 2)
  state = core.init_state(DELAYED)
  out = P(None, None, None, "tp", None) if annotated else None

  def step(x, w, state, out_sharding=None):
    def loss(x, w, state):
      y = core.dot_general(
        x, w, GEMMA_DN, threshold=None, recipe=DELAYED, state=state, out_sharding=out_sharding
      )
      return jnp.sum(y * dy), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, state)

  want = jax.jit(step)(x, w, state)
  mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp", None, None)))
    got = jax.jit(step, static_argnums=3)(x, ws, state, out)
  (_, y), grads = got
  assert y.sharding.spec == P(None, None, None, "tp", None)
  assert grads[1].sharding.spec == P(None, "tp", None, None)
  # The input's gradient sums over the heads, split over the devices: exact for exact_data.
  spmd_checks.assert_trees_match_one_device(got, want)


def test_gemm_layout_orders_sharded_dims_first_and_puts_the_output_back():
  layout = core_gemm.GemmLayout(GEMMA_DN, (2, 8, 32), (3, 4, 32, 16), ((), (1,), ()))
  assert layout.rhs_free == [1, 0, 3] and layout.rhs_perm == (1, 0, 3, 2)
  assert layout.out_shape == (2, 8, 3, 4, 16) and layout.split_out_shape == (2, 8, 4, 3, 16)
  assert layout.out_perm == (0, 1, 3, 2, 4) and layout.unserved == ((), (), ())
  # Contracting pairs follow the lhs's sharded dim; a second sharded dim of a group is unserved.
  layout = core_gemm.GemmLayout(
    (((1, 2), (0, 1)), ((), ())), (4, 8, 16), (8, 16, 32), ((2,), (), (0,))
  )
  assert layout.dn == (((2, 1), (1, 0)), ((), ())) and layout.out_perm is None
  assert layout.unserved == ((), (), ())
  layout = core_gemm.GemmLayout(GEMMA_DN, (2, 8, 32), (3, 4, 32, 16), ((), (1, 3), (2,)))
  assert layout.rhs_free[0] == 0 and layout.unserved == ((), (1, 3), ())
