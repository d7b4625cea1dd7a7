"""Grouped GEMM for mixture-of-experts: a quantized ``ragged_dot`` with a custom VJP.

``lhs`` [M, K] holds the rows of G groups one after another (group g has ``group_sizes[g]`` rows;
rows past ``sum(group_sizes)`` belong to no group), ``rhs`` [G, K, N] holds one kernel per group,
and row ``i`` of the output is ``lhs[i] @ rhs[group(i)]`` (zero for rows past the groups).

Every quantity here is computed on the device from ``group_sizes``: the row-to-group map, the
per-group amaxes and scales. Nothing is copied to the host and nothing waits for it, so the op
runs under ``jit`` with group sizes produced by a router. The three GEMMs are
``jax.lax.ragged_dot_general`` calls with FP8 operands, so their speed is that of XLA's lowering:
XLA's GPU compiler (its ``RaggedDotRewriter``) expands a ragged dot into a dense dot over a
group-masked operand, G times the FLOPs; ``bench/ragged.py`` measures what that costs. On a
Hopper GPU with the extension built with CUTLASS (``TE_ADAPTERS_CUTLASS_DIR``), the per-tensor
recipes run the three GEMMs on the native grouped GEMM instead (``_grouped_kernel``), the same
FP8 operands and per-group scales, with the recipe's accumulation per GEMM; and with
``recipe=None`` bfloat16 operands run there too (float32 sums, ``bf16_ragged_dot``).
``MXFP8BlockScaling`` (block scales, no state) is in ``_ragged_mxfp8``.

Scales are **per group** for every role: the rows of group g (x, and the output gradient) share
one scale, and expert g's kernel has its own. Measured on CPU with ``bench/ragged_scales.py``
(current scaling, HYBRID, M=4096, K=N=256, G=8; normwise relative error against float64, per-group
vs per-tensor scales):

- N(0,1) data, random routing: fwd 0.0374 vs 0.0374, dgrad 0.0589 vs 0.0589, wgrad 0.0589 vs
  0.0589. The same, since every group has about the same amax.
- One expert's kernel scaled by 1e-3 or more: the same. By 1e-4: that expert's fwd 0.037 vs
  0.064 and dgrad 0.059 vs 0.079; by 1e-5: 0.037 vs 0.58 and 0.059 vs 0.58.
- x rows of group j scaled by gates spread from 1 down to 1e-3: the same; down to 1e-5: the
  smallest group's fwd 0.037 vs 0.52 and wgrad 0.059 vs 0.52. Output gradients scaled the same
  way stay equal (E5M2's range covers 1e-5).
- Delayed scaling (history 16) over 12 steps with skewed routing (the rarest expert gets 1% of
  the tokens): that expert's fwd 0.0375 vs 0.0374, dgrad 0.0593 vs 0.0590. A per-group history
  does not hurt small groups.

So per-group scales match per-tensor ones on ordinary data and keep a group whose values are
1e4 or more below the others' from falling into FP8's subnormals. They cost no extra pass over
memory (a segment-max over the row amaxes, and a per-row factor on the GEMM output where a
per-tensor scale needs a scalar one), and under expert parallelism a per-expert amax needs no
collective across expert shards. The state of ``DelayedScaling`` therefore holds one scale and one
amax history per group: ``{role}_scale`` (G, 1) and ``{role}_amax_history`` (G, L), that is, G
stacked copies of one GEMM's state (slice g is what ``dot_general`` would keep for expert g).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from te_adapters.core import formats
from te_adapters.core import state as core_state
from te_adapters.core.formats import _mxfp8, _scaling
from te_adapters.core.gemm import _frozen, _grouping, _ragged_mxfp8, _remat
from te_adapters.core.gemm._grouping import row_groups
from te_adapters.core.kernels import _grouped_kernel
from te_adapters.core.recipes import check_recipe
from te_adapters.core.state import DelayedScalingState

__all__ = ["ragged_dot", "init_ragged_state", "check_ragged_state"]

# Row i of lhs (or of the output gradient) times kernel group(i); contracting the output
# gradient's N with the kernel's N gives dx; contracting the ragged rows gives one dW per group.
_FWD_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)
_DGRAD_DIMS = _grouping.ROWS_TIMES_GROUP_KERNEL_DIMS
_WGRAD_DIMS = _grouping.PER_GROUP_WGRAD_DIMS

# cuBLAS FP8 GEMMs need the contracting and output feature sizes to be multiples of 16.
_FP8_ALIGNMENT = 16


def init_ragged_state(recipe, num_groups: int) -> DelayedScalingState | dict:
  """The initial state of one grouped GEMM (``ragged_dot``) with ``num_groups`` groups.

  For ``DelayedScaling``: a ``DelayedScalingState`` with ``{x,kernel,grad}_scale`` float32
  (G, 1), ones, and ``{x,kernel,grad}_amax_history`` float32 (G, L), zeros; slice ``g`` of each
  is the state of expert g. An ``EmptyState`` for stateless recipes.

  Args:
    recipe: a recipe instance.
    num_groups: G, the number of groups (experts).

  Returns:
    The state (an ``EmptyState`` for stateless recipes).

  Example:
    >>> import te_adapters as ta
    >>> s = ta.core.init_ragged_state(ta.DelayedScaling(amax_history_len=4), 8)
    >>> s["x_scale"].shape, s["x_amax_history"].shape
    ((8, 1), (8, 4))
  """
  recipe = check_ragged_recipe(recipe)
  num_groups = _check_num_groups(num_groups)
  one = formats.format_of(recipe).init_state(recipe)
  return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_groups, *leaf.shape)), one)


_SUPPORTED = (
    "DelayedScaling, Float8CurrentScaling and MXFP8BlockScaling (or recipe=None for a "
    "high-precision GEMM)"
)


# The block-scaled formats with a grouped GEMM, and it: ``(lhs, rhs, group_sizes, out_dtype,
# recipe) -> [M, N]``. A format missing here is refused by ``ragged_dot``.
GROUPED_GEMMS = {_mxfp8.FORMAT: _ragged_mxfp8.mxfp8_ragged_dot}


def check_ragged_recipe(recipe):
  """``check_recipe`` for grouped GEMMs: also refuses the recipes ``ragged_dot`` lacks."""
  recipe = check_recipe(recipe)
  if recipe.block_scaled and formats.block_of(recipe) not in GROUPED_GEMMS:
    raise NotImplementedError(
        f"ragged_dot does not implement {type(recipe).__name__}; grouped GEMMs support "
        f"{_SUPPORTED}"
    )
  return recipe


def _check_num_groups(num_groups) -> int:
  if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
    raise TypeError(f"num_groups must be an int, got {num_groups!r}")
  if num_groups < 1:
    raise ValueError(f"num_groups must be >= 1, got {num_groups}")
  return int(num_groups)


def _expected_shapes(recipe, num_groups: int) -> dict[str, tuple[int, ...]]:
  if recipe.block_scaled:
    return {}
  shapes = formats.format_of(recipe).state_shapes(recipe)
  return {name: (num_groups, *shape) for name, shape in shapes.items()}


def check_ragged_state(recipe, state: Mapping[str, Any] | None, num_groups: int):
  """Validates the state of a grouped GEMM against ``recipe``; returns it typed (``typed_state``);
  raises naming the mismatch."""
  expected = _expected_shapes(recipe, num_groups)
  if state is None:
    if expected:
      raise ValueError(
          f"{type(recipe).__name__} keeps state: pass "
          f"state=te_adapters.core.init_ragged_state(recipe, {num_groups})"
      )
    return formats.typed_state(recipe, {})

  def bad_shape(name, got, shape):
    hint = ""
    if got in ((1,), (recipe.amax_history_len,)):
      hint = " (this is one GEMM's state; use init_ragged_state(recipe, num_groups))"
    return (
        f"state[{name!r}] has shape {got} but {num_groups} groups under {recipe!r} need "
        f"{shape}{hint}"
    )

  core_state.warn_dict_state(
      state, f"te_adapters.core.init_ragged_state(recipe, {num_groups}), or "
      "te_adapters.core.typed_state(recipe, saved) for a saved dict")
  core_state.check_leaves(
      state,
      expected,
      mismatch=f"state does not match {recipe!r} for a grouped GEMM",
      bad_shape=bad_shape,
  )
  return formats.typed_state(recipe, state)


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    out_sharding=None,
    *,
    recipe,
    state=None,
):
  """``jax.lax.ragged_dot`` with FP8 operands, per ``recipe``: the grouped GEMM of an MoE layer.

  Has ``jax.lax.ragged_dot``'s signature plus keywords, so
  ``functools.partial(ragged_dot, recipe=r, state=s)`` replaces it. Group sizes stay on the
  device (no host transfer or synchronisation), so they may come from a router under ``jit``.
  The VJP computes dgrad grouped like the forward pass and one weight gradient per group; an
  empty group gets zero output rows and a zero weight gradient.

  Per-tensor recipes: scales are per group (see the module docstring for the measurements
  behind that choice).

  ``MXFP8BlockScaling``: each GEMM quantizes both operands in blocks of 32 along the dimension it
  contracts, each copy from the high-precision input, with TE's E8M0 round-up rule, exactly as
  ``dot_general`` does. Forward: lhs rows in 1x32 blocks along K, each expert's kernel in
  blocks along K. Dgrad: the output gradient along N, each kernel along N. Wgrad contracts the
  rows of each group, so lhs and the output gradient are quantized in blocks of 32 rows that
  never cross a group boundary: each group's blocks start at its first row, and its last block
  is completed with zero rows (the result equals padding every group with zeros to a multiple
  of 32, as TE's MXFP8 grouped GEMM requires, and dropping the padding afterwards; group sizes
  need not be multiples of 32). K must be a multiple of 32, and N too when differentiating. No
  state. The GEMMs are emulated (dequantized values, float32 accumulation); see
  ``_ragged_mxfp8``. ``NVFP4BlockScaling`` and ``Float8BlockScaling`` are not implemented.

  Args:
    lhs: [M, K] rows of all groups, group by group (real floating point).
    rhs: [G, K, N] one kernel per group (real floating point).
    group_sizes: [G] integers on the device, non-negative with ``sum(group_sizes) <= M``; rows
      past the sum give zero output rows (and zero gradient).
    precision: passed to the GEMMs (FP8 GEMMs accumulate in float32 whatever it says); the
      emulated MXFP8 GEMMs always accumulate in float32 and do not use it.
    preferred_element_type: output dtype; default as ``jax.lax.ragged_dot`` would give.
    group_offset: must be ``None`` (sharded group offsets are not supported).
    out_sharding: as for ``jax.lax.ragged_dot``. On Explicit mesh axes the output takes it, or
      by default lhs's sharding of its rows and rhs's of its columns, and each gradient its
      operand's sharding; elsewhere it constrains the output's sharding. Expert parallelism:
      under ``jit`` with the experts' kernel and recipe state sharded over a mesh axis (Auto or
      Explicit), or inside ``shard_map`` with each device's own experts and tokens; each equals
      one device.
    recipe: a recipe (``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``), or
      ``None`` for a plain ``jax.lax.ragged_dot`` in the operands' precision. With ``None``,
      bfloat16 operands and a bfloat16 result on a Hopper GPU with the grouped GEMM built (and
      no ``out_sharding``), the three GEMMs run on the native grouped kernel with float32 sums
      instead of XLA's ragged dot.
    state: this GEMM's recipe state (``init_ragged_state(recipe, G)``); ``None`` for stateless
      recipes.

  Returns:
    [M, N], with the dtype ``jax.lax.ragged_dot`` gives. Under differentiation, the gradient with
    respect to ``state`` is the state for the next step.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((32, 16)), jnp.ones((2, 16, 16))
    >>> gs = jnp.array([8, 16], jnp.int32)  # rows 24..31 belong to no group
    >>> y = ta.core.ragged_dot(x, w, gs, recipe=ta.Float8CurrentScaling())
    >>> round(float(y[0, 0]), 4), float(y[31, 0])
    (16.0, 0.0)
  """
  formats.check_float_operand("lhs", lhs)
  formats.check_float_operand("rhs", rhs)
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be 2-D [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be 3-D [G, K, N], got shape {rhs.shape}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
        f"contracting sizes differ: lhs {lhs.shape} has K={lhs.shape[1]}, rhs {rhs.shape} has "
        f"K={rhs.shape[1]}"
    )
  group_sizes = _check_group_sizes(group_sizes, rhs.shape[0])
  if group_offset is not None:
    raise NotImplementedError("group_offset is not supported; pass group_offset=None")
  # The dtype lax.ragged_dot gives (its rule is dot_general's), from shapes without shardings:
  # ragged_dot_general has no sharding inference on Explicit mesh axes.
  out_dtype = jax.eval_shape(
      functools.partial(
          lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())), precision=precision,
          preferred_element_type=preferred_element_type,
      ),
      jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype),
  ).dtype
  if recipe is None:
    if state:
      raise ValueError("state was given but recipe is None")
    if out_sharding is None and _grouped_kernel.bf16_refusal(lhs, rhs, out_dtype) is None:
      # Hopper with the grouped GEMM built: bfloat16 in and out, float32 sums, as XLA's.
      return _grouped_kernel.bf16_ragged_dot(lhs, rhs, group_sizes)
    return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type,
                          out_sharding=out_sharding)
  recipe = check_ragged_recipe(recipe)
  if not recipe.block_scaled:
    _check_fp8_sizes(lhs.shape[1], rhs.shape[2])
  state = check_ragged_state(recipe, state, rhs.shape[0])
  if recipe.block_scaled:
    grouped_gemm = GROUPED_GEMMS[formats.block_of(recipe)]

    def call(lhs, rhs, group_sizes, state):
      del state
      return grouped_gemm(lhs, rhs, group_sizes, out_dtype, recipe)
  else:
    if state:
      # Under differentiation: warns at trace time when the state would stay frozen.
      lhs, rhs, state = _frozen.watch_state(lhs, rhs, state)
    operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    # On Hopper with the extension's CUTLASS grouped GEMM built, the three GEMMs run natively.
    native = _grouped_kernel.refusal(lhs, rhs, recipe, (out_dtype, *operand_dtypes)) is None

    def call(lhs, rhs, group_sizes, state):
      return _fp8_ragged_dot(
          lhs, rhs, group_sizes, state, precision, np.dtype(out_dtype), operand_dtypes, recipe,
          "group", native,
      )

  explicit = _explicit_out_sharding(lhs, rhs, out_sharding)
  if explicit is None:
    y = call(lhs, rhs, group_sizes, state)
    return y if out_sharding is None else lax.with_sharding_constraint(y, out_sharding)
  # Explicit mesh axes: the quantization mixes per-group and per-row arrays, which XLA's
  # partitioner places itself with the axes Auto; the output gets the sharding asked for, and
  # each gradient its operand's.
  return jax.sharding.auto_axes(call, out_sharding=explicit)(lhs, rhs, group_sizes, state)


def _explicit_out_sharding(lhs, rhs, out_sharding):
  """The output's ``PartitionSpec`` on Explicit mesh axes (the caller's, or lhs's rows and
  rhs's columns); None when no operand lies on Explicit axes."""
  specs = []
  for a in (lhs, rhs):
    sharding = getattr(jax.typeof(a), "sharding", None)
    explicit = (isinstance(sharding, NamedSharding) and not sharding.mesh.empty
                and any(t == AxisType.Explicit for t in sharding.mesh.axis_types))
    specs.append(tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
                 if explicit else None)
  if specs == [None, None]:
    return None
  if out_sharding is not None:
    return out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
  rows = specs[0][0] if specs[0] is not None else None
  cols = specs[1][2] if specs[1] is not None else None
  return PartitionSpec(rows, cols)


def _check_group_sizes(group_sizes, num_groups: int) -> jax.Array:
  if not hasattr(group_sizes, "dtype"):
    group_sizes = np.asarray(group_sizes)
  dtype = np.dtype(group_sizes.dtype)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"group_sizes must be an integer array, got dtype {dtype}")
  group_sizes = jnp.asarray(group_sizes)
  if group_sizes.shape != (num_groups,):
    raise ValueError(
        f"group_sizes must have shape ({num_groups},), one size per group of rhs, got "
        f"{group_sizes.shape}"
    )
  return group_sizes.astype(jnp.int32)


def _check_fp8_sizes(k: int, n: int) -> None:
  bad = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % _FP8_ALIGNMENT]
  if bad:
    raise ValueError(
        f"FP8 grouped GEMMs need K and N to be multiples of {_FP8_ALIGNMENT}; got "
        f"{', '.join(bad)}. Pad the features, or pass recipe=None for a high-precision GEMM."
    )


def _per_row(values: jax.Array, ids: jax.Array, fill: float) -> jax.Array:
  """``values[ids]`` for per-group ``values`` [G]; ``fill`` for rows past the groups."""
  return jnp.concatenate([values, jnp.full((1,), fill, values.dtype)])[ids]


def _group_amax(x: jax.Array, ids: jax.Array, num_groups: int) -> jax.Array:
  """max |x| over each group's rows, float32 [G]: 0 for an empty group, NaN if a row has NaN."""
  row_amax = jnp.max(jnp.abs(x), axis=1).astype(jnp.float32)
  row_nan = jnp.any(jnp.isnan(x), axis=1)
  # A masked [M, G] reduction rather than a scatter: M rows would contend for G slots.
  member = ids[:, None] == jnp.arange(num_groups, dtype=ids.dtype)[None, :]
  amax = jnp.max(jnp.where(member, row_amax[:, None], 0.0), axis=0)
  has_nan = jnp.any(member & row_nan[:, None], axis=0)
  return jnp.where(has_nan, jnp.float32(jnp.nan), amax)


def _to_tensor_amax(amax: jax.Array) -> jax.Array:
  # One amax for all groups (the per-tensor alternative, kept for measurements).
  total = jnp.where(jnp.any(jnp.isnan(amax)), jnp.float32(jnp.nan), jnp.max(amax))
  return jnp.broadcast_to(total, amax.shape)


def _role_scales(amax, role, q_dtype, recipe, state):
  """Per-group scales [G] for one role; returns (scale, the role's new state or None).

  Each group is one GEMM of the recipe's scaling (``_tensor_scaling``), its state slice g.
  """
  scaling = formats.format_of(recipe).scaling
  next_scale = functools.partial(
      scaling.next_scale, recipe, role=role, fp8_max=_scaling.fp8_max(q_dtype)
  )
  scale, new = jax.vmap(lambda a, s: next_scale(a, s))(amax[:, None], state)
  return scale[:, 0], new


def _quantize_rows(x, ids, num_groups, role, q_dtype, recipe, state, granularity):
  """Quantizes [M, F] rows with their group's scale; rows past the groups become 0."""
  amax = _group_amax(x, ids, num_groups)
  if granularity == "tensor":
    amax = _to_tensor_amax(amax)
  scale, new = _role_scales(amax, role, q_dtype, recipe, state)
  limit = _scaling.fp8_max(q_dtype)
  scaled = x.astype(jnp.float32) * _per_row(scale, ids, 1.0)[:, None]
  data = jnp.clip(scaled, -limit, limit).astype(q_dtype)
  data = jnp.where((ids < num_groups)[:, None], data, jnp.zeros((), q_dtype))
  return data, _scaling.scale_inverse(scale), new


def _quantize_experts(w, role, q_dtype, recipe, state, granularity, native=False):
  """Quantizes the kernels [G, K, N], each with its expert's scale.

  Returns ``(data, data_t, 1/scale [G], the role's new state)``. ``native`` (the native grouped
  GEMM runs): ``data_t`` is the (G, N, K) copy its forward GEMM reads, written by the same pass
  as ``data`` (the extension's per-expert cast on the GPU), and with delayed scaling that pass
  also takes the amax that rolls into the history; otherwise ``data_t`` is None.
  """
  stored = formats.format_of(recipe).scaling.stored_scale(state, role) if state else None
  # Delayed scaling on the native path casts with the stored scales and takes the amax (an
  # expert's amax is inf where it holds a NaN or inf, as the per-tensor amax) in the same pass.
  one_pass = native and stored is not None
  if one_pass:
    data, data_t, amax = formats.cast_transpose_per_batch(
        w, stored.reshape(w.shape[0]), q_dtype, with_amax=True)
  else:
    amax = _scaling.leading_amax(w)
  if granularity == "tensor":
    amax = _to_tensor_amax(amax)
  scale, new = _role_scales(amax, role, q_dtype, recipe, state)
  if not one_pass:
    # Off the native path the pure-JAX cast, whose transposed copy XLA drops unused.
    data, data_t, _ = formats.cast_transpose_per_batch(
        w, scale, q_dtype, backend=None if native else "jax")
  return data, (data_t if native else None), _scaling.scale_inverse(scale), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _fp8_ragged_dot(
    lhs, rhs, group_sizes, state, precision, out_dtype, operand_dtypes, recipe, granularity,
    native=False,
):
  y, _ = _fp8_fwd(
      lhs, rhs, group_sizes, state, precision, out_dtype, operand_dtypes, recipe, granularity,
      native,
  )
  return y


def _fp8_fwd(
    lhs, rhs, group_sizes, state, precision, out_dtype, operand_dtypes, recipe, granularity,
    native=False,
):
  del operand_dtypes
  num_groups = rhs.shape[0]
  ids = row_groups(group_sizes, lhs.shape[0])
  q_x, sinv_x, new_x = _quantize_rows(
      lhs, ids, num_groups, "x", recipe.fwd_dtype, recipe, state, granularity
  )
  q_w, q_w_t, sinv_w, new_w = _quantize_experts(
      rhs, "kernel", recipe.fwd_dtype, recipe, state, granularity, native
  )
  q_x, sinv_x = _remat.name_quantized((q_x, sinv_x), _remat.QUANTIZED_X)
  q_w, sinv_w = _remat.name_quantized((q_w, sinv_w), _remat.QUANTIZED_KERNEL)
  if native:
    y = _grouped_kernel.rows_gemm(
        q_x, q_w_t,
        _grouped_kernel.clamped_sizes(group_sizes, lhs.shape[0]), sinv_x * sinv_w, out_dtype,
        _grouped_kernel.fast_accumulation(precision, "fwd", recipe),
    )
  else:
    y = lax.ragged_dot_general(
        q_x, q_w, group_sizes, _FWD_DIMS, precision=precision, preferred_element_type=jnp.float32
    )
    y = (y * _per_row(sinv_x * sinv_w, ids, 0.0)[:, None]).astype(out_dtype)
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  residuals = (q_x, sinv_x, q_w, sinv_w, group_sizes, {"x": new_x, "kernel": new_w}, state)
  return y, residuals


def _fp8_bwd(precision, out_dtype, operand_dtypes, recipe, granularity, native, residuals, g):
  q_x, sinv_x, q_w, sinv_w, group_sizes, new_fwd_state, state = residuals
  lhs_dtype, rhs_dtype = operand_dtypes
  del out_dtype
  num_groups = q_w.shape[0]
  ids = row_groups(group_sizes, q_x.shape[0])
  q_g, sinv_g, new_g = _quantize_rows(
      g, ids, num_groups, "grad", recipe.bwd_dtype, recipe, state, granularity
  )
  scaling = formats.format_of(recipe).scaling
  new_state = scaling.next_state(state, {**new_fwd_state, "grad": new_g})
  if native:
    sizes = _grouped_kernel.clamped_sizes(group_sizes, q_x.shape[0])
    dx = _grouped_kernel.rows_gemm(
        q_g, q_w, sizes, sinv_g * sinv_w, lhs_dtype,
        _grouped_kernel.fast_accumulation(precision, "dgrad", recipe),
    )
    dw = _grouped_kernel.wgrad_gemm(
        q_x, q_g, sizes, sinv_x * sinv_g, rhs_dtype,
        _grouped_kernel.fast_accumulation(precision, "wgrad", recipe),
    )
    return dx, dw, None, new_state
  dx = lax.ragged_dot_general(
      q_g, q_w, group_sizes, _DGRAD_DIMS, precision=precision, preferred_element_type=jnp.float32
  )
  dx = (dx * _per_row(sinv_g * sinv_w, ids, 0.0)[:, None]).astype(lhs_dtype)
  dw = lax.ragged_dot_general(
      q_x, q_g, group_sizes, _WGRAD_DIMS, precision=precision, preferred_element_type=jnp.float32
  )
  dw = (dw * (sinv_x * sinv_g)[:, None, None]).astype(rhs_dtype)
  return dx, dw, None, new_state


_fp8_ragged_dot.defvjp(_fp8_fwd, _fp8_bwd)
