"""FSDP with ``kernel_all_gather``: the kernel quantized shard by shard, its FP8 bytes
all-gathered, and the kernel gradient reduce-scattered onto the shard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core.sharding import _mesh, _spmd_plan

__all__ = ["gathered_kernel_type", "gather_kernel", "scatter_kernel_grad", "whole_where_gathered"]


def _operand_mesh(operand):
  sharding = getattr(jax.typeof(operand), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def _gather_axes(plan: _spmd_plan.SpmdPlan) -> tuple[tuple[str, ...], ...]:
  """``plan.kernel_all_gather``, never None here: the public functions return early then."""
  axes = plan.kernel_all_gather
  assert axes is not None
  return axes


def _gather_mode(plan: _spmd_plan.SpmdPlan, kernel) -> str:
  axes = {a for dim in _gather_axes(plan) for a in dim}
  manual = _mesh.manual_axes()
  if axes <= manual:
    return "manual"
  if axes & manual:
    raise ValueError(
      f"kernel_all_gather mixes manual axes {sorted(axes & manual)} with axes "
      f"{sorted(axes - manual)} that are not manual here"
    )
  mesh = plan.kernel_mesh or _mesh.abstract_mesh() or _operand_mesh(kernel)
  if mesh is None:
    raise ValueError(
      "kernel_all_gather needs a mesh: call under jax.set_mesh(mesh), pass a NamedSharding, "
      "or call inside shard_map"
    )
  unknown = sorted(axes - set(mesh.axis_names))
  if unknown:
    raise ValueError(
      f"kernel_all_gather names mesh axes {unknown} that the mesh {tuple(mesh.axis_names)} lacks"
    )
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if all(types[a] == jax.sharding.AxisType.Explicit for a in axes):
    return "explicit"
  return "auto"


def _constraint(plan: _spmd_plan.SpmdPlan, spec: PartitionSpec):
  return NamedSharding(plan.kernel_mesh, spec) if plan.kernel_mesh is not None else spec


def _shard_spec(plan: _spmd_plan.SpmdPlan) -> PartitionSpec:
  entries = [dim if dim else PartitionSpec.UNCONSTRAINED for dim in _gather_axes(plan)]
  return PartitionSpec(*[e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries])


def _gathered_spec(plan: _spmd_plan.SpmdPlan) -> PartitionSpec:
  return PartitionSpec(
    *[None if dim else PartitionSpec.UNCONSTRAINED for dim in _gather_axes(plan)]
  )


def _explicit_spec_without(q, plan: _spmd_plan.SpmdPlan) -> PartitionSpec:
  spec = tuple(jax.typeof(q).sharding.spec)
  spec = spec + (None,) * (q.ndim - len(spec))
  out = []
  for d, (entry, gather) in enumerate(zip(spec, _gather_axes(plan), strict=True)):
    have = _mesh.axis_tuple(entry, "spec entry")
    if gather and not set(gather) <= set(have):
      raise ValueError(
        f"kernel_all_gather gathers kernel dim {d} over {gather}, but the kernel's sharding "
        f"on that dim is {entry!r}"
      )
    rest = tuple(a for a in have if a not in gather)
    out.append(rest[0] if len(rest) == 1 else (rest or None))
  return PartitionSpec(*out)


def _check_manual_gather(kernel, plan: _spmd_plan.SpmdPlan) -> None:
  if not _mesh.checks_vma():
    return
  vma = _mesh.varying_axes(kernel)
  for d, axes in enumerate(_gather_axes(plan)):
    if axes and not set(axes) <= vma:
      raise ValueError(
        f"kernel_all_gather gathers kernel dim {d} over {axes}, but inside this shard_map "
        f"the kernel varies only over {sorted(vma)}: is it sharded that way (in_specs)?"
      )


def gathered_kernel_type(kernel, plan: _spmd_plan.SpmdPlan):
  """``kernel``, or inside ``shard_map`` with an FP8 gather, the type of the gathered kernel."""
  if plan.kernel_all_gather is None or _gather_mode(plan, kernel) != "manual":
    return kernel
  _check_manual_gather(kernel, plan)
  mesh = _mesh.abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  shape = tuple(
    n * int(np.prod([sizes[a] for a in axes]))
    for n, axes in zip(kernel.shape, plan.kernel_all_gather, strict=True)
  )
  return jax.ShapeDtypeStruct(shape, kernel.dtype)


def gather_kernel(q, plan: _spmd_plan.SpmdPlan):
  """All-gathers the kernel shard ``q`` over ``plan.kernel_all_gather``; FP8 as bytes."""
  if plan.kernel_all_gather is None:
    return q
  mode = _gather_mode(plan, q)
  as_bytes = np.dtype(q.dtype).itemsize == 1
  u = lax.bitcast_convert_type(q, jnp.uint8) if as_bytes else q
  if mode == "manual":
    _check_manual_gather(u, plan)
    for d, axes in enumerate(plan.kernel_all_gather):
      if axes:
        u = lax.all_gather(u, axes if len(axes) > 1 else axes[0], axis=d, tiled=True)
  elif mode == "explicit":
    u = jax.sharding.reshard(u, jax.typeof(u).sharding.update(spec=_explicit_spec_without(u, plan)))
  else:
    u = lax.with_sharding_constraint(u, _constraint(plan, _shard_spec(plan)))
    u = lax.with_sharding_constraint(u, _constraint(plan, _gathered_spec(plan)))
  return lax.bitcast_convert_type(u, q.dtype) if as_bytes else u


def scatter_kernel_grad(dw, shard, plan: _spmd_plan.SpmdPlan):
  """Reduce-scatters the gathered kernel's gradient back onto the kernel shard's layout."""
  if plan.kernel_all_gather is None:
    return dw
  mode = _gather_mode(plan, shard)
  if mode == "manual":
    for d, axes in reversed(list(enumerate(plan.kernel_all_gather))):
      if axes:
        dw = lax.psum_scatter(
          dw, axes if len(axes) > 1 else axes[0], scatter_dimension=d, tiled=True
        )
    return dw
  if mode == "explicit":
    return jax.sharding.reshard(dw, jax.typeof(shard).sharding)
  return lax.with_sharding_constraint(dw, _constraint(plan, _shard_spec(plan)))


def whole_where_gathered(data, plan: _spmd_plan.SpmdPlan, kernel_dim: int, dim: int):
  """Under Auto mesh axes, ``data`` (an FP8 copy of the operand that a GEMM contracts with the
  gathered kernel) constrained whole on its dim ``dim``, where the kernel's dim ``kernel_dim``
  (of the contracting-last layout) is gathered; ``data`` itself elsewhere.

  The gathered kernel is whole on that dim (``gather_kernel``), so the GEMM's sum over it need
  not be split over devices. Left open, XLA's partitioner could shard both copies of the operand
  over the gather's axes there (from the weight gradient, sharded like the kernel): the GEMM
  then sums partial products over devices (an all-reduce of its output, in the output's dtype)
  on the gathered kernel sliced again, where one device computes it whole.
  """
  axes = None if plan.kernel_all_gather is None else plan.kernel_all_gather[kernel_dim]
  if not axes or _gather_mode(plan, data) != "auto":
    return data
  spec = [None if d == dim else PartitionSpec.UNCONSTRAINED for d in range(data.ndim)]
  return lax.with_sharding_constraint(data, _constraint(plan, PartitionSpec(*spec)))
