"""Cotangents with their primals' types: the sums ``pvary``'s transpose would do inside
``shard_map``, and the shardings JAX's ``dot_general`` transpose gives on Explicit axes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core.sharding import _mesh

__all__ = ["type_witness", "match_cotangent", "wgrad_dtype", "transposed_out_sharding"]


def type_witness(x):
  """Inside ``shard_map``, a zero-size array that varies over the axes ``x`` varies over.

  It carries the primal's type into the custom VJP's backward pass; ``None`` elsewhere.
  """
  if not _mesh.manual_axes() or not _mesh.checks_vma():
    return None
  axes = _mesh.in_mesh_order(_mesh.varying_axes(x))
  return lax.pcast(jnp.zeros((0,), jnp.float32), axes, to="varying")


def match_cotangent(ct, witness):
  """Sums ``ct`` over the manual axes its primal does not vary over (``pvary``'s transpose)."""
  if witness is None:
    return ct  # under jit, or shard_map(check_vma=False) whose own transpose does the sums
  primal = _mesh.varying_axes(witness)
  extra = _mesh.varying_axes(ct) - primal
  if extra:
    ct = lax.psum(ct, _mesh.in_mesh_order(extra))
  missing = primal - _mesh.varying_axes(ct)
  if missing:
    ct = lax.pcast(ct, _mesh.in_mesh_order(missing), to="varying")
  return ct


def wgrad_dtype(dtype, witness):
  """The dtype the weight-gradient GEMM emits: float32 inside shard_map, where the gradient is
  then summed over the data-parallel devices (XLA sums it in float32 under jit too)."""
  return np.dtype(np.float32) if witness is not None else dtype


def transposed_out_sharding(operand, perm: Sequence[int] | None):
  """``out_sharding`` of a backward GEMM whose output, transposed by ``perm``, is ``operand``.

  Mirrors JAX's ``dot_general`` transpose: the cotangent gets the primal operand's sharding.
  Only Explicit mesh axes need it; ``None`` otherwise. ``perm=None`` is the identity.
  """
  sharding = getattr(jax.typeof(operand), "sharding", None)
  if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
    return None
  explicit = jax.sharding.AxisType.Explicit
  if not any(t == explicit for t in sharding.mesh.axis_types):
    return None
  spec = tuple(sharding.spec) + (None,) * (len(operand.shape) - len(sharding.spec))
  if perm is None:
    return sharding.update(spec=PartitionSpec(*spec))
  inverse = [None] * len(perm)
  for i, p in enumerate(perm):
    inverse[p] = spec[i]
  return sharding.update(spec=PartitionSpec(*inverse))
