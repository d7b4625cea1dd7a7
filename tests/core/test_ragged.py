"""core.ragged_dot: numerics against a per-group float64 reference, state, errors, no host sync."""

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters.core import kernels

E4M3_MAX = 448.0
E5M2_MAX = 57344.0

# TE's TestGroupedDense shapes (G, m, n, k), m multiplied by 32 as TE does for tensor scaling.
TE_SHAPES = [(5, 32, 128, 64), (8, 64, 32, 128), (8, 64, 128, 256), (4, 4, 128, 128)]
RECIPES = {
  "bf16": None,
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=4),
}


def te_group_sizes(rng, m, g):
  """TE's recipe: sorted random cut points, then group 1 emptied into group 0."""
  cuts = np.sort(rng.integers(0, m, size=g - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [m]]))
  sizes[0] += sizes[1]
  sizes[1] = 0
  return sizes.astype(np.int32)


def reference(x, w, dy, group_sizes):
  """Per-group float64 forward, dgrad and wgrad; rows past the groups give zeros."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  ends = np.cumsum(group_sizes)
  y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  for g, (s, e) in enumerate(zip(ends - group_sizes, ends, strict=True)):
    y[s:e] = x[s:e] @ w[g]
    dx[s:e] = dy[s:e] @ w[g].T
    dw[g] = x[s:e].T @ dy[s:e]
  return y, dx, dw


@functools.partial(jax.jit, static_argnames="recipe")
def train_step(x, w, state, group_sizes, dy, recipe):
  """Output, (dx, dw) and the new state of one step with loss vdot(y, dy)."""

  def loss(x, w, state):
    y = core.ragged_dot(x, w, group_sizes, recipe=recipe, state=state)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, state)
  return y, grads


def init(recipe, g):
  return {} if recipe is None else core.init_ragged_state(recipe, g)


# Delayed scaling runs three steps; two shapes keep the CPU time down.
CASES = [(s, r) for s in TE_SHAPES for r in ("bf16", "current")] + [
  (TE_SHAPES[0], "delayed"),
  (TE_SHAPES[2], "delayed"),
]


@pytest.mark.parametrize(
  "shape, recipe_name", CASES, ids=[f"G{s[0]}_m{s[1]}_n{s[2]}_k{s[3]}-{r}" for s, r in CASES]
)
def test_te_grouped_shapes_against_float64(shape, recipe_name, rel):
  g, m, n, k = shape
  m *= 32
  recipe = RECIPES[recipe_name]
  rng = np.random.default_rng(sum(shape))
  dtype = jnp.bfloat16 if recipe is None else jnp.float32
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((g, k, n)), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  sizes = te_group_sizes(rng, m, g)
  assert sizes[1] == 0
  y_ref, dx_ref, dw_ref = reference(x, w, dy, sizes)

  state = init(recipe, g)
  steps = 3 if recipe_name == "delayed" else 1  # delayed: scales from earlier steps
  for _ in range(steps):
    y, (dx, dw, state) = train_step(x, w, state, jnp.asarray(sizes), dy, recipe)

  assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
  errs = rel(y, y_ref), rel(dx, dx_ref), rel(dw, dw_ref)
  if recipe is None:  # bf16 operands; only the bf16 rounding of the results
    assert max(errs) < 0.01, errs
  else:  # FP8: about 0.037 forward and 0.06 backward; clearly above bf16's 0.003
    assert 0.015 < errs[0] < 0.05, errs
    assert 0.025 < errs[1] < 0.08 and 0.025 < errs[2] < 0.08, errs
  # The forced empty group: no rows, and its expert's weight gradient is exactly zero.
  np.testing.assert_array_equal(np.asarray(dw[1], np.float32), 0.0)


@pytest.mark.parametrize("recipe_name", ["bf16", "current"])
def test_rows_past_the_groups_give_zeros(recipe_name, rel):
  recipe = RECIPES[recipe_name]
  rng = np.random.default_rng(1)
  m, k, n, g = 96, 32, 16, 3
  sizes = np.array([20, 0, 50], np.int32)  # rows 70..95 belong to no group
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[70:] = 1e30  # garbage there must neither leak into the output nor into the scales
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  dy = rng.standard_normal((m, n)).astype(np.float32)
  dy[70:] = 1e30
  y, (dx, dw, _) = train_step(
    jnp.asarray(x), jnp.asarray(w), init(recipe, g), jnp.asarray(sizes), jnp.asarray(dy), recipe
  )
  y_ref, dx_ref, dw_ref = reference(x, w, dy, sizes)
  np.testing.assert_array_equal(np.asarray(y[70:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dx[70:]), 0.0)
  np.testing.assert_array_equal(np.asarray(dw[1]), 0.0)
  # Without a recipe: float32 sums of 32 products on CPU; GPUs run float32 dots in TF32 by
  # default (unit roundoff 2**-11; 3e-4 seen on an H100). A leak of the 1e30 rows is O(1e30).
  bound = (1e-5 if jax.default_backend() == "cpu" else 2e-3) if recipe is None else 0.08
  assert rel(y[:70], y_ref[:70]) < bound
  assert rel(dx[:70], dx_ref[:70]) < bound
  assert rel(dw, dw_ref) < bound


def test_delayed_state_after_several_steps():
  """Per-group histories roll like TE's; scales = fp8_max / max(window); empty groups keep 1."""
  recipe = ta.DelayedScaling(amax_history_len=3)
  m, k, n, g = 64, 16, 16, 3
  sizes = np.array([24, 0, 32], np.int32)  # group 1 is always empty, rows 56..63 unused
  rng = np.random.default_rng(2)
  state = core.init_ragged_state(recipe, g)
  expected = {f"{r}_amax_history": np.zeros((g, 3)) for r in ("x", "kernel", "grad")}
  window = {r: [] for r in ("x", "kernel", "grad")}
  for step, factor in enumerate([1.0, 4.0, 2.0, 0.5]):
    x = rng.standard_normal((m, k)).astype(np.float32) * factor
    x[24:56] *= 3.0  # group 2's rows are larger than group 0's
    x[56:] = 1e6  # not in any group
    w = rng.standard_normal((g, k, n)).astype(np.float32) * factor
    w[2] *= 0.25
    dy = rng.standard_normal((m, n)).astype(np.float32) / factor
    dy[56:] = 1e6
    _, (_, _, state) = train_step(
      jnp.asarray(x), jnp.asarray(w), state, jnp.asarray(sizes), jnp.asarray(dy), recipe
    )
    amax = {
      "x": [np.abs(x[:24]).max(), 0.0, np.abs(x[24:56]).max()],
      "kernel": [np.abs(w[i]).max() for i in range(g)],
      "grad": [np.abs(dy[:24]).max(), 0.0, np.abs(dy[24:56]).max()],
    }
    for role, limit in (("x", E4M3_MAX), ("kernel", E4M3_MAX), ("grad", E5M2_MAX)):
      window[role] = (window[role] + [amax[role]])[-3:]
      hist = expected[f"{role}_amax_history"]
      hist[:, 0] = amax[role]
      win_max = np.max(hist, axis=1)
      hist[:] = np.roll(hist, -1, axis=1)
      hist[:, 0] = 0.0
      np.testing.assert_allclose(state[f"{role}_amax_history"], hist, rtol=1e-6)
      want_scale = np.where(win_max > 0, limit / np.where(win_max > 0, win_max, 1.0), 1.0)
      np.testing.assert_allclose(
        state[f"{role}_scale"][:, 0], want_scale, rtol=1e-6, err_msg=f"{role} step {step}"
      )
  # TE's L=3 order after 4 steps: [0, a3, a4] per group.
  assert state["x_scale"].shape == (g, 1) and state["x_amax_history"].shape == (g, 3)
  np.testing.assert_array_equal(state["x_scale"][1], 1.0)


def test_per_group_scales_protect_a_small_expert(rel):
  """Expert 3's kernel and group 3's rows are 1e5 below the rest; per-tensor scales fail."""
  rng = np.random.default_rng(3)
  m, k, n, g = 256, 64, 64, 4
  sizes = np.array([64, 64, 64, 64], np.int32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  dy = rng.standard_normal((m, n)).astype(np.float32)
  w[3] *= 1e-5
  recipe = RECIPES["current"]
  y, (dx, _, _) = train_step(x, w, {}, sizes, dy, recipe)
  y_ref, dx_ref, _ = reference(x, w, dy, sizes)
  assert rel(y[192:], y_ref[192:]) < 0.05  # one scale for all experts gives about 0.6
  assert rel(dx[192:], dx_ref[192:]) < 0.08
  x[192:] *= 1e-5
  w[3] *= 1e5
  y, (_, dw, _) = train_step(x, w, {}, sizes, dy, recipe)
  y_ref, _, dw_ref = reference(x, w, dy, sizes)
  assert rel(y[192:], y_ref[192:]) < 0.05
  assert rel(dw[3], dw_ref[3]) < 0.08
  # A NaN in group 0's rows makes group 0's output NaN and leaves the other groups' scales alone.
  x[5, 7] = np.nan
  y, _ = train_step(x, w, {}, sizes, dy, recipe)
  assert np.all(np.isnan(y[5]))
  assert rel(y[64:192], y_ref[64:192]) < 0.05


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
@pytest.mark.parametrize("granularity", ["group", "tensor"])
def test_native_kernel_cast_equals_the_xla_cast(recipe_name, granularity):
  """The native grouped GEMM's cast of the kernels (one pass writing both orientations, and with
  delayed scaling the amax for the history) gives the XLA path's FP8 values, inverse scales and
  next state, with a NaN in one expert and an infinity in another (their amaxes inf, their old
  scales kept). On the GPU the pass is the extension's kernel (tests/csrc checks it against
  pure JAX bit for bit); here it is pure JAX."""
  recipe = RECIPES[recipe_name]
  rng = np.random.default_rng(11)
  w = rng.standard_normal((4, 32, 48)) * np.array([1e-3, 1.0, 30.0, 1.0])[:, None, None]
  w[2, 5, 6], w[3, 0, 0] = np.nan, -np.inf
  w = jnp.asarray(w, jnp.bfloat16)
  state = init(recipe, 4)
  if state:  # non-trivial stored scales, so that the cast uses them and not the amax
    state = state.with_roles(
      {
        role: dataclasses.replace(state.role(role), scale=jnp.asarray([[0.5], [2.0], [8.0], [1.0]]))
        for role in ("x", "kernel", "grad")
      }
    )
  sizes = jnp.asarray([8, 8, 8, 8], jnp.int32)

  def run(native):
    # The format's grouped quantize of the kernels on the native grouped GEMM's route (its
    # one-pass cast, pure JAX here) or XLA's.
    grouped = core.format_of(recipe).grouped
    route = "native" if native else "xla"
    request = lambda w, st: core.formats.GroupedRequest(
      w, "kernel", recipe, sizes, st, route=route, granularity=granularity
    )
    q = jax.jit(lambda w, st: grouped.quantize(request(w, st)))(w, state)
    return q.cols.data, q.rows.data, q.cols.scale_inv, q.state

  q1, q1_t, sinv1, new1 = run(True)
  q0, q0_rows, sinv0, new0 = run(False)
  assert q0_rows.shape == q0.shape and q1_t.shape == (4, 48, 32)  # XLA reads (G, K, N)
  bits = lambda a: np.asarray(a).view(np.uint8)
  np.testing.assert_array_equal(bits(q1), bits(q0))
  np.testing.assert_array_equal(bits(q1_t), bits(jnp.swapaxes(q0, 1, 2)))
  np.testing.assert_array_equal(np.asarray(sinv1), np.asarray(sinv0))
  for a, b in zip(jax.tree.leaves(new1), jax.tree.leaves(new0), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if recipe_name == "delayed":
    # The stored scales; NaN for the experts whose amax is not finite (GemmConfig.non_finite's
    # default: their products become NaN, not saturated), for every expert when one amax is
    # taken over all of them.
    want = 1 / np.array([0.5, 2.0, 8.0, 1.0])
    want[2:] = np.nan
    if granularity == "tensor":
      want[:] = np.nan
    np.testing.assert_array_equal(np.asarray(sinv1), want)
    history = np.asarray(new1.amax_history)  # the newest amax last
    if granularity == "group":
      assert np.isfinite(history[:2, -1]).all() and np.isposinf(history[2:, -1]).all()
      np.testing.assert_array_equal(np.asarray(new1.scale)[2:, 0], [8.0, 1.0])  # kept
    else:
      assert np.isposinf(history[:, -1]).all()


def test_fp8_operands_reach_the_ragged_gemms():
  """Each of the three grouped GEMMs gets FP8 operands (HYBRID: E5M2 for the gradient)."""
  recipe = RECIPES["current"]
  x, w, dy = jnp.ones((32, 16)), jnp.ones((2, 16, 16)), jnp.ones((32, 16))
  jaxpr = jax.make_jaxpr(train_step.__wrapped__, static_argnums=(5,))(
    x, w, {}, jnp.array([16, 16]), dy, recipe
  )
  operand_types = []
  for eqn in inspect.equations(jaxpr):
    # XLA's ragged dot, or the extension's grouped GEMM on Hopper.
    if eqn.primitive.name == "ragged_dot_general" or (
      eqn.params.get("target_name") == "te_adapters_grouped_gemm"
    ):
      operand_types.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
  assert sorted(operand_types) == sorted(
    [
      ("float8_e4m3fn", "float8_e4m3fn"),  # forward
      ("float8_e5m2", "float8_e4m3fn"),  # dgrad
      ("float8_e4m3fn", "float8_e5m2"),  # wgrad
    ]
  ), operand_types


# --- group sizes stay on the device --------------------------------------------------------------

_HOST_PRIMITIVES = re.compile(r"callback|infeed|outfeed|device_put|host")
_HOST_HLO = re.compile(
  r"callback|infeed|outfeed|\bsend\(|\brecv\(|send-done|recv-done|S\(5\)|MoveToHost|"
  r"host_compute|annotate_device_placement",
  re.IGNORECASE,
)


def host_traffic(fn, *args):
  """Host-transfer primitives in ``fn``'s jaxpr, such ops in its compiled HLO, and the latter."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  names = {e.primitive.name for e in inspect.equations(jaxpr)}
  prims = sorted(n for n in names if _HOST_PRIMITIVES.search(n))
  compiled = jax.jit(fn).lower(*args).compile()
  ops = sorted(set(m.group(0) for m in _HOST_HLO.finditer(compiled.as_text())))
  return prims, ops, compiled


def moe_loss(recipe):
  """A top-1 MoE layer: the router picks experts on the device, tokens are sorted by expert."""

  def loss(router, w, state, x):
    experts = jnp.argmax(x @ router, axis=-1)
    order = jnp.argsort(experts)
    group_sizes = jnp.bincount(experts, length=w.shape[0]).astype(jnp.int32)
    y = core.ragged_dot(x[order], w, group_sizes, recipe=recipe, state=state)
    return jnp.sum(jnp.zeros_like(y).at[order].set(y) ** 2)

  return loss


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_no_host_transfer_with_on_device_router(recipe_name):
  recipe = RECIPES[recipe_name]
  rng = np.random.default_rng(4)
  g = 4
  args = (
    jnp.asarray(rng.standard_normal((32, g)), jnp.float32),
    jnp.asarray(rng.standard_normal((g, 32, 16)), jnp.float32),
    init(recipe, g),
    jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
  )
  step = jax.value_and_grad(moe_loss(recipe), argnums=(1, 2))
  prims, ops, compiled = host_traffic(step, *args)
  assert prims == [] and ops == []
  loss, (dw, new_state) = compiled(*args)
  assert np.isfinite(float(loss)) and dw.shape == (g, 32, 16)
  if recipe_name == "delayed":  # the router's choice reached the per-group state
    assert float(jnp.max(new_state["x_amax_history"])) > 0


def test_host_traffic_check_detects_a_callback():
  """The detector itself: a host callback of the group sizes is caught in jaxpr and HLO."""

  def leaky(x, sizes):
    sizes = jax.pure_callback(lambda s: s, jax.ShapeDtypeStruct(sizes.shape, sizes.dtype), sizes)
    return core.ragged_dot(x, jnp.ones((2, 16, 16)), sizes, recipe=RECIPES["current"])

  prims, ops, _ = host_traffic(leaky, jnp.ones((8, 16)), jnp.array([4, 4], jnp.int32))
  assert prims == ["pure_callback"] and ops


# --- composition ---------------------------------------------------------------------------------


def test_state_reused_twice_combines_by_max():
  recipe = ta.DelayedScaling(amax_history_len=2)
  g = 2
  sizes = jnp.array([4, 4], jnp.int32)
  w = jnp.ones((g, 16, 16))
  x1 = jnp.ones((8, 16)).at[:4].multiply(3.0)  # group 0 amax 3, group 1 amax 1
  x2 = jnp.ones((8, 16)).at[4:].multiply(5.0)  # group 0 amax 1, group 1 amax 5

  def loss(state):
    state = core.with_max_grad(state)
    y1 = core.ragged_dot(x1, w, sizes, recipe=recipe, state=state)
    y2 = core.ragged_dot(x2, w, sizes, recipe=recipe, state=state)
    return jnp.sum(y1) + jnp.sum(y2)

  new = jax.jit(jax.grad(loss))(core.init_ragged_state(recipe, g))
  np.testing.assert_allclose(new["x_amax_history"][:, -1], [3.0, 5.0])
  np.testing.assert_allclose(new["x_scale"][:, 0], [448 / 3.0, 448 / 5.0], rtol=1e-6)
  assert new["x_scale"].dtype == jnp.float32


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_remat_gives_the_same_grads_and_state(recipe_name):
  """Saved FP8 operands hold values up to 448; remat must neither change nor NaN them."""
  recipe = RECIPES[recipe_name]
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 16, 16)), jnp.float32)
  sizes = jnp.array([10, 20], jnp.int32)

  def loss(x, w, state):
    return jnp.sum(jnp.sin(core.ragged_dot(x, w, sizes, recipe=recipe, state=state)))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  state = step(x, w, init(recipe, 2))[2]  # delayed: scales from a first step, not 1.0
  plain = step(x, w, state)
  remat = jax.checkpoint(loss, policy=core.save_quantized_operands)
  again = jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(x, w, state)
  assert not np.any(np.isnan(again[0])) and not np.any(np.isnan(again[1]))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), plain, again)


def test_drop_in_for_lax_ragged_dot_and_vmap():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 16, 16)), jnp.float32)
  sizes = jnp.array([[4, 12], [0, 16], [16, 0]], jnp.int32)
  ours = jax.jit(jax.vmap(functools.partial(core.ragged_dot, recipe=None)))(
    x, w[None].repeat(3, 0), sizes
  )
  lax = jax.jit(jax.vmap(jax.lax.ragged_dot))(x, w[None].repeat(3, 0), sizes)
  np.testing.assert_array_equal(ours, lax)
  fp8 = functools.partial(core.ragged_dot, recipe=RECIPES["current"])
  # As for jax.lax.ragged_dot, every operand must be batched (JAX's batching rule).
  y = jax.jit(jax.vmap(fp8))(x, w[None].repeat(3, 0), sizes)
  assert y.shape == (3, 16, 16)
  for i in range(3):
    want = reference(x[i], w, np.zeros((16, 16)), np.asarray(sizes[i]))[0]
    assert 0.01 < np.linalg.norm(np.asarray(y[i]) - want) / np.linalg.norm(want) < 0.06


def test_preferred_element_type_and_dtypes():
  x = jnp.ones((16, 16), jnp.bfloat16)
  w = jnp.ones((2, 16, 16), jnp.bfloat16)
  sizes = jnp.array([8, 8])
  fp8 = functools.partial(core.ragged_dot, recipe=RECIPES["current"])
  assert jax.eval_shape(fp8, x, w, sizes).dtype == jnp.bfloat16
  y = jax.jit(functools.partial(fp8, preferred_element_type=jnp.float32))(x, w, sizes)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, 16.0, rtol=1e-6)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(lhs=jnp.ones((2, 8, 16))), ValueError, r"lhs must be 2-D"),
    (dict(rhs=jnp.ones((16, 16))), ValueError, r"rhs must be 3-D"),
    (dict(rhs=jnp.ones((2, 32, 16))), ValueError, r"contracting sizes differ"),
    (dict(group_sizes=jnp.array([4.0, 4.0])), TypeError, r"group_sizes must be an integer"),
    (dict(group_sizes=jnp.array([4, 4, 0])), ValueError, r"shape \(2,\), one size per group"),
    (dict(lhs=jnp.ones((8, 16), jnp.int32)), TypeError, r"lhs must be a floating-point"),
    (dict(group_offset=jnp.array([1])), NotImplementedError, r"group_offset"),
    (dict(recipe=ta.DelayedScaling), TypeError, r"recipe instance"),
    (dict(recipe=ta.DelayedScaling()), ValueError, r"init_ragged_state\(recipe, 2\)"),
    (
      dict(
        recipe=ta.DelayedScaling(amax_history_len=4),
        state=core.init_state(ta.DelayedScaling(amax_history_len=4)),
      ),
      ValueError,
      r"x_scale.*shape \(1,\).*need \(2, 1\).*one GEMM's state",
    ),
    (dict(state={"x_scale": jnp.ones((2, 1))}), ValueError, r"unexpected \['x_scale'\]"),
    (dict(recipe=None, state={"x_scale": jnp.ones(1)}), ValueError, r"recipe is None"),
    (
      dict(lhs=jnp.ones((8, 24)), rhs=jnp.ones((2, 24, 40))),
      ValueError,
      r"ragged_dot with rhs \(2, 24, 40\): .*multiples of 16, got K=24, N=40",
    ),
  ],
)
def test_bad_input_raises_a_clear_error(kwargs, error, match):
  args = dict(
    lhs=jnp.ones((8, 16)),
    rhs=jnp.ones((2, 16, 16)),
    group_sizes=jnp.array([4, 4]),
    recipe=ta.Float8CurrentScaling(),
  )
  args.update(kwargs)
  with pytest.raises(error, match=match):
    core.ragged_dot(**args)


def test_init_ragged_state():
  s = core.init_ragged_state(ta.DelayedScaling(amax_history_len=5), 3)
  assert sorted(s) == sorted(core.state_names(ta.DelayedScaling()))
  assert s["grad_scale"].shape == (3, 1) and s["grad_amax_history"].shape == (3, 5)
  np.testing.assert_array_equal(s["kernel_scale"], 1.0)
  assert core.init_ragged_state(ta.Float8CurrentScaling(), 3) == {}
  with pytest.raises(ValueError, match="num_groups must be >= 1"):
    core.init_ragged_state(ta.Float8CurrentScaling(), 0)
  with pytest.raises(TypeError, match="num_groups must be an int"):
    core.init_ragged_state(ta.Float8CurrentScaling(), 2.0)


# --- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_fp8_grouped_gemm_numerics_and_hlo(rel):
  """On the GPU: FP8 GEMMs in the compiled step, numerics and no host transfer."""
  recipe = RECIPES["current"]
  rng = np.random.default_rng(7)
  g, m, k, n = 8, 2048, 256, 512
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  sizes = te_group_sizes(rng, m, g)
  args = (x, w, {}, jnp.asarray(sizes), dy)
  hlo = train_step.lower(*args, recipe).compile().as_text()
  if kernels.available():
    assert hlo.count('custom_call_target="te_adapters_grouped_gemm"') == 3, "no grouped kernel"
  else:
    assert "__cublas$lt$matmul$f8" in hlo, "no FP8 cuBLAS GEMM in the compiled step"
  assert not _HOST_HLO.search(hlo)
  y, (dx, dw, _) = train_step(*args, recipe)
  y_ref, dx_ref, dw_ref = reference(
    x.astype(jnp.float32), w.astype(jnp.float32), dy.astype(jnp.float32), sizes
  )
  assert 0.015 < rel(y, y_ref) < 0.05
  assert rel(dx, dx_ref) < 0.08 and rel(dw, dw_ref) < 0.08


def test_state_left_out_of_the_gradient_warns_instead_of_freezing_silently():
  recipe = RECIPES["delayed"]
  x = jnp.ones((64, 32), jnp.bfloat16)
  w = jnp.ones((2, 32, 32), jnp.float32)
  gs = jnp.array([40, 24], jnp.int32)
  state = core.init_ragged_state(recipe, 2)

  def loss(x, w, state):
    return jnp.sum(core.ragged_dot(x, w, gs, recipe=recipe, state=state).astype(jnp.float32))

  with pytest.warns(core.FrozenStateWarning, match=r"kernel \(2, 32, 32\)"):
    jax.grad(loss, argnums=(0, 1))(x, w, state)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    new = jax.grad(loss, argnums=2)(x, w, state)
    _, (_, _, new) = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, state)
  assert float(new["x_amax_history"].max()) == 1.0  # the state's gradient is its next value


def test_frozen_state_warning_names_the_layer_and_gives_its_frameworks_remedy():
  recipe = RECIPES["delayed"]
  x, w = jnp.ones((64, 32)), jnp.ones((2, 32, 32))
  gs = jnp.array([40, 24], jnp.int32)
  state = core.init_ragged_state(recipe, 2)

  def loss(x, w, **names):
    return jnp.sum(core.ragged_dot(x, w, gs, recipe=recipe, state=state, **names))

  with pytest.warns(core.FrozenStateWarning) as record:
    jax.grad(functools.partial(loss, layer="layer 'moe/experts'", framework="haiku"))(x, w)
  (warning,) = [w for w in record if issubclass(w.category, core.FrozenStateWarning)]
  message = str(warning.message)
  assert warning.filename == __file__
  assert "layer 'moe/experts' (x (64, 32) float32 . kernel (2, 32, 32) float32)" in message
  assert "te_adapters.haiku.value_grad_and_state" in message
  assert "nnx" not in message and "Linen" not in message
  with pytest.warns(core.FrozenStateWarning) as record:
    jax.grad(loss)(x, w)  # plain JAX: the shapes, and every framework's remedy
  message = str(record[0].message)
  assert "the GEMM x (64, 32) float32 . kernel (2, 32, 32) float32" in message
  assert "Flax NNX" in message and "Haiku" in message and "plain JAX" in message
  with pytest.raises(ValueError, match="framework must be one of"):
    core.ragged_dot(x, w, gs, recipe=recipe, state=state, framework="torch")
