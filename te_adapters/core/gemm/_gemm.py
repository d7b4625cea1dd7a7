"""The quantized ``dot_general`` and its one custom VJP, written over the format interface.

Every recipe's GEMM runs the same rule (``_quantized_gemm``), in the contracting-last layout
(``_layout.GemmLayout``): ``x3 (.., M, K)`` and ``w3 (.., N, K)`` (or ``(.., K, N)``, a Dense
kernel as it is stored). The recipe's ``Format`` (``_registry.format_of``) quantizes each operand
into the copies its GEMMs take, in the pass that reads it, and runs the GEMMs:

- forward ``y = x3 . w3^T``: x's copy along K and the kernel's along K;
- dgrad ``dx = g . w``: the gradient's copy along N and the kernel's copy along N;
- wgrad ``dw = x^T . g``: the swapped copies of x and of the gradient, along M.

The backward copies of x and of the kernel are made in the forward pass and saved (checkpoint
names ``QUANTIZED_X``, ``QUANTIZED_KERNEL``); the gradient is quantized once in the backward
pass. Recipe state travels through the gradient channel: the cotangent returned for ``state`` is
the state for the next step ("overwrite with gradient"), which the format computes from its
roles' new states. Below the size threshold (or with ``recipe=None``) the GEMM is
``lax.dot_general`` in high precision.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core import formats, recipes, sharding
from te_adapters.core.formats import QuantizeRequest, check_state
from te_adapters.core.gemm import _dimension_numbers, _frozen, _remat, _threshold
from te_adapters.core.gemm._layout import GemmLayout, sorted_contracting
from te_adapters.core.gemm._threshold import DEFAULT_SIZE_THRESHOLD
from te_adapters.core.kernels import ShardingFallbackWarning, warning_site
from te_adapters.core.recipes import (
  GemmConfig,
  caller_site,
  caller_stacklevel,
  check_config,
  check_recipe,
)
from te_adapters.core.state import (
  ROLES,
  is_accumulating,
  shared_max_grad,
)

if TYPE_CHECKING:
  from jax.typing import ArrayLike, DTypeLike

  from te_adapters.core.gemm._threshold import SizeThreshold
  from te_adapters.core.recipes import Recipe
  from te_adapters.core.state import State

# ``amax_axes``: mesh axis names, for every role or by role ("x", "kernel", "grad").
AmaxAxes = str | Sequence[str] | Mapping[str, str | Sequence[str]]

__all__ = [
  "Chain",
  "Stage",
  "checked_plan",
  "checked_state",
  "dot_general",
  "fsdp_gemm_layout",
  "quantized_gemms",
]


def dot_general(
  lhs: ArrayLike,
  rhs: ArrayLike,
  dimension_numbers: lax.DotDimensionNumbers,
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  *,
  recipe: Recipe | None,
  state: State | Mapping[str, ArrayLike] | None = None,
  rng: jax.Array | None = None,
  out_sharding: NamedSharding | PartitionSpec | None = None,
  amax_axes: AmaxAxes | None = None,
  kernel_all_gather: PartitionSpec | NamedSharding | None = None,
  threshold: SizeThreshold | None = DEFAULT_SIZE_THRESHOLD,
  config: GemmConfig | None = None,
  layer: str | None = None,
  kernel_sharding: PartitionSpec | tuple[Any, ...] | None = None,
  framework: str | None = None,
  sequence_parallel: tuple[str, str] | None = None,
) -> jax.Array:
  """``jax.lax.dot_general`` with FP8 (or FP4) operands, per ``recipe``.

  Drops into anything that takes a ``dot_general``, for example
  ``functools.partial(dot_general, recipe=r, state=s)``.

  Args:
    lhs: the activation ``x`` (real floating point).
    rhs: the ``kernel`` (real floating point).
    dimension_numbers: as for ``lax.dot_general``: any contracting and batch dimensions.
    precision: the ``lax.dot_general`` precision of each per-tensor FP8 GEMM whose recipe
      ``MMParams`` do not ask for a split accumulator (by default the forward GEMM). On Hopper,
      ``DEFAULT`` lets cuBLASLt accumulate FP8 products in the tensor cores' reduced precision
      ("fast accumulation"); ``HIGHEST`` promotes the sums to float32 as they go, which is what a
      split accumulator (by default dgrad and wgrad) gets. Block-scaled recipes promote per
      128-wide (or 32/16-wide) block and do not use it.
    preferred_element_type: output dtype; default as ``lax.dot_general`` would give.
    recipe: a recipe (``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``,
      ``NVFP4BlockScaling``, ``Float8BlockScaling``, ``Float8RowwiseScaling``), or ``None`` for a
      plain ``lax.dot_general``.
    state: this GEMM's recipe state (``init_state(recipe)``); ``None`` for stateless recipes.
    rng: a PRNG key for the stochastic rounding of the gradient, required when differentiating
      under ``NVFP4BlockScaling`` unless ``disable_stochastic_rounding``; use a fresh key per step
      and per GEMM. Must be ``None`` for recipes that do not use it (``recipe.uses_rng``).
      Inside ``shard_map`` each shard folds its index along the mesh axes the gradient varies
      over into the key, so shards round with different random bits.
    out_sharding: as for ``lax.dot_general`` (needed with Explicit mesh axes when a contracting
      dimension is sharded, e.g. row-parallel tensor parallelism).
    amax_axes: inside ``shard_map``, the mesh axes over which each operand's amax is
      max-reduced so that all devices share one scale: an axis name, a sequence of names, or a
      dict by role (``"x"``, ``"kernel"``, ``"grad"``). ``None`` (default): every manual axis the
      operand varies over, less those its DelayedScaling state varies over (a pipeline axis
      with per-stage state); with ``shard_map(check_vma=False)``, every manual axis. ``()``
      keeps per-shard scales (stateless recipes only). Under ``jit`` amaxes are global anyway.
      NVFP4's per-tensor amax is reduced the same way; MXFP8 and FP8 block scales are per block
      and need no reduction (each shard must hold whole blocks). ``Float8RowwiseScaling`` scales
      the rows of each shard (a row split over devices gets a scale per part) and refuses
      ``amax_axes``.
    kernel_all_gather: FSDP. A ``PartitionSpec`` (or ``NamedSharding``) naming, per kernel
      dimension, the mesh axes the kernel is sharded over; the kernel is quantized shard by shard
      and the FP8 shards are all-gathered for the GEMM, and its gradient is reduce-scattered back.
      Works under ``jit`` (mesh from ``jax.set_mesh`` or the ``NamedSharding``) and inside
      ``shard_map``.
    threshold: a ``SizeThreshold``: GEMMs below it (by default: on GPU only, small ones, see
      ``DEFAULT_SIZE_THRESHOLD``) are slower in FP8 than in high precision and run as
      ``lax.dot_general`` on the unquantized operands instead, with a
      ``HighPrecisionGemmWarning`` at trace time (``runs_in_fp8`` tells in advance). ``rng`` and
      ``amax_axes`` are unused then, ``kernel_all_gather`` gathers the unquantized kernel, and
      the state gradient is the unchanged state (under ``with_max_grad``: no contribution, so
      ``updated_state`` keeps the state). ``None``: always quantize.
    config: a ``GemmConfig``: which kernels cast and multiply (``None``: ``GemmConfig()``, the
      fastest where each runs). It leaves the quantized values alone.
    layer: what warnings and errors about this GEMM call it (an adapter passes the layer's path
      in its model where it knows it, or its equation); ``None``: the GEMM by its operands'
      shapes.
    kernel_sharding: the kernel's ``PartitionSpec`` (a model's annotation; or a tuple of its
      entries, as the adapters pass it) where its type does not carry it: under ``jit`` on Auto
      mesh axes, where XLA's partitioner would otherwise gather a kernel whose sharded free dim
      the layout flattens behind another. It only orders
      the layout of the kernel's free dims (below); the contracting and batch dims keep their
      order, which the input shares; the kernel's own Explicit sharding wins over it.
    framework: the framework of the layer calling (``"linen"``, ``"nnx"``, ``"haiku"``), whose
      remedy a ``FrozenStateWarning`` gives; ``None`` (plain JAX): the remedies of all of them.
    sequence_parallel: inside ``shard_map``, sequence parallelism (Megatron's, TE's) for a
      tensor-parallel pair, ``(mode, axis)``. The input's rows (its free dims flattened, the
      sequence dim first: a sequence-first ``(S, B, H)`` input, or batch 1) are split over the
      manual mesh axis ``axis``. ``("all_gather", axis)`` (the column-parallel GEMM): the
      input's rows are all-gathered for the GEMM, which returns every row of its output
      columns, and the input gradient is reduce-scattered back onto the rows.
      ``("reduce_scatter", axis)`` (the row-parallel GEMM, contracting over ``axis``'s
      shards): the output's partial sums are reduce-scattered over its rows (in
      ``GemmConfig.partial_sums``'s dtype), and the output gradient's rows are all-gathered.
      What moves is ``GemmConfig.sequence_gather``'s choice: the rows unquantized, each device
      then casting all of them (the default for bfloat16 and float16 rows), or each shard
      quantized (its amax reduced over the mesh) and its FP8 copies gathered; the same FP8
      values either way. Per-tensor recipes, no batch dims, not with ``kernel_all_gather``.

  Sharded operands: the GEMM flattens each group of dims (batch, the free dims of each operand,
  contracting) into one, which keeps whole shards only when its first dim is the sharded one; so
  the dims of each group are ordered with a sharded one first (the result is the same, put back
  in ``lax.dot_general``'s layout). Where a group has more than one sharded dim (Explicit mesh
  axes, or ``out_sharding``), the operand is all-gathered over the others (the output computed
  without them and resharded) with a ``ShardingFallbackWarning`` naming ``layer``;
  ``kernel_all_gather`` over more than one dim of a group is refused.

  Returns:
    The product, with the dtype and shape ``lax.dot_general`` gives. Under differentiation, the
    gradient with respect to ``state`` is the state for the next step.

  Raises:
    TypeError: operands that are not real floating point, or a ``recipe``, ``threshold`` or
      ``config`` of another type (a recipe class rather than an instance, say).
    ValueError: ``state``, ``rng``, ``amax_axes`` or ``kernel_all_gather`` without a recipe; a
      state that does not match the recipe (missing for ``DelayedScaling``, another history
      length); an ``rng`` the recipe does not use, or none where it rounds stochastically;
      sizes the recipe's blocks do not tile.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> y = ta.core.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling())
    >>> round(float(y[0, 0]), 4)
    32.0
  """
  formats.check_float_operand("lhs", lhs)
  formats.check_float_operand("rhs", rhs)
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  threshold = _threshold.check_threshold(threshold)
  config = check_config(config)
  framework = _frozen.check_framework(framework)
  if recipe is None:
    if state:
      raise ValueError("state was given but recipe is None")
    if rng is not None:
      raise ValueError("rng was given but recipe is None")
    if amax_axes is not None or kernel_all_gather is not None:
      raise ValueError(_SPMD_NEEDS_RECIPE)
    dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, rhs.shape)
    # Sequence parallelism in high precision: the same collectives on the unquantized input
    # and output (autodiff makes the gradients').
    plan = sharding.make_plan(sequence_parallel=sequence_parallel, rhs_ndim=rhs.ndim)
    y = lax.dot_general(
      _sequence_gather(lhs, plan, 0),
      rhs,
      dn,
      precision,
      preferred_element_type,
      out_sharding=out_sharding,
    )
    return _sequence_scatter(y, plan, 0)
  plan = checked_plan(
    recipe,
    rhs.ndim,
    amax_axes=amax_axes,
    kernel_all_gather=kernel_all_gather,
    out_sharding=out_sharding,
    sequence_parallel=sequence_parallel,
  )
  recipe = check_recipe(recipe)
  fmt = formats.format_of(recipe)
  if plan.sequence is not None:
    _check_sequence(plan, fmt, recipe, dimension_numbers, lhs, rhs)
  # The kernel as the GEMM sees it: inside shard_map, kernel_all_gather gathers the shard first.
  gemm_rhs = sharding.gathered_kernel_type(rhs, plan)
  dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, gemm_rhs.shape)
  state = checked_state(recipe, state, layer)
  rng = recipes.check_rng(recipe, rng)
  out = jax.eval_shape(
    functools.partial(
      lax.dot_general,
      dimension_numbers=dn,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    ),
    lhs,
    gemm_rhs,
  )
  # What the format cannot take is refused before the size decides the precision, so bad input
  # gets the same error at every size (the backward's checks under differentiation).
  layout = GemmLayout(dn, lhs.shape, gemm_rhs.shape)
  fmt.check(recipe, layout, False, lhs, rhs)
  if not fmt.per_tensor or recipe.uses_rng:
    lhs, rhs = _checked_under_grad(lhs, rhs, dn, gemm_rhs.shape, recipe, rng is None)
  m, k, n = layout.b * layout.m, layout.k, layout.n
  dtypes = str(lhs.dtype) if lhs.dtype == rhs.dtype else f"{lhs.dtype} x {rhs.dtype}"
  if _threshold.keeps_high_precision(threshold, m, k, n, recipe, dtypes, layer=layer):
    if plan.sequence is not None:
      lhs = _sequence_gather(lhs, plan, 0)
    y = _high_precision_dot_general(lhs, rhs, state, dn, precision, preferred_element_type, plan)
    return _sequence_scatter(y, plan, 0)
  if state:
    # Under differentiation: warns at trace time when the state would stay frozen.
    lhs, rhs, state = _frozen.watch_state(lhs, rhs, state, layer=layer, framework=framework)
  if layer is None:
    layer = f"the GEMM {jnp.shape(lhs)} . {jnp.shape(rhs)} (dimension_numbers {dn})"
  return _contracting_last(
    lhs, rhs, state, rng, dn, precision, out, recipe, plan, config, fmt, layer, kernel_sharding
  )


_SPMD_NEEDS_RECIPE = "amax_axes and kernel_all_gather need a recipe; recipe is None"


def checked_plan(
  recipe,
  rhs_ndim: int,
  *,
  amax_axes=None,
  kernel_all_gather=None,
  out_sharding=None,
  sequence_parallel=None,
) -> sharding.SpmdPlan:
  """``dot_general``'s SPMD keywords for a kernel of ``rhs_ndim`` dims, checked into a
  ``SpmdPlan`` with its errors: the fused paths take ``kernel_all_gather`` through it too.

  Raises:
    ValueError, TypeError, NotImplementedError: ``dot_general``'s (a spec that does not fit the
      kernel, SPMD keywords without a recipe, ``kernel_all_gather`` under a block recipe).
  """
  if recipe is None:
    if amax_axes is not None or kernel_all_gather is not None:
      raise ValueError(_SPMD_NEEDS_RECIPE)
    return sharding.make_plan(sequence_parallel=sequence_parallel, rhs_ndim=rhs_ndim)
  plan = sharding.make_plan(
    amax_axes,
    kernel_all_gather,
    out_sharding,
    rhs_ndim=rhs_ndim,
    sequence_parallel=sequence_parallel,
  )
  recipe = check_recipe(recipe)
  if formats.format_of(recipe).per_tensor:
    sharding.check_amax_axes(plan)
  else:
    sharding.check_block_scaled(recipe, plan)
  return plan


def fsdp_gemm_layout(kernel, plan, m: int, contracting: int, layer: str | None = None):
  """A fused path's GEMM under FSDP (``plan.kernel_all_gather``), laid out as ``dot_general``
  lays its own out: the GEMM of ``m`` rows with ``kernel`` contracting its dim ``contracting``.

  Returns ``(layout, w3, plan)``: the ``GemmLayout`` (the gathered kernel's, its gathered free
  dim ordered first; ``split_out_shape`` and ``out_perm`` put the output's dims back), the
  kernel (inside ``shard_map``: this shard) transposed and reshaped to ``(N, K)``, which a
  chain's stage takes with ``kernel_kn=False``, and ``plan`` with ``kernel_all_gather`` on those
  two dims (``plan_for_tn_layout``: a gather no layout serves raises ``dot_general``'s error,
  naming ``layer``).
  """
  full = sharding.gathered_kernel_type(kernel, plan).shape
  assert plan.kernel_all_gather is not None
  gathered = tuple(d for d, axes in enumerate(plan.kernel_all_gather) if axes)
  dn = (((1,), (contracting,)), ((), ()))
  layout = GemmLayout(dn, (m, full[contracting]), full, ((), gathered, ()))
  if layer is None:
    layer = f"the GEMM of {m} rows . {tuple(full)} (contracting dim {contracting})"
  plan = sharding.plan_for_tn_layout(plan, layout, layer)
  w3 = sharding.reshape(jnp.transpose(kernel, layout.rhs_perm), layout.kernel_shape(kernel.shape))
  return layout, w3, plan


def _check_sequence(plan, fmt, recipe, dimension_numbers, lhs, rhs):
  dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, rhs.shape)
  if not fmt.per_tensor:
    raise ValueError(
      f"sequence_parallel takes per-tensor recipes (DelayedScaling, Float8CurrentScaling), "
      f"got {type(recipe).__name__}"
    )
  if dn[1][0]:
    raise ValueError(
      "sequence_parallel takes a GEMM without batch dims (its input's rows are the sequence)"
    )
  if len(dn[0][0]) == lhs.ndim:
    raise ValueError("sequence_parallel needs an input with rows (a free dim)")


def _sequence_gather(a, plan, dim):
  """Below the size threshold, in "all_gather" mode: ``a``'s rows all-gathered over the
  sequence axis (autodiff scatters the gradient back)."""
  if plan.sequence is None or plan.sequence[0] != "all_gather":
    return a
  return lax.all_gather(a, plan.sequence[1], axis=dim, tiled=True)


def _sequence_scatter(y, plan, dim):
  """Below the size threshold, in "reduce_scatter" mode: ``y``'s partial sums reduce-scattered
  over the sequence axis."""
  if plan.sequence is None or plan.sequence[0] != "reduce_scatter":
    return y
  return lax.psum_scatter(y, plan.sequence[1], scatter_dimension=dim, tiled=True)


def _gathers_unquantized(chain, mode: str, dtype) -> bool:
  """Whether the sequence-parallel GEMM of ``chain`` in ``mode`` all-gathers the rows it
  quantizes (of ``dtype``) unquantized and casts them whole (``GemmConfig.sequence_gather``):
  the input in "all_gather" mode, the output gradient in "reduce_scatter" mode. Only
  ``dot_general`` takes ``sequence_parallel``: one GEMM, no fused norm, no bias."""
  seq, config = chain.plan.sequence, chain.config
  if seq is None or seq[0] != mode:
    return False
  choice = config.sequence_gather
  if choice == "auto":
    choice = "fp8" if config.collective_matmul or np.dtype(dtype).itemsize > 2 else "input"
  if choice != "input":
    return False
  assert chain.lhs is None and len(chain.stages) == 1, "sequence_parallel is dot_general's"
  return True


def _gather_unquantized(a, plan):
  """``a``'s rows (its dim -2) all-gathered over the sequence axis, the same on every device
  of it (invariant, so its amax is not reduced over that axis again)."""
  return lax.all_gather(a, plan.sequence[1], axis=a.ndim - 2, tiled=True, to="invarying")


def _gathered_rows(t, axis_name, axis, config):
  """A ScaledTensor with its dim ``axis`` (the rows, or a transposed copy's columns)
  all-gathered over the mesh axis ``axis_name`` (FP8 as bytes), by XLA's all-gather or by
  exchanges (``GemmConfig.device_sums``)."""
  dim = t.data.ndim + axis
  u = lax.bitcast_convert_type(t.data, jnp.uint8)
  if _exchanges(config, axis_name):
    u = sharding.exchange_gather(u, (axis_name,), lax.axis_size(axis_name), dim)
  else:
    u = lax.all_gather(u, axis_name, axis=dim, tiled=True)
  return dataclasses.replace(t, data=lax.bitcast_convert_type(u, t.data.dtype))


def _scattered_sums(y, axis_name, config):
  """``y``'s partial sums reduce-scattered over its rows (dim -2) and the mesh axis
  ``axis_name``, by XLA's reduce-scatter or by exchanges (``GemmConfig.device_sums``)."""
  dim = y.ndim - 2
  if _exchanges(config, axis_name):
    return sharding.exchange_sum_scatter(y, (axis_name,), lax.axis_size(axis_name), dim)
  return lax.psum_scatter(y, axis_name, scatter_dimension=dim, tiled=True)


def _exchanges(config, axis_name) -> bool:
  """Whether ``GemmConfig.device_sums`` moves a sequence-parallel GEMM's rows by exchanges:
  asked for, over a power-of-two count of devices (otherwise XLA's collectives, said by a
  ``ShardingFallbackWarning``)."""
  if config.device_sums != "exchange":
    return False
  n = lax.axis_size(axis_name)
  if sharding.is_power_of_two(n):
    return True
  warnings.warn(
    f"GemmConfig(device_sums='exchange') pairs devices in powers of two, and the sequence axis "
    f"{axis_name!r} holds {n} devices; XLA's all-gather and reduce-scatter move its rows instead",
    ShardingFallbackWarning,
    stacklevel=2,
  )
  return False


def _ppermute_bytes(a, axis_name, perm):
  u = lax.ppermute(lax.bitcast_convert_type(a, jnp.uint8), axis_name, perm)
  return lax.bitcast_convert_type(u, a.dtype)


def _sequence_gemm(a, b, out_dtype, which, chain, *, gather: bool):
  """``fmt.gemm(a, b)`` for FP8 ``a`` (M, K) whose rows are split over the sequence axis:
  ``gather``: ``a``'s rows all-gathered first, every row of the output returned; else the
  output's partial sums reduce-scattered over its rows (in ``GemmConfig.partial_sums``'s
  dtype). With ``GemmConfig.collective_matmul`` each is decomposed into ring steps
  (``ppermute``), each chunk's GEMM running while the next chunk moves (collective matmul)."""
  fmt, config, axis = chain.format, chain.config, chain.plan.sequence[1]

  def gemm(x, dtype):
    return fmt.gemm(x, b, dtype, which, chain.recipe, config, chain.precision, None)

  if gather:
    if not config.collective_matmul:
      return gemm(_gathered_rows(a, axis, -2, config), out_dtype)
    return _ring_gather_gemm(a, gemm, out_dtype, axis)
  sum_dtype = np.dtype(out_dtype if config.partial_sums == "output" else np.float32)
  if not config.collective_matmul:
    y = gemm(a, sum_dtype).astype(sum_dtype)
    return _scattered_sums(y, axis, config).astype(out_dtype)
  return _ring_scatter_gemm(a, gemm, sum_dtype, axis).astype(out_dtype)


def _ring_gather_gemm(a, gemm, out_dtype, axis):
  """``gemm(all_gather(a rows))``: n steps; at step i each device multiplies the rows of device
  ``(j + i) % n`` and passes them on to device ``j - 1``."""
  n, j = lax.axis_size(axis), lax.axis_index(axis)
  perm = [(d, (d - 1) % n) for d in range(n)]
  chunk, outs = a, []
  for i in range(n):
    outs.append(gemm(chunk, out_dtype))
    if i < n - 1:
      chunk = dataclasses.replace(chunk, data=_ppermute_bytes(chunk.data, axis, perm))
  y = jnp.stack(outs)  # outs[i]: the rows of device (j + i) % n
  y = jnp.take(y, (jnp.arange(n) - j) % n, axis=0)  # by device
  return y.reshape(n * y.shape[1], y.shape[2])


def _ring_scatter_gemm(a, gemm, sum_dtype, axis):
  """``psum_scatter(gemm(a))`` over the rows: n steps; at step t each device adds its partial
  product of row block ``(j - 1 - t) % n`` to the running sum it received from device ``j - 1``
  and passes it on to device ``j + 1``; after the last step device j holds block j's sum."""
  n, j = lax.axis_size(axis), lax.axis_index(axis)
  m = a.data.shape[-2] // n
  perm = [(d, (d + 1) % n) for d in range(n)]
  acc = None
  for t in range(n):
    block = (j - 1 - t) % n
    rows = lax.dynamic_slice_in_dim(a.data, block * m, m, axis=a.data.ndim - 2)
    part = gemm(dataclasses.replace(a, data=rows), sum_dtype).astype(sum_dtype)
    acc = part if acc is None else lax.ppermute(acc, axis, perm) + part
  return acc


def checked_state(recipe, state, layer: str | None = None):
  """One GEMM's recipe state, checked and typed where a call enters the core (``check_state``,
  its errors naming ``layer`` where given),
  and marked so that every use of one traced state gets the same max-marked arrays: a plain
  ``jax.grad`` then combines several uses by max, never by sum (see ``core.with_max_grad``).
  ``dot_general`` and the fused paths take their state through it."""
  state = check_state(recipe, state, layer)
  return shared_max_grad(state) if state else state


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _checked_under_grad(lhs, rhs, dn, rhs_shape, recipe, no_rng) -> tuple[jax.Array, jax.Array]:
  """``(lhs, rhs)``; under differentiation, first the checks of the format's backward GEMMs
  (blocks that must tile M and N, a missing PRNG key), so the same input gets the same error at
  every size, the GEMMs below the size threshold included."""
  del dn, rhs_shape, recipe, no_rng
  return lhs, rhs


def _checked_fwd(lhs, rhs, dn, rhs_shape, recipe, no_rng):
  fmt = formats.format_of(recipe)
  fmt.check(recipe, GemmLayout(dn, lhs.shape, rhs_shape), True, lhs, rhs)
  if recipe.uses_rng and no_rng:
    raise ValueError(
      f"{type(recipe).__name__} rounds the gradient stochastically: pass rng=<PRNG key> to "
      "dot_general (a fresh key per step), or use disable_stochastic_rounding=True"
    )
  return (lhs, rhs), None


def _checked_bwd(dn, rhs_shape, recipe, no_rng, residuals, g):
  del dn, rhs_shape, recipe, no_rng, residuals
  return g


_checked_under_grad.defvjp(_checked_fwd, _checked_bwd)


def _high_precision_dot_general(lhs, rhs, state, dn, precision, preferred_element_type, plan):
  """The GEMM below the size threshold: ``lax.dot_general`` on the unquantized operands."""
  # FSDP inside shard_map: the kernel is a shard, gathered (and its gradient reduce-scattered by
  # autodiff) in high precision; under jit the gather is a sharding constraint.
  rhs = sharding.gather_kernel(rhs, plan)
  y = lax.dot_general(
    lhs, rhs, dn, precision, preferred_element_type, out_sharding=plan.out_sharding
  )
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  return _keep_state(y, state) if state else y


@jax.custom_vjp
def _keep_state(y, state):
  """``y``, with the state's gradient set to the unchanged state (its "new state")."""
  del state
  return y


def _keep_state_fwd(y, state):
  return y, (state, jax.tree_util.tree_map(sharding.type_witness, state))


def _keep_state_bwd(residuals, g):
  state, witness = residuals
  return g, _match_state(jax.tree_util.tree_map(_unchanged, state), witness)


def _match_state(new_state, witness):
  """The new state, each leaf with its old leaf's varying mesh axes (see ``match_cotangent``)."""
  return jax.tree_util.tree_map(sharding.match_cotangent, new_state, witness)


def _unchanged(leaf):
  # Marked for max (always, under differentiation): the identity of the max/scale combination
  # (-inf): this use contributes nothing, so other uses of the state win, and alone it decodes
  # to the old state. Plain float32: the old value itself.
  if is_accumulating(leaf):
    return lax.convert_element_type(jnp.full(leaf.shape, -jnp.inf, jnp.float32), leaf.dtype)
  return leaf


_keep_state.defvjp(_keep_state_fwd, _keep_state_bwd)


# For tests and tools: roles in the order the state lists them.
STATE_ROLES = ROLES


# ---------------------------------------------------------------------------------------------
# The one quantized GEMM rule. The operands are brought to x3 (.., M, K) and w3 (.., N, K) (or a
# Dense kernel as stored, (.., K, N)) outside the VJP (plain JAX transposes and reshapes, which
# XLA fuses into the casts; autodiff transposes the cotangents back), and inside it each operand
# is quantized into the copies its GEMMs need, in the pass that reads it:
#   y  (M, N) = q(x3)     . q(w3)^T      contracting K
#   dx (M, K) = q(g)      . q(w3^T)^T    contracting N
#   dw (K, N) = q(x3^T)   . q(g^T)^T     contracting M  (then transposed back to (N, K), which
#                                                       cancels against the caller's transpose)
# A chain of such GEMMs (the MLP block: GEMM 1, activation, GEMM 2) runs in the same rule, so
# that what sits before or between GEMMs (a norm, an activation and its gradient, a bias's
# gradient) is the format's quantize with a producer: cast to FP8 in the pass that computes it.


@dataclasses.dataclass(frozen=True)
class Stage:
  """One GEMM of a chain (static).

  Attributes:
    out_dtype: the GEMM's output dtype.
    kernel_kn: the kernel is ``(.., K, N)``, as a Dense kernel is stored (its two FP8 copies
      trade places), else ``(.., N, K)``.
    name: the ``checkpoint_name`` of the GEMM's output (before any bias).
    activation: between this GEMM and the next: an object with ``quantize(fmt, request, h, b)
      -> Quantized`` (the next GEMM's FP8 input ``act(h + b)``, cast as it is computed) and
      ``quantize_grad(fmt, request, dz, h, b) -> (Quantized, dbias)`` (this GEMM's FP8 output
      gradient ``dz * act'(h + b)`` and the float32 gradient of ``b``); None for the last GEMM.
    bias_grad: for the last GEMM, with a bias: an object with ``quantize_grad(fmt, request, g)
      -> (Quantized, dbias)`` (the output gradient in FP8, the bias's float32 gradient summed in
      the same pass).
  """

  out_dtype: np.dtype
  kernel_kn: bool
  name: str = _remat.GEMM_OUTPUT
  activation: Any = None
  bias_grad: Any = None


@dataclasses.dataclass(frozen=True)
class Chain:
  """The static facts of one quantized GEMM or a chain of them (a hashable argument of the VJP).

  Attributes:
    recipe, plan, config, precision: as ``dot_general`` takes them.
    stages: the GEMMs, in order.
    lhs: how the first GEMM's input is made from the chain's input arrays: None (the input is
      ``x3``), or an object with ``quantize(fmt, request, *inputs) -> (Quantized, residuals)``
      and ``backward(residuals, d_operand) -> the inputs' cotangents`` (a norm, cast to FP8 in
      the pass that computes it).
    layer: what the kernels' ``ShardingFallbackWarning`` calls the chain (None: the GEMM).
  """

  recipe: Any
  plan: Any
  config: GemmConfig
  precision: Any
  stages: tuple[Stage, ...]
  lhs: Any = None
  layer: str | None = None

  @property
  def format(self):
    return formats.format_of(self.recipe)


def quantized_gemms(inputs, kernels, biases, states, rng, chain: Chain):
  """The chain's output ``q(... act(q(lhs(inputs)) . q(w0)^T + b0) ...) . q(wn)^T + bn``.

  Args:
    inputs: the first GEMM's input arrays (``(x3,)`` without ``chain.lhs``).
    kernels, biases, states: one per stage (a bias None: none; the last one's gradient needs
      the stage's ``bias_grad``).
    rng: the PRNG key for stochastic rounding of the output gradient, or None; or a tuple of
      one key per stage (each stage's output gradient rounds with its own).
    chain: the ``Chain``.

  Returns:
    The last GEMM's output. The gradient with respect to each state is its next value.
  """
  n = len(chain.stages)
  if not (len(kernels) == len(biases) == len(states) == n):
    raise ValueError(f"a chain of {n} GEMMs takes {n} kernels, biases and states")
  if biases[-1] is not None and chain.stages[-1].bias_grad is None:
    raise ValueError("the last GEMM's bias needs the stage's bias_grad")
  return _quantized_gemms(tuple(inputs), tuple(kernels), tuple(biases), tuple(states), rng, chain)


def _sharded_dims(entries) -> list[int]:
  """The dims a spec's ``entries`` shard."""
  return [d for d, e in enumerate(entries) if sharding.axis_tuple(e, "spec entry")]


def _without(entries, dims):
  """``entries`` with those of ``dims`` replicated."""
  return PartitionSpec(*(None if d in dims else e for d, e in enumerate(entries)))


def _shard_count(mesh, entries, dims) -> int:
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  return int(np.prod([sizes[a] for d in dims for a in sharding.axis_tuple(entries[d], "entry")]))


def _served(lhs, rhs, dn, plan, layer, kernel_sharding=None):
  """The layout that serves the operands' shardings, and the operands and plan it can take.

  Each group of dims the GEMM flattens is ordered with a sharded dim first (``GemmLayout``);
  dims sharded beside it are gathered (an operand on Explicit axes is resharded without them;
  the output is computed without them, to be resharded to ``out_sharding`` after), with a
  ``ShardingFallbackWarning`` that names ``layer`` and the cost. Returns ``(layout, lhs, rhs,
  plan, out_sharding)``: ``out_sharding`` is the one to reshard the output to (None: none).
  """
  explicits = [sharding.explicit_sharding(operand) for operand in (lhs, rhs)]
  specs = [None if explicit is None else tuple(explicit.spec) for explicit in explicits]
  out = plan.out_sharding
  out_entries = None
  if out is not None:
    spec = out.spec if isinstance(out, NamedSharding) else out
    (lc, _), (lb, _) = dn
    out_ndim = lhs.ndim + rhs.ndim - 2 * len(lc) - len(lb)
    out_entries = tuple(spec) + (None,) * (out_ndim - len(tuple(spec)))
  gather = plan.kernel_all_gather
  rhs_spec = specs[1]
  if rhs_spec is None and kernel_sharding is not None and not sharding.manual_axes():
    hint = tuple(getattr(kernel_sharding, "spec", kernel_sharding))
    # An annotation orders the layout only, and only the kernel's free dims: the contracting
    # and batch groups are the input's too, whose sharding under Auto axes is not known here
    # (a kernel resharded to the input's order costs less than the input resharded to it).
    (_, rc), (_, rb) = dn
    if len(hint) <= rhs.ndim:
      rhs_spec = tuple(None if d in rc or d in rb else e for d, e in enumerate(hint))
  rhs_sharded = set(_sharded_dims(rhs_spec or ()))
  if gather is not None:
    rhs_sharded |= {d for d, axes in enumerate(gather) if axes}
  sharded = (_sharded_dims(specs[0] or ()), sorted(rhs_sharded), _sharded_dims(out_entries or ()))
  gemm_rhs_shape = sharding.gathered_kernel_type(rhs, plan).shape
  layout = GemmLayout(dn, lhs.shape, gemm_rhs_shape, sharded)
  unserved_lhs, unserved_rhs, unserved_out = layout.unserved
  if gather is not None and any(gather[d] for d in unserved_rhs):
    return layout, lhs, rhs, plan, None  # plan_for_tn_layout refuses it, naming the layer
  operands = [lhs, rhs]
  for i, (name, dims) in enumerate((("input", unserved_lhs), ("kernel", unserved_rhs))):
    current = explicits[i]
    if not dims or current is None:
      continue
    operand = operands[i]
    count = _shard_count(current.mesh, specs[i], dims)
    warnings.warn(
      f"{layer}: the {name} {tuple(operand.shape)} {operand.dtype} is sharded as "
      f"{current.spec} and the GEMM flattens its dims {list(dims)} with another sharded dim "
      f"into one, which can keep only one dim's shards; it is all-gathered over dims "
      f"{list(dims)} before the GEMM on every call ({count}x each device's share of the "
      f"{name}, and of its part of the GEMM). Shard only one dim of each group (batch, free, "
      "contracting dims) to avoid it.",
      ShardingFallbackWarning,
      stacklevel=caller_stacklevel(),
    )
    operands[i] = jax.sharding.reshard(operand, current.update(spec=_without(specs[i], dims)))
  restore = None
  if unserved_out:
    reduced = _without(out_entries, unserved_out)
    mesh = out.mesh if isinstance(out, NamedSharding) else sharding.abstract_mesh()
    count = _shard_count(mesh, out_entries, unserved_out)
    warnings.warn(
      f"{layer}: out_sharding {out_entries} shards dims {list(unserved_out)} of the output "
      f"{layout.out_shape} beside another dim that the GEMM writes into the same flattened "
      f"dim; the GEMM computes its output sharded as {tuple(reduced)} ({count}x each "
      "device's share) and then keeps each device's share. Shard only one dim of each group "
      "to avoid it.",
      ShardingFallbackWarning,
      stacklevel=caller_stacklevel(),
    )
    restore = out
    reduced = out.update(spec=reduced) if isinstance(out, NamedSharding) else reduced
    plan = dataclasses.replace(plan, out_sharding=reduced)
  return layout, operands[0], operands[1], plan, restore


def _contracting_last(
  lhs,
  rhs,
  state,
  rng,
  dn,
  precision,
  out,
  recipe,
  plan,
  config,
  fmt,
  layer,
  kernel_sharding=None,
):
  dn = sorted_contracting(dn)
  layout, lhs, rhs, plan, restore = _served(lhs, rhs, dn, plan, layer, kernel_sharding)
  lead = layout.lead if fmt.per_tensor else (layout.b,)  # block GEMMs take (B, M, K) always
  # The kernel's own (N, K): inside shard_map with kernel_all_gather, that of its shard.
  local = layout.kernel_shape(rhs.shape)
  if fmt.per_tensor:
    plan = sharding.plan_for_tn_layout(plan, layout, layer)
  else:
    # Explicit mesh axes: the forward GEMM's output sharding, in the (B, M, N) layout.
    out3 = sharding.explicit_sharding(out)
    if out3 is not None:
      entries = layout.in_gemm_order(tuple(out3.spec))
      if restore is not None:
        entries = _without(entries, [layout.out_order.index(d) for d in layout.unserved[2]])
      out3 = sharding.reshaped_sharding(
        out3.update(spec=PartitionSpec(*entries)),
        layout.split_out_shape,
        (layout.b, layout.m, layout.n),
      )
    plan = dataclasses.replace(plan, out_sharding=out3)
  # A kernel stored contracting-first (a Dense kernel (K, N)) goes in as it is: the cast writes
  # both orientations anyway, so a transpose here would be a pass for nothing (1 GB of float32
  # read and written for seed 000's kernel).
  identity = tuple(range(rhs.ndim))
  kernel_kn = (
    plan.kernel_all_gather is None and layout.rhs_perm != identity and layout.rhs_stored_kn
  )
  # Under Explicit mesh axes the reshapes name their output sharding (a clear error where a
  # merge would split a sharded dimension's shards).
  x3 = sharding.reshape(jnp.transpose(lhs, layout.lhs_perm), lead + (layout.m, layout.k))
  if kernel_kn:
    w3 = sharding.reshape(rhs, lead + local[::-1])
  else:
    w3 = sharding.reshape(jnp.transpose(rhs, layout.rhs_perm), lead + local)
  stage = Stage(out_dtype=np.dtype(out.dtype), kernel_kn=kernel_kn)
  chain = Chain(recipe, plan, config, precision, (stage,), layer=layer)
  y3 = _quantized_gemms((x3,), (w3,), (None,), (state,), rng, chain)
  split = layout.split_out_shape
  if plan.sequence is not None:  # the output's leading rows: all of them, or this shard's
    n_seq = lax.axis_size(plan.sequence[1])
    rows = split[0] * n_seq if plan.sequence[0] == "all_gather" else split[0] // n_seq
    split = (rows, *split[1:])
  y = sharding.reshape(y3, split)
  if layout.out_perm is not None:
    y = jnp.transpose(y, layout.out_perm)  # the dims the layout ordered first, put back
  if restore is not None:  # each device keeps its share of out_sharding (a slice)
    if sharding.explicit_sharding(y) is not None:
      y = jax.sharding.reshard(y, restore)
    else:
      y = lax.with_sharding_constraint(y, restore)
  return y


def _swap_last(a):
  return jnp.swapaxes(a, -1, -2)


def _request(x, role, chain, state, **kw):
  return QuantizeRequest(x, role, chain.recipe, state, chain.plan, chain.config, **kw)


def _proto(a):
  return None if a is None else np.zeros((0,), a.dtype)


def _whole_where_gathered(q, plan, kernel_dim: int):
  """Both copies of the operand a GEMM contracts with the FSDP-gathered kernel (x's along K,
  ``kernel_dim=-1``; the gradient's along N, ``-2``), whole on that dim under Auto mesh axes
  (``sharding.whole_where_gathered``): the rows copy (.., M, C) on its last dim, the swapped
  copy (.., C, M) on the one before."""
  if plan.kernel_all_gather is None:
    return q

  def whole(t, dim):
    if t is None:
      return None
    data = sharding.whole_where_gathered(t.data, plan, kernel_dim, t.data.ndim + dim)
    return dataclasses.replace(t, data=data)

  return q._replace(rows=whole(q.rows, -1), cols=whole(q.cols, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _quantized_gemms(inputs, kernels, biases, states, rng, chain: Chain):
  # Not differentiated (inference): only the copies the forward GEMMs take.
  with warning_site(chain.layer, caller_site()):
    y, _ = _forward(inputs, kernels, biases, states, rng, chain, backward=False)
  return y


def _quantized_gemms_fwd(inputs, kernels, biases, states, rng, chain: Chain):
  with warning_site(chain.layer, caller_site()):
    return _forward(inputs, kernels, biases, states, rng, chain, backward=True)


def _forward(inputs, kernels, biases, states, rng, chain: Chain, backward: bool):
  fmt, plan, last = chain.format, chain.plan, len(chain.stages) - 1
  # The first GEMM's input in both orientations: this one for the forward GEMM, the swapped copy
  # (kept for the backward pass) for wgrad.
  lhs = inputs[0]
  whole = _gathers_unquantized(chain, "all_gather", lhs.dtype)
  # GemmConfig.sequence_gather: every device may quantize all the rows (the same values);
  # the cotangent still takes the shard's type (the witness below).
  request = _request(
    _gather_unquantized(lhs, plan) if whole else lhs, "x", chain, states[0], cols=backward
  )
  if chain.lhs is None:
    qx, lhs_residuals = fmt.quantize(request), None
  else:
    qx, lhs_residuals = chain.lhs.quantize(fmt, request, *inputs)
  saved, y = [], None
  for i, stage in enumerate(chain.stages):
    w3, state = kernels[i], states[i]
    qx = _whole_where_gathered(qx, plan, -1)
    shard = None
    if plan.kernel_all_gather is None:
      # The forward GEMM's copy is along K: the swapped one of a kernel stored (K, N).
      rows, cols = (backward, True) if stage.kernel_kn else (True, backward)
      qw = fmt.quantize(_request(w3, "kernel", chain, state, rows=rows, cols=cols))
      w_fwd, w_dgrad = (qw.cols, qw.rows) if stage.kernel_kn else (qw.rows, qw.cols)
      if backward:
        w_dgrad = _remat.name_quantized(w_dgrad, _remat.QUANTIZED_KERNEL)
    else:
      # FSDP (per-tensor formats): the FP8 shard is cast, named (a remat policy that saves only
      # it gathers again in the backward pass) and all-gathered; the gathered kernel is
      # transposed in FP8.
      qw = fmt.quantize(_request(w3, "kernel", chain, state, cols=False))
      shard = _remat.name_quantized(qw.rows, _remat.QUANTIZED_KERNEL)
      w_fwd = dataclasses.replace(shard, data=sharding.gather_kernel(shard.data, plan))
      w_dgrad = dataclasses.replace(w_fwd, data=_swap_last(w_fwd.data))
    x_wgrad = _remat.name_quantized(qx.cols, _remat.QUANTIZED_X) if backward else None
    if plan.sequence is None or whole:
      y = fmt.gemm(
        qx.rows,
        w_fwd,
        stage.out_dtype,
        "fwd",
        chain.recipe,
        chain.config,
        chain.precision,
        plan.out_sharding,
      )
    else:
      gather = plan.sequence[0] == "all_gather"
      if gather and x_wgrad is not None:  # wgrad's columns of every row
        x_wgrad = _gathered_rows(x_wgrad, plan.sequence[1], -1, chain.config)
      y = _sequence_gemm(qx.rows, w_fwd, stage.out_dtype, "fwd", chain, gather=gather)
    # Every GEMM's output under the library's name (what its remat policies save: on Hopper GPUs
    # the GEMM is an FFI call that JAX's dot policies miss), and a module's own name beside it.
    y = checkpoint_name(y, _remat.GEMM_OUTPUT)
    if stage.name != _remat.GEMM_OUTPUT:
      y = checkpoint_name(y, stage.name)
    new_fwd = {"x": qx.state, "kernel": qw.state}
    protos = (_proto(lhs), _proto(w3), _proto(biases[i]))
    # Zero-size arrays with the primals' varying mesh axes (shard_map only; None elsewhere).
    witness = jax.tree_util.tree_map(sharding.type_witness, (lhs, w3, state, biases[i]))
    between = None
    if i < last:
      # The next GEMM's input, cast from this one's output in the pass that computes it.
      between = (y, biases[i])
      lhs = y
      qx = stage.activation.quantize(fmt, _request(y, "x", chain, states[i + 1]), y, biases[i])
    elif biases[i] is not None:
      y = y + biases[i].astype(y.dtype)
    saved.append((x_wgrad, w_dgrad, shard, new_fwd, between, protos, witness))
  inputs_witness = jax.tree_util.tree_map(sharding.type_witness, inputs)
  return y, (tuple(saved), lhs_residuals, states, rng, inputs_witness)


def _quantized_gemms_bwd(chain: Chain, residuals, g):
  # Traced where the user takes the gradient: the kernels' warnings point at that line.
  with warning_site(chain.layer, caller_site()):
    return _backward(chain, residuals, g)


def _backward(chain: Chain, residuals, g):
  saved, lhs_residuals, states, rng, inputs_witness = residuals
  fmt, last = chain.format, len(chain.stages) - 1
  keys = rng if isinstance(rng, tuple) else (rng,) * (last + 1)
  d_kernels, d_biases, new_states = [None] * (last + 1), [None] * (last + 1), [None] * (last + 1)
  dz = None
  for i in reversed(range(last + 1)):
    stage, state = chain.stages[i], states[i]
    x_wgrad, w_dgrad, shard, new_fwd, between, protos, witness = saved[i]
    x_proto, w_proto, b_proto = protos
    # Inside shard_map each shard of the gradient rounds with its own key.
    key = sharding.shard_key(keys[i], g if i == last else dz)
    # The output gradient's rows gathered unquantized (GemmConfig.sequence_gather): cast whole,
    # then the plain dgrad.
    whole = _gathers_unquantized(chain, "reduce_scatter", g.dtype)
    if i < last:
      h, b = between
      request = _request(h, "grad", chain, state, key=key)
      qg, db = stage.activation.quantize_grad(fmt, request, dz, h, b)
    elif stage.bias_grad is not None and b_proto is not None:
      qg, db = stage.bias_grad.quantize_grad(fmt, _request(g, "grad", chain, state, key=key), g)
    else:
      g_in = _gather_unquantized(g, chain.plan) if whole else g
      qg, db = fmt.quantize(_request(g_in, "grad", chain, state, key=key)), None
    qg = _whole_where_gathered(qg, chain.plan, -2)
    if db is not None and b_proto is not None:  # summed over the rows of every shard
      d_biases[i] = sharding.match_cotangent(db, witness[3]).astype(b_proto.dtype)
    ndim = x_wgrad.data.ndim
    swap = (*range(ndim - 2), ndim - 1, ndim - 2)
    # With Explicit mesh axes each cotangent gets its primal's sharding.
    dx_sharding = sharding.transposed_out_sharding(x_wgrad.data, swap)
    w3_layout = w_dgrad if shard is None else shard
    dw_sharding = sharding.transposed_out_sharding(
      w3_layout.data, swap if shard is not None else None
    )
    # Inside shard_map a cotangent is summed over the mesh axes its primal is replicated on:
    # block formats sum the input gradient in float32, and every format the weight gradient.
    dx_dtype = x_proto.dtype
    if witness[0] is not None and not fmt.per_tensor:
      dx_dtype = np.dtype(np.float32)
    g_cols, seq = qg.cols, chain.plan.sequence
    if seq is None or whole:
      dx = fmt.gemm(
        qg.rows,
        w_dgrad,
        dx_dtype,
        "dgrad",
        chain.recipe,
        chain.config,
        chain.precision,
        dx_sharding,
      )
    else:
      # The output gradient's FP8 rows gathered (row-parallel), or the input gradient's partial
      # sums scattered back onto the input's rows (column-parallel).
      gather = seq[0] == "reduce_scatter"
      if gather:
        g_cols = _gathered_rows(g_cols, seq[1], -1, chain.config)
      dx = _sequence_gemm(qg.rows, w_dgrad, dx_dtype, "dgrad", chain, gather=gather)
    dw_dtype = sharding.wgrad_dtype(w_proto.dtype, witness[1])
    dw = fmt.gemm(
      x_wgrad, g_cols, dw_dtype, "wgrad", chain.recipe, chain.config, chain.precision, dw_sharding
    )
    if not stage.kernel_kn:
      dw = _swap_last(dw)  # (.., N, K); cancels against the caller's transpose
    dw = sharding.scatter_kernel_grad(dw, None if shard is None else shard.data, chain.plan)
    dz = sharding.match_cotangent(dx, witness[0]).astype(x_proto.dtype)  # (.., M, K)
    d_kernels[i] = sharding.match_cotangent(dw, witness[1]).astype(w_proto.dtype)
    new_state = fmt.next_state(chain.recipe, state, {**new_fwd, "grad": qg.state})
    new_states[i] = _match_state(new_state, witness[2])
  d_inputs = (dz,) if chain.lhs is None else tuple(chain.lhs.backward(lhs_residuals, dz))
  # Inside shard_map a norm's gamma and beta are summed over the shards' rows too.
  d_inputs = tuple(
    sharding.match_cotangent(d, w) for d, w in zip(d_inputs, inputs_witness, strict=True)
  )
  return d_inputs, tuple(d_kernels), tuple(d_biases), tuple(new_states), None


_quantized_gemms.defvjp(_quantized_gemms_fwd, _quantized_gemms_bwd)
