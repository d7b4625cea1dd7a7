"""Sequence-parallel tensor parallelism for the column-then-row pair (``dot_general``'s
``sequence_parallel``), inside ``shard_map`` on 2 devices, against one device.

Megatron's layout, sequence first: x ``(S, B, H)`` sharded on S. The column-parallel GEMM
all-gathers x's rows and returns every row of its output columns; the activation runs on those;
the row-parallel GEMM's partial sums are reduce-scattered back onto the sequence shards.
Backward: the output gradient's rows are all-gathered, the input gradient reduce-scattered. The
gathered rows move as FP8 (each shard quantized, its amax reduced over the mesh:
``sequence_gather="fp8"``) or unquantized, every device casting all of them
(``sequence_gather="input"``; ``"auto"`` picks by the rows' dtype); either way the activations
move as the gathers and the one reduce-scatter per GEMM pair that bf16 tensor parallelism
without sequence parallelism would run as an all-reduce.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

S, B, H, F = 32, 2, 64, 128
DN = (((2,), (0,)), ((), ()))
RECIPES = {"current": ta.Float8CurrentScaling(), "delayed": ta.DelayedScaling(amax_history_len=4)}
# Float32 sums over the devices (the row-parallel output, the column-parallel input gradient):
# one device's bound on a GPU (spmd_checks). The default sequence_gather ("auto"): x (bf16) is
# gathered unquantized, the float32 output gradient as FP8.
CONFIG = core.GemmConfig(partial_sums="float32")
# The rows cast shard by shard and gathered as FP8 (both copies).
FP8 = core.GemmConfig(partial_sums="float32", sequence_gather="fp8")


def _mesh():
  return jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _pair(x, w1, w2, states, recipe, sequence=True, config=CONFIG):
  """The column-then-row pair: ``gelu(x @ w1) @ w2``."""
  seq = (lambda mode: (mode, "tp")) if sequence else (lambda mode: None)
  h = core.dot_general(
    x,
    w1,
    DN,
    recipe=recipe,
    state=states[0],
    threshold=None,
    config=config,
    sequence_parallel=seq("all_gather"),
  )
  a = jax.nn.gelu(h.astype(jnp.float32)).astype(h.dtype)
  return core.dot_general(
    a,
    w2,
    DN,
    recipe=recipe,
    state=states[1],
    threshold=None,
    config=config,
    sequence_parallel=seq("reduce_scatter"),
  )


def _data(s=S):
  x = spmd_checks.random((s, B, H), 0).astype(jnp.bfloat16)
  w1 = spmd_checks.random((H, F), 1) * H**-0.5
  w2 = spmd_checks.random((F, H), 2) * F**-0.5
  dy = spmd_checks.random((s, B, H), 3)
  return x, w1, w2, dy


def _states(recipe):
  return tuple(core.init_state(recipe) if recipe.stateful else None for _ in range(2))


def _step(fn):
  def loss(x, w1, w2, states, dy):
    y = fn(x, w1, w2, states)
    return jnp.sum(y.astype(jnp.float32) * dy), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _sharded(recipe, config=CONFIG, policy=None):
  def body(x, w1, w2, states):
    return _pair(x, w1, w2, states, recipe, config=config)

  return jax.shard_map(
    body if policy is None else jax.checkpoint(body, policy=policy),
    mesh=_mesh(),
    in_specs=(P("tp"), P(None, "tp"), P("tp", None), P()),
    out_specs=P("tp"),
  )


def _run(step, x, w1, w2, states, dy):
  out = []
  for factor in spmd_checks.FACTORS:
    (_, y), grads = step(x * factor, w1, w2, states, dy)
    states = grads[3]
    out.append((y, grads))
  return out


RING = core.GemmConfig(partial_sums="float32", collective_matmul=True)
# FP8 gathers and the reduce-scatters moved by ppermute exchanges (GemmConfig.device_sums).
EXCHANGE = core.GemmConfig(partial_sums="float32", sequence_gather="fp8", device_sums="exchange")
# The rows gathered unquantized and cast whole on every device.
WHOLE = core.GemmConfig(partial_sums="float32", sequence_gather="input")


def _assert_matches(got, want):
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    name = jax.tree_util.keystr(path)
    if spmd_checks.is_recipe_state(path):
      # The amaxes are the whole tensors' (reduced over the mesh); the activation's is computed
      # from the column-parallel GEMM's output, whose float32 sums may round one ulp apart.
      np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=2)
    elif a.dtype == jnp.bfloat16 and not spmd_checks.ON_GPU:
      # The row-parallel output and the column-parallel input gradient add the two devices'
      # float32 partial sums and round once; one device's XLA GEMM on CPU rounds its output to
      # bf16 before the scale and again after it: one bf16 ulp apart at most.
      assert spmd_checks.comparison_figures(a, b)["max_ulps"] <= 1, name
    else:
      spmd_checks.assert_close_to_one_device(a, b, name, cpu_rel=1e-6)


@pytest.mark.parametrize(
  "config",
  [FP8, RING, WHOLE, CONFIG, EXCHANGE],
  ids=["collectives", "ring", "input", "auto", "exchange"],
)
@pytest.mark.parametrize("name", RECIPES)
def test_sequence_parallel_pair_matches_one_device(name, config):
  """With one all-gather or reduce-scatter per GEMM (of FP8 copies, of unquantized rows
  (``sequence_gather="input"``), or each as the rows' dtype decides), decomposed into ring
  steps (``GemmConfig.collective_matmul``: each chunk's GEMM while the next chunk moves), and
  moved by exchanges (``GemmConfig.device_sums="exchange"``)."""
  recipe = RECIPES[name]
  x, w1, w2, dy = _data()
  states = _states(recipe)
  want = _run(_step(lambda *a: _pair(*a, recipe, sequence=False)), x, w1, w2, states, dy)
  with jax.set_mesh(_mesh()):
    got = _run(_step(_sharded(recipe, config)), x, w1, w2, states, dy)
  _assert_matches(got, want)
  if recipe.stateful:
    history = np.asarray(want[-1][1][3][0]["x_amax_history"])
    assert history.max() > 0


def test_activations_move_in_fp8_and_as_one_reduce_scatter():
  """The compiled step's collectives: x and the output gradient all-gathered as FP8 bytes (each
  in both orientations: the forward or dgrad GEMM's rows and wgrad's transposed copy), the
  output and the input gradient reduce-scattered, and no all-reduce but the amaxes' and the
  loss's. Every GEMM takes FP8 operands."""
  recipe = RECIPES["current"]
  s = 64  # the gathered rows (s * B = 128) differ from H (64): the two orientations differ
  x, w1, w2, dy = _data(s)
  step = _step(_sharded(recipe, FP8))
  with jax.set_mesh(_mesh()):
    assert inspect.count_fp8_dot_generals(step, x, w1, w2, _states(recipe), dy) == (6, 6)
    text = step.lower(x, w1, w2, _states(recipe), dy).compile().as_text()
  found = inspect.hlo_collectives(text)
  # Counted by the arrays they gather: XLA:GPU combines collectives into one op of several
  # arrays (the results follow the operands in a -start op's type).
  gathered = [a for c in found if c.op == "all-gather" for a in spmd_checks.result_arrays(c)]
  rows = s * B
  assert len(gathered) == 4, gathered
  assert all(dtype == "u8" and int(np.prod(shape)) == rows * H for dtype, shape in gathered)
  if jax.default_backend() == "cpu":
    # (XLA:GPU lays the gathered bytes out in shapes of its own, such as (128, 32) for (64, 64).)
    assert sorted(gathered) == [("u8", (H, rows))] * 2 + [("u8", (rows, H))] * 2, gathered
  scattered = [a for c in found if c.op == "reduce-scatter" for a in spmd_checks.result_arrays(c)]
  assert len(scattered) == 2, [(c.op, c.arrays) for c in found]
  # The amaxes (x's, the kernel's and the gradient's of each GEMM: 6 floats) and the loss (a
  # scalar) only, which XLA:GPU may concatenate into arrays of several; a sum left as an
  # all-reduce would have rows * H elements.
  reduced = [a for c in found if c.op == "all-reduce" for a in spmd_checks.result_arrays(c)]
  assert all(dtype == "f32" for dtype, _ in reduced), reduced
  assert sum(int(np.prod(shape)) for _, shape in reduced) <= 7, reduced


@pytest.mark.parametrize("config", [FP8, WHOLE], ids=["fp8", "input"])
@pytest.mark.parametrize("name", RECIPES)
def test_remat_saving_the_fp8_operands_matches_no_remat(name, config):
  """``jax.checkpoint`` with ``save_quantized_operands``: with FP8 gathers it keeps x's FP8
  shard (named before its gather) and gathers it again in the backward pass; with unquantized
  gathers it keeps the FP8 copy of every row. The same outputs, gradients and state as without
  remat either way."""
  recipe = RECIPES[name]
  x, w1, w2, dy = _data()
  states = _states(recipe)
  with jax.set_mesh(_mesh()):
    want = _run(_step(_sharded(recipe, config)), x, w1, w2, states, dy)
    policy = core.save_quantized_operands
    got = _run(_step(_sharded(recipe, config, policy=policy)), x, w1, w2, states, dy)
  if spmd_checks.ON_GPU:
    # Another program, in which the extension's GEMM may time and keep another cuBLASLt kernel
    # for the same shapes (spmd_checks): bounded as a sharded program against one device.
    _assert_matches(got, want)
  else:
    spmd_checks.assert_trees_identical(got, want)


@pytest.mark.parametrize("name", RECIPES)
def test_gathering_unquantized_rows_gives_the_fp8_gathers_results_bit_for_bit(name):
  """``sequence_gather="input"`` casts the gathered rows with the scale every shard's cast uses
  under the FP8 gathers (the whole tensor's amax), elementwise, so the GEMMs see the same FP8
  values in the same layout: outputs, gradients and the next state identical over three
  steps, whose inputs are scaled (``spmd_checks.FACTORS``) so that DelayedScaling's stored
  scales lag."""
  recipe = RECIPES[name]
  x, w1, w2, dy = _data()
  states = _states(recipe)
  with jax.set_mesh(_mesh()):
    want = _run(_step(_sharded(recipe, FP8)), x, w1, w2, states, dy)
    got = _run(_step(_sharded(recipe, WHOLE)), x, w1, w2, states, dy)
  if spmd_checks.ON_GPU:
    # Another program, whose GEMMs the extension may serve with other cuBLASLt kernels.
    _assert_matches(got, want)
  else:
    spmd_checks.assert_trees_identical(got, want)


@pytest.mark.parametrize("config", [WHOLE, CONFIG], ids=["input", "auto"])
def test_unquantized_gathers_move_bf16_rows_and_reduce_no_gathered_amax(config):
  """``sequence_gather="input"``, and its default ``"auto"`` for a bf16 layer: x and the output
  gradient are each all-gathered once, as bf16 rows (bf16 x and kernels), and their amaxes are
  not reduced over the mesh
  (each device takes the amax of the rows it gathered). The amaxes still reduced are those of
  the tensors sharded on their columns: the two kernels, the hidden activation and its
  gradient (4 floats, with the loss 5; the FP8 gathers' program reduces x's and the output
  gradient's too). Every GEMM takes FP8 operands."""
  recipe = RECIPES["current"]
  s = 64
  x, w1, w2, dy = _data(s)
  w1, w2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
  step = _step(_sharded(recipe, config))
  with jax.set_mesh(_mesh()):
    assert inspect.count_fp8_dot_generals(step, x, w1, w2, _states(recipe), dy) == (6, 6)
    jaxpr = jax.make_jaxpr(step)(x, w1, w2, _states(recipe), dy)
    text = step.lower(x, w1, w2, _states(recipe), dy).compile().as_text()
  # The dtypes as traced (XLA:CPU widens bf16 collectives to f32 when it compiles them).
  gathers = [
    e.outvars[0].aval for e in inspect.equations(jaxpr) if e.primitive.name.startswith("all_gather")
  ]
  assert [(a.dtype, a.shape) for a in gathers] == [(jnp.bfloat16, (s * B, H))] * 2, gathers
  found = inspect.hlo_collectives(text)
  gathered = [a for c in found if c.op == "all-gather" for a in spmd_checks.result_arrays(c)]
  assert len(gathered) == 2, gathered
  assert all(int(np.prod(shape)) == s * B * H for _, shape in gathered), gathered
  assert all(dtype != "u8" for dtype, _ in gathered), gathered
  scattered = [a for c in found if c.op == "reduce-scatter" for a in spmd_checks.result_arrays(c)]
  assert len(scattered) == 2, [(c.op, c.arrays) for c in found]
  reduced = [a for c in found if c.op == "all-reduce" for a in spmd_checks.result_arrays(c)]
  assert all(dtype == "f32" for dtype, _ in reduced), reduced
  assert sum(int(np.prod(shape)) for _, shape in reduced) == 5, reduced


def test_auto_gathers_float32_rows_as_fp8():
  """The default ``sequence_gather="auto"`` gathers float32 rows (a float32 layer) as their FP8
  copies, a quarter of each row's bytes: 4 gathers of bytes, none of float32."""
  recipe = RECIPES["current"]
  x, w1, w2, dy = _data()
  step = _step(_sharded(recipe))
  with jax.set_mesh(_mesh()):
    jaxpr = jax.make_jaxpr(step)(x.astype(jnp.float32), w1, w2, _states(recipe), dy)
  gathers = [
    e.outvars[0].aval.dtype
    for e in inspect.equations(jaxpr)
    if e.primitive.name.startswith("all_gather")
  ]
  assert gathers == [jnp.uint8] * 4, gathers


def test_unquantized_gathers_are_not_ring_steps():
  with pytest.raises(ValueError, match="sequence_gather='input'.*collective_matmul"):
    core.GemmConfig(sequence_gather="input", collective_matmul=True)
  with pytest.raises(ValueError, match="GemmConfig.sequence_gather must be one of"):
    core.GemmConfig(sequence_gather="bf16")


def test_high_precision_pair_runs_the_same_layout():
  """``recipe=None`` (the bf16 baseline of a sequence-parallel model) gathers and scatters the
  unquantized activations the same way: the plain pair's result."""
  x, w1, w2, dy = _data()
  want = _run(_step(lambda *a: _pair(*a, None, sequence=False)), x, w1, w2, (None, None), dy)
  with jax.set_mesh(_mesh()):
    got = _run(_step(_sharded(None)), x, w1, w2, (None, None), dy)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    if a.dtype == jnp.bfloat16:
      # dx: the two devices' bf16 partial products (autodiff's dgrad in the input's dtype)
      # summed by the reduce-scatter in bf16, one rounding more than one device's float32 sum:
      # normwise within two bf16 epsilons (2**-7); a sum left out would be off by about 1.
      figures = spmd_checks.comparison_figures(a, b)
      assert figures["rel"] < 2**-7, (jax.tree_util.keystr(path), figures)
    else:
      spmd_checks.assert_close_to_one_device(a, b, jax.tree_util.keystr(path), cpu_rel=1e-5)


def test_ring_steps_are_collective_permutes_beside_the_gemms():
  """``collective_matmul``: the forward's all-gather of x and reduce-scatter of y become
  collective-permutes of FP8 bytes and of partial sums, one per step but the first."""
  recipe = RECIPES["current"]
  x, w1, w2, dy = _data()
  with jax.set_mesh(_mesh()):
    fwd = jax.jit(_sharded(recipe, RING)).lower(x, w1, w2, _states(recipe)).compile().as_text()
  found = inspect.hlo_collectives(fwd)
  ops = [c.op for c in found]
  assert "all-gather" not in ops and "reduce-scatter" not in ops, ops
  permutes = [c.arrays[-1] for c in found if c.op == "collective-permute"]
  assert ("u8", (S // 2 * B, H)) in permutes, permutes  # x's FP8 rows of one device
  assert ("f32", (S // 2 * B, H)) in permutes, permutes  # one block's partial sums


def test_exchanges_move_the_fp8_rows_and_the_sums_as_collective_permutes():
  """``device_sums="exchange"`` with FP8 gathers: no all-gather and no reduce-scatter is left;
  x's and the output gradient's FP8 bytes (both copies) are exchanged as u8, and the partial
  sums' halves as float32. The results match the collectives' over three steps as a sharded
  program matches one device: the same FP8 values and the same two partials per sum, but XLA
  may lay out and block a GEMM whose operand is joined from exchanged halves differently
  (float32 sums 4 ulps apart were seen on CPU)."""
  recipe = RECIPES["delayed"]
  x, w1, w2, dy = _data()
  states = _states(recipe)
  with jax.set_mesh(_mesh()):
    step = _step(_sharded(recipe, EXCHANGE))
    text = step.lower(x, w1, w2, states, dy).compile().as_text()
    got = _run(step, x, w1, w2, states, dy)
    want = _run(_step(_sharded(recipe, FP8)), x, w1, w2, states, dy)
  found = inspect.hlo_collectives(text)
  ops = {c.op for c in found}
  assert not ops & {"all-gather", "reduce-scatter"}, ops
  # Counted by the arrays they move: XLA:GPU combines collective permutes into one op of several
  # arrays, and lays out a transposed copy's bytes as (H, rows).
  moved = [
    (dtype, int(np.prod(shape)))
    for c in found
    if c.op == "collective-permute"
    for dtype, shape in spmd_checks.result_arrays(c)
  ]
  shard = S // 2 * B
  # x's and the output gradient's FP8 bytes, each in both orientations, and a sum's half.
  assert moved.count(("u8", shard * H)) == 4, moved
  assert ("f32", shard * H) in moved, moved
  _assert_matches(got, want)


@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize(
  "config",
  [CONFIG, RING, WHOLE, FP8, EXCHANGE],
  ids=["collectives", "ring", "input", "fp8", "exchange"],
)
@pytest.mark.parametrize("name", RECIPES)
def test_an_infinity_in_one_shard_is_reported_as_on_one_device(name, config, where):
  """An inf in the first device's rows (of x, or of the output gradient) gives the output,
  every gradient and the next state the NaNs and infinities one device's step gives
  (``non_finite="propagate"``: the amax reduced over the mesh, or taken of the gathered rows,
  makes every device's GEMM output NaN, whether its own rows hold the entry or only the
  gathered ones; under the ring too); with ``"saturate"`` the output stays finite."""
  recipe = RECIPES[name]
  x, w1, w2, dy = _data()
  if where == "x":
    x = x.at[1, 0, 5].set(jnp.inf)
  else:
    dy = dy.at[1, 0, 5].set(-jnp.inf)
  states = _states(recipe)
  (_, want_y), want = _step(lambda *a: _pair(*a, recipe, sequence=False))(x, w1, w2, states, dy)
  with jax.set_mesh(_mesh()):
    (_, y), got = _step(_sharded(recipe, config))(x, w1, w2, states, dy)
    saturate = dataclasses.replace(config, non_finite="saturate")
    (_, y_saturated), _ = _step(_sharded(recipe, saturate))(x, w1, w2, states, dy)
  if where == "x":
    assert np.isnan(np.asarray(y, np.float32)).all()
    assert np.isfinite(np.asarray(y_saturated, np.float32)).all()
  # The entry reaches dx, dw1 and dw2 either way.
  assert not any(np.isfinite(np.asarray(g, np.float32)).all() for g in got[:3])
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path((y, got)),
    jax.tree.leaves((want_y, want)),
    strict=True,
  ):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), jax.tree_util.keystr(path))
    np.testing.assert_array_equal(np.isinf(a), np.isinf(b), jax.tree_util.keystr(path))


def test_sequence_parallel_refuses_what_it_cannot_serve():
  x, w1, _, _ = _data()
  with pytest.raises(ValueError, match="sequence_parallel over 'tp' runs inside shard_map"):
    core.dot_general(
      x, w1, DN, recipe=RECIPES["current"], threshold=None, sequence_parallel=("all_gather", "tp")
    )

  def body(x, w1):
    return core.dot_general(
      x,
      w1,
      DN,
      recipe=ta.MXFP8BlockScaling(),
      threshold=None,
      sequence_parallel=("all_gather", "tp"),
    )

  with pytest.raises(ValueError, match="sequence_parallel takes per-tensor recipes"):
    jax.eval_shape(
      jax.shard_map(
        body, mesh=_mesh(), in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, None, "tp")
      ),
      x,
      w1,
    )
  with pytest.raises(ValueError, match="sequence_parallel must be"):
    jax.eval_shape(
      jax.shard_map(
        lambda x, w1: core.dot_general(
          x, w1, DN, recipe=RECIPES["current"], sequence_parallel=("gather", "tp")
        ),
        mesh=_mesh(),
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, None, "tp"),
      ),
      x,
      w1,
    )
