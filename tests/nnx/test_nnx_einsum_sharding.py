"""Gemma's two attention einsums under their own sharding annotations, converted by
``quantize_model``: ``qkv_einsum`` (``BTD,SNDH->SBTNH``, heads N sharded) and ``kv_einsum``
(``BTD,CKDH->CBTKH``, kv heads K sharded), the kernels annotated as Gemma does
(``nnx.with_partitioning``), on a 2-device mesh.

The GEMM flattens the kernel's free dims (S, N, H) into N; the sharded heads are not the first of
them, so the layout orders them first (``GemmLayout``) and puts the output's dims back. A group
with two sharded dims is gathered with a ``ShardingFallbackWarning`` naming the layer; an FSDP
gather over two dims of a group is refused, naming the layer and the way out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from te_adapters import core, inspect
from te_adapters import nnx as ta_nnx
from tests import spmd_checks

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")

RECIPE = spmd_checks.RECIPE
HEADS, KV_HEADS, DIM, HEAD_DIM = 4, 2, 32, 16
BATCH, SEQ = 2, 8
# Gemma's heads over the tensor-parallel axis: the kernels (S|C, N|K, D, H) and the projections'
# outputs (S|C, B, T, N|K, H), as its ShardingConfig's qkv_weight_cndh and act_btnh.
KERNEL_SPEC = (None, "model", None, None)
OUT_SPEC = P(None, None, None, "model", None)


class Attention(nnx.Module):
  """Gemma's projections with one head count per einsum (its qkv and kv einsums)."""

  def __init__(self, rngs, sharded=False, kernel_spec=KERNEL_SPEC):
    def init():
      base = nnx.initializers.lecun_normal()
      return nnx.with_partitioning(base, kernel_spec) if sharded else base

    self.qkv_einsum = nnx.Einsum(
      "BTD,SNDH->SBTNH", (3, HEADS, DIM, HEAD_DIM), bias_shape=None, kernel_init=init(), rngs=rngs
    )
    self.kv_einsum = nnx.Einsum(
      "BTD,CKDH->CBTKH",
      (2, KV_HEADS, DIM, HEAD_DIM),
      bias_shape=None,
      kernel_init=init(),
      rngs=rngs,
    )

  def __call__(self, x, out_sharding=None):
    return (
      self.qkv_einsum(x, out_sharding=out_sharding),
      self.kv_einsum(x, out_sharding=out_sharding),
    )


def _model(mesh=None, kernel_spec=KERNEL_SPEC, exact=True, **convert):
  """The converted model; under ``mesh`` its kernels sharded by their annotations. With
  ``exact``, kernels of ``spmd_checks.exact_data`` (sums exact in float32: bit for bit on CPU)."""
  model = Attention(nnx.Rngs(0), sharded=mesh is not None, kernel_spec=kernel_spec)
  if exact:
    for seed, layer in enumerate((model.qkv_einsum, model.kv_einsum)):
      value = layer.kernel[...]
      layer.kernel.set_value(
        jax.device_put(spmd_checks.exact_data(value.shape, 10 + seed), value.sharding)
      )
  report = ta_nnx.quantize_model(model, RECIPE, threshold=None, **convert)
  assert report.quantized == ["kv_einsum", "qkv_einsum"]
  return model


def _data():
  x = spmd_checks.exact_data((BATCH, SEQ, DIM), 0)
  dys = (
    spmd_checks.exact_data((3, BATCH, SEQ, HEADS, HEAD_DIM), 1),
    spmd_checks.exact_data((2, BATCH, SEQ, KV_HEADS, HEAD_DIM), 2),
  )
  return x, dys


def _mesh(axis_type=AxisType.Explicit):
  return jax.make_mesh((2,), ("model",), axis_types=(axis_type,), devices=jax.devices()[:2])


def _steps(model, x, dys, out_sharding=None):
  """Per step (x scaled by ``spmd_checks.FACTORS``): outputs, gradients (params and recipe
  state), the recipe state replaced by its gradient between steps."""
  graphdef, state = nnx.split(model)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x, out_sharding=out_sharding)
    return sum(jnp.sum(a * b) for a, b in zip(y, dys, strict=True)), y

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  out = []
  for factor in spmd_checks.FACTORS:
    (_, y), grads = step(state, x * factor)
    params, _ = nnx.split_state(state, nnx.Param, ta_nnx.RecipeState)
    _, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    state = nnx.merge_state(params, recipe_state)
    out.append((y, nnx.to_pure_dict(grads)))
  return out


@pytest.mark.parametrize("out_sharding", [None, OUT_SPEC], ids=["inferred", "annotated"])
def test_gemma_einsums_with_heads_sharded_match_one_device(out_sharding):
  """Explicit mesh axes (the kernels' types carry their shardings): without the ordering the
  flattening of (S, N, H) split the heads' shards and was refused."""
  x, dys = _data()
  want = _steps(_model(), x, dys)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    model = _model(mesh)
    assert model.qkv_einsum.kernel[...].sharding.spec == P(*KERNEL_SPEC)
    got = _steps(model, x, dys, out_sharding)
  for (y, _), _ in zip(got, want, strict=True):
    assert [a.sharding.spec for a in y] == [OUT_SPEC] * 2
  spmd_checks.assert_trees_match_one_device(got, want)
  history = want[-1][1]["qkv_einsum"]["einsum_op"]["state"]["x_amax_history"]
  assert np.max(np.asarray(history)) == 7.0  # the second step's amax (2 x 3.5): the state moved


def test_gemma_einsums_under_auto_axes_match_one_device():
  """Auto mesh axes: the annotations reach XLA through jit's shardings."""
  x, dys = _data()
  want = _steps(_model(), x, dys)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    got = _steps(_model(_mesh(AxisType.Auto)), x, dys)
  spmd_checks.assert_trees_match_one_device(got, want)


def test_under_auto_axes_the_annotation_orders_the_layout_and_no_kernel_is_gathered():
  """Under jit on Auto axes the kernels' types carry no sharding: quantize_model hands each op
  its kernel's annotation, which orders the layout, so XLA's partitioner keeps the heads' shards
  (without it, it all-gathered each kernel and ran the GEMM whole on every device)."""
  mesh = _mesh(AxisType.Auto)
  x, dys = _data()
  with jax.set_mesh(mesh):
    model = _model(mesh)
    assert model.qkv_einsum.einsum_op.kernel_sharding == KERNEL_SPEC
    graphdef, state = nnx.split(model)

    def loss(state, x):
      y = nnx.merge(graphdef, state)(x)
      return sum(jnp.sum(a * b) for a, b in zip(y, dys, strict=True))

    text = jax.jit(jax.grad(loss)).lower(state, x).compile().as_text()
  ops = [c.op for c in inspect.hlo_collectives(text)]
  assert "all-gather" not in ops and "all-to-all" not in ops, ops


def _train(mesh, steps=3):
  """``steps`` of SGD with nnx.Optimizer and the library's value_and_grad, under ``mesh``."""
  model = _model(mesh, exact=False)
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  x = spmd_checks.random((BATCH, SEQ, DIM), 0)
  out = OUT_SPEC if mesh is not None else None

  def loss(model, x):
    (q, k, v), (k2, v2) = model(x, out_sharding=out)
    return jnp.mean(jnp.tanh(q * k) * v) + jnp.mean(k2 * v2)

  @nnx.jit
  def step(model, optimizer, x):
    value, (params, recipe_state) = ta_nnx.value_and_grad(loss)(model, x)
    optimizer.update(model, params)
    nnx.update(model, recipe_state)
    return value

  losses = [step(model, optimizer, x) for _ in range(steps)]
  return losses, nnx.to_pure_dict(nnx.state(model))


def test_gemma_einsums_train_under_their_annotations_like_one_device():
  """Three optimizer steps with the kernels updated. No GEMM sums over a sharded dim but the
  input's gradient, which the loss does not use, so on CPU the kernels and the recipe state are
  one device's bit for bit; the loss (a mean over outputs whose heads are split over the devices)
  adds the two halves' sums: float32 reassociation, within a few float32 ulps. On a GPU the
  shards' FP8 GEMMs also sum in another order (spmd_checks), and the kernels drift by that much
  from the second step on."""
  want_losses, want = _train(None)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got_losses, got = _train(mesh)
  loss_rtol, rtol = (1e-6, 0) if not spmd_checks.ON_GPU else (5e-2, 5e-2)
  np.testing.assert_allclose(np.asarray(got_losses), np.asarray(want_losses), rtol=loss_rtol)
  for path, value in jax.tree_util.tree_leaves_with_path(want):
    name = jax.tree_util.keystr(path)
    mine = dict(jax.tree_util.tree_leaves_with_path(got))[path]
    np.testing.assert_allclose(np.asarray(mine), np.asarray(value), rtol=rtol, err_msg=name)


def _four_device_mesh():
  return jax.make_mesh(
    (2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
  )


def test_two_sharded_dims_of_one_group_are_gathered_with_a_warning_naming_the_layer():
  """Heads over "model" and head_dim over "data": the flattened (S, N, H) keeps the heads'
  shards; the kernel is all-gathered over head_dim, said once, naming the layer and the cost."""
  x, dys = _data()
  want = _steps(_model(), x, dys)
  mesh = _four_device_mesh()
  with jax.set_mesh(mesh):
    model = _model(mesh, kernel_spec=(None, "model", None, "data"))
    with pytest.warns(core.ShardingFallbackWarning) as record:
      got = _steps(model, x, dys)
  messages = [str(w.message) for w in record]
  for layer in (
    "layer 'qkv_einsum'",
    "layer 'kv_einsum'",
  ):
    hits = [m for m in messages if m.startswith(layer)]
    assert hits, (layer, messages)
    assert "all-gathered over dims [3]" in hits[0] and "2x each device's share" in hits[0]
  spmd_checks.assert_trees_match_one_device(got, want)


def test_out_sharding_over_two_dims_of_one_group_warns_naming_the_layer():
  x, dys = _data()
  want = _steps(_model(), x, dys)
  mesh = _four_device_mesh()
  with jax.set_mesh(mesh):
    model = _model(mesh)
    out = P(None, None, None, "model", "data")
    with pytest.warns(core.ShardingFallbackWarning, match=r"^layer 'qkv_einsum': out_sharding"):
      got = _steps(model, x, dys, out)
  for y, _ in got:
    assert [a.sharding.spec for a in y] == [out] * 2
  spmd_checks.assert_trees_match_one_device(got, want)


def test_fsdp_gather_over_two_dims_of_one_group_is_refused_naming_the_layer_and_the_way_out():
  mesh = _four_device_mesh()
  x, _ = _data()
  with jax.set_mesh(mesh):
    model = _model(mesh, kernel_all_gather=P(None, "model", None, "data"))
    with pytest.raises(
      ValueError,
      match=(
        r"layer '(qkv|kv)_einsum': kernel_all_gather "
        r"shards dimensions .*Shard one of these dimensions only, or leave this layer "
        r"unquantized \(an adapter's conversion: its filter\)"
      ),
    ):
      nnx.jit(lambda m, x: m(x))(model, x)


def test_a_quantized_einsum_built_directly_takes_its_kernel_annotation():
  with jax.set_mesh(_mesh(AxisType.Auto)):
    layer = ta_nnx.Einsum(
      "BTD,SNDH->SBTNH",
      (3, HEADS, DIM, HEAD_DIM),
      None,
      recipe=RECIPE,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), KERNEL_SPEC),
      rngs=nnx.Rngs(0),
    )
  assert layer.einsum_op.kernel_sharding == KERNEL_SPEC
  plain = ta_nnx.Einsum(
    "BTD,SNDH->SBTNH", (3, HEADS, DIM, HEAD_DIM), None, recipe=RECIPE, rngs=nnx.Rngs(0)
  )
  assert plain.einsum_op.kernel_sharding is None
