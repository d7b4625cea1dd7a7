"""Grouped GEMM for mixture-of-experts: a quantized ``ragged_dot`` and its one custom VJP.

``lhs`` [M, K] holds the rows of G groups one after another (group g has ``group_sizes[g]`` rows;
rows past ``sum(group_sizes)`` belong to no group), ``rhs`` [G, K, N] holds one kernel per group,
and row ``i`` of the output is ``lhs[i] @ rhs[group(i)]`` (zero for rows past the groups).

Every recipe's grouped GEMM runs the same rule (``_grouped_gemms``), written over the recipe's
``QuantizationFormat`` and its ``GroupedFormat`` (``fmt.grouped``), as ``_gemm``'s rule is over
the format: the format quantizes x and the kernels in the forward pass (the copies for the
forward GEMM, and those the backward GEMMs read, saved under the checkpoint names
``QUANTIZED_X`` and ``QUANTIZED_KERNEL``), the output gradient in the backward pass, runs the
three grouped GEMMs

- forward ``y (M, N)``: x's and the kernels' copies contracting K;
- dgrad ``dx (M, K)``: the gradient's and the kernels' copies contracting N;
- wgrad ``dw (G, K, N)``: x's and the gradient's copies contracting the rows of each group;

and gives the next state, the cotangent of ``state`` ("overwrite with gradient"). What depends
on the groups is the format's: per-tensor formats scale each group on its own
(``formats._grouped_tensor``: per-group scales and state, XLA's ragged dot or, on Hopper with the
extension built with CUTLASS, the native grouped GEMM); MXFP8 quantizes blocks that never cross a
group (``formats._grouped_block``). A format without a grouped GEMM (``fmt.grouped`` None) is
refused. Every quantity is computed on the device from ``group_sizes``: nothing is copied to the
host and nothing waits for it, so the op runs under ``jit`` with group sizes produced by a
router. With ``recipe=None`` bfloat16 operands run on the native grouped GEMM too, where it is
built (float32 sums, ``kernels.bf16_ragged_dot``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from te_adapters.core import formats, kernels
from te_adapters.core import state as core_state
from te_adapters.core.formats import GroupedRequest
from te_adapters.core.gemm import _frozen, _remat
from te_adapters.core.gemm._layer import check_gemm_dims
from te_adapters.core.recipes import GemmConfig, caller_site, check_config, check_recipe
from te_adapters.core.state import DelayedScalingState

if TYPE_CHECKING:
  from jax.typing import ArrayLike, DTypeLike

  from te_adapters.core.recipes import Recipe
  from te_adapters.core.state import State

__all__ = ["Grouped", "check_ragged_state", "grouped_gemms", "init_ragged_state", "ragged_dot"]


def init_ragged_state(recipe: Recipe, num_groups: int) -> DelayedScalingState | dict:
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


def _supported() -> str:
  names = [f.recipe_type.__name__ for f in formats.formats() if f.grouped is not None]
  listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
  return f"{listed} (or recipe=None for a high-precision GEMM)"


def check_ragged_recipe(recipe):
  """``check_recipe`` for grouped GEMMs: also refuses a recipe whose format has no grouped GEMM
  (``QuantizationFormat.grouped``)."""
  recipe = check_recipe(recipe)
  if formats.format_of(recipe).grouped is None:
    raise NotImplementedError(
      f"ragged_dot does not implement {type(recipe).__name__}; grouped GEMMs support {_supported()}"
    )
  return recipe


def _check_num_groups(num_groups) -> int:
  if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
    raise TypeError(f"num_groups must be an int, got {num_groups!r}")
  if num_groups < 1:
    raise ValueError(f"num_groups must be >= 1, got {num_groups}")
  return int(num_groups)


def _expected_shapes(recipe, num_groups: int) -> dict[str, tuple[int, ...]]:
  shapes = formats.format_of(recipe).state_shapes(recipe)
  return {name: (num_groups, *shape) for name, shape in shapes.items()}


def check_ragged_state(
  recipe, state: Mapping[str, Any] | None, num_groups: int, layer: str | None = None
):
  """Validates the state of a grouped GEMM against ``recipe``; returns it typed (``typed_state``);
  raises naming the mismatch, and ``layer`` where given."""
  expected = _expected_shapes(recipe, num_groups)
  if state is None:
    if expected:
      lead = f"{layer}: " if layer else ""
      raise ValueError(
        f"{lead}{type(recipe).__name__} keeps state: pass "
        f"state=te_adapters.core.init_ragged_state(recipe, {num_groups})"
      )
    return formats.typed_state(recipe, {})

  def bad_shape(name, got, shape):
    hint = ""
    if got in ((1,), (recipe.amax_history_len,)):
      hint = " (this is one GEMM's state; use init_ragged_state(recipe, num_groups))"
    return (
      f"state[{name!r}] has shape {got} but {num_groups} groups under {recipe!r} need {shape}{hint}"
    )

  core_state.warn_dict_state(
    state,
    f"te_adapters.core.init_ragged_state(recipe, {num_groups}), or "
    "te_adapters.core.typed_state(recipe, saved) for a saved dict",
  )
  core_state.check_leaves(
    state,
    expected,
    mismatch=f"state does not match {recipe!r} for a grouped GEMM",
    bad_shape=bad_shape,
    layer=layer,
  )
  return formats.typed_state(recipe, state)


def ragged_dot(
  lhs: ArrayLike,
  rhs: ArrayLike,
  group_sizes: ArrayLike,
  precision: lax.PrecisionLike = None,
  preferred_element_type: DTypeLike | None = None,
  group_offset: jax.Array | None = None,
  out_sharding: NamedSharding | PartitionSpec | None = None,
  *,
  recipe: Recipe | None,
  state: State | Mapping[str, ArrayLike] | None = None,
  config: GemmConfig | None = None,
  layer: str | None = None,
  framework: str | None = None,
) -> jax.Array:
  """``jax.lax.ragged_dot`` with FP8 operands, per ``recipe``: the grouped GEMM of an MoE layer.

  Has ``jax.lax.ragged_dot``'s signature plus keywords, so
  ``functools.partial(ragged_dot, recipe=r, state=s)`` replaces it. Group sizes stay on the
  device (no host transfer or synchronisation), so they may come from a router under ``jit``.
  The VJP computes dgrad grouped like the forward pass and one weight gradient per group; an
  empty group gets zero output rows and a zero weight gradient.

  Per-tensor recipes: scales are per group (see ``formats._grouped_tensor`` for the
  measurements behind that choice).

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
  ``formats._grouped_block``. ``Float8BlockScaling`` the same way with its 1x128 blocks (the
  rows of each group padded to 128) and each expert's kernel in 128x128 tiles; on Hopper with the
  extension built with CUTLASS its three GEMMs run in FP8 on the grouped GEMM with blockwise
  scaling (``kernels.block_rows_gemm``, ``kernels.block_wgrad_gemm``).
  ``Float8RowwiseScaling``: one scale per row along each GEMM's contracting dim, the weight
  gradient's operands one per column within each group, FP8 ragged dots
  (``formats._grouped_rowwise``). ``NVFP4BlockScaling`` is not implemented.

  Args:
    lhs: [M, K] rows of all groups, group by group (real floating point).
    rhs: [G, K, N] one kernel per group (real floating point). With a recipe, K and N must be
      multiples of 16 (the layers' size rule, ``gemm_dims_refusal``), whatever the format.
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
    recipe: a recipe (``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``,
      ``Float8BlockScaling``, ``Float8RowwiseScaling``), or
      ``None`` for a plain ``jax.lax.ragged_dot`` in the operands' precision. With ``None``,
      bfloat16 operands and a bfloat16 result on a Hopper GPU with the grouped GEMM built (and
      no ``out_sharding``), the three GEMMs run on the native grouped kernel with float32 sums
      instead of XLA's ragged dot.
    state: this GEMM's recipe state (``init_ragged_state(recipe, G)``); ``None`` for stateless
      recipes.
    config: a ``GemmConfig``; the grouped GEMM takes its ``non_finite`` (a group whose rows, or
      an expert whose kernel, hold a NaN or an infinity gives NaN rows by default). ``None``:
      ``GemmConfig()``.
    layer: what warnings and errors about this GEMM call it (an adapter passes the layer's path
      in its model where it knows it); ``None``: the grouped GEMM by its operands' shapes.
    framework: the framework of the layer calling (``"linen"``, ``"nnx"``, ``"haiku"``), whose
      remedy a ``FrozenStateWarning`` gives; ``None`` (plain JAX): the remedies of all of them.

  Returns:
    [M, N], with the dtype ``jax.lax.ragged_dot`` gives. Under differentiation, the gradient with
    respect to ``state`` is the state for the next step.

  Raises:
    ValueError: ``lhs`` not 2-D, ``rhs`` not 3-D, different contracting sizes, a ``state``
      without a recipe or one that does not match it.
    NotImplementedError: a ``group_offset``.

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
  config = check_config(config)
  framework = _frozen.check_framework(framework)
  if group_offset is not None:
    raise NotImplementedError("group_offset is not supported; pass group_offset=None")
  # The dtype lax.ragged_dot gives (its rule is dot_general's), from shapes without shardings:
  # ragged_dot_general has no sharding inference on Explicit mesh axes.
  out_dtype = jax.eval_shape(
    functools.partial(
      lax.dot_general,
      dimension_numbers=(((1,), (0,)), ((), ())),
      precision=precision,
      preferred_element_type=preferred_element_type,
    ),
    jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
    jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype),
  ).dtype
  if recipe is None:
    if state:
      raise ValueError("state was given but recipe is None")
    if out_sharding is None and kernels.bf16_refusal(lhs, rhs, out_dtype) is None:
      # Hopper with the grouped GEMM built: bfloat16 in and out, float32 sums, as XLA's.
      return kernels.bf16_ragged_dot(lhs, rhs, group_sizes)
    return lax.ragged_dot(
      lhs, rhs, group_sizes, precision, preferred_element_type, out_sharding=out_sharding
    )
  recipe = check_ragged_recipe(recipe)
  # A layer's size rule (its kernels are a layer's parameters), whatever the format could tile.
  check_gemm_dims(rhs.shape[1], rhs.shape[2], f"{layer or 'ragged_dot'} with rhs {rhs.shape}")
  grouped = formats.format_of(recipe).grouped
  assert grouped is not None  # check_ragged_recipe refuses formats without one
  grouped.check(recipe, lhs.shape[1], rhs.shape[2], False)
  state = check_ragged_state(recipe, state, rhs.shape[0], layer)
  if state:
    # Under differentiation: warns at trace time when the state would stay frozen.
    lhs, rhs, state = _frozen.watch_state(lhs, rhs, state, layer=layer, framework=framework)
  operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  # Which GEMMs run is the format's choice (the native grouped GEMM where it runs), made here,
  # where the operands' placement is the caller's.
  route = grouped.route(lhs, rhs, recipe, (out_dtype, *operand_dtypes))
  spec = Grouped(
    recipe,
    precision,
    np.dtype(out_dtype),
    operand_dtypes,
    route,
    non_finite=config.non_finite,
    layer=layer or f"ragged_dot {tuple(lhs.shape)} . {tuple(rhs.shape)}",
  )

  def call(lhs, rhs, group_sizes, state):
    return _grouped_gemms(lhs, rhs, group_sizes, state, spec)

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
  specs: list[tuple | None] = []
  for a in (lhs, rhs):
    sharding = getattr(jax.typeof(a), "sharding", None)
    if not (
      isinstance(sharding, NamedSharding)
      and not sharding.mesh.empty
      and any(t == AxisType.Explicit for t in sharding.mesh.axis_types)
    ):
      specs.append(None)
      continue
    specs.append(tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec)))
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


# ---------------------------------------------------------------------------------------------
# The one grouped GEMM rule, over the format's GroupedFormat:
#   y  (M, N)    = q(x) . q(w)           contracting K      (x's rows, the kernels' rows)
#   dx (M, K)    = q(g) . q(w)^T         contracting N      (g's rows, the kernels' cols)
#   dw (G, K, N) = q(x)_g^T . q(g)_g     contracting the rows of group g  (x's and g's cols)


@dataclasses.dataclass(frozen=True)
class Grouped:
  """The static facts of one grouped GEMM (a hashable argument of the VJP).

  Attributes:
    recipe, precision: as ``ragged_dot`` takes them.
    out_dtype: the output's dtype.
    operand_dtypes: lhs's and rhs's dtypes (those of dx and dw).
    route: the format's choice of GEMMs (``GroupedFormat.route``).
    granularity: ``"group"`` (per-group scales, as ``ragged_dot`` runs) or ``"tensor"`` (one
      amax over all groups; per-tensor formats, for measurements).
    non_finite: ``GemmConfig.non_finite``.
    layer: what the kernels' warnings call this GEMM (``ragged_dot``'s ``layer``, or its shapes).
  """

  recipe: Any
  precision: Any
  out_dtype: np.dtype
  operand_dtypes: tuple[np.dtype, np.dtype]
  route: Any = None
  granularity: str = "group"
  non_finite: str = "propagate"
  layer: str | None = None

  @property
  def grouped(self):
    return formats.format_of(self.recipe).grouped


def grouped_gemms(lhs, rhs, group_sizes, state, spec: Grouped):
  """The quantized grouped GEMM ``y (M, N)`` of ``lhs`` (M, K), ``rhs`` (G, K, N) and
  ``group_sizes`` (G,) int32, per ``spec``; the gradient with respect to ``state`` (the grouped
  state, ``{}`` when stateless) is its next value. ``ragged_dot`` checks the arguments first."""
  return _grouped_gemms(lhs, rhs, group_sizes, state, spec)


def _request(x, role, spec: Grouped, group_sizes, state, **kw):
  return GroupedRequest(
    x,
    role,
    spec.recipe,
    group_sizes,
    state,
    route=spec.route,
    granularity=spec.granularity,
    non_finite=spec.non_finite,
    **kw,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_gemms(lhs, rhs, group_sizes, state, spec: Grouped):
  # Not differentiated (inference): only the copies the forward GEMM takes. The kernels traced
  # inside (the per-batch cast, the amaxes) name the layer at the user's line in their warnings.
  with kernels.warning_site(spec.layer, caller_site()):
    y, _ = _grouped_forward(lhs, rhs, group_sizes, state, spec, backward=False)
  return y


def _grouped_fwd(lhs, rhs, group_sizes, state, spec: Grouped):
  spec.grouped.check(spec.recipe, lhs.shape[1], rhs.shape[2], True)
  with kernels.warning_site(spec.layer, caller_site()):
    return _grouped_forward(lhs, rhs, group_sizes, state, spec, backward=True)


def _grouped_forward(lhs, rhs, group_sizes, state, spec: Grouped, backward: bool):
  grouped = spec.grouped
  qx = grouped.quantize(_request(lhs, "x", spec, group_sizes, state, cols=backward))
  qw = grouped.quantize(_request(rhs, "kernel", spec, group_sizes, state, cols=backward))
  x_wgrad = w_dgrad = None
  if backward:
    x_wgrad = _remat.name_quantized(qx.cols, _remat.QUANTIZED_X)
    w_dgrad = _remat.name_quantized(qw.cols, _remat.QUANTIZED_KERNEL)
  y = grouped.gemm(
    qx.rows, qw.rows, group_sizes, spec.out_dtype, "fwd", spec.recipe, spec.precision, spec.route
  )
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  new_fwd = {"x": qx.state, "kernel": qw.state}
  return y, (x_wgrad, w_dgrad, group_sizes, new_fwd, state)


def _grouped_bwd(spec: Grouped, residuals, g):
  # Traced where the user takes the gradient: the kernels' warnings point at that line.
  with kernels.warning_site(spec.layer, caller_site()):
    return _grouped_backward(spec, residuals, g)


def _grouped_backward(spec: Grouped, residuals, g):
  x_wgrad, w_dgrad, group_sizes, new_fwd, state = residuals
  grouped = spec.grouped
  lhs_dtype, rhs_dtype = spec.operand_dtypes
  qg = grouped.quantize(_request(g, "grad", spec, group_sizes, state))
  new_state = grouped.next_state(spec.recipe, state, {**new_fwd, "grad": qg.state})
  dx = grouped.gemm(
    qg.rows, w_dgrad, group_sizes, lhs_dtype, "dgrad", spec.recipe, spec.precision, spec.route
  )
  dw = grouped.gemm(
    x_wgrad, qg.cols, group_sizes, rhs_dtype, "wgrad", spec.recipe, spec.precision, spec.route
  )
  return dx, dw, None, new_state


_grouped_gemms.defvjp(_grouped_fwd, _grouped_bwd)
