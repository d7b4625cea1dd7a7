"""Partitioning rules for the extension's FFI calls, so sharded ``jit`` programs run them per shard.

XLA cannot split a custom call it knows nothing about: it would gather every operand onto every
device first. Each function here wraps one FFI call, given as a function of its operands, in
``jax.experimental.custom_partitioning``: the rule tells XLA's partitioner (Shardy, or GSPMD) how
the outputs are sharded given the operands' shardings, and what runs on each shard. Operands
sharded over Explicit mesh axes, whose types carry their shardings, take the same rule through
``shard_map`` instead.

- ``cast_transpose`` and ``amax`` serve every sharding. The FP8 copy keeps the input's sharding,
  the transposed copy has it with its last two dims swapped, and each shard's amax is
  max-reduced over the mesh axes that shard the input, so every device holds the amax of the
  whole tensor (what ``amax_axes`` does inside ``shard_map``). The per-batch cast keeps every
  dim's sharding too, its scales and amaxes sharded like the batch dim.
- The fused casts (``norm_cast``, ``act_cast``, ``dact_cast`` and the amax passes ``act_amax``,
  ``dact_amax``) keep the rows' sharding, and the columns' where a shard of them is one of the
  output's (the activation kernels with two activations gather them); amaxes are max-reduced and
  the bias gradient's column sums summed over the mesh axes that shard the rows.
- The rowwise passes (``row_col_amax``, ``rowwise_cast``) keep every dim's sharding: each row's
  amax is max-reduced over the mesh axes that shard the columns and each column's over those
  that shard the rows; the cast with per-row and per-column scales reduces nothing.
- ``gemm`` runs ``a (B, M, K) . b (B, N, K)^T -> (B, M, N)``. B and M keep ``a``'s sharding, N
  keeps ``b``'s. Where a mesh axis shards K in both operands, each device multiplies its slices
  into partial products of the sum dtype it is given, which are summed (``psum``) in that dtype
  and converted to the output dtype: in float32 (the default here), one device's result up to
  the order of the float32 additions; in the output dtype (``GemmConfig.partial_sums="output"``),
  as XLA's program of the same dot sums, with half the bytes for bfloat16. Such a shard's GEMM
  may run in chunks of its output rows, each summed as soon as it is computed so that its sum
  overlaps the next chunk's GEMM (``GemmConfig.sum_chunks``), and with SMs left free for the
  sums (``GemmConfig.comm_sm_margin``, the per-tensor GEMM's). A combination the
  kernel cannot take shard by shard is resharded (a dim gathered), and where a shard's shape is
  one the kernel refuses, XLA's GEMM runs on the shards instead; each is said once per distinct
  case by a ``ShardingFallbackWarning`` naming the GEMM and the shardings, and the layer
  (``warning_site``: the core's GEMMs and ``ragged_dot`` set it) or, for a kernel called
  directly, the kernels' function and its operands' shapes, issued at the user's line (per
  layer and case).

Under ``vmap`` a rule runs as a loop of its calls over the batch (``custom_partitioning`` has no
batching rule; the FFI calls loop under ``vmap`` on one device too).

Outside a ``jit`` over several devices (one device, or inside ``shard_map``, where every value is
a shard) the call runs as it is; inside ``shard_map`` its outputs are typed as varying over the
mesh axes its operands vary over, which an FFI call's outputs are not by themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core import sharding as core_sharding
from te_adapters.core.recipes import caller_site

__all__ = [
  "ShardingFallbackWarning",
  "act_amax",
  "act_cast",
  "amax",
  "block_scaled_gemm",
  "cast_transpose",
  "cast_transpose_per_batch",
  "dact_amax",
  "dact_cast",
  "gemm",
  "norm_cast",
  "row_col_amax",
  "rowwise_cast",
  "sum_chunk_rows",
  "tensor_fallback",
  "tensor_scaled_gemm",
  "warning_site",
]


class ShardingFallbackWarning(UserWarning):
  """An extension kernel inside a sharded program needed a reshard or XLA's GEMM on its shards.

  Issued once per layer and distinct case, naming the layer (where a GEMM of ``core.gemm``, the
  fused paths or ``ragged_dot`` traced the kernel, ``warning_site``; for a kernel of
  ``core.kernels`` called directly, the function and its operands' shapes), the GEMM and the
  shardings, at the user's line that traced it, though XLA's partitioner decides it later: a
  sharding the kernel cannot take shard by shard is resharded (a dim gathered), a shard shape it
  refuses runs as XLA's GEMM, and ``dot_general`` gathers an operand whose group of dims holds
  more than one sharded dim. The results are right either way; the warning says where
  communication or speed is lost. Make it an error to find such layouts while tuning a sharded
  model.

  Example:
    >>> import warnings, jax.numpy as jnp, te_adapters as ta
    >>> x, w, dn = jnp.ones((16, 32)), jnp.ones((32, 16)), (((1,), (0,)), ((), ()))
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("error", ta.core.ShardingFallbackWarning)
    ...   y = ta.core.dot_general(x, w, dn, recipe=ta.Float8CurrentScaling(), threshold=None)
    >>> y.shape  # unsharded: nothing to fall back from
    (16, 16)
  """


_WARNED: set = set()

# (layer, (filename, lineno, module) or None): set by ``warning_site`` while a GEMM is traced,
# carried into the partitioning callbacks as a static argument (they run at compile time, with
# none of the user's frames on the stack), and read there by ``_warn_once``.
_Site = tuple[str | None, tuple[str, int, str] | None]
_TRACED_SITE: contextvars.ContextVar[_Site | None] = contextvars.ContextVar("site", default=None)
_SPLIT_SITE: contextvars.ContextVar[_Site | None] = contextvars.ContextVar("split", default=None)


@contextlib.contextmanager
def warning_site(layer: str | None, line: tuple[str, int, str] | None) -> Iterator[None]:
  """The layer and the user's line ``(filename, lineno, module)`` that the kernels traced inside
  name in their ``ShardingFallbackWarning`` (said once per layer and case)."""
  token = _TRACED_SITE.set((layer, line))
  try:
    yield
  finally:
    _TRACED_SITE.reset(token)


@contextlib.contextmanager
def _splitting(site: _Site | None) -> Iterator[None]:
  token = _SPLIT_SITE.set(site)
  try:
    yield
  finally:
    _SPLIT_SITE.reset(token)


def _warn_once(key, message: str) -> None:
  layer, line = _SPLIT_SITE.get() or (None, None)
  key = (layer, key)
  if key in _WARNED:
    return
  _WARNED.add(key)
  if layer is not None:
    message = f"{layer}: {message}"
  if line is None:
    warnings.warn(message, ShardingFallbackWarning, stacklevel=2)
  else:
    filename, lineno, module = line
    warnings.warn_explicit(message, ShardingFallbackWarning, filename, lineno, module)


def _partitioned_here() -> bool:
  """Whether a call traced now may see operands spread over several devices of one program."""
  if jax.device_count() == 1:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  # Inside shard_map the values are shards already (its manual axes).
  return not (not mesh.empty and mesh.manual_axes)


def _as_varying(outs, args):
  """Inside ``shard_map``, ``outs`` typed as varying over every manual axis ``args`` vary over.

  An FFI call's outputs carry no varying axes, so without this a shard's result would pass for
  the same on every device, and the custom VJPs would skip the sums over devices it needs.
  """
  if not core_sharding.manual_axes() or not core_sharding.checks_vma():
    return outs
  axes = frozenset().union(*(core_sharding.varying_axes(a) for a in args))

  def vary(out):
    missing = axes - core_sharding.varying_axes(out)
    return lax.pcast(out, core_sharding.in_mesh_order(missing), to="varying") if missing else out

  return jax.tree.map(vary, outs)


def _spec(sharding, ndim: int) -> tuple[tuple[str, ...], ...]:
  """Per dim, the mesh axes that shard it (empty tuple: not sharded)."""
  if not isinstance(sharding, NamedSharding):
    return ((),) * ndim
  entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  out: list[tuple[str, ...]] = []
  for e in entries:
    if e is None or e is PartitionSpec.UNCONSTRAINED:
      out.append(())
    elif isinstance(e, str):
      out.append((e,))
    else:
      out.append(tuple(e))
  return tuple(out)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _named(mesh, spec) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(*[_entry(a) for a in spec]))


def _show(spec) -> str:
  return str(PartitionSpec(*[_entry(a) for a in spec]))


def _axes_of(spec) -> tuple[str, ...]:
  return tuple(a for dim in spec for a in dim)


def _shards(mesh, axes) -> int:
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  return math.prod(sizes[a] for a in axes)


def _letters(n: int, prefix: str) -> list[str]:
  return [f"{prefix}{i}" for i in range(n)]


# --------------------------------------------------------------------------- the two lowerings


def _explicit_mesh(args):
  """The mesh of the first operand sharded over Explicit mesh axes, else None."""
  for x in args:
    sharding = core_sharding.explicit_sharding(x)
    if sharding is not None:
      return sharding.mesh
  return None


def _explicit_spec(x, ndim):
  sharding = getattr(jax.typeof(x), "sharding", None)
  return _spec(sharding, ndim) if isinstance(sharding, NamedSharding) else ((),) * ndim


def _shardable(
  name: str,
  split: Callable,
  call: Callable,
  ndims: tuple[int, ...],
  sharding_rule: str,
  single: bool = False,
  wants_result: bool = False,
):
  """``call`` run per shard in a multi-device ``jit``, as ``split`` says.

  ``split(mesh, specs) -> (arg_specs, out_specs, per_shard)``: from the operands' specs (per dim,
  a tuple of mesh axes), the specs the operands are brought to, those of the outputs (a tuple of
  specs, of one spec where ``single``), and the function of one device's shards. Auto mesh axes go
  through ``custom_partitioning`` (XLA's partitioner picks the shardings); Explicit axes, whose
  shardings the operands' types carry, through ``shard_map``. With ``wants_result`` (``single``
  only), ``split(mesh, specs, result)`` also gets the spec Shardy's propagation chose for the
  output (what its users ask for; ``None`` where no partitioner chose one: GSPMD's inference, or
  Explicit axes without one named), which it may follow where it can serve it at no extra cost.
  ``name``: the kernels' function a user calls for it, which its warnings name with the
  operands' shapes where no GEMM of the core traced it (a direct call, ``_direct_site``).

  The function returned takes the operands and, with ``single``, ``out_sharding``: a
  ``NamedSharding`` on Explicit mesh axes that the output's type must have (a backward GEMM's,
  its primal's sharding). It runs through ``shard_map`` then, on that mesh where no operand is
  sharded; with ``wants_result`` its spec is the result ``split`` gets, and the output is
  resharded to it where ``split`` gives another.
  """

  def out_shardings(mesh, out_specs):
    shardings = tuple(_named(mesh, spec) for spec in out_specs)
    return shardings[0] if single else shardings

  @functools.partial(custom_partitioning, static_argnums=(0,))
  def rule(site, *args):
    del site  # the warnings' layer and line: read by the callbacks
    return call(*args)

  def specs_of(arg_shapes):
    return tuple(_spec(a.sharding, n) for a, n in zip(arg_shapes, ndims, strict=True))

  def split_for(site, mesh, arg_shapes, result_shape):
    with _splitting(site):
      if not wants_result:
        return split(mesh, specs_of(arg_shapes))
      result = None
      if result_shape is not None:
        result = _spec(result_shape.sharding, len(result_shape.shape))
      return split(mesh, specs_of(arg_shapes), result)

  def infer(site, mesh, arg_shapes, result_shape):
    del result_shape
    _, out_specs, _ = split_for(site, mesh, arg_shapes, None)
    return out_shardings(mesh, out_specs)

  def partition(site, mesh, arg_shapes, result_shape):
    arg_specs, out_specs, per_shard = split_for(site, mesh, arg_shapes, result_shape)
    args = tuple(_named(mesh, s) for s in arg_specs)
    return mesh, per_shard, out_shardings(mesh, out_specs), args

  rule.def_partition(
    partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule
  )
  # Under jit, so that eager calls on sharded arrays are partitioned too; looped under vmap.
  jitted = jax.jit(rule, static_argnums=0)

  @functools.cache
  def partitioned(site):
    return _looped_under_vmap(functools.partial(jitted, site))

  def explicit(site, mesh, *args, out_sharding=None):
    specs = tuple(_explicit_spec(x, n) for x, n in zip(args, ndims, strict=True))
    shapes = jax.eval_shape(call, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args))
    flat = (shapes,) if single else tuple(shapes)
    result = None if out_sharding is None else _spec(out_sharding, flat[0].ndim)
    with _splitting(site):
      arg_specs, out_specs, per_shard = (
        split(mesh, specs, result) if wants_result else split(mesh, specs)
      )
    args = tuple(
      x if have == want else jax.sharding.reshard(x, _named(mesh, want))
      for x, have, want in zip(args, specs, arg_specs, strict=True)
    )
    # Empty arrays (the (0,) placeholders of operands left out and of outputs not asked for)
    # stay out of the shard_map, made where they are used: XLA:GPU's compiler crashed (a
    # segfault in its Shardy export, two H100s) on a manual computation taking or returning one.
    kept = [i for i, a in enumerate(flat) if a.size]
    passed = [i for i, x in enumerate(args) if x.size]
    empty = {i: (x.shape, x.dtype) for i, x in enumerate(args) if not x.size}
    specs_out = out_shardings(mesh, out_specs)
    specs_out = (specs_out,) if single else tuple(specs_out)

    def kept_outputs(*xs):
      given = iter(xs)
      full = [jnp.zeros(*empty[i]) if i in empty else next(given) for i in range(len(args))]
      outs = per_shard(*full)
      outs = (outs,) if single else tuple(outs)
      return tuple(outs[i] for i in kept)

    mapped = jax.shard_map(
      kept_outputs,
      mesh=mesh,
      in_specs=tuple(_named(mesh, arg_specs[i]).spec for i in passed),
      out_specs=tuple(specs_out[i].spec for i in kept),
      check_vma=False,
    )
    got = iter(mapped(*(args[i] for i in passed)))
    outs = tuple(next(got) if a.size else jnp.zeros(a.shape, a.dtype) for a in flat)
    return outs[0] if single else outs

  def run(*args, out_sharding=None):
    assert out_sharding is None or single
    if not _partitioned_here():
      out = _as_varying(call(*args), args)
    else:
      site = _TRACED_SITE.get() or _direct_site(name, args)
      mesh = _explicit_mesh(args)
      if mesh is None and out_sharding is not None:
        mesh = out_sharding.mesh  # replicated operands on Explicit axes
      if mesh is None:
        return partitioned(site)(*args)
      out = explicit(site, mesh, *args, out_sharding=out_sharding)
    return core_sharding.match_sharding(out, out_sharding)

  return run


def _direct_site(name: str, args) -> _Site:
  """The site of a kernel called directly, outside the core's GEMMs (which name their layer,
  ``warning_site``): the kernels' function and its operands' shapes, at the user's line."""
  operands = ", ".join(f"{tuple(jnp.shape(a))} {jnp.result_type(a)}" for a in args)
  return f"te_adapters.core.kernels.{name} on {operands}", caller_site()


def _looped_under_vmap(fn: Callable) -> Callable:
  """``fn`` that ``vmap`` runs as a loop of its calls, one per batch index.

  ``custom_partitioning`` has no batching rule, so a vmapped rule would fail to trace; this one
  maps ``fn`` over the batched operands with ``lax.map`` (the unbatched ones passed to every
  call), each call partitioned as any other. The FFI calls inside loop under ``vmap`` anyway
  (``vmap_method="sequential"``), so it costs what the unpartitioned call does on one device.
  """

  @jax.custom_batching.custom_vmap
  def batchable(*args):
    return fn(*args)

  @batchable.def_vmap
  def _loop(axis_size, in_batched, *args):
    del axis_size
    batched = tuple(a for a, b in zip(args, in_batched, strict=True) if b)

    def one(slices):
      it = iter(slices)
      return batchable(*(next(it) if b else a for a, b in zip(args, in_batched, strict=True)))

    outs = lax.map(one, batched)
    return outs, jax.tree.map(lambda _: True, outs)

  return batchable


# --------------------------------------------------------------------------- cast and amax


def _amax_axes(mesh, spec, over_mesh: bool) -> tuple[str, ...]:
  """The mesh axes a shard's amax is max-reduced over: those that shard the input, or with
  ``over_mesh`` every axis of the mesh where any does (the same value: over an axis that does not
  shard the input each device holds the same data), so that the amaxes of a GEMM's operands,
  sharded over different axes, are reduced over the same devices and XLA can combine their
  all-reduces into one."""
  axes = _axes_of(spec)
  if over_mesh and axes:
    return tuple(mesh.axis_names)
  return axes


@functools.cache
def cast_transpose(
  call: Callable, ndim: int, rowwise: bool, colwise: bool, with_amax: bool, over_mesh: bool = False
):
  """``call(x, scale) -> (q, q_t, amax)`` (unrequested outputs of shape (0,)) made shardable.

  ``x`` has ``ndim`` dims; ``q`` is shaped like it, ``q_t`` with its last two dims swapped, and
  ``amax`` is the global max(|x|) on every device (reduced over every mesh axis with
  ``over_mesh``, see ``_amax_axes``).
  """

  def split(mesh, specs):
    spec = specs[0]
    swapped = spec[:-2] + (spec[-1], spec[-2]) if ndim >= 2 else ((),)
    axes = _amax_axes(mesh, spec, over_mesh)

    def per_shard(x, scale):
      q, q_t, a = call(x, scale)
      if with_amax and axes:
        a = lax.pmax(a, axes)  # the amax is inf (never NaN) for NaN input: a max reduces it
      return q, q_t, a

    outs = (spec if rowwise else ((),), swapped if colwise else ((),), ((),))
    return (spec, ((),)), outs, per_shard

  dims = _letters(ndim, "d")
  q = " ".join(dims) if rowwise else "e0"
  q_t = " ".join(dims[:-2] + [dims[-1], dims[-2]]) if colwise else "e1"
  return _shardable(
    "cast_transpose", split, call, (ndim, 1), f"{' '.join(dims)}, s -> {q}, {q_t}, a"
  )


@functools.cache
def amax(call: Callable, ndim: int, over_mesh: bool = False):
  """``call(x) -> amax`` (float32 (1,)) made shardable: the global max(|x|) on every device
  (reduced over every mesh axis with ``over_mesh``, see ``_amax_axes``)."""

  def split(mesh, specs):
    axes = _amax_axes(mesh, specs[0], over_mesh)

    def per_shard(x):
      a = call(x)
      return lax.pmax(a, axes) if axes else a

    return specs, (((),),), per_shard

  dims = _letters(ndim, "d")
  return _shardable("amax", split, call, (ndim,), f"{' '.join(dims)} -> a", single=True)


# --------------------------------------------------------------------------- GEMM


def gemm(
  name: str,
  kernel: Callable,
  fallback: Callable,
  a,
  b,
  a_scale,
  b_scale,
  out_dtype,
  *,
  block_scales: bool = False,
  refusal: Callable | None = None,
  sum_dtype=None,
  summed_kernel: Callable | None = None,
  sum_chunks: int = 1,
  function: str = "gemm",
  out_sharding: NamedSharding | None = None,
  device_sums: str = "collective",
):
  """``kernel(a, b, a_scale, b_scale, dtype)``: ``a (B, M, K) . b (B, N, K)^T`` per shard.

  Args:
    name: how warnings name the GEMM.
    kernel: the FFI GEMM of one device's operands, returning ``(B, M, N)`` of ``dtype``.
    fallback: XLA's GEMM with the same signature (float32 or ``dtype`` out), run on the shards
      where ``refusal`` refuses their shapes.
    a, b: ``(M, K)``/``(N, K)``, or with one leading batch dim.
    a_scale, b_scale: per-tensor scales of shape (1,) (replicated), or with ``block_scales``
      block scales with one entry per block, of the operand's rank (sharded like it).
    out_dtype: the result's dtype.
    refusal: ``refusal(a_shape, b_shape) -> str | None``: why the kernel cannot take one shard.
    sum_dtype: where K is split over devices, the dtype of each device's partial product and of
      their sum (``None``: float32); the sum is then converted to ``out_dtype``.
    summed_kernel: the kernel run on shards whose partial products are summed over devices
      (``None``: ``kernel``), e.g. one that leaves SMs to the sums beside it.
    sum_chunks: on those shards, the GEMM in this many chunks of ``a``'s rows (M), each summed
      over devices as soon as it is computed (per-tensor scales only; where M splits into
      chunks of a multiple of 16 rows, else one GEMM).
    function: the kernels' function called, which warnings name where no GEMM of the core (no
      ``warning_site``) traced it.
    out_sharding: the output's sharding on Explicit mesh axes (``None``: the rule's), as JAX's
      ``dot_general`` takes it: a backward GEMM's output gets its primal's sharding. The rule
      serves it where it can (a K summed over the axes it shards the output over is
      reduce-scattered onto them) and reshards its output to it otherwise.
    device_sums: how those partial products are summed over devices: ``"collective"`` (XLA's
      all-reduce or reduce-scatter) or ``"exchange"`` (pairwise ``ppermute`` steps,
      ``core.sharding.exchange_sum``), as ``GemmConfig.device_sums``.
  """
  if not _partitioned_here():
    y = _as_varying(kernel(a, b, a_scale, b_scale, out_dtype), (a, b, a_scale, b_scale))
    return core_sharding.match_sharding(y, out_sharding)
  shapes = tuple(tuple(t.shape) for t in (a, b, a_scale, b_scale))
  sum_dtype = np.dtype(np.float32 if sum_dtype is None else sum_dtype)
  run = _gemm_rule(
    name,
    kernel,
    fallback,
    np.dtype(out_dtype),
    block_scales,
    refusal,
    shapes,
    sum_dtype,
    summed_kernel or kernel,
    sum_chunks,
    function,
    device_sums,
  )
  return run(a, b, a_scale, b_scale, out_sharding=out_sharding)


def _gemm_plan(mesh, a_spec, b_spec, a_shape, b_shape, scale_shapes, block_scales):
  """The specs a and b are brought to, the output's, and the axes K is summed over."""
  batched = len(a_shape) == 3
  ab = a_spec[0] if batched else ()
  am, ak = a_spec[-2], a_spec[-1]
  bn, bk = b_spec[-2], b_spec[-1]
  used: set[str] = set()

  def keep(axes, sizes):
    # Axes already used elsewhere in the output, or splitting a dim (or its blocks) unevenly,
    # are dropped: that dim is gathered.
    out: list[str] = []
    for a in axes:
      if a in used or any(size % _shards(mesh, (*out, a)) for size in sizes):
        continue
      out.append(a)
    used.update(out)
    return tuple(out)

  a_sizes = [a_shape, scale_shapes[0]] if block_scales else [a_shape]
  b_sizes = [b_shape, scale_shapes[1]] if block_scales else [b_shape]
  if batched:
    ab = keep(ab, [s[0] for s in a_sizes + b_sizes])
  m = keep(am, [s[-2] for s in a_sizes])
  # K: the axes that shard it in a, or in b where a's K is whole (a is then sliced where it
  # lies, with no communication); sharded differently in both: gathered.
  k_axes = ak if (ak == bk or not bk) else (bk if not ak else ())
  k = keep(k_axes, [s[-1] for s in a_sizes + b_sizes])
  n = keep(bn, [s[-2] for s in b_sizes])
  lead = (ab,) if batched else ()
  return lead + (m, k), lead + (n, k), lead + (m, n), k


def sum_chunk_rows(rows: int, chunks: int) -> int:
  """The rows of each chunk of a GEMM summed in ``chunks`` chunks (``rows``: not chunked)."""
  if chunks <= 1 or rows % (16 * chunks):
    return rows
  return rows // chunks


def _gemm_rule(
  name,
  kernel,
  fallback,
  out_dtype,
  block_scales,
  refusal,
  shapes,
  sum_dtype,
  summed_kernel,
  sum_chunks,
  function,
  device_sums,
):
  a_shape, b_shape, sa_shape, sb_shape = shapes
  ndim = len(a_shape)

  def split(mesh, specs, result=None):
    a_spec, b_spec = specs[0], specs[1]
    new_a, new_b, out, k = _gemm_plan(
      mesh, a_spec, b_spec, a_shape, b_shape, (sa_shape, sb_shape), block_scales
    )
    # Where the output's users want it sharded over axes that K is summed over (FSDP's weight
    # gradient, sharded like the kernel), the partial products are reduce-scattered onto that
    # dim instead of all-reduced whole and sliced after: half the bytes on the wire.
    scatter_dim, scatter = _scatter_plan(mesh, out, k, result, a_shape, b_shape)
    if scatter:
      out = out[:scatter_dim] + (scatter,) + out[scatter_dim + 1 :]
      k = tuple(a for a in k if a not in scatter)
    # An axis added to a dim is a local slice of a replicated operand; one removed, a gather.
    if _gathers(a_spec, new_a) or _gathers(b_spec, new_b):
      _warn_once(
        (name, a_spec, b_spec),
        f"{name}: operands sharded as {_show(a_spec)} and {_show(b_spec)} are resharded to "
        f"{_show(new_a)} and {_show(new_b)} for the extension's kernel (the dims that lost "
        "mesh axes are all-gathered)",
      )
    local_a = tuple(n // _shards(mesh, s) for n, s in zip(a_shape, new_a, strict=True))
    local_b = tuple(n // _shards(mesh, s) for n, s in zip(b_shape, new_b, strict=True))
    why = refusal(local_a, local_b) if refusal is not None else None
    fn = kernel
    if why is not None:
      fn = fallback
      _warn_once(
        (name, new_a, new_b, "fallback"),
        f"{name}: with operands sharded as {_show(new_a)} and {_show(new_b)} each device holds "
        f"{local_a} and {local_b}, which the extension's kernel cannot take ({why}); XLA's GEMM "
        "runs on the shards instead",
      )

    summed = summed_kernel if why is None else fallback
    rows = local_a[-2]
    chunk = rows if block_scales else sum_chunk_rows(rows, sum_chunks)
    if scatter and scatter_dim == ndim - 2:
      chunk = rows  # chunks of the rows scattered one by one would interleave the shards
    psum, psum_scatter = _device_sums(mesh, device_sums, name, k + scatter)

    def per_shard(a, b, a_scale, b_scale):
      if scatter:
        y = summed(a, b, a_scale, b_scale, sum_dtype).astype(sum_dtype)
        y = psum(y, k) if k else y
        return psum_scatter(y, scatter, scatter_dim).astype(out_dtype)
      if not k:
        return fn(a, b, a_scale, b_scale, out_dtype).astype(out_dtype)
      # K is split: partial products in sum_dtype (float32: rounded once, after the sum; the
      # output dtype: each partial and each addition rounded, half the bytes for bfloat16).
      # In chunks of rows, each summed as soon as it is computed: its all-reduce can run while
      # the next chunk's GEMM does.
      parts = []
      for start in range(0, rows, chunk):
        part = a if chunk == rows else lax.slice_in_dim(a, start, start + chunk, axis=-2)
        y = summed(part, b, a_scale, b_scale, sum_dtype).astype(sum_dtype)
        parts.append(psum(y, k))
      y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)
      return y.astype(out_dtype)

    scale = (lambda spec: spec) if block_scales else (lambda spec: ((),))
    return (new_a, new_b, scale(new_a), scale(new_b)), (out,), per_shard

  lead = ["b"] if ndim == 3 else []
  a_dims = " ".join(lead + ["m", "k"])
  b_dims = " ".join(lead + ["n", "k"])
  if block_scales:
    sa = " ".join(_letters(len(sa_shape), "sa"))
    sb = " ".join(_letters(len(sb_shape), "sb"))
  else:
    sa, sb = "sa", "sb"
  call = functools.partial(_call_with_dtype, kernel, out_dtype)
  ndims = (ndim, ndim, len(sa_shape), len(sb_shape))
  rule = f"{a_dims}, {b_dims}, {sa}, {sb} -> {' '.join(lead + ['m', 'n'])}"
  return _shardable(function, split, call, ndims, rule, single=True, wants_result=True)


def _device_sums(mesh, how, name, axes):
  """``(psum(y, axes), psum_scatter(y, axes, dim))`` as ``GemmConfig.device_sums`` says: XLA's
  collectives, or exchanges where every summed axis group holds a power-of-two count of devices
  (otherwise the collectives, said once)."""

  def collective_scatter(y, axes, dim):
    return lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)

  if how == "collective" or not axes:
    return lax.psum, collective_scatter
  count = core_sharding.device_count(mesh, axes)
  if not core_sharding.is_power_of_two(count):
    _warn_once(
      (name, "device_sums", count),
      f"{name}: GemmConfig(device_sums='exchange') pairs devices in powers of two, and the "
      f"partial products are summed over {count} devices (mesh axes {axes}); XLA's collectives "
      "sum them instead",
    )
    return lax.psum, collective_scatter

  def exchange_sum(y, axes):
    return core_sharding.exchange_sum(y, axes, core_sharding.device_count(mesh, axes))

  def exchange_scatter(y, axes, dim):
    n = core_sharding.device_count(mesh, axes)
    return core_sharding.exchange_sum_scatter(y, axes, n, dim)

  return exchange_sum, exchange_scatter


def _scatter_plan(mesh, out, k, result, a_shape, b_shape):
  """``(dim, axes)``: the output dim (M or N) that ``result`` shards over some of the axes ``k``
  sums over, where the plan leaves that dim whole and the axes split it evenly; ``(None, ())``
  where there is none (the sum is an all-reduce)."""
  if not k or result is None or len(result) != len(out):
    return None, ()
  sizes = {len(out) - 2: a_shape[-2], len(out) - 1: b_shape[-2]}
  for dim, size in sizes.items():
    want = result[dim]
    if want and not out[dim] and set(want) <= set(k) and size % _shards(mesh, want) == 0:
      return dim, tuple(want)
  return None, ()


def _gathers(spec, new_spec) -> bool:
  return any(set(old) - set(new) for old, new in zip(spec, new_spec, strict=True))


def _call_with_dtype(kernel, out_dtype, a, b, a_scale, b_scale):
  return kernel(a, b, a_scale, b_scale, out_dtype)


# --------------------------------------------------------------------------- the extension's GEMMs


def tensor_scaled_gemm(
  call: Callable,
  a,
  b,
  a_scale,
  b_scale,
  out_dtype,
  fast_accum: bool,
  sum_dtype=None,
  sm_margin: int | None = None,
  sum_chunks: int = 1,
  out_sharding: NamedSharding | None = None,
  device_sums: str = "collective",
):
  """The extension's FP8 GEMM with per-tensor scales (``call``: ``cublas_call``, scale mode 0),
  per shard; XLA's FP8 GEMM on shards it cannot take (M, N or K not a multiple of 16).
  ``sum_dtype``, ``sum_chunks``, ``out_sharding``, ``device_sums``: as for ``gemm``.
  ``sm_margin``: on the shards whose partial products are summed over devices, the SMs the
  kernel leaves to those sums (``None``: none)."""
  kernel = functools.partial(_tensor_kernel, call, fast_accum, 0)
  summed = functools.partial(_tensor_kernel, call, fast_accum, sm_margin or 0)
  fallback = functools.partial(tensor_fallback, fast_accum)
  return gemm(
    "the per-tensor FP8 GEMM",
    kernel,
    fallback,
    a,
    b,
    a_scale,
    b_scale,
    out_dtype,
    refusal=_tensor_refusal,
    sum_dtype=sum_dtype,
    summed_kernel=summed,
    sum_chunks=sum_chunks,
    function="tensor_scaled_gemm",
    out_sharding=out_sharding,
    device_sums=device_sums,
  )


def _tensor_kernel(call, fast_accum, sm_margin, a, b, a_scale, b_scale, dtype):
  return call(
    a,
    b,
    a_scale,
    b_scale,
    dtype,
    lhs_mode=0,
    rhs_mode=0,
    fast_accum=fast_accum,
    sm_margin=sm_margin,
  )


def tensor_fallback(fast_accum, a, b, a_scale, b_scale, dtype):
  batch = tuple(range(a.ndim - 2))
  precision = lax.Precision.DEFAULT if fast_accum else lax.Precision.HIGHEST
  y = lax.dot_general(
    a,
    b,
    (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch)),
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  return (y * (a_scale * b_scale).reshape(())).astype(dtype)


def _tensor_refusal(a_shape, b_shape) -> str | None:
  m, k, n = a_shape[-2], a_shape[-1], b_shape[-2]
  if m % 16 or n % 16 or k % 16:
    return f"it needs M, N and K multiples of 16, got M={m}, N={n}, K={k} per device"
  return None


def block_scaled_gemm(
  call: Callable, fallback: Callable, a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype
):
  """The extension's 1x128/128x128 block-scaled FP8 GEMM per shard.

  ``call(a, a_scale_inv, a_block, b, b_scale_inv, b_block, dtype)`` is the kernel and
  ``fallback`` (without ``dtype``, float32 out) XLA's formulation, run on shards cuBLAS cannot
  take (M or N not a multiple of 16). The block scales are sharded with their data, so a shard
  holds whole blocks (a mesh axis that would split a block is dropped, its dim gathered).
  """
  kernel = functools.partial(_block_kernel, call, a_block, b_block)
  xla = functools.partial(_block_fallback, fallback, a_block, b_block)
  dtype = jnp.bfloat16 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else jnp.float32
  return gemm(
    "the block-scaled FP8 GEMM",
    kernel,
    xla,
    a,
    b,
    a_scale_inv,
    b_scale_inv,
    dtype,
    block_scales=True,
    refusal=_block_refusal,
    function="block_scaled_gemm",
  )


def _block_kernel(call, a_block, b_block, a, b, a_scale_inv, b_scale_inv, dtype):
  return call(a, a_scale_inv, a_block, b, b_scale_inv, b_block, dtype)


def _block_fallback(fallback, a_block, b_block, a, b, a_scale_inv, b_scale_inv, dtype):
  del dtype
  return fallback(a, a_scale_inv, a_block, b, b_scale_inv, b_block)


def _block_refusal(a_shape, b_shape) -> str | None:
  m, n = a_shape[-2], b_shape[-2]
  if m % 16 or n % 16:
    return f"cuBLAS needs M and N multiples of 16, got M={m}, N={n} per device"
  return None


# --------------------------------------------------------------------------- the norm's cast


@functools.cache
def norm_cast(call: Callable, has_beta: bool, with_amax: bool):
  """``call(x, mean, rsigma, gamma, beta, scale) -> (q, q_t, amax)``, the norm's output cast to
  FP8 in both orientations from its row statistics, made shardable.

  ``x`` (M, K) keeps its sharding, ``mean`` and ``rsigma`` (M,) take its rows', ``gamma`` and
  ``beta`` (K,) its columns' (without ``has_beta``, ``beta`` is a placeholder of shape (0,));
  ``q`` is sharded like ``x``, ``q_t`` with the two swapped, and ``amax`` is the global max on
  every device. The statistics come in whole (computed over the full rows), so every shard
  casts exactly what one device would. Inside ``shard_map`` the kernel runs on the shard as it
  is (the amax its own; the format reduces it over ``amax_axes``, as for the other casts).
  """

  def split(mesh, specs):
    del mesh
    rows, cols = specs[0]
    axes = rows + cols
    beta = (cols,) if has_beta else ((),)

    def per_shard(x, mean, rsigma, gamma, beta, scale):
      q, q_t, a = call(x, mean, rsigma, gamma, beta, scale)
      if with_amax and axes:
        a = lax.pmax(a, axes)
      return q, q_t, a

    args = ((rows, cols), (rows,), (rows,), (cols,), beta, ((),))
    return args, ((rows, cols), (cols, rows), ((),)), per_shard

  beta = "k" if has_beta else "b"
  return _shardable(
    "norm_cast", split, call, (2, 1, 1, 1, 1, 1), f"m k, m, m, k, {beta}, s -> m k, k m, a"
  )


# --------------------------------------------------------------------------- the MLP's casts


def _activation_columns(cols, n_act: int, name: str):
  """The mesh axes the activation kernels keep on ``h``'s columns (n_act * F): all of them with
  one activation; none with two, whose F-wide slices lie side by side in ``h``, so that a shard
  of its columns would not hold the matching columns of both (gathered, said once)."""
  if n_act == 1 or not cols:
    return cols
  _warn_once(
    (name, cols),
    f"{name}: h's columns (two activations' slices side by side) are sharded over {cols}; a "
    "shard of them would not hold both slices of its columns, so they are all-gathered for the "
    "extension's kernel",
  )
  return ()


def _dact_layout(specs, n_act: int, name: str):
  """``(rows, cols, dz)``: the mesh axes of the activation gradient's rows and columns (``h``'s,
  rows ``dz``'s where ``h``'s are unsharded) and the spec ``dz`` is brought to, from the specs of
  ``(dz, h, ...)``."""
  rows, cols = specs[1]
  rows = rows or specs[0][0]
  cols = _activation_columns(cols, n_act, name)
  return rows, cols, (rows, cols) if n_act == 1 else (rows, ())


def _activation_rule(dz: bool, n_act: int, has_bias: bool, scale: bool, outs: str) -> str:
  """The sharding rule of an activation kernel, operands ``([dz,] h, bias[, scale])``: h is
  ``m n`` (n = n_act * F), dz ``m f`` (``m n`` with one activation), the bias ``n`` (a
  placeholder of shape (0,) without one)."""
  ops = (["m f" if n_act > 1 else "m n"] if dz else []) + ["m n", "n" if has_bias else "c"]
  return f"{', '.join(ops + (['s'] if scale else []))} -> {outs}"


@functools.cache
def act_cast(call: Callable, n_act: int, has_bias: bool, with_amax: bool):
  """``call(h, bias, scale) -> (q, q_t, amax)``, the activation of ``h`` (M, n_act * F) plus its
  bias cast to FP8 in both orientations (``q`` (M, F), ``q_t`` (F, M)), made shardable.

  Every row is computed from its own row of ``h``, so ``h``'s rows keep their sharding and so do
  ``q``'s (``q_t``'s columns); ``h``'s columns too with one activation (``bias`` (F,) sharded like
  them), with two they are gathered (``_activation_columns``). ``amax`` is the global max on
  every device: each shard's max-reduced over the axes that shard ``h``.
  """

  def split(mesh, specs):
    del mesh
    rows, cols = specs[0]
    cols = _activation_columns(cols, n_act, "the activation cast")
    axes = rows + cols

    def per_shard(h, bias, scale):
      q, q_t, a = call(h, bias, scale)
      if with_amax and axes:
        a = lax.pmax(a, axes)
      return q, q_t, a

    args = ((rows, cols), (cols,) if has_bias else ((),), ((),))
    return args, ((rows, cols), (cols, rows), ((),)), per_shard

  f = "n" if n_act == 1 else "f"
  rule = _activation_rule(False, n_act, has_bias, True, f"m {f}, {f} m, a")
  return _shardable("act_cast", split, call, (2, 1, 1), rule)


@functools.cache
def dact_cast(call: Callable, n_act: int, has_bias: bool, with_amax: bool):
  """``call(dz, h, bias, scale) -> (q, q_t, amax, dbias)``, ``dz * act'(h + bias)`` (M, n_act * F)
  cast to FP8 in both orientations with the bias gradient (its float32 column sums, (n_act * F,)),
  made shardable.

  Rows as in ``act_cast`` (``h``'s; ``dz`` is brought to them), columns too with one activation.
  ``amax`` is the global max on every device, and ``dbias`` sums every row: each shard's column
  sums are summed (``psum``, float32) over the axes that shard the rows, so it equals one
  device's up to the order of the float32 additions.
  """

  def split(mesh, specs):
    del mesh
    rows, cols, dz = _dact_layout(specs, n_act, "the activation-gradient cast")
    axes = rows + cols

    def per_shard(dz, h, bias, scale):
      q, q_t, a, dbias = call(dz, h, bias, scale)
      if with_amax and axes:
        a = lax.pmax(a, axes)
      if rows:
        dbias = lax.psum(dbias, rows)
      return q, q_t, a, dbias

    args = (dz, (rows, cols), (cols,) if has_bias else ((),), ((),))
    return args, ((rows, cols), (cols, rows), ((),), (cols,)), per_shard

  rule = _activation_rule(True, n_act, has_bias, True, "m n, n m, a, n")
  return _shardable("dact_cast", split, call, (2, 2, 1, 1), rule)


@functools.cache
def act_amax(call: Callable, n_act: int, has_bias: bool):
  """``call(h, bias) -> amax`` (float32 (1,)), the amax of ``act_cast``'s values, made shardable:
  the global max on every device (operands as ``act_cast``'s)."""

  def split(mesh, specs):
    del mesh
    rows, cols = specs[0]
    cols = _activation_columns(cols, n_act, "the activation's amax")
    axes = rows + cols

    def per_shard(h, bias):
      a = call(h, bias)
      return lax.pmax(a, axes) if axes else a

    return ((rows, cols), (cols,) if has_bias else ((),)), (((),),), per_shard

  return _shardable(
    "act_amax",
    split,
    call,
    (2, 1),
    _activation_rule(False, n_act, has_bias, False, "a"),
    single=True,
  )


@functools.cache
def dact_amax(call: Callable, n_act: int, has_bias: bool):
  """``call(dz, h, bias) -> amax`` (float32 (1,)), the amax of ``dact_cast``'s values, made
  shardable: the global max on every device (operands as ``dact_cast``'s)."""

  def split(mesh, specs):
    del mesh
    rows, cols, dz = _dact_layout(specs, n_act, "the activation gradient's amax")
    axes = rows + cols

    def per_shard(dz, h, bias):
      a = call(dz, h, bias)
      return lax.pmax(a, axes) if axes else a

    return (dz, (rows, cols), (cols,) if has_bias else ((),)), (((),),), per_shard

  return _shardable(
    "dact_amax",
    split,
    call,
    (2, 2, 1),
    _activation_rule(True, n_act, has_bias, False, "a"),
    single=True,
  )


@functools.cache
def cast_transpose_per_batch(call: Callable, with_amax: bool):
  """``call(x, scales) -> (q, q_t, amax)``, each ``x[b]`` of ``x`` (B, R, C) cast with its own
  scale of ``scales`` (B,) into ``q`` (B, R, C) and ``q_t`` (B, C, R), with its own amax (B,)
  (empty unless ``with_amax``), made shardable.

  Every dim keeps its sharding (``q_t`` has R's and C's swapped); the scales and amaxes are
  sharded like B, and each shard's amaxes are max-reduced over the axes that shard R and C, so
  every device holds the amaxes of its whole ``x[b]``.
  """

  def split(mesh, specs):
    del mesh
    batch, rows, cols = specs[0]
    axes = rows + cols

    def per_shard(x, scales):
      q, q_t, a = call(x, scales)
      if with_amax and axes:
        a = lax.pmax(a, axes)
      return q, q_t, a

    amaxes = (batch,) if with_amax else ((),)
    return (
      ((batch, rows, cols), (batch,)),
      ((batch, rows, cols), (batch, cols, rows), amaxes),
      per_shard,
    )

  amaxes = "b" if with_amax else "a"
  return _shardable(
    "cast_transpose_per_batch", split, call, (3, 1), f"b r c, b -> b r c, b c r, {amaxes}"
  )


@functools.cache
def row_col_amax(call: Callable, ndim: int, rows: bool, cols: bool):
  """``call(x) -> (row_amax, col_amax)``, ``max(|x|)`` over each row ``(.., P)`` and over each
  column ``(.., C)`` of ``x (.., P, C)`` (one not asked for is a (0,) placeholder), made shardable.

  Every dim keeps its sharding: a row amax is sharded like ``x``'s rows and is max-reduced over
  the axes that shard the columns (a shard holds part of each of its rows), a column amax
  sharded like the columns is max-reduced over the axes that shard the rows.
  """

  def split(mesh, specs):
    del mesh
    spec = specs[0]
    lead, p, c = spec[:-2], spec[-2], spec[-1]

    def per_shard(x):
      a_rows, a_cols = call(x)
      if rows and c:
        a_rows = lax.pmax(a_rows, c)  # inf (never NaN) where a NaN is: a max reduces it
      if cols and p:
        a_cols = lax.pmax(a_cols, p)
      return a_rows, a_cols

    outs = ((*lead, p) if rows else ((),), (*lead, c) if cols else ((),))
    return specs, outs, per_shard

  dims = _letters(ndim, "d")
  lead = dims[:-2]
  a_rows = " ".join([*lead, dims[-2]]) if rows else "e0"
  a_cols = " ".join([*lead, dims[-1]]) if cols else "e1"
  return _shardable("row_col_amax", split, call, (ndim,), f"{' '.join(dims)} -> {a_rows}, {a_cols}")


@functools.cache
def rowwise_cast(call: Callable, ndim: int, rowwise: bool, colwise: bool):
  """``call(x, row_scale, col_scale) -> (q, q_t)``, ``x (.., P, C)`` cast with one scale per row
  (``row_scale (.., P)``) into ``q`` shaped like it and with one per column (``col_scale
  (.., C)``) into ``q_t`` with its last two dims swapped (a copy not asked for, and its scales,
  a (0,) placeholder), made shardable.

  Nothing is reduced: each shard's codes need only the scales of its rows and columns, so the
  scales are brought to the shardings of ``x``'s rows and columns and the copies keep ``x``'s
  (``q_t`` with its last two swapped).
  """

  def split(mesh, specs):
    del mesh
    spec = specs[0]
    lead, p, c = spec[:-2], spec[-2], spec[-1]
    swapped = (*lead, c, p)
    row_scale = (*lead, p) if rowwise else ((),)
    col_scale = (*lead, c) if colwise else ((),)
    outs = (spec if rowwise else ((),), swapped if colwise else ((),))
    return (spec, row_scale, col_scale), outs, call

  dims = _letters(ndim, "d")
  lead, p, c = dims[:-2], dims[-2], dims[-1]
  s_rows = " ".join([*lead, p]) if rowwise else "e0"
  s_cols = " ".join([*lead, c]) if colwise else "e1"
  q = " ".join(dims) if rowwise else "e2"
  q_t = " ".join([*lead, c, p]) if colwise else "e3"
  ndims = (ndim, ndim - 1 if rowwise else 1, ndim - 1 if colwise else 1)
  return _shardable(
    "rowwise_cast", split, call, ndims, f"{' '.join(dims)}, {s_rows}, {s_cols} -> {q}, {q_t}"
  )
