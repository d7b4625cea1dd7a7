"""The typed recipe state: one type per format, typed where a call enters the core, and held as
that type by NNX; numpy, ``flax.serialization``, Orbax and ``nnx.to_pure_dict`` checkpoint it,
and the dict spelling keeps working for one release with a ``DeprecationWarning``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core

DELAYED = ta.DelayedScaling(amax_history_len=4)
STATELESS = [
  ta.Float8CurrentScaling(),
  ta.MXFP8BlockScaling(),
  ta.NVFP4BlockScaling(),
  ta.Float8BlockScaling(),
]
DN = (((1,), (0,)), ((), ()))


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.standard_normal((32, 64)), jnp.float32),
    jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
  )


def _step(state, seed=0):
  """One training step of one GEMM: the output and the new state."""
  x, w = _inputs(seed)

  def loss(state):
    y = core.dot_general(x, w, DN, recipe=DELAYED, state=state, threshold=None)
    return jnp.sum(y**2), y

  (_, y), g = jax.value_and_grad(loss, has_aux=True)(state)
  return y, core.updated_state(state, g)


def _assert_same(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


@pytest.mark.parametrize("recipe", STATELESS, ids=lambda r: type(r).__name__)
def test_stateless_recipes_keep_an_empty_state(recipe):
  state = core.init_state(recipe)
  assert type(state) is core.EmptyState
  assert state == {} and dict(state) == {} and len(state) == 0 and not state
  assert jax.tree.leaves(state) == []
  # It passes through jit and is returned as itself.
  assert type(jax.jit(lambda s: s)(state)) is core.EmptyState
  assert type(core.typed_state(recipe, {})) is core.EmptyState


def test_grouped_state_is_typed_too():
  assert type(core.init_ragged_state(ta.Float8CurrentScaling(), 3)) is core.EmptyState
  grouped = core.init_ragged_state(DELAYED, 3)
  assert type(grouped) is core.DelayedScalingState
  assert grouped.role("x").amax_history.shape == (3, 4)


def test_state_comes_back_as_its_type_after_steps():
  state = core.init_state(DELAYED)
  for seed in range(3):
    _, state = _step(state, seed)
    assert type(state) is core.DelayedScalingState
  x, w = _inputs(2)
  assert float(state.role("x").amax_history[-1]) == float(jnp.max(jnp.abs(x)))
  # Delayed scaling: the scale from the largest amax in the history (margin 0).
  history = np.asarray(state.role("x").amax_history)
  assert np.count_nonzero(history) == 3
  np.testing.assert_allclose(state.role("x").scale, [448.0 / history.max()], rtol=1e-7)
  assert float(state.role("kernel").amax_history[-1]) == float(jnp.max(jnp.abs(w)))


def test_a_dict_of_te_names_warns_once_at_the_callers_line_and_changes_nothing():
  typed = core.init_state(DELAYED)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    y_typed, new_typed = _step(typed)
  assert not [w for w in record if issubclass(w.category, DeprecationWarning)]

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    y_dict, new_dict = _step(dict(typed))
  deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
  assert len(deprecations) == 1, [str(w.message) for w in record]
  assert "typed_state" in str(deprecations[0].message)
  assert deprecations[0].filename == __file__  # _step's call, not a frame inside the package
  np.testing.assert_array_equal(np.asarray(y_dict), np.asarray(y_typed))
  _assert_same(new_dict, new_typed)
  assert type(new_dict) is dict  # the caller's container comes back


def test_an_empty_dict_for_a_stateless_recipe_is_silent():
  x, w = _inputs()
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    core.dot_general(x, w, DN, recipe=ta.Float8CurrentScaling(), state={}, threshold=None)
  assert not [w for w in record if issubclass(w.category, DeprecationWarning)]


def test_a_grouped_dict_warns_and_runs_like_the_typed_state():
  recipe = ta.DelayedScaling(amax_history_len=4)
  typed = core.init_ragged_state(recipe, 2)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)
  sizes = jnp.array([16, 16], jnp.int32)
  want = core.ragged_dot(x, w, sizes, recipe=recipe, state=typed)
  with pytest.warns(DeprecationWarning, match="init_ragged_state"):
    got = core.ragged_dot(x, w, sizes, recipe=recipe, state=dict(typed))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_typed_state_converts_and_refuses_clearly():
  saved = {k: np.asarray(v) for k, v in core.init_state(DELAYED).items()}
  state = core.typed_state(DELAYED, saved)
  assert type(state) is core.DelayedScalingState
  assert core.typed_state(DELAYED, state) is state
  with pytest.raises(ValueError, match=r"missing \['x_scale'\]"):
    core.typed_state(DELAYED, {k: v for k, v in saved.items() if k != "x_scale"})
  with pytest.raises(ValueError, match=r"unexpected \['x_scale'\]"):
    core.typed_state(ta.Float8CurrentScaling(), {"x_scale": saved["x_scale"]})
  with pytest.raises(TypeError, match="got list"):
    core.typed_state(DELAYED, [1.0])


def test_numpy_checkpoint_round_trip(tmp_path):
  _, state = _step(core.init_state(DELAYED))
  np.savez(tmp_path / "state.npz", **{k: np.asarray(v) for k, v in state.items()})
  with np.load(tmp_path / "state.npz") as saved:
    restored = core.typed_state(DELAYED, {k: jnp.asarray(saved[k]) for k in saved.files})
  _assert_same(restored, state)
  _assert_same(_step(restored, 1)[1], _step(state, 1)[1])


def test_flax_serialization_round_trip():
  serialization = pytest.importorskip("flax.serialization")
  from te_adapters import linen  # noqa: F401  (registers the typed states)

  _, state = _step(core.init_state(DELAYED))
  tree = {"dense": state, "mlp": core.init_state(ta.Float8CurrentScaling())}
  data = serialization.to_bytes(tree)
  # Written as dicts of TE's names, as before the state was typed.
  raw = serialization.msgpack_restore(data)
  assert sorted(raw["dense"]) == sorted(core.state_names(DELAYED)) and raw["mlp"] == {}
  restored = serialization.from_bytes(
    {"dense": core.init_state(DELAYED), "mlp": core.init_state(ta.Float8CurrentScaling())}, data
  )
  assert type(restored["dense"]) is core.DelayedScalingState
  assert type(restored["mlp"]) is core.EmptyState
  _assert_same(restored["dense"], state)


def test_orbax_round_trip(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  _, state = _step(core.init_state(DELAYED))
  tree = {"dense": state, "mlp": core.init_state(ta.Float8CurrentScaling())}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", tree)
  assert type(restored["dense"]) is core.DelayedScalingState
  _assert_same(restored["dense"], state)


def test_nnx_holds_the_typed_state_and_checkpoints_it():
  nnx = pytest.importorskip("flax.nnx")
  from te_adapters import nnx as ta_nnx

  layer = ta_nnx.Linear(64, 32, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(0))
  assert type(layer.dot_general.state) is core.DelayedScalingState
  assert isinstance(layer.dot_general.state.x_scale, ta_nnx.RecipeState)
  assert type(layer.dot_general.recipe_state()) is core.DelayedScalingState
  current = ta_nnx.Linear(64, 32, recipe=ta.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  assert type(current.dot_general.state) is core.EmptyState

  x, _ = _inputs()

  def train(model, steps):
    for _ in range(steps):
      _, (_, state_grads) = ta_nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
      ta_nnx.update_recipe_state(model, state_grads)

  train(layer, 2)
  saved = nnx.to_pure_dict(nnx.state(layer))
  # A plain nested dict of arrays, TE's names under the op's typed state.
  assert sorted(saved["dot_general"]["state"]) == sorted(core.state_names(DELAYED))
  assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(saved))

  fresh = ta_nnx.Linear(64, 32, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(1))
  state = nnx.state(fresh)
  nnx.replace_by_pure_dict(state, saved)
  nnx.update(fresh, state)
  _assert_same(fresh.dot_general.recipe_state(), layer.dot_general.recipe_state())
  train(layer, 1)
  train(fresh, 1)
  _assert_same(fresh.dot_general.recipe_state(), layer.dot_general.recipe_state())


def test_nnx_old_te_named_checkpoint_loads_after_upgrade():
  nnx = pytest.importorskip("flax.nnx")
  from te_adapters import nnx as ta_nnx

  layer = ta_nnx.Linear(64, 32, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(0))
  x, _ = _inputs()
  _, (_, state_grads) = ta_nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  ta_nnx.update_recipe_state(layer, state_grads)
  saved = nnx.to_pure_dict(nnx.state(layer))
  # The layout before the state was typed: the op's entries directly under it.
  old = {**saved, "dot_general": dict(saved["dot_general"].pop("state"))}
  assert "x_scale" in old["dot_general"]
  fresh = ta_nnx.Linear(64, 32, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(1))
  state = nnx.state(fresh)
  with pytest.raises(Exception):  # noqa: B017 (nnx's own error for a path it does not have)
    nnx.replace_by_pure_dict(state, old)
  state = nnx.state(fresh)
  nnx.replace_by_pure_dict(state, ta_nnx.upgrade_state_dict(old))
  nnx.update(fresh, state)
  _assert_same(fresh.dot_general.recipe_state(), layer.dot_general.recipe_state())
  # Today's layout comes back unchanged.
  once = ta_nnx.upgrade_state_dict(old)
  twice = ta_nnx.upgrade_state_dict(once)
  assert jax.tree.structure(twice) == jax.tree.structure(once)
  assert all(a is b for a, b in zip(jax.tree.leaves(twice), jax.tree.leaves(once), strict=True))


def test_nnx_old_attribute_names_warn_and_reach_the_same_variable():
  nnx = pytest.importorskip("flax.nnx")
  from te_adapters import nnx as ta_nnx

  layer = ta_nnx.Linear(64, 32, recipe=DELAYED, rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning, match=r"state\.x_scale"):
    variable = layer.dot_general.x_scale
  assert variable is layer.dot_general.state.x_scale
  current = ta_nnx.Linear(64, 32, recipe=ta.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning), pytest.raises(AttributeError, match="x_scale"):
    _ = current.dot_general.x_scale
