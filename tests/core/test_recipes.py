import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta


def test_defaults_match_te():
  r = ta.DelayedScaling()
  assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
    0,
    ta.Format.HYBRID,
    1024,
    "max",
  )
  assert ta.Float8CurrentScaling().fp8_format is ta.Format.HYBRID


def test_format_dtypes():
  assert ta.Format.HYBRID.fwd_dtype == np.dtype(jnp.float8_e4m3fn)
  assert ta.Format.HYBRID.bwd_dtype == np.dtype(jnp.float8_e5m2)
  assert ta.Format.E4M3.fwd_dtype == ta.Format.E4M3.bwd_dtype == np.dtype(jnp.float8_e4m3fn)


def test_frozen_and_hashable():
  a, b = ta.DelayedScaling(amax_history_len=16), ta.DelayedScaling(amax_history_len=16)
  assert a == b and hash(a) == hash(b)
  assert {a: 1}[b] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.amax_history_len = 3


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_history_len=2.5), TypeError, "amax_history_len"),
    (dict(amax_history_len=True), TypeError, "amax_history_len"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(amax_compute_algo=max), ValueError, "amax_compute_algo"),
    (dict(margin=-1), ValueError, "margin"),
    (dict(margin="1"), TypeError, "margin"),
    (dict(fp8_format="HYBRID"), TypeError, "fp8_format"),
    (dict(fp8_format=ta.Format.E5M2), ValueError, "E5M2"),
  ],
)
def test_delayed_rejects_bad_values(kwargs, error, match):
  with pytest.raises(error, match=match):
    ta.DelayedScaling(**kwargs)


def test_current_rejects_pure_e5m2():
  with pytest.raises(ValueError, match="E5M2"):
    ta.Float8CurrentScaling(fp8_format=ta.Format.E5M2)


def test_check_recipe_errors():
  with pytest.raises(TypeError, match="class DelayedScaling"):
    ta.core.check_recipe(ta.DelayedScaling)
  with pytest.raises(TypeError, match="recipe must be"):
    ta.core.check_recipe("delayed")
