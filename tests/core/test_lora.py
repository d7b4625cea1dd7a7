"""core.low_rank_adaptation against float64: TE's shapes, scaling, axes and rank rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_adapters import core
from tests.conftest import rel_err

# Elementwise on CPU; normwise elsewhere, where XLA's float32 GEMMs may run in TF32 (entries near
# zero then miss any elementwise tolerance; seen on an H100).
TOL = 2e-5 if jax.default_backend() == "cpu" else 5e-3


def _close(y, ref):
  if jax.default_backend() == "cpu":
    np.testing.assert_allclose(y, ref, rtol=TOL, atol=TOL)
  else:
    assert rel_err(y, ref) < TOL


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("alpha", [None, 8.0])
def test_term_against_float64(alpha):
  x, a, b = _rand((3, 5, 32), 0), _rand((32, 4), 1), _rand((4, 48), 2)
  y = core.low_rank_adaptation(x, a, b, alpha=alpha)
  scaling = 1.0 if alpha is None else alpha / 4
  ref = np.float64(x) @ np.float64(a) @ np.float64(b) * scaling
  assert y.shape == (3, 5, 48) and y.dtype == jnp.float32
  _close(y, ref)


def test_several_axes_and_features_follow_tes_shapes():
  in_shape, features, rank = (4, 8), (2, 16), 3
  a_shape, b_shape = core.lora_shapes(in_shape, features, rank)
  assert (a_shape, b_shape) == ((4, 8, 2, 3), (2, 3, 16))
  x, a, b = _rand((5, 4, 6, 8), 0), _rand(a_shape, 1), _rand(b_shape, 2)
  y = core.low_rank_adaptation(x, a, b, axis=(1, 3), alpha=6.0)
  ref = np.einsum("pirj,ijhs,hsn->prhn", *(np.float64(v) for v in (x, a, b))) * 2.0
  assert y.shape == (5, 6, 2, 16)
  _close(y, ref)


def test_bf16_inputs_give_bf16():
  x, a, b = (
    v.astype(jnp.bfloat16) for v in (_rand((4, 32), 0), _rand((32, 2), 1), _rand((2, 16), 2))
  )
  assert core.low_rank_adaptation(x, a, b).dtype == jnp.bfloat16


@pytest.mark.parametrize("rank", [0, 33, 17, 2.0])
def test_rank_outside_one_to_min_dims_is_a_clear_error(rank):
  with pytest.raises(
    ValueError,
    match=r"layer: low_rank_adaptation_dim must be an int from 1 "
    r"to min\(K, N\) = 16 \(K=32 contracted, N=16",
  ):
    core.check_lora_rank(rank, (32,), (16,), "layer")


def test_mismatched_factors_are_a_clear_error():
  with pytest.raises(ValueError, match="do not match"):
    core.low_rank_adaptation(_rand((4, 32), 0), _rand((32, 4), 1), _rand((3, 16), 2))
  with pytest.raises(ValueError, match="needs contracted sizes"):
    core.low_rank_adaptation(_rand((4, 32), 0), _rand((16, 4), 1), _rand((4, 16), 2))
