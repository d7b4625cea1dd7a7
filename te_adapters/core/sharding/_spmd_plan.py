"""The SPMD plan of one GEMM: ``amax_axes``, ``kernel_all_gather`` and ``out_sharding``, checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core.sharding import _mesh

__all__ = ["ROLES", "SpmdPlan", "plan_for_tn_layout", "make_plan"]


ROLES = ("x", "kernel", "grad")


@dataclasses.dataclass(frozen=True)
class SpmdPlan:
  """How one quantized GEMM runs on a mesh; hashable, a static argument of the custom VJP.

  Attributes:
    amax_axes: per role (x, kernel, grad), the mesh axes whose amaxes are max-reduced inside
      ``shard_map``, or ``None`` for "every manual axis the operand varies over".
    kernel_all_gather: per kernel dimension, the mesh axes the FSDP kernel is sharded over and
      gathered from (empty tuple: not gathered), or ``None`` for no FP8 gather.
    kernel_mesh: the mesh of a ``NamedSharding`` given as ``kernel_all_gather``, else ``None``.
    out_sharding: passed to the forward ``lax.dot_general``.
    sequence: sequence parallelism inside ``shard_map``, ``(mode, axis)``: ``"all_gather"``
      (the input's rows all-gathered over ``axis`` in FP8 before the GEMM, the input gradient
      reduce-scattered back) or ``"reduce_scatter"`` (the output's partial sums reduce-scattered
      over its rows, the output gradient all-gathered in FP8); None: neither.
  """

  amax_axes: tuple[tuple[str, ...] | None, ...] = (None, None, None)
  kernel_all_gather: tuple[tuple[str, ...], ...] | None = None
  kernel_mesh: Any = None
  out_sharding: Any = None
  sequence: tuple[str, str] | None = None

  def role_amax_axes(self, role: str) -> tuple[str, ...] | None:
    return self.amax_axes[ROLES.index(role)]


def _normalize_amax_axes(amax_axes) -> tuple[tuple[str, ...] | None, ...]:
  if amax_axes is None:
    return (None, None, None)
  if isinstance(amax_axes, Mapping):
    unknown = sorted(set(amax_axes) - set(ROLES))
    if unknown:
      raise ValueError(f"amax_axes keys must be among {ROLES}, got {unknown}")
    return tuple(
      None if amax_axes.get(r) is None else _mesh.axis_tuple(amax_axes[r], f"amax_axes[{r!r}]")
      for r in ROLES
    )
  axes = _mesh.axis_tuple(amax_axes, "amax_axes")
  return (axes, axes, axes)


def _normalize_kernel_all_gather(spec, rhs_ndim: int):
  if spec is None:
    return None, None
  mesh = None
  if isinstance(spec, NamedSharding):
    mesh, spec = spec.mesh, spec.spec
  if not isinstance(spec, (PartitionSpec, tuple, list)):
    raise TypeError(
      "kernel_all_gather must be a PartitionSpec (or NamedSharding) naming, per kernel "
      f"dimension, the mesh axes the kernel is sharded over; got {spec!r}"
    )
  entries = tuple(spec)
  if len(entries) > rhs_ndim:
    raise ValueError(
      f"kernel_all_gather {spec} has {len(entries)} entries but the kernel has {rhs_ndim} dims"
    )
  entries = entries + (None,) * (rhs_ndim - len(entries))
  dims = tuple(_mesh.axis_tuple(e, "kernel_all_gather entries") for e in entries)
  if not any(dims):
    raise ValueError(f"kernel_all_gather {spec} names no mesh axis to gather over")
  return dims, mesh


def _merged(entries, what: str, dims, layer: str):
  """The spec entry of dims merged by a reshape: only the first (most major) may be sharded."""
  entries = [_mesh.axis_tuple(e, what) for e in entries]
  if any(entries[1:]):
    raise ValueError(
      f"{layer}: {what} shards dimensions {list(dims)} ({entries}), which the GEMM flattens "
      "into one dimension; a flattened dimension keeps whole shards only when one of them, "
      "ordered first, is sharded. Shard one of these dimensions only, or leave this layer "
      "unquantized (an adapter's conversion: its filter)"
    )
  return entries[0] if entries else ()


def plan_for_tn_layout(plan: SpmdPlan, layout, layer: str = "the GEMM") -> SpmdPlan:
  """``plan`` for the contracting-last operands: x3 (B, M, K), w3 (B, N, K), y3 (B, M, N).

  The kernel's FSDP dims and the output sharding are mapped through the transpose and reshape
  that make w3 and y3 from the kernel and the output. ``layout`` is the GEMM's
  ``gemm.GemmLayout`` (its ``dn``, ``rhs_free`` and output order, sharded dims first: the layout
  arithmetic is done there once); ``layer`` names the GEMM in an error.
  """
  (_, rc), (lb, rb) = layout.dn
  rf = list(layout.rhs_free)
  lead = [rb] if lb else []
  gather = plan.kernel_all_gather
  if gather is not None:
    gather = tuple(
      _merged([gather[d] for d in group], "kernel_all_gather", group, layer)
      for group in lead + [rf, rc]
    )
  out = plan.out_sharding
  if out is not None:
    spec = out.spec if isinstance(out, NamedSharding) else out
    entries = layout.in_gemm_order(tuple(spec))
    sizes = [len(lb), len(layout.lhs_free), len(rf)]
    starts = np.cumsum([0] + sizes)
    groups = [list(range(starts[i], starts[i + 1])) for i in range(3)]
    merged = [
      _mesh.spec_entry(
        _merged([entries[d] for d in g], "out_sharding", [layout.out_order[d] for d in g], layer)
      )
      for g in (groups if lb else groups[1:])
    ]
    spec = PartitionSpec(*merged)
    out = out.update(spec=spec) if isinstance(out, NamedSharding) else spec
  return dataclasses.replace(plan, kernel_all_gather=gather, out_sharding=out)


SEQUENCE_MODES = ("all_gather", "reduce_scatter")


def _normalize_sequence(sequence_parallel, kernel_all_gather):
  if sequence_parallel is None:
    return None
  if (
    not isinstance(sequence_parallel, (tuple, list))
    or len(sequence_parallel) != 2
    or sequence_parallel[0] not in SEQUENCE_MODES
    or not isinstance(sequence_parallel[1], str)
  ):
    raise ValueError(
      "sequence_parallel must be (mode, axis) with mode 'all_gather' (column-parallel: the "
      "input's rows gathered) or 'reduce_scatter' (row-parallel: the output's rows scattered) "
      f"and axis a mesh axis name, got {sequence_parallel!r}"
    )
  mode, axis = sequence_parallel
  if axis not in _mesh.manual_axes():
    raise ValueError(
      f"sequence_parallel over {axis!r} runs inside shard_map with {axis!r} among its manual "
      f"axes (here: {sorted(_mesh.manual_axes())})"
    )
  if kernel_all_gather is not None:
    raise ValueError("sequence_parallel and kernel_all_gather cannot be combined in one GEMM")
  return (mode, axis)


def make_plan(
  amax_axes=None,
  kernel_all_gather=None,
  out_sharding=None,
  *,
  rhs_ndim: int,
  sequence_parallel=None,
):
  """Validates the SPMD keywords of ``dot_general`` into a hashable ``SpmdPlan``."""
  dims, mesh = _normalize_kernel_all_gather(kernel_all_gather, rhs_ndim)
  return SpmdPlan(
    amax_axes=_normalize_amax_axes(amax_axes),
    kernel_all_gather=dims,
    kernel_mesh=mesh,
    out_sharding=out_sharding,
    sequence=_normalize_sequence(sequence_parallel, kernel_all_gather),
  )
