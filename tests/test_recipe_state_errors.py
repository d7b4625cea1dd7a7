"""Missing or mismatched recipe state is an error in every adapter, never silently replaced or
ignored: a ``DelayedScaling`` model's variables given to a ``Float8CurrentScaling`` one (which
keeps no state and would quantize on as if nothing were there), a ``DelayedScaling`` model given
no state, or state of another history length. And NNX layers refuse a missing ``rngs`` as
``nnx.Linear`` does."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import te_adapters as ta
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

pytestmark = pytest.mark.filterwarnings("ignore::te_adapters.core.HighPrecisionGemmWarning")

DELAYED, CURRENT = ta.DelayedScaling(amax_history_len=4), ta.Float8CurrentScaling()
X = jnp.ones((4, 32))
IGNORED = r"keeps none, so it would be silently ignored"


class Tower(nn.Module):
  """Nested layers of three kinds, each built with ``recipe``."""

  recipe: object

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, dot_general_cls=ta_linen.make_dot_general_cls(self.recipe), name="proj")(x)
    x = ta_linen.Dense(32, recipe=self.recipe, name="dense")(x)
    out, _ = ta_linen.LayerNormMLP(
      64, recipe=self.recipe, intermediate_dropout_rate=0.0, name="mlp"
    )(x, deterministic=True)
    return out


def test_linen_stateful_variables_given_to_a_stateless_model_raise():
  variables = Tower(DELAYED).init(jax.random.PRNGKey(0), X)
  assert set(variables["_overwrite_with_gradient"]) == {"proj", "dense", "mlp"}
  with pytest.raises(ValueError, match=IGNORED) as info:
    Tower(CURRENT).apply(variables, X)
  message = str(info.value)
  # The layer path and the entries that would be ignored, and both ways out.
  assert "(proj/DelayedScalingDotGeneral_0)" in message and "Float8CurrentScaling" in message
  assert "variables.pop('_overwrite_with_gradient')" in message
  # Each kind of layer checks (the first to run raises; drop the others' entries to reach it).
  for name, path in (("dense", "dense/DelayedScalingDotGeneral_0"), ("mlp", "mlp/x_0_scale")):
    only = {
      "params": variables["params"],
      "_overwrite_with_gradient": {name: variables["_overwrite_with_gradient"][name]},
    }
    with pytest.raises(ValueError, match=IGNORED) as info:
      Tower(CURRENT).apply(only, X)
    assert path in str(info.value)
  # The way out the message names works, and the stateless model then runs.
  params_only = {"params": variables["params"]}
  assert Tower(CURRENT).apply(params_only, X).shape == (4, 32)


def test_linen_gemms_of_two_recipes_side_by_side_are_not_mistaken_for_a_checkpoints():
  """make_dot_general_cls instances built in a model of the user's belong to that model, beside
  each other: a stateless one next to a DelayedScaling one is no mismatch."""

  class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      current = ta_linen.make_dot_general_cls(CURRENT)
      delayed = ta_linen.make_dot_general_cls(DELAYED)
      return nn.Dense(32, dot_general=delayed())(nn.Dense(32, dot_general=current())(x))

  variables = Mixed().init(jax.random.PRNGKey(0), X)
  assert set(variables["_overwrite_with_gradient"]) == {"DelayedScalingDotGeneral_0"}
  assert Mixed().apply(variables, X).shape == (4, 32)


MISSING = (
  r"keeps recipe state \('x_scale' and the other entries of its GEMM, in "
  r"'_overwrite_with_gradient'\), but the variables given to apply have none for it"
)


def test_linen_missing_or_mismatched_delayed_state_raises():
  variables = Tower(DELAYED).init(jax.random.PRNGKey(0), X)
  # No recipe state (a bf16 model's variables, say): Flax said the collection is empty.
  with pytest.raises(ValueError, match=r"^layer 'proj': its recipe DelayedScaling " + MISSING):
    Tower(DELAYED).apply({"params": variables["params"]}, X)
  # One layer's missing (Flax: no such variable): that layer is named.
  collection = dict(variables["_overwrite_with_gradient"])
  del collection["dense"]
  with pytest.raises(ValueError, match=r"^layer 'dense': its recipe DelayedScaling " + MISSING):
    Tower(DELAYED).apply({"params": variables["params"], "_overwrite_with_gradient": collection}, X)
  # The way out the message names: a bf16 model's parameters with the recipe state from init.
  # (These small GEMMs stay in high precision under the size threshold: the bf16 model's outputs.)
  x = jax.random.normal(jax.random.PRNGKey(2), X.shape)
  plain = _LinenLayers(None).init(jax.random.PRNGKey(1), x)
  fresh = _LinenLayers(DELAYED).init(jax.random.PRNGKey(0), x)["_overwrite_with_gradient"]
  y = _LinenLayers(DELAYED).apply({**plain, "_overwrite_with_gradient": fresh}, x)
  np.testing.assert_allclose(y, _LinenLayers(None).apply(plain, x), rtol=1e-6, atol=1e-6)
  # The error names the layer (the first to run).
  with pytest.raises(
    ValueError, match=r"^layer 'proj': state\['x_amax_history'\] has shape \(4,\)"
  ):
    Tower(ta.DelayedScaling(amax_history_len=8)).apply(variables, X)


class _Experts(nn.Module):
  recipe: object

  @nn.compact
  def __call__(self, x):
    w = self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), (2, 32, 32))
    return ta_linen.make_ragged_dot_cls(self.recipe)(name="experts")(x, w, jnp.array([2, 2]))


def test_linen_experts_state_given_to_a_stateless_model_raises():
  variables = _Experts(DELAYED).init(jax.random.PRNGKey(0), X)
  with pytest.raises(ValueError, match=IGNORED) as info:
    _Experts(CURRENT).apply(variables, X)
  assert "experts/x_scale" in str(info.value)
  # The way out the message names works.
  assert _Experts(CURRENT).apply({"params": variables["params"]}, X).shape == (4, 32)


def test_nnx_mismatched_state_raises():
  delayed = ta_nnx.Linear(32, 32, recipe=DELAYED, rngs=nnx.Rngs(0))
  current = ta_nnx.Linear(32, 32, recipe=CURRENT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^Linear layer \(kernel \(32, 32\)\): .*grad_amax_history"):
    nnx.update(current, nnx.state(delayed))
  other = ta_nnx.Linear(32, 32, recipe=ta.DelayedScaling(amax_history_len=8), rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(delayed))  # NNX replaces the arrays; the layer's check refuses them
  with pytest.raises(ValueError, match=r"has shape \(4,\)"):
    other(X)


class _Blocks(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(2)])
    self.experts = ta_nnx.GroupedLinear(2, 32, 32, recipe=DELAYED, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.experts(x, jnp.array([2, 2], jnp.int32))


def test_nnx_mismatched_state_errors_name_the_layer():
  model = _Blocks(nnx.Rngs(0))
  ta_nnx.quantize_model(model, DELAYED, threshold=None)
  longer = _Blocks(nnx.Rngs(0))
  longer.experts = ta_nnx.GroupedLinear(
    2, 32, 32, recipe=ta.DelayedScaling(amax_history_len=8), rngs=nnx.Rngs(0)
  )
  ta_nnx.quantize_model(longer, ta.DelayedScaling(amax_history_len=8), threshold=None)
  nnx.update(model, nnx.state(longer, ta_nnx.RecipeState))  # a checkpoint's, say
  # A converted layer by its path; an experts layer (no path in NNX) by its class.
  with pytest.raises(
    ValueError, match=r"^layer 'blocks/0': state\['x_amax_history'\] has shape \(8,\)"
  ):
    model(X)
  model = _Blocks(nnx.Rngs(0))
  nnx.update(model.experts, nnx.state(longer.experts, ta_nnx.RecipeState))
  with pytest.raises(
    ValueError,
    match=r"^GroupedLinear layer \(kernel \(2, 32, 32\)\): state\['x_amax_history'\] has shape "
    r"\(2, 8\)",
  ):
    model(X)


def test_haiku_missing_or_mismatched_state_raises():
  hk = pytest.importorskip("haiku")
  from te_adapters import haiku as ta_hk

  def model(recipe):
    return hk.transform_with_state(lambda x: ta_hk.Linear(32, recipe=recipe)(x))

  params, state = model(DELAYED).init(jax.random.PRNGKey(0), X)
  with pytest.raises(ValueError, match=IGNORED) as info:
    model(CURRENT).apply(params, state, None, X)
  assert "'linear'" in str(info.value) and "Float8CurrentScaling" in str(info.value)
  with pytest.raises(ValueError, match="the state given to apply has none for it"):
    model(DELAYED).apply(params, {}, None, X)
  _, fresh = model(CURRENT).init(jax.random.PRNGKey(0), X)
  assert model(CURRENT).apply(params, fresh, None, X)[0].shape == (4, 32)
  # State of another history length: the error names the layer.
  with pytest.raises(ValueError, match=r"^layer 'linear': state\['x_amax_history'\] has shape"):
    model(ta.DelayedScaling(amax_history_len=8)).apply(params, state, None, X)

  def experts(recipe):
    sizes = jnp.array([2, 2], jnp.int32)
    return hk.transform_with_state(lambda x: ta_hk.GroupedLinear(2, 32, recipe=recipe)(x, sizes))

  params, state = experts(DELAYED).init(jax.random.PRNGKey(0), X)
  # The experts layer as the dense one: no state, or state its recipe would ignore, raise.
  with pytest.raises(ValueError, match="'grouped_linear' keeps recipe state .* has none for it"):
    experts(DELAYED).apply(params, {}, None, X)
  with pytest.raises(ValueError, match=IGNORED) as info:
    experts(CURRENT).apply(params, state, None, X)
  assert "'grouped_linear'" in str(info.value)
  with pytest.raises(
    ValueError, match=r"^layer 'grouped_linear': state\['x_amax_history'\] has shape \(2, 4\)"
  ):
    experts(ta.DelayedScaling(amax_history_len=8)).apply(params, state, None, X)


NNX_REFUSED = (
  r"the state given to it \(nnx.update, or a checkpoint restored into this model\) holds "
  r"DelayedScaling's recipe state \(amax history length 4\), entries \['grad_amax_history', "
  r"'grad_scale', 'kernel_amax_history', 'kernel_scale', 'x_amax_history', 'x_scale'\], but "
)
NNX_WAY_OUT = (
  r"Build this model with that recipe to load it, or leave the recipe state out of what you "
  r"load \(nnx.state\(other, nnx.Not\(te_adapters.nnx.RecipeState\)\)\) to go on "
)


class _Converted(nnx.Module):
  """An NNX model of the user's, converted by ``quantize_model`` (its layers know their path)."""

  def __init__(self, recipe, rngs):
    self.up = nnx.Linear(32, 64, rngs=rngs)
    self.down = nnx.Linear(64, 32, rngs=rngs)
    ta_nnx.quantize_model(self, recipe, threshold=None)

  def __call__(self, x):
    return self.down(self.up(x))


SIZES = jnp.array([2, 2], jnp.int32)
NNX_MODELS = {
  # name: (build(recipe), call(model), how the error names the layer)
  "Linear": (
    lambda r: ta_nnx.Linear(32, 32, recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X),
    r"^Linear layer \(kernel \(32, 32\)\): ",
  ),
  "Einsum": (
    lambda r: ta_nnx.Einsum("bd,df->bf", (32, 32), recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X),
    r"^Einsum layer \(kernel \(32, 32\)\): ",
  ),
  "LayerNormMLP": (
    lambda r: ta_nnx.LayerNormMLP(32, 64, recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X)[0],
    r"^LayerNormMLP layer \(wi_kernel \(32, 1, 64\)\): ",
  ),
  "GroupedLinear": (
    lambda r: ta_nnx.GroupedLinear(2, 32, 32, recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X, SIZES),
    r"^GroupedLinear layer \(kernel \(2, 32, 32\)\): ",
  ),
  "converted": (
    lambda r: _Converted(r, nnx.Rngs(0)),
    lambda m: m(X),
    r"^layer 'down': ",
  ),
}


@pytest.mark.parametrize("name", list(NNX_MODELS))
def test_nnx_stateful_state_given_to_a_stateless_layer_raises(name):
  """A DelayedScaling model's state given to a Float8CurrentScaling one with ``nnx.update``
  (Flax said "Cannot set key ... on immutable node of type EmptyState"): an error at that call
  naming the layer, the state found, the recipe that keeps none and the ways out."""
  build, call, layer = NNX_MODELS[name]
  delayed, current = build(DELAYED), build(CURRENT)
  for given in (nnx.state(delayed), nnx.state(delayed, ta_nnx.RecipeState)):
    with pytest.raises(ValueError, match=layer + NNX_REFUSED) as info:
      nnx.update(current, given)
    message = str(info.value)
    assert "but its recipe Float8CurrentScaling keeps none" in message
    assert re.search(NNX_WAY_OUT + r"with Float8CurrentScaling\.$", message)
  # The way out the message names works: the parameters load, the layer runs stateless.
  nnx.update(current, nnx.state(delayed, nnx.Not(ta_nnx.RecipeState)))
  for a, b in zip(
    jax.tree.leaves(nnx.state(current)),
    jax.tree.leaves(nnx.state(delayed, nnx.Param)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert call(current).shape == (4, 32)


def test_nnx_recipe_state_given_to_a_layer_without_recipe_raises():
  delayed = ta_nnx.GroupedLinear(2, 32, 32, recipe=DELAYED, rngs=nnx.Rngs(0))
  plain = ta_nnx.GroupedLinear(2, 32, 32, recipe=None, rngs=nnx.Rngs(0))
  grouped = r"^GroupedLinear layer \(kernel \(2, 32, 32\)\): "
  with pytest.raises(ValueError, match=grouped + NNX_REFUSED) as info:
    nnx.update(plain, nnx.state(delayed))
  assert "but it has no recipe (high precision), so the layer cannot take it" in str(info.value)
  assert str(info.value).endswith("to go on without a recipe.")


def test_nnx_checkpoint_of_another_recipe_raises_at_restore(tmp_path):
  """A checkpoint of a DelayedScaling model (its pure dict through Orbax) restored into a
  Float8CurrentScaling model raises at ``nnx.update``, naming the layer."""
  ocp = pytest.importorskip("orbax.checkpoint")
  build, _, layer = NNX_MODELS["converted"]
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", nnx.to_pure_dict(nnx.state(build(DELAYED))))
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt")
  nnx.update(build(DELAYED), restored)  # the model it came from takes it
  with pytest.raises(ValueError, match=layer + NNX_REFUSED):
    nnx.update(build(CURRENT), restored)


@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_nnx_stateless_checkpoint_restored_into_an_abstract_stateful_model_raises(name):
  """A Float8CurrentScaling model's checkpoint restored into an abstract DelayedScaling model
  (``nnx.eval_shape``, ``replace_by_pure_dict``, ``merge``: Flax's restore recipe) leaves its
  recipe state abstract; the call says so (it failed with "'ShapeDtypeStruct' object has no
  attribute 'at'")."""
  build, call, _ = NNX_MODELS[name]
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build(DELAYED)))
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(build(CURRENT))))
  model = nnx.merge(graphdef, state)
  with pytest.raises(
    ValueError,
    match=r"state\['x_scale'\] is a jax.ShapeDtypeStruct, not an array: the recipe state was "
    r"never loaded .* Restore a checkpoint of this recipe, or start from the initial state",
  ):
    call(model)


@pytest.mark.parametrize(
  "make",
  [
    lambda: ta_nnx.Linear(32, 32, recipe=DELAYED),
    lambda: ta_nnx.LinearGeneral(32, 32, recipe=DELAYED),
    lambda: ta_nnx.Einsum("bd,df->bf", (32, 32), recipe=DELAYED),
  ],
  ids=["Linear", "LinearGeneral", "Einsum"],
)
def test_nnx_layers_without_rngs_fail_as_flax_does(make):
  with pytest.raises(
    TypeError,
    match=r"__init__\(\) missing 1 required keyword-only argument: "
    r"'rngs'",
  ):
    make()


# --- recipe state given to layers without a recipe (high precision) --------------------------

NO_RECIPE = r"has no recipe \(high precision\) and keeps none, so it would be silently ignored"


class _LinenLayers(nn.Module):
  """One of each Linen layer, all built with ``recipe``."""

  recipe: object

  @nn.compact
  def __call__(self, x):
    x = ta_linen.Dense(32, recipe=self.recipe, name="dense")(x)
    x = ta_linen.DenseGeneral(32, recipe=self.recipe, name="general")(x)
    x, _ = ta_linen.LayerNormDenseGeneral(32, recipe=self.recipe, name="norm_dense")(x)
    out, _ = ta_linen.LayerNormMLP(
      64, recipe=self.recipe, intermediate_dropout_rate=0.0, name="mlp"
    )(x, deterministic=True)
    return out


def test_linen_recipe_state_given_to_layers_without_a_recipe_raises():
  """A DelayedScaling model's variables applied to the same model without a recipe (high
  precision): each layer refuses the state it would ignore, naming itself and its entries."""
  variables = _LinenLayers(DELAYED).init(jax.random.PRNGKey(0), X)
  collection = variables["_overwrite_with_gradient"]
  assert set(collection) == {"dense", "general", "norm_dense", "mlp"}
  entries = {
    "dense": "dense/DelayedScalingDotGeneral_0",
    "general": "general/DelayedScalingDotGeneral_0",
    "norm_dense": "norm_dense/x_scale",
    "mlp": "mlp/x_0_scale",
  }
  for name, entry in entries.items():  # each layer alone holding state: it is the one to raise
    only = {"params": variables["params"], "_overwrite_with_gradient": {name: collection[name]}}
    with pytest.raises(ValueError, match=f"^layer '{name}': .*" + NO_RECIPE) as info:
      _LinenLayers(None).apply(only, X)
    assert entry in str(info.value)
    assert str(info.value).endswith(
      "(variables.pop('_overwrite_with_gradient')) to go on without one."
    )
  # The way out the message names: the parameters alone run in high precision, as the
  # DelayedScaling model's GEMMs would without quantization.
  y = _LinenLayers(None).apply({"params": variables["params"]}, X)
  assert y.shape == (4, 32) and np.isfinite(np.asarray(y)).all()


def test_haiku_recipe_state_given_to_layers_without_a_recipe_raises():
  hk = pytest.importorskip("haiku")
  from te_adapters import haiku as ta_hk

  layers = {  # the layer, and the module its state is under
    "linear": (lambda r: ta_hk.Linear(32, recipe=r, name="proj")(X), "proj"),
    "norm_dense": (
      lambda r: ta_hk.LayerNormDenseGeneral(32, recipe=r, name="norm_dense")(X)[0],
      "norm_dense",
    ),
    "mlp": (lambda r: ta_hk.LayerNormMLP(64, recipe=r, name="mlp")(X)[0], "mlp/gemm_0"),
  }
  for name, (call, module) in layers.items():
    delayed = hk.transform_with_state(functools.partial(call, DELAYED))
    plain = hk.transform_with_state(functools.partial(call, None))
    params, state = delayed.init(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=NO_RECIPE) as info:
      plain.apply(params, state, None)
    message = str(info.value)
    assert f"holds recipe state for {module!r}" in message, (name, message)
    assert message.endswith("pass the state init returns without a recipe."), name
    # The way out it names: no recipe state, the same parameters.
    y, _ = plain.apply(params, {}, None)
    assert y.shape == (4, 32), name


NNX_PLAIN = {  # name: (build(recipe), call(model), how the error names the layer)
  "Linear": NNX_MODELS["Linear"],
  "LinearGeneral": (
    lambda r: ta_nnx.LinearGeneral(32, 32, recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X),
    r"^LinearGeneral layer \(kernel \(32, 32\)\): ",
  ),
  "Einsum": NNX_MODELS["Einsum"],
  "LayerNormDenseGeneral": (
    lambda r: ta_nnx.LayerNormDenseGeneral(32, 32, recipe=r, rngs=nnx.Rngs(0)),
    lambda m: m(X)[0],
    r"^LayerNormDenseGeneral layer \(kernel \(32, 32\)\): ",
  ),
  "LayerNormMLP": NNX_MODELS["LayerNormMLP"],
}


@pytest.mark.parametrize("name", list(NNX_PLAIN))
def test_nnx_recipe_state_given_to_layers_without_a_recipe_raises(name):
  """``nnx.update`` of a layer without a recipe with a DelayedScaling layer's state: Flax said
  "Found data on value of type State assigned to static attribute 'dot_general'" (the dense
  layers) or "Cannot set key 'state' on immutable node of type NoneType" (the norm and MLP)."""
  build, call, layer = NNX_PLAIN[name]
  delayed, plain = build(DELAYED), build(None)
  with pytest.raises(ValueError, match=layer + NNX_REFUSED) as info:
    nnx.update(plain, nnx.state(delayed))
  message = str(info.value)
  assert "but it has no recipe (high precision), so the layer cannot take it" in message
  assert re.search(NNX_WAY_OUT + r"without a recipe\.$", message)
  # The way out it names: the parameters load and the layer runs in high precision.
  nnx.update(plain, nnx.state(delayed, nnx.Not(ta_nnx.RecipeState)))
  for a, b in zip(
    jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(delayed, nnx.Param)), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  assert call(plain).shape == (4, 32)


# --- what Flax and Orbax say first (docs/guide/nnx.md, "a checkpoint of another recipe") ------


class _Pair(nnx.Module):
  def __init__(self, recipe, rngs):
    self.up = ta_nnx.Linear(32, 64, recipe=recipe, rngs=rngs)
    self.down = ta_nnx.Linear(64, 32, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.down(self.up(x))


def test_nnx_merge_and_replace_by_pure_dict_refuse_another_recipes_state():
  """Flax's own calls see a checkpoint of another recipe before any layer does; they raise
  (never load it silently), with the messages the guide quotes."""
  delayed, current, plain = (_Pair(r, nnx.Rngs(0)) for r in (DELAYED, CURRENT, None))
  for model in (current, plain):
    graphdef, _ = nnx.split(model)
    with pytest.raises(ValueError, match="Incorrect number of leaves"):
      nnx.merge(graphdef, nnx.state(delayed))
    with pytest.raises(ValueError, match="Incorrect number of leaves"):
      nnx.merge(nnx.split(delayed)[0], nnx.state(model))
    with pytest.raises(
      ValueError,
      match=r"key in pure_dict not available in state: \('down', 'dot_general', 'state', ",
    ):
      nnx.replace_by_pure_dict(nnx.state(model), nnx.to_pure_dict(nnx.state(delayed)))
  # The other way the dict's parameters load and a built model keeps its initial recipe state:
  # a bf16 model's weights start FP8 training.
  target = _Pair(DELAYED, nnx.Rngs(1))
  state = nnx.state(target)
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(plain)))
  nnx.update(target, state)
  np.testing.assert_array_equal(target.up.kernel[...], plain.up.kernel[...])
  for name, value in ta.core.init_state(DELAYED).items():
    np.testing.assert_array_equal(target.up.dot_general.state[name][...], value)


def test_orbax_restore_with_another_recipes_target_raises(tmp_path):
  """Orbax compares the target's tree with the checkpoint's: a bf16 checkpoint into an FP8
  model's target, or an FP8 one into a bf16 model's, is its ValueError, naming the recipe
  state's path; the guide's restore (the shared parameters) loads both ways."""
  ocp = pytest.importorskip("orbax.checkpoint")
  delayed, plain = _Pair(DELAYED, nnx.Rngs(0)), _Pair(None, nnx.Rngs(1))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "fp8", nnx.state(delayed))
    checkpointer.save(tmp_path / "bf16", nnx.state(plain))
  mismatch = r"tree structures do not match:\ndown.dot_general:"
  abstract_mismatch = r"Structure mismatch: Target path \('down', 'dot_general', 'state', "
  with ocp.StandardCheckpointer() as checkpointer:
    for path, recipe in (("fp8", None), ("bf16", DELAYED)):
      with pytest.raises(ValueError, match=mismatch):
        checkpointer.restore(tmp_path / path, nnx.state(_Pair(recipe, nnx.Rngs(2))))
    # An abstract target (nnx.eval_shape), Flax's restore recipe.
    abstract = nnx.eval_shape(lambda: _Pair(DELAYED, nnx.Rngs(2)))
    with pytest.raises(ValueError, match=abstract_mismatch):
      checkpointer.restore(tmp_path / "bf16", nnx.state(abstract))
    # What both share: the parameters.
    fp8 = _Pair(DELAYED, nnx.Rngs(2))
    nnx.update(fp8, checkpointer.restore(tmp_path / "bf16", nnx.state(fp8, nnx.Param)))
    np.testing.assert_array_equal(fp8.down.kernel[...], plain.down.kernel[...])
    # Restored without a target, the FP8 checkpoint reaches the layer's own refusal.
    with pytest.raises(ValueError, match=r"^Linear layer \(kernel \(64, 32\)\): " + NNX_REFUSED):
      nnx.update(_Pair(None, nnx.Rngs(2)), checkpointer.restore(tmp_path / "fp8"))
