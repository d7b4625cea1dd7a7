"""The typed recipe state: ``DelayedScalingState`` reads as TE names it and keeps its type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import state as core_state

RECIPE = ta.DelayedScaling(amax_history_len=4)
DN = (((1,), (0,)), ((), ()))
NAMES = [f"{r}_{k}" for r in ("x", "kernel", "grad") for k in ("scale", "amax_history")]


def test_init_state_is_typed_with_te_names_as_keys_and_paths():
  s = core.init_state(RECIPE)
  assert isinstance(s, core.DelayedScalingState)
  assert list(s) == NAMES and len(s) == 6
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
  assert paths == [f"['{n}']" for n in sorted(NAMES)]
  # The leaves come in the order of the dict layout's leaves.
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(dict(s)), strict=True):
    assert a is b
  assert s.role("grad").amax_history.shape == (4,) and float(s["kernel_scale"][0]) == 1.0
  assert core.init_state(ta.Float8CurrentScaling()) == {}
  with pytest.raises(KeyError):
    s["x_amax"]
  with pytest.raises(ValueError, match="role must be one of"):
    s.role("y")


def test_with_roles_replaces_only_the_given_roles():
  s = core.init_state(RECIPE)
  new = s.with_roles({"x": core.RoleState(jnp.full((1,), 2.0), jnp.arange(4.0))})
  assert float(new["x_scale"][0]) == 2.0 and new["x_amax_history"].tolist() == [0, 1, 2, 3]
  assert new["kernel_scale"] is s["kernel_scale"] and float(s["x_scale"][0]) == 1.0


def test_ragged_state_is_typed_with_a_group_axis():
  s = core.init_ragged_state(RECIPE, 3)
  assert isinstance(s, core.DelayedScalingState)
  assert s.role("x").scale.shape == (3, 1) and s["grad_amax_history"].shape == (3, 4)


def _new_state(state):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)

  def loss(w, state):
    return jnp.sum(core.dot_general(x, w, DN, recipe=RECIPE, state=state, threshold=None) ** 2)

  _, g = jax.grad(loss, argnums=(0, 1))(w, state)
  return core.updated_state(state, g), float(jnp.max(jnp.abs(x)))


def test_state_keeps_its_type_through_a_step_and_dicts_still_work():
  typed, x_amax = _new_state(core.init_state(RECIPE))
  as_dict, _ = _new_state(dict(core.init_state(RECIPE)))
  assert isinstance(typed, core.DelayedScalingState) and type(as_dict) is dict
  for name in NAMES:
    np.testing.assert_array_equal(typed[name], as_dict[name])
  np.testing.assert_allclose(typed["x_amax_history"], [0, 0, 0, x_amax], rtol=0)
  np.testing.assert_allclose(typed["x_scale"], [448.0 / x_amax], rtol=1e-6)


def test_updated_state_keeps_the_type_of_each_state_in_a_tree():
  typed = core.init_state(RECIPE)
  tree = {"a": typed, "b": {"c": dict(typed)}}
  grads = jax.tree.map(lambda v: v + 1, tree)
  out = core.updated_state(tree, grads)
  assert isinstance(out["a"], core.DelayedScalingState) and type(out["b"]["c"]) is dict
  assert float(out["a"]["x_scale"][0]) == 2.0 and float(out["b"]["c"]["grad_scale"][0]) == 2.0
  unused = jax.tree.map(jnp.zeros_like, tree)  # zero scales: the GEMM did not run
  kept = core.updated_state(tree, unused)
  assert float(kept["a"]["x_scale"][0]) == 1.0 and float(kept["b"]["c"]["x_scale"][0]) == 1.0


def test_with_max_grad_marks_scales_and_histories_by_kind():
  for state in (core.init_state(RECIPE), dict(core.init_state(RECIPE))):
    marked = core.with_max_grad({"layer": state})["layer"]
    assert type(marked) is type(state)
    for name in NAMES:
      assert core_state.is_accumulating(marked[name])
      want = "scale" if name.endswith("_scale") else "max"
      assert marked[name].dtype.combine == want, name


def test_bad_state_errors_name_the_entries():
  good = dict(core.init_state(RECIPE))
  with pytest.raises(ValueError, match=r"missing \['x_scale'\].*init_state"):
    core.DelayedScalingState.from_mapping({k: v for k, v in good.items() if k != "x_scale"})
  with pytest.raises(ValueError, match=r"unexpected \['y_scale'\]"):
    core.check_state(RECIPE, {**good, "y_scale": jnp.ones((1,))})
  with pytest.raises(TypeError, match="DelayedScalingState or a dict"):
    core.check_state(RECIPE, [1.0])
