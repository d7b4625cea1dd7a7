"""Recipe state saved in the dict layout (before ``DelayedScalingState``) still loads and trains.

The fixture ``fixtures/dict_layout_checkpoint.msgpack`` was written by
``fixtures/make_dict_layout_checkpoint.py`` with the version whose ``init_state`` returned a
dict: one GEMM's state after 3 and 4 steps, and a Linen model's variables after 3 steps.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import serialization  # noqa: E402

import te_adapters as ta  # noqa: E402
from te_adapters import linen as ta_linen  # noqa: E402, F401  (registers the typed state)
from tests.conftest import FP8_GEMM_RTOL, assert_scales_equal  # noqa: E402
from tests.fixtures import make_dict_layout_checkpoint as old  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "dict_layout_checkpoint.msgpack"


@pytest.fixture(scope="module")
def saved():
  return serialization.msgpack_restore(FIXTURE.read_bytes())


# Steps taken here from the fixture's state end where the fixture's own steps ended: exactly on
# CPU, where it was made; to the GEMMs' rounding on a GPU (2.4e-5 of an amax seen on an H100).
CONTINUED = 0.0 if jax.default_backend() == "cpu" else FP8_GEMM_RTOL


def assert_state_equal(actual, desired, rtol=0.0):
  assert sorted(actual) == sorted(desired)
  for name in desired:
    if rtol:
      np.testing.assert_allclose(np.asarray(actual[name]), desired[name], rtol=rtol)
    elif name.endswith("_scale"):
      assert_scales_equal(actual[name], desired[name])
    else:
      np.testing.assert_array_equal(np.asarray(actual[name]), desired[name])


def test_old_bytes_restore_into_the_typed_state_and_continue_exactly(saved):
  target = ta.core.init_state(old.RECIPE)
  state = serialization.from_state_dict(target, saved["core_state"])
  assert isinstance(state, ta.core.DelayedScalingState)
  assert_state_equal(state, saved["core_state"])
  x, w = old.inputs()
  new = old.step(w, state, x, 3)
  assert isinstance(new, ta.core.DelayedScalingState)
  assert_state_equal(new, saved["core_state_after_4"], rtol=CONTINUED)
  # Saving the typed state writes the dict layout again.
  again = serialization.msgpack_restore(serialization.to_bytes(state))
  assert_state_equal(again, saved["core_state"])


def test_old_dict_passed_as_is_trains_and_stays_a_dict(saved):
  state = {k: jnp.asarray(v) for k, v in saved["core_state"].items()}
  x, w = old.inputs()
  with pytest.warns(DeprecationWarning, match="typed_state"):
    new = old.step(w, state, x, 3)
  assert type(new) is dict
  assert_state_equal(new, saved["core_state_after_4"], rtol=CONTINUED)


def test_old_linen_variables_load_into_the_model_and_continue(saved):
  x, _ = old.inputs()
  template = old.linen_model().init(jax.random.key(1), x)
  variables = serialization.from_state_dict(template, saved["linen_variables"])
  fresh = old.linen_step(variables, x, 3)["_overwrite_with_gradient"]["dot_general"]
  # The same step from the same state, in the dict layout the core takes directly.
  kernel = variables["params"]["kernel"]
  bias_free = old.step(kernel, variables["_overwrite_with_gradient"]["dot_general"], x, 3)
  assert_state_equal(fresh, dict(bias_free))
  assert not np.array_equal(
    fresh["x_amax_history"],
    saved["linen_variables"]["_overwrite_with_gradient"]["dot_general"]["x_amax_history"],
  )


def test_incomplete_or_mismatched_old_state_gets_a_clear_error(saved):
  x, w = old.inputs()
  partial = {k: v for k, v in saved["core_state"].items() if k != "grad_scale"}
  with pytest.raises(ValueError, match=r"missing \['grad_scale'\]"):
    old.step(w, partial, x, 3)
  with pytest.raises(ValueError, match=r"missing \['grad_scale'\]"):
    serialization.from_state_dict(ta.core.init_state(old.RECIPE), partial)
  longer = ta.core.init_state(ta.DelayedScaling(amax_history_len=8))
  with pytest.raises(ValueError, match=r"x_amax_history.*shape \(4,\).*\(8,\)"):
    ta.core.dot_general(
      x,
      w,
      old.DN,
      recipe=ta.DelayedScaling(amax_history_len=8),
      state=serialization.from_state_dict(longer, saved["core_state"]),
      threshold=None,
    )
