"""The mesh context a GEMM is traced in: manual axes, varying axes, mesh-axis names."""

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = [
  "abstract_mesh",
  "manual_axes",
  "checks_vma",
  "varying_axes",
  "in_mesh_order",
  "check_axis_names",
  "axis_tuple",
  "spec_entry",
]


def abstract_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def manual_axes() -> frozenset:
  """The mesh axes that are manual here (inside ``shard_map``); empty under plain ``jit``."""
  mesh = abstract_mesh()
  return frozenset(mesh.manual_axes) if mesh is not None else frozenset()


def checks_vma() -> bool:
  """Whether the enclosing ``shard_map`` tracks varying axes (``check_vma=True``, the default)."""
  from jax._src import config  # the flag shard_map sets while tracing its body (private API)

  flag = getattr(config, "_check_vma", None)
  return True if flag is None else bool(flag.value)


def varying_axes(x) -> frozenset:
  """The manual mesh axes along which ``x`` may differ between devices (its type's vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def in_mesh_order(axes) -> tuple[str, ...]:
  mesh = abstract_mesh()
  names = tuple(mesh.axis_names) if mesh is not None else ()
  return tuple(n for n in names if n in axes) + tuple(sorted(a for a in axes if a not in names))


def check_axis_names(axes: Sequence[str], what: str) -> None:
  mesh = abstract_mesh()
  if mesh is None:
    return
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(
      f"{what} names mesh axes {unknown} that the current mesh {tuple(mesh.axis_names)} lacks"
    )


def axis_tuple(value, what: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise TypeError(f"{what} must be a mesh axis name or a sequence of names, got {value!r}")


def spec_entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)
