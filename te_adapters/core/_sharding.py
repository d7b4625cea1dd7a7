"""The quantized GEMM on JAX's SPMD engine: global amaxes, sharded transposes, FSDP FP8 gathers.

Per-tensor scaling needs the amax of the *global* tensor, so that every device uses one scale and
the sharded result equals the single-device one.

- Under ``jax.jit`` with sharded inputs (``NamedSharding``, Auto or Explicit mesh axes), JAX sees
  global arrays: ``max(|x|)`` is already global, and XLA inserts the all-reduce. Nothing to do,
  except giving the backward GEMMs the primal operands' shardings, as JAX's own ``dot_general``
  transpose does (Explicit axes require it).
- Inside ``shard_map`` every device sees its shard. The amax of each operand is max-reduced over
  the manual mesh axes it varies over (or over the axes the caller names), and the custom VJP
  reduces cotangents the way JAX's implicit ``pvary`` transposes would.

``kernel_all_gather`` (FSDP) quantizes the kernel shard by shard and all-gathers the FP8 bytes:
half of bf16's traffic. The FP8 data travel as ``uint8`` so no backend can widen them before the
collective (XLA's CPU backend turns FP8 GEMM operands into float16 early). The gathered FP8
kernel is kept for the backward pass (under a remat policy that saves only the named FP8 shard,
it is gathered again there instead), and the kernel gradient is reduce-scattered onto the shard.

All mesh information comes from the arguments and from JAX's own mesh context
(``jax.set_mesh``, ``shard_map``); this module keeps no state.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["SpmdPlan", "make_plan", "Collective", "hlo_collectives"]

_ROLES = ("x", "kernel", "grad")


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
  """

  amax_axes: tuple[tuple[str, ...] | None, ...] = (None, None, None)
  kernel_all_gather: tuple[tuple[str, ...], ...] | None = None
  kernel_mesh: Any = None
  out_sharding: Any = None

  def role_amax_axes(self, role: str) -> tuple[str, ...] | None:
    return self.amax_axes[_ROLES.index(role)]


def _axis_tuple(value, what: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise TypeError(f"{what} must be a mesh axis name or a sequence of names, got {value!r}")


def _normalize_amax_axes(amax_axes) -> tuple[tuple[str, ...] | None, ...]:
  if amax_axes is None:
    return (None, None, None)
  if isinstance(amax_axes, Mapping):
    unknown = sorted(set(amax_axes) - set(_ROLES))
    if unknown:
      raise ValueError(f"amax_axes keys must be among {_ROLES}, got {unknown}")
    return tuple(
        None if amax_axes.get(r) is None else _axis_tuple(amax_axes[r], f"amax_axes[{r!r}]")
        for r in _ROLES
    )
  axes = _axis_tuple(amax_axes, "amax_axes")
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
  dims = tuple(_axis_tuple(e, "kernel_all_gather entries") for e in entries)
  if not any(dims):
    raise ValueError(f"kernel_all_gather {spec} names no mesh axis to gather over")
  return dims, mesh


def _merged(entries, what: str, dims):
  """The spec entry of dims merged by a reshape: only the first (most major) may be sharded."""
  entries = [_axis_tuple(e, what) for e in entries]
  if any(entries[1:]):
    raise ValueError(
        f"{what}: dimensions {list(dims)} are merged into one by the contracting-last GEMM "
        f"layout, and only the first of them may be sharded; got {entries}"
    )
  return entries[0] if entries else ()


def _spec_entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def plan_for_tn_layout(plan: SpmdPlan, dn, lhs_ndim: int, rhs_ndim: int) -> SpmdPlan:
  """``plan`` for the contracting-last operands: x3 (B, M, K), w3 (B, N, K), y3 (B, M, N).

  The kernel's FSDP dims and the output sharding are mapped through the transpose and reshape
  that make w3 and y3 from the kernel and the output.
  """
  (lc, rc), (lb, rb) = dn
  lf = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
  lead = [rb] if lb else []
  gather = plan.kernel_all_gather
  if gather is not None:
    gather = tuple(
        _merged([gather[d] for d in group], "kernel_all_gather", group)
        for group in lead + [rf, rc]
    )
  out = plan.out_sharding
  if out is not None:
    spec = out.spec if isinstance(out, NamedSharding) else out
    entries = tuple(spec) + (None,) * (len(lb) + len(lf) + len(rf) - len(tuple(spec)))
    sizes = ([len(lb)] if lb else [0]) + [len(lf), len(rf)]
    starts = np.cumsum([0] + sizes)
    groups = [list(range(starts[i], starts[i + 1])) for i in range(3)]
    merged = [
        _spec_entry(_merged([entries[d] for d in g], "out_sharding", g))
        for g in (groups if lb else groups[1:])
    ]
    spec = PartitionSpec(*merged)
    out = out.update(spec=spec) if isinstance(out, NamedSharding) else spec
  return dataclasses.replace(plan, kernel_all_gather=gather, out_sharding=out)


def make_plan(amax_axes=None, kernel_all_gather=None, out_sharding=None, *, rhs_ndim: int):
  """Validates the SPMD keywords of ``dot_general`` into a hashable ``SpmdPlan``."""
  dims, mesh = _normalize_kernel_all_gather(kernel_all_gather, rhs_ndim)
  return SpmdPlan(
      amax_axes=_normalize_amax_axes(amax_axes),
      kernel_all_gather=dims,
      kernel_mesh=mesh,
      out_sharding=out_sharding,
  )


# --------------------------------------------------------------------------- mesh context


def _abstract_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def _manual_axes() -> frozenset:
  """The mesh axes that are manual here (inside ``shard_map``); empty under plain ``jit``."""
  mesh = _abstract_mesh()
  return frozenset(mesh.manual_axes) if mesh is not None else frozenset()


def _checks_vma() -> bool:
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


def _in_mesh_order(axes) -> tuple[str, ...]:
  mesh = _abstract_mesh()
  names = tuple(mesh.axis_names) if mesh is not None else ()
  return tuple(n for n in names if n in axes) + tuple(sorted(a for a in axes if a not in names))


def _check_axis_names(axes: Sequence[str], what: str) -> None:
  mesh = _abstract_mesh()
  if mesh is None:
    return
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(
        f"{what} names mesh axes {unknown} that the current mesh {tuple(mesh.axis_names)} lacks"
    )


# --------------------------------------------------------------------------- amax reduction


def global_amax(a, x, role: str, plan: SpmdPlan, state_varying: frozenset | None):
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
    _check_axis_names(requested, f"amax_axes for {role!r}")
  manual = _manual_axes()
  if not manual:
    return a  # jit or eager: the array is global and so is its amax
  stateful = state_varying is not None
  if stateful and not _checks_vma():
    raise ValueError(
        "DelayedScaling inside shard_map(check_vma=False) is not supported: shard_map would "
        "sum the replicated state's gradient over the mesh, adding up scales and amaxes. "
        "Use shard_map's default check_vma=True."
    )
  vma = varying_axes(x)
  if requested is None:
    axes = (vma - state_varying) if stateful else (vma if _checks_vma() else manual)
  else:
    axes = frozenset(requested) & manual
    if _checks_vma():
      axes &= vma  # over an axis x does not vary over, its amax is the same everywhere already
    if stateful:
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
  return lax.pmax(a, _in_mesh_order(axes))


def check_block_scaled(recipe, plan: SpmdPlan) -> None:
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


def check_amax_axes(plan: SpmdPlan) -> None:
  """Raises where ``amax_axes`` names a mesh axis that the current mesh lacks."""
  for role, axes in zip(_ROLES, plan.amax_axes, strict=True):
    if axes is not None:
      _check_axis_names(axes, f"amax_axes for {role!r}")


def shard_key(key, x):
  """Inside ``shard_map``, ``key`` folded with this device's index along the axes ``x`` varies
  over (every manual axis under ``check_vma=False``), so that shards draw different random bits;
  ``key`` itself elsewhere. Devices holding the same data (``x`` replicated) keep one key."""
  manual = _manual_axes()
  if key is None or not manual:
    return key
  axes = _in_mesh_order(varying_axes(x) if _checks_vma() else manual)
  if not axes:
    return key
  return jax.random.fold_in(key, lax.axis_index(axes))


# --------------------------------------------------------------------------- explicit reshapes


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
      n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
      if t == jax.sharding.AxisType.Explicit
  }
  spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
  if not any(set(_axis_tuple(e, "spec entry")) & explicit for e in spec):
    return None
  return sharding.update(spec=PartitionSpec(*spec))


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
    entries = [_axis_tuple(spec[d], "spec entry") for d in group_in]
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
      out[group_out[0]] = _spec_entry(entries[0])
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


# --------------------------------------------------------------------------- cotangents


def type_witness(x):
  """Inside ``shard_map``, a zero-size array that varies over the axes ``x`` varies over.

  It carries the primal's type into the custom VJP's backward pass; ``None`` elsewhere.
  """
  if not _manual_axes() or not _checks_vma():
    return None
  return lax.pcast(jnp.zeros((0,), jnp.float32), _in_mesh_order(varying_axes(x)), to="varying")


def match_cotangent(ct, witness):
  """Sums ``ct`` over the manual axes its primal does not vary over (``pvary``'s transpose)."""
  if witness is None:
    return ct  # under jit, or shard_map(check_vma=False) whose own transpose does the sums
  primal = varying_axes(witness)
  extra = varying_axes(ct) - primal
  if extra:
    ct = lax.psum(ct, _in_mesh_order(extra))
  missing = primal - varying_axes(ct)
  if missing:
    ct = lax.pcast(ct, _in_mesh_order(missing), to="varying")
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


# --------------------------------------------------------------------------- FSDP FP8 gather


def _operand_mesh(operand):
  sharding = getattr(jax.typeof(operand), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def _gather_mode(plan: SpmdPlan, kernel) -> str:
  axes = {a for dim in plan.kernel_all_gather for a in dim}
  manual = _manual_axes()
  if axes <= manual:
    return "manual"
  if axes & manual:
    raise ValueError(
        f"kernel_all_gather mixes manual axes {sorted(axes & manual)} with axes "
        f"{sorted(axes - manual)} that are not manual here"
    )
  mesh = plan.kernel_mesh or _abstract_mesh() or _operand_mesh(kernel)
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


def _constraint(plan: SpmdPlan, spec: PartitionSpec):
  return NamedSharding(plan.kernel_mesh, spec) if plan.kernel_mesh is not None else spec


def _shard_spec(plan: SpmdPlan) -> PartitionSpec:
  entries = [dim if dim else PartitionSpec.UNCONSTRAINED for dim in plan.kernel_all_gather]
  return PartitionSpec(*[e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries])


def _gathered_spec(plan: SpmdPlan) -> PartitionSpec:
  return PartitionSpec(
      *[None if dim else PartitionSpec.UNCONSTRAINED for dim in plan.kernel_all_gather]
  )


def _explicit_spec_without(q, plan: SpmdPlan) -> PartitionSpec:
  spec = tuple(jax.typeof(q).sharding.spec)
  spec = spec + (None,) * (q.ndim - len(spec))
  out = []
  for d, (entry, gather) in enumerate(zip(spec, plan.kernel_all_gather, strict=True)):
    have = _axis_tuple(entry, "spec entry")
    if gather and not set(gather) <= set(have):
      raise ValueError(
          f"kernel_all_gather gathers kernel dim {d} over {gather}, but the kernel's sharding "
          f"on that dim is {entry!r}"
      )
    rest = tuple(a for a in have if a not in gather)
    out.append(rest[0] if len(rest) == 1 else (rest or None))
  return PartitionSpec(*out)


def _check_manual_gather(kernel, plan: SpmdPlan) -> None:
  if not _checks_vma():
    return
  vma = varying_axes(kernel)
  for d, axes in enumerate(plan.kernel_all_gather):
    if axes and not set(axes) <= vma:
      raise ValueError(
          f"kernel_all_gather gathers kernel dim {d} over {axes}, but inside this shard_map "
          f"the kernel varies only over {sorted(vma)}: is it sharded that way (in_specs)?"
      )


def gathered_kernel_type(kernel, plan: SpmdPlan):
  """``kernel``, or inside ``shard_map`` with an FP8 gather, the type of the gathered kernel."""
  if plan.kernel_all_gather is None or _gather_mode(plan, kernel) != "manual":
    return kernel
  _check_manual_gather(kernel, plan)
  mesh = _abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  shape = tuple(
      n * int(np.prod([sizes[a] for a in axes]))
      for n, axes in zip(kernel.shape, plan.kernel_all_gather, strict=True)
  )
  return jax.ShapeDtypeStruct(shape, kernel.dtype)


def gather_kernel(q, plan: SpmdPlan):
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


def scatter_kernel_grad(dw, shard, plan: SpmdPlan):
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


# --------------------------------------------------------------------------- HLO inspection


class Collective(NamedTuple):
  """One collective in compiled HLO text.

  Attributes:
    op: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` or
      ``collective-permute`` (asynchronous ``-start`` forms are reported under these names).
    arrays: ``(dtype, shape)`` of each array in the op's result type; for a ``-start`` op the
      operand's arrays come first.
    line: the HLO instruction.
  """

  op: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]
  line: str


_COLLECTIVE_RE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def hlo_collectives(hlo_text: str) -> list[Collective]:
  """The collectives of compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

  Example:
    >>> import jax, te_adapters as ta
    >>> ta.core.hlo_collectives(jax.jit(lambda x: x + 1).lower(1.0).compile().as_text())
    []
  """
  found = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE_RE.search(line)
    if m is None:
      continue
    arrays = tuple(
        (dtype, tuple(int(n) for n in dims.split(",") if n))
        for dtype, dims in _ARRAY_RE.findall(m.group("type"))
    )
    found.append(Collective(m.group("op"), arrays, line.strip()))
  return found
