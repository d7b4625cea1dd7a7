"""Global amaxes inside ``shard_map``, the checks of ``amax_axes``, and per-shard random keys."""

from __future__ import annotations

import jax
from jax import lax

from te_adapters.core.sharding import _mesh, _spmd_plan

__all__ = ["global_amax", "check_block_scaled", "check_amax_axes", "shard_key"]


def global_amax(a, x, role: str, plan: _spmd_plan.SpmdPlan, state_varying: frozenset | None):
  """The amax of the global tensor from ``a = amax(local x)``.

  Args:
    a: float32 (1,), the amax of ``x`` as this device sees it.
    x: the operand (only its type is read).
    role: "x", "kernel" or "grad".
    plan: the GEMM's ``SpmdPlan``.
    state_varying: for a stateful recipe, the axes the role's state varies over; ``None`` for a
      stateless recipe.
  """
  requested = plan.role_amax_axes(role)
  if requested is not None:
    _mesh.check_axis_names(requested, f"amax_axes for {role!r}")
  manual = _mesh.manual_axes()
  if not manual:
    return a  # jit or eager: the array is global and so is its amax
  if state_varying is not None and not _mesh.checks_vma():
    raise ValueError(
      "DelayedScaling inside shard_map(check_vma=False) is not supported: shard_map would "
      "sum the replicated state's gradient over the mesh, adding up scales and amaxes. "
      "Use shard_map's default check_vma=True."
    )
  vma = _mesh.varying_axes(x)
  if requested is None:
    if state_varying is not None:
      axes = vma - state_varying
    else:
      axes = vma if _mesh.checks_vma() else manual
  else:
    axes = frozenset(requested) & manual
    if _mesh.checks_vma():
      axes &= vma  # over an axis x does not vary over, its amax is the same everywhere already
    if state_varying is not None:
      missing = vma - axes - state_varying
      if missing:
        raise ValueError(
          f"amax_axes for {role!r} leaves out mesh axes {sorted(missing)} that the {role} "
          "operand varies over while its DelayedScaling state does not: devices would compute "
          "different states. Add them to amax_axes (or leave amax_axes=None)."
        )
  if not axes:
    return a
  # The core's amax is inf, never NaN, for a tensor holding NaN: a plain max reduces it.
  return lax.pmax(a, _mesh.in_mesh_order(axes))


def check_block_scaled(recipe, plan: _spmd_plan.SpmdPlan) -> None:
  """Refuses what block-scaled recipes do not support on meshes yet, naming it.

  Their block scales are local (a shard holds whole blocks when its size is a multiple of the
  block), so MXFP8 and FP8 1x128/128x128 need no amax reduction and ignore ``amax_axes``;
  NVFP4's per-tensor amax is reduced like the per-tensor recipes' (``global_amax``).
  """
  if plan.kernel_all_gather is not None:
    raise NotImplementedError(
      f"{type(recipe).__name__}: kernel_all_gather is implemented for per-tensor FP8 recipes "
      "(DelayedScaling, Float8CurrentScaling) only"
    )
  check_amax_axes(plan)


def check_amax_axes(plan: _spmd_plan.SpmdPlan) -> None:
  """Raises where ``amax_axes`` names a mesh axis that the current mesh lacks."""
  for role, axes in zip(_spmd_plan.ROLES, plan.amax_axes, strict=True):
    if axes is not None:
      _mesh.check_axis_names(axes, f"amax_axes for {role!r}")


def shard_key(key, x):
  """Inside ``shard_map``, ``key`` folded with this device's index along the axes ``x`` varies
  over (every manual axis under ``check_vma=False``), so that shards draw different random bits;
  ``key`` itself elsewhere. Devices holding the same data (``x`` replicated) keep one key."""
  manual = _mesh.manual_axes()
  if key is None or not manual:
    return key
  axes = _mesh.in_mesh_order(_mesh.varying_axes(x) if _mesh.checks_vma() else manual)
  if not axes:
    return key
  return jax.random.fold_in(key, lax.axis_index(axes))
