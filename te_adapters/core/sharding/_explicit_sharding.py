"""Reshapes of arrays on Explicit mesh axes: their specs carried through, and resharding."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core.sharding import _mesh

__all__ = [
  "explicit_out_sharding",
  "explicit_sharding",
  "reshape_spec",
  "reshape",
  "reshaped_sharding",
  "match_sharding",
]


def explicit_sharding(x) -> NamedSharding | None:
  """The ``NamedSharding`` of ``x`` (an array or a ``ShapeDtypeStruct``) when it is sharded
  over Explicit mesh axes, padded to one spec entry per dimension; ``None`` otherwise."""
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
  else:
    sharding = getattr(jax.typeof(x), "sharding", None)
  if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
    return None
  mesh = sharding.mesh
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == jax.sharding.AxisType.Explicit
  }
  spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
  if not any(set(_mesh.axis_tuple(e, "spec entry")) & explicit for e in spec):
    return None
  return sharding.update(spec=PartitionSpec(*spec))


def explicit_out_sharding(out_sharding) -> NamedSharding | None:
  """``out_sharding`` (a ``NamedSharding``, or a ``PartitionSpec`` of the context mesh) as a
  ``NamedSharding`` where its mesh has Explicit axes and every axis it names is one of them (an
  output whose type such a sharding can give: ``jax.sharding.reshard``); ``None`` otherwise."""
  if out_sharding is None:
    return None
  if isinstance(out_sharding, NamedSharding):
    sharding = out_sharding
  else:
    mesh = _mesh.abstract_mesh()
    if mesh is None:
      return None
    sharding = NamedSharding(mesh, out_sharding)
  mesh = sharding.mesh
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == jax.sharding.AxisType.Explicit
  }
  if any(e is PartitionSpec.UNCONSTRAINED for e in sharding.spec):
    return None
  named = {a for e in sharding.spec for a in _mesh.axis_tuple(e, "spec entry")}
  return sharding if explicit and named <= explicit else None


def reshape_spec(shape, spec, new_shape, axis_sizes: Mapping[str, int]) -> PartitionSpec:
  """The spec of ``reshape(x, new_shape)`` for ``x`` of ``shape`` sharded as ``spec``.

  Dimensions are matched in groups of equal size (a split or a merge); a group keeps the
  sharding of its first input dimension on its first output dimension, which is where the
  shards' elements land. Raises a ValueError when that cannot hold (a minor dimension of a
  merge is sharded, or the first output dimension does not divide into the shards).
  """
  shape, new_shape = tuple(shape), tuple(new_shape)
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  out = [None] * len(new_shape)
  i = j = 0
  while i < len(shape) or j < len(new_shape):
    if i < len(shape) and shape[i] == 1:
      i += 1
      continue
    if j < len(new_shape) and new_shape[j] == 1:
      j += 1
      continue
    group_in, group_out = [i], [j]
    size_in, size_out = shape[i], new_shape[j]
    i, j = i + 1, j + 1
    while size_in != size_out:
      if size_in < size_out:
        group_in.append(i)
        size_in *= shape[i]
        i += 1
      else:
        group_out.append(j)
        size_out *= new_shape[j]
        j += 1
    entries = [_mesh.axis_tuple(spec[d], "spec entry") for d in group_in]
    if any(entries[1:]):
      raise ValueError(
        f"reshaping {shape} sharded as {PartitionSpec(*spec)} to {new_shape}: dimensions "
        f"{group_in} become {group_out}, and only the first of them may be sharded (got "
        f"{[spec[d] for d in group_in]}); shard the operand differently"
      )
    if entries[0]:
      shards = int(np.prod([axis_sizes[a] for a in entries[0]]))
      if new_shape[group_out[0]] % shards:
        raise ValueError(
          f"reshaping {shape} sharded as {PartitionSpec(*spec)} to {new_shape}: dimension "
          f"{group_out[0]} (size {new_shape[group_out[0]]}) cannot hold the {shards} shards "
          f"of dimension {group_in[0]}"
        )
      out[group_out[0]] = _mesh.spec_entry(entries[0])
  return PartitionSpec(*out)


def reshape(x, new_shape):
  """``jnp.reshape(x, new_shape)``; under Explicit mesh axes with the output sharding named,
  which JAX asks for when a reshape splits or merges more than one pair of dimensions."""
  new_shape = tuple(new_shape)
  sharding = explicit_sharding(x)
  if sharding is None or 0 in x.shape:
    return jnp.reshape(x, new_shape)
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
  spec = reshape_spec(x.shape, sharding.spec, new_shape, sizes)
  return jnp.reshape(x, new_shape, out_sharding=sharding.update(spec=spec))


def reshaped_sharding(sharding: NamedSharding | None, shape, new_shape):
  """``sharding`` (of an array of ``shape``) carried through ``reshape`` to ``new_shape``."""
  if sharding is None:
    return None
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
  return sharding.update(spec=reshape_spec(shape, sharding.spec, new_shape, sizes))


def match_sharding(x, sharding: NamedSharding | None):
  """``x`` resharded to ``sharding`` (Explicit axes) where it differs; ``x`` otherwise."""
  if sharding is None:
    return x
  current = explicit_sharding(x)
  if current is not None and current.spec == sharding.spec:
    return x
  return jax.sharding.reshard(x, sharding)
