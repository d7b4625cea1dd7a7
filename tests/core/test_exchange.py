"""Sums over devices as pairwise exchanges (core/sharding/_exchange.py), inside ``shard_map`` on
8 virtual CPU devices (conftest.py): every device's result against XLA's ``psum``,
``psum_scatter`` and ``all_gather`` over one axis, another, and both (2, 4 and 8 devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_adapters.core import sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest.py)")

AXES = [("tp",), ("dp",), ("dp", "tp")]


def _mesh():
  return jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])


def _run(fn, x, mesh):
  spec = P(("dp", "tp"))
  x = jax.device_put(x, NamedSharding(mesh, spec))
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  return [np.asarray(o) for o in jax.jit(mapped)(x)]


@pytest.mark.parametrize("axes", AXES, ids=["-".join(a) for a in AXES])
def test_exchange_sum_is_psum_on_every_device(axes):
  """Integer-valued float32 data: every order of the additions gives the same sum, so the
  exchanges' sum equals psum's exactly; a device that adds a partner twice, or misses one, is
  off by an integer."""
  mesh = _mesh()
  n = sharding.device_count(mesh, axes)
  x = jnp.asarray(np.random.default_rng(0).integers(-50, 50, (8, 16, 12)), jnp.float32)

  def fn(shard):
    return sharding.exchange_sum(shard, axes, n), lax.psum(shard, axes)

  got, want = _run(fn, x, mesh)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axes", AXES, ids=["-".join(a) for a in AXES])
def test_exchange_sum_gives_every_device_the_same_bits(axes):
  """Random float32 data, where the additions' order matters: every device of a group holds
  the same bits (the pairwise sums commute), within float32 rounding of the float64 sum."""
  mesh = _mesh()
  n = sharding.device_count(mesh, axes)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16, 12)), jnp.float32)

  def fn(shard):
    return (sharding.exchange_sum(shard, axes, n),)

  (got,) = _run(fn, x, mesh)
  shards = np.asarray(x, np.float64).reshape(2, 4, 16, 12)  # (dp, tp, ...)
  over = {("tp",): (1,), ("dp",): (0,), ("dp", "tp"): (0, 1)}[axes]
  summed = shards.sum(over, keepdims=True)
  # n - 1 float32 additions, each rounded within 2**-24 of its result (<= the sum of |x|).
  bound = (n - 1) * 2**-24 * np.abs(shards).sum(over, keepdims=True)
  got = got.reshape(2, 4, 16, 12)
  assert np.all(np.abs(got - summed) <= bound), np.abs(got - summed).max()
  first = got[:1, :1] if axes == ("dp", "tp") else (got[:, :1] if axes == ("tp",) else got[:1])
  np.testing.assert_array_equal(got, np.broadcast_to(first, got.shape))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axes", AXES, ids=["-".join(a) for a in AXES])
def test_exchange_sum_scatter_is_tiled_psum_scatter(axes, dim):
  """Device i keeps the i-th slice of the sum, as ``psum_scatter(..., tiled=True)`` does."""
  mesh = _mesh()
  n = sharding.device_count(mesh, axes)
  x = jnp.asarray(np.random.default_rng(2).integers(-50, 50, (64, 16, 16)), jnp.float32)

  def fn(shard):
    got = sharding.exchange_sum_scatter(shard, axes, n, dim)
    return got, lax.psum_scatter(shard, axes, scatter_dimension=dim, tiled=True)

  got, want = _run(fn, x, mesh)
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axes", AXES, ids=["-".join(a) for a in AXES])
def test_exchange_gather_is_tiled_all_gather(axes, dim):
  """Every device holds the devices' slices joined in their order, as ``all_gather(...,
  tiled=True)`` gives them: each is a copy, so the two agree exactly on any data."""
  mesh = _mesh()
  n = sharding.device_count(mesh, axes)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((16, 6, 5)), jnp.float32)

  def fn(shard):
    got = sharding.exchange_gather(shard, axes, n, dim)
    return got, lax.all_gather(shard, axes, axis=dim, tiled=True)

  got, want = _run(fn, x, mesh)
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)


def test_exchanges_refuse_what_they_cannot_pair():
  x = jnp.zeros((6, 4))
  with pytest.raises(ValueError, match="power-of-two device count, got 6"):
    sharding.exchange_sum(x, ("a",), 6)
  with pytest.raises(ValueError, match="power-of-two device count, got 3"):
    sharding.exchange_sum_scatter(x, ("a",), 3, 0)
  with pytest.raises(ValueError, match="power-of-two device count, got 12"):
    sharding.exchange_gather(x, ("a",), 12, 0)
  with pytest.raises(ValueError, match=r"dim 1 of \(6, 4\) does not split into 8"):
    sharding.exchange_sum_scatter(x, ("a",), 8, 1)
  assert [n for n in range(1, 9) if sharding.is_power_of_two(n)] == [1, 2, 4, 8]
  assert not sharding.is_power_of_two(0)
