"""Models shaped like Flax's NNX Gemma, Flax's Linen lm1b and Haiku's transformer example
(``tests/models``), converted by each adapter's conversion, trained under a 2-device
tensor-parallel mesh with their own sharding annotations, against the same steps on one device.

- Linen lm1b: ``nn.with_logical_partitioning`` annotations (``('embed', 'kv')`` on every
  attention projection, ``('embed', 'mlp')`` / ``('mlp', 'embed')``, ``('embed', 'vocab')``)
  mapped by logical axis rules; the parameters placed by ``nn.get_partition_spec``. The attention
  output projection's kernel ``(heads, head_dim, embed)`` carries the flat ``('embed', 'kv')``
  names, so its second contracting dim (head_dim) is the sharded one: the Linen GEMM hands the
  core that annotation (``kernel_sharding``) and the layout orders it first.
- NNX Gemma: heads sharded in ``qkv_einsum`` (``SNDH``) and ``attn_vec_einsum`` (``NHD``), the
  MLP column- then row-parallel, as ``nnx.with_partitioning`` annotates them.
- Haiku transformer: Haiku's parameters carry no annotations; they are placed Megatron-style by
  name (query/key/value and the first dense layer column-parallel, the attention output and the
  second dense layer row-parallel), and Haiku's layers name themselves to the core.

Under ``jit`` on Auto mesh axes, XLA's partitioner follows the parameters' shardings. On CPU the
row-parallel GEMMs' float32 sums are split over the two devices (reassociation), and an FP8 cast
can turn a last-bit difference into a step of its grid, so the bound is relative, not bit for
bit; on a GPU the shards' FP8 GEMMs also sum in another order (``tests/spmd_checks.py``).
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from tests import models, spmd_checks
from tests.models import gemma_nnx, lm1b_linen, transformer_haiku

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

RECIPE = ta.DelayedScaling(amax_history_len=4)
STEPS = 2
BATCH, LENGTH, VOCAB = 4, 16, 64
# Relative bounds on each step's loss and on the trained parameters (see the module docstring).
LOSS_RTOL, PARAM_TOL = (1e-5, 1e-4) if not spmd_checks.ON_GPU else (5e-2, 5e-2)
# lm1b's logical axes on a tensor-parallel mesh axis.
RULES = (("embed", None), ("kv", "model"), ("mlp", "model"), ("vocab", "model"))


def _mesh():
  return jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _tokens():
  return models.token_batch(0, BATCH, LENGTH, VOCAB)


def _spy(monkeypatch):
  """Records each quantized GEMM's ``layer`` and ``kernel_sharding`` as the adapters pass them."""
  seen = {}
  real = core.dot_general

  def spy(*args, **kwargs):
    seen[kwargs.get("layer")] = kwargs.get("kernel_sharding")
    return real(*args, **kwargs)

  monkeypatch.setattr(core, "dot_general", spy)
  return seen


def _assert_trained_alike(got, want):
  (got_losses, got_params), (want_losses, want_params) = got, want
  np.testing.assert_allclose(np.asarray(got_losses), np.asarray(want_losses), rtol=LOSS_RTOL)
  assert want_losses[-1] < want_losses[0]  # it trains
  want_leaves = dict(jax.tree_util.tree_leaves_with_path(want_params))
  got_leaves = dict(jax.tree_util.tree_leaves_with_path(got_params))
  assert got_leaves.keys() == want_leaves.keys()
  for path, value in want_leaves.items():
    np.testing.assert_allclose(
      np.asarray(got_leaves[path]),
      np.asarray(value),
      rtol=PARAM_TOL,
      atol=PARAM_TOL,
      err_msg=jax.tree_util.keystr(path),
    )


# --------------------------------------------------------------------------- Linen lm1b


def _train_lm1b(mesh):
  model = lm1b_linen.TransformerLM(lm1b_linen.TransformerConfig(num_layers=1))
  q = ta_linen.quantize(RECIPE, threshold=None)
  tokens = _tokens()
  boxed = q(model.init)(jax.random.key(0), tokens)
  assert len(q.report.quantized) == 7 and not q.report.skipped
  if mesh is not None:
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    is_box = lambda v: isinstance(v, nn.Partitioned)  # noqa: E731
    boxed = jax.tree.map(
      lambda v, s: (
        v.replace_boxed(jax.device_put(v.value, s)) if is_box(v) else jax.device_put(v, s)
      ),
      boxed,
      shardings,
      is_leaf=is_box,
    )
  tx = optax.sgd(0.5)
  opt_state = tx.init(boxed["params"])

  def loss_fn(variables, tokens):
    return lm1b_linen.next_token_loss(q(model.apply)(variables, tokens), tokens)

  @jax.jit
  def step(variables, opt_state, tokens):
    loss, (grads, recipe_state) = ta_linen.value_and_grad(loss_fn)(variables, tokens)
    updates, opt_state = tx.update(grads, opt_state)
    params = optax.apply_updates(variables["params"], updates)
    return loss, {"params": params, ta_linen.OVERWRITE_WITH_GRADIENT: recipe_state}, opt_state

  losses, variables = [], boxed
  with nn.logical_axis_rules(RULES):
    for _ in range(STEPS):
      loss, variables, opt_state = step(variables, opt_state, tokens)
      losses.append(loss)
  return losses, nn.unbox(variables)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
def test_lm1b_linen_trains_under_its_logical_annotations_like_one_device(monkeypatch):
  seen = _spy(monkeypatch)
  want = _train_lm1b(None)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got = _train_lm1b(mesh)
  _assert_trained_alike(got, want)
  block = "decoder/encoderdecoderblock_0"
  # Each Linen GEMM names its layer and hands the core its kernel's annotation in mesh axes.
  assert seen[f"layer '{block}/SelfAttention_0/query'"] == (None, "model")
  assert seen[f"layer '{block}/SelfAttention_0/out'"] == (None, "model")  # head_dim of (N, H, D)
  assert seen[f"layer '{block}/MlpBlock_0/Dense_1'"] == ("model", None)
  assert seen["layer 'decoder/logitdense'"] == (None, "model")


class _GemmaQkv(nn.Module):
  """A Linen layer holding Gemma's qkv kernel ``(S, N, D, H)``, heads annotated, its GEMM
  (``BTD,SNDH->SBTNH``'s dimension numbers) through a ``dot_general_cls`` slot."""

  dot_general_cls: type

  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model", None, None))
    kernel = self.param("kernel", init, (3, 4, 32, 16))
    return self.dot_general_cls()(x, kernel, (((2,), (2,)), ((), ())))


def test_linen_kernel_annotation_keeps_the_heads_shards_under_auto_axes():
  """Under jit on Auto axes the kernel's type carries no sharding: the Linen GEMM hands the core
  its ``nn.with_partitioning`` annotation, which orders the flattened free dims (S, N, H) with
  the heads first, so XLA's partitioner keeps the heads' shards (without it, it all-gathered the
  kernel); outputs and gradients as on one device."""
  model = _GemmaQkv(ta_linen.make_dot_general_cls(RECIPE, threshold=None))
  x = spmd_checks.exact_data((2, 8, 32), 0)
  dy = spmd_checks.exact_data((2, 8, 3, 4, 16), 1)

  def step(variables):
    return jax.value_and_grad(lambda v: jnp.sum(model.apply(v, x) * dy))(variables)

  boxed = model.init(jax.random.key(0), x)
  boxed["params"]["kernel"] = boxed["params"]["kernel"].replace_boxed(
    spmd_checks.exact_data((3, 4, 32, 16), 2)
  )
  want = jax.jit(step)(nn.unbox(boxed))
  mesh = _mesh()
  with jax.set_mesh(mesh):
    box = boxed["params"]["kernel"]
    placed = jax.device_put(box.value, NamedSharding(mesh, box.get_partition_spec()))
    sharded = {**boxed, "params": {"kernel": box.replace_boxed(placed)}}
    compiled = jax.jit(step).lower(sharded).compile()
    got = compiled(sharded)
  ops = [c.op for c in inspect.hlo_collectives(compiled.as_text())]
  assert "all-gather" not in ops and "all-to-all" not in ops, ops
  spmd_checks.assert_trees_match_one_device(nn.unbox(got), want)


def test_linen_gemm_without_an_annotation_hands_none():
  """A kernel created without partitioning metadata: no annotation reaches the core."""
  seen = {}
  real = core.dot_general

  def spy(*args, **kwargs):
    seen[kwargs["layer"]] = kwargs["kernel_sharding"]
    return real(*args, **kwargs)

  model = nn.Dense(32)
  q = ta_linen.quantize(RECIPE, threshold=None)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(core, "dot_general", spy)
    q(model.init)(jax.random.key(0), jnp.ones((4, 16)))
  assert list(seen.values()) == [None]


# --------------------------------------------------------------------------- NNX Gemma

# Gemma's heads over the tensor-parallel axis, as its ShardingConfig annotates them.
GEMMA_SPECS = {
  "qkv_einsum": (None, "model", None, None),  # (S, N, D, H)
  "attn_vec_einsum": ("model", None, None),  # (N, H, D)
  "gate_proj": (None, "model"),
  "up_proj": (None, "model"),
  "down_proj": ("model", None),
}


def _gemma(annotated: bool):
  model = gemma_nnx.Transformer(gemma_nnx.GemmaConfig(num_layers=1), rngs=nnx.Rngs(0))
  if annotated:
    for path, layer in nnx.iter_graph(model):
      if path and path[-1] in GEMMA_SPECS:
        layer.kernel.set_metadata(out_sharding=GEMMA_SPECS[path[-1]])
  report = ta_nnx.quantize_model(model, RECIPE, threshold=None)
  assert len(report.quantized) == 5, report
  return model


def _train_gemma(mesh):
  model = _gemma(annotated=mesh is not None)
  if mesh is not None:
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
  optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
  tokens = _tokens()

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, (grads, recipe_state) = ta_nnx.value_and_grad(gemma_nnx.next_token_loss)(model, tokens)
    optimizer.update(model, grads)
    nnx.update(model, recipe_state)
    return loss

  losses = [step(model, optimizer, tokens) for _ in range(STEPS)]
  return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_gemma_nnx_trains_under_its_annotations_like_one_device():
  want = _train_gemma(None)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    got = _train_gemma(mesh)
    model = _gemma(annotated=True)
  assert model.layers[0].attn.qkv_einsum.einsum_op.kernel_sharding == GEMMA_SPECS["qkv_einsum"]
  _assert_trained_alike(got, want)


# --------------------------------------------------------------------------- Haiku transformer


def _haiku_spec(name: str, param: str):
  """Megatron-style placement by name: column-parallel query/key/value and first dense layers,
  row-parallel attention output and second dense layers, the rest replicated."""
  last = name.rsplit("/", 1)[-1]
  role = None
  if "multi_head_attention" in name:
    role = "row" if last == "linear" else "column"
  elif name.startswith("transformer/linear"):
    role = "column" if int(last.partition("_")[2] or 0) % 2 == 0 else "row"
  column, row = role == "column", role == "row"
  if column:
    return P(None, "model") if param == "w" else P("model")
  if row and param == "w":
    return P("model", None)
  return P()


def _one_layer_forward(tokens):
  transformer = transformer_haiku.Transformer(num_layers=1, name="transformer")
  return transformer_haiku.LanguageModel(transformer, name="language_model")(tokens)


def _train_haiku(mesh):
  q = ta_hk.quantize(RECIPE, threshold=None)
  f = hk.transform_with_state(q(_one_layer_forward))
  tokens = _tokens()
  params, state = f.init(jax.random.key(0), tokens)
  assert len(q.report.quantized) == 7 and not q.report.skipped
  if mesh is not None:
    params = {
      name: {p: jax.device_put(v, NamedSharding(mesh, _haiku_spec(name, p))) for p, v in d.items()}
      for name, d in params.items()
    }
  tx = optax.sgd(0.5)
  opt_state = tx.init(params)

  def loss_fn(params, state, tokens):
    logits, state = f.apply(params, state, None, tokens)
    return transformer_haiku.next_token_loss(logits, tokens), state

  @jax.jit
  def step(params, state, opt_state, tokens):
    loss, (grads, state) = ta_hk.value_and_grad(loss_fn)(params, state, tokens)
    updates, opt_state = tx.update(grads, opt_state)
    return loss, optax.apply_updates(params, updates), state, opt_state

  losses = []
  for _ in range(STEPS):
    loss, params, state, opt_state = step(params, state, opt_state, tokens)
    losses.append(loss)
  return losses, params


def test_haiku_transformer_trains_megatron_sharded_like_one_device(monkeypatch):
  seen = _spy(monkeypatch)
  want = _train_haiku(None)
  with jax.set_mesh(_mesh()):
    got = _train_haiku(_mesh())
  _assert_trained_alike(got, want)
  # Haiku's layers name themselves in the core's sharding messages.
  assert {
    "layer 'transformer/multi_head_attention/query'",
    "layer 'transformer/linear_1'",
    "layer 'language_model/linear'",
  } <= set(seen)
