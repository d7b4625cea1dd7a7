"""NNX's ordinary training loop: ``nnx.grad`` over Param + RecipeState combines reuse by max;
``nnx.value_and_grad`` over params only warns that the state is frozen; a Gemma-shaped model
(Einsum projections with sharding annotations, a tied embedding) converted by ``quantize_model``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core
from te_adapters import nnx as ta_nnx
from tests import plain_loops as pl

RECIPE = ta.DelayedScaling(amax_history_len=pl.HISTORY)
DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))


def _twice(model):
  return jnp.sum(model(pl.X1) * pl.DY1) + jnp.sum(model(pl.X2) * pl.DY2)


def _plain_step(model, optimizer, loss):
  """The framework's loop: nnx.value_and_grad, nnx.Optimizer(wrt=Param), nnx.update."""
  _, grads = nnx.value_and_grad(loss, argnums=DIFF)(model)
  params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
  optimizer.update(model, params)
  nnx.update(model, recipe_state)


@pytest.mark.parametrize("build", ["linear", "quantize_model"])
def test_plain_nnx_loop_combines_reuse_by_max(build):
  if build == "linear":
    model = ta_nnx.Linear(32, 32, recipe=RECIPE, threshold=None, use_bias=False, rngs=nnx.Rngs(0))
  else:
    model = nnx.Linear(32, 32, use_bias=False, rngs=nnx.Rngs(0))
    ta_nnx.quantize_model(model, RECIPE, threshold=None)
  model.kernel.set_value(jnp.asarray(pl.W0))
  optimizer = nnx.Optimizer(model, optax.sgd(pl.LR), wrt=nnx.Param)
  step = nnx.jit(lambda m, o: _plain_step(m, o, _twice))
  kernels = []
  for _ in range(3):
    kernels.append(np.asarray(model.kernel.get_value(), np.float64))
    step(model, optimizer)
  state = model.dot_general.recipe_state()
  pl.assert_state(state, pl.reference_states(kernels)[-1])
  # The optimizer never saw the state, and the state saves as plain float32 arrays.
  assert not jax.tree.leaves(nnx.state(optimizer, ta_nnx.RecipeState))
  saved = nnx.to_pure_dict(nnx.state(model, ta_nnx.RecipeState))
  assert all(np.asarray(v).dtype == np.float32 for v in jax.tree.leaves(saved))


def test_params_only_loop_warns_and_helper_does_not():
  model = ta_nnx.Linear(32, 32, recipe=RECIPE, threshold=None, rngs=nnx.Rngs(0))
  with pytest.warns(core.FrozenStateWarning, match="te_adapters.nnx.value_and_grad"):
    nnx.value_and_grad(_twice)(model)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    ta_nnx.value_and_grad(_twice)(model)
    nnx.grad(_twice, argnums=DIFF)(model)


class Embedder(nnx.Module):  # Gemma's: the output logits come from the tied embedding
  def __init__(self, vocab, dim, rngs):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)) * 0.5)

  def encode(self, tokens, mesh):
    table = self.input_embedding[...]
    if mesh is None:
      return table[tokens]
    return table.at[tokens].get(out_sharding=NamedSharding(mesh, P("data", None, None)))

  def attend(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class Block(nnx.Module):
  """Attention projections as Gemma writes them: Einsums with sharding annotations."""

  def __init__(self, dim, heads, head_dim, rngs, sharded):
    init = nnx.initializers.lecun_normal()
    if sharded:  # the heads over "model", as Gemma's ShardingConfig.fsdp_tp_sharding()
      init = nnx.with_partitioning(init, ("model", None, None))
    self.q = nnx.Einsum(
      "BTD,NDH->BTNH", (heads, dim, head_dim), bias_shape=None, rngs=rngs, kernel_init=init
    )
    self.o = nnx.Einsum(
      "BTNH,NHD->BTD", (heads, head_dim, dim), bias_shape=None, rngs=rngs, kernel_init=init
    )

  def __call__(self, x, mesh):
    heads = NamedSharding(mesh, P("data", None, "model", None)) if mesh else None
    tokens = NamedSharding(mesh, P("data", None, None)) if mesh else None
    h = self.q(x, out_sharding=heads)
    return x + self.o(jnp.tanh(h), out_sharding=tokens)


class Gemma(nnx.Module):
  def __init__(self, rngs, sharded=False):
    self.embedder = Embedder(64, 32, rngs)
    self.block = Block(32, 2, 16, rngs, sharded)

  def __call__(self, tokens, mesh=None):
    x = self.embedder.encode(tokens, mesh)
    x = self.block(self.block(x, mesh), mesh)  # one block applied twice: reuse
    return self.embedder.attend(x)


def _lm_loss(model, tokens, mesh=None):
  logits = model(tokens, mesh)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def _train(mesh, helper, steps=3):
  model = Gemma(nnx.Rngs(0), sharded=mesh is not None)
  report = ta_nnx.quantize_model(model, RECIPE, threshold=None)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  tokens = jnp.arange(4 * 16).reshape(4, 16) % 64

  def step(model, optimizer, tokens):
    if helper:
      _, (params, recipe_state) = ta_nnx.value_and_grad(_lm_loss)(model, tokens, mesh)
    else:
      _, grads = nnx.value_and_grad(_lm_loss, argnums=DIFF)(model, tokens, mesh)
      params, recipe_state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
    optimizer.update(model, params)
    nnx.update(model, recipe_state)

  if mesh is not None:
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
  for _ in range(steps):
    nnx.jit(step)(model, optimizer, tokens)
  return report, nnx.to_pure_dict(nnx.state(model, ta_nnx.RecipeState))


def test_gemma_shaped_model_report_lists_the_tied_embedding():
  report, _ = _train(None, helper=False, steps=0)
  assert report.quantized == ["block/o", "block/q"]
  skipped = dict(report.skipped)
  assert set(skipped) == {"embedder"}
  assert "Embedder.attend" in skipped["embedder"] and "no conversion reaches" in skipped["embedder"]
  assert "skipped 1" in str(report)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
def test_gemma_shaped_model_plain_loop_under_its_sharding_matches_the_helper_loop():
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    _, sharded = _train(mesh, helper=False)
  _, reference = _train(None, helper=True)  # one device, the helper's max
  # On CPU the states after three steps agree to float32 rounding. On a GPU the sharded FP8
  # GEMMs sum in another order (tests/spmd_checks.py); from the second step on, the parameters
  # differ by that much, and the quantized operands of the next steps can then land one FP8
  # step (E4M3 2**-3, E5M2 2**-2 of the value) away on a few elements: amaxes 0.5% apart after
  # three steps on four H100s. A state that adds the uses instead of taking their max, or one
  # left frozen, is off by 2x or more.
  rtol = 5e-2 if jax.default_backend() == "gpu" else 1e-5
  for path, value in jax.tree_util.tree_leaves_with_path(reference):
    got = sharded
    for key in path:
      got = got[key.key]
    np.testing.assert_allclose(np.asarray(got), np.asarray(value), rtol=rtol, err_msg=str(path))
  history = reference["block"]["q"]["einsum_op"]["state"]["x_amax_history"]
  assert np.all(np.asarray(history)[-3:] > 0)  # the state did move


_SCAN_XS = jnp.stack([pl.X1 * 0 + a * jnp.sign(pl.X1) for a in (2.0, 5.0, 3.0)])


def _scan_loss(how):
  """A loss that runs one layer on each of three inputs (amax 2, 5, 3) through nnx.scan, the
  layer handed to every iteration as ``how`` says."""
  if how == "carry":

    def loss(m):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
      def body(m, x):
        return m, m(x)

      return jnp.sum(body(m, _SCAN_XS)[1])

    return loss
  axes = None if how == "broadcast" else nnx.StateAxes({ta_nnx.RecipeState: None, ...: None})

  def loss(m):
    @nnx.scan(in_axes=(axes, 0), out_axes=0)
    def body(m, x):
      return m(x)

    return jnp.sum(body(m, _SCAN_XS))

  return loss


@pytest.mark.parametrize("how", ["broadcast", "carry", "state_axes"])
def test_plain_grad_through_scan_over_one_layer_is_refused_at_trace_time(how):
  """nnx.scan hands the layer's state to every iteration unchanged (in_axes None, nnx.Carry or
  StateAxes None): JAX would add up the iterations' amaxes under a plain nnx.grad (10.0 here,
  not 5.0), so tracing that gradient raises and names the way out; the forward pass and a grad
  over the parameters alone still trace."""
  model = ta_nnx.Linear(32, 32, threshold=None, recipe=RECIPE, rngs=nnx.Rngs(0))
  loss = _scan_loss(how)
  with pytest.raises(ValueError, match=r"nnx\.scan.*add up.*te_adapters\.nnx\.value_and_grad"):
    nnx.jit(nnx.grad(loss, argnums=DIFF))(model)
  assert np.isfinite(float(nnx.jit(loss)(model)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", core.FrozenStateWarning)
    grads = nnx.jit(nnx.grad(loss))(model)
  assert np.all(np.isfinite(np.asarray(grads["kernel"].get_value())))


@pytest.mark.parametrize("how", ["broadcast", "carry", "state_axes"])
def test_library_grad_through_scan_over_one_layer_takes_the_max(how):
  """The library's value_and_grad marks the state before the scan: the new state is the one the
  iteration with the largest amax (5.0) gives, as TE's rule asks."""
  model = ta_nnx.Linear(32, 32, threshold=None, recipe=RECIPE, rngs=nnx.Rngs(0))
  _, (_, state_grads) = nnx.jit(ta_nnx.value_and_grad(_scan_loss(how)))(model)
  state = nnx.to_pure_dict(state_grads)["dot_general"]["state"]
  history = np.asarray(state["x_amax_history"])
  assert history[-1] == 5.0, history  # a sum over the iterations would be 10.0
  np.testing.assert_allclose(state["x_scale"], [448.0 / 5.0], rtol=1e-6)


def test_plain_grad_through_scan_over_stacked_layers_gives_each_layer_its_state():
  """Scanning over stacked layers (in_axes=0) gives each iteration its own state: the plain
  nnx.grad is allowed there, and each layer's history holds the amax of its own input."""

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return ta_nnx.Linear(32, 32, threshold=None, recipe=RECIPE, rngs=nnx.Rngs(key))

  model = make(jax.random.split(jax.random.key(0), 3))

  def loss(m):
    @nnx.scan(in_axes=(0, 0), out_axes=0)
    def body(layer, x):
      return layer(x)

    return jnp.sum(body(m, _SCAN_XS))

  grads = nnx.jit(nnx.grad(loss, argnums=DIFF))(model)
  state = nnx.to_pure_dict(nnx.state(grads, ta_nnx.RecipeState))["dot_general"]["state"]
  np.testing.assert_array_equal(np.asarray(state["x_amax_history"])[:, -1], [2.0, 5.0, 3.0])
