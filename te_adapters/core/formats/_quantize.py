"""Quantize and dequantize: a tensor in a low-precision dtype with its scales, as a pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from te_adapters.core import recipes
from te_adapters.core.formats import _block, _block_scaled, _registry, _scaling
from te_adapters.core.formats._format import QuantizeRequest
from te_adapters.core.formats._scaled_tensor import (
  ScaledTensor,
  cast_with_scale,
  check_float_operand,
  check_fp8_dtype,
)
from te_adapters.core.recipes import check_recipe

__all__ = ["ScaledTensor", "quantize", "dequantize"]


def quantize(
  x: jax.Array,
  q_dtype: DTypeLike | None = None,
  *,
  scale: jax.Array | None = None,
  recipe: recipes.Recipe | None = None,
  role: str = "x",
  axis: int | tuple[int, int] | None = None,
  rng: jax.Array | None = None,
  rht: bool = False,
) -> ScaledTensor:
  """Quantizes ``x`` with one scale for the whole tensor, or per block under a block recipe.

  Args:
    x: a real floating-point array.
    q_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``; with a ``recipe``, ``None`` (default)
      takes the recipe's dtype for ``role``, and any other value must equal it.
    scale: float32 of shape (1,) or (), the multiplier applied before the cast (delayed scaling
      passes its stored scale). ``None`` computes it from ``x`` (current scaling):
      ``fp8_max / amax(|x|)``, or 1 when the amax is zero or not finite. Block recipes compute
      their own scales and take no ``scale``.
    recipe: ``None`` (per-tensor, ``q_dtype`` required), a per-tensor recipe, a block recipe
      (``MXFP8BlockScaling``, ``NVFP4BlockScaling``, ``Float8BlockScaling``), or
      ``Float8RowwiseScaling`` (one scale per slice along ``axis``, default -1: per row).
    role: ``"x"``, ``"kernel"`` or ``"grad"``: which operand ``x`` is, which sets the dtype
      (HYBRID: E5M2 for ``"grad"``) and, for block recipes, the blocks (NVFP4 and FP8 blocks tile
      the kernel in 2-D by default) and NVFP4's stochastic rounding (``"grad"``).
    axis: block and rowwise recipes only. For 1-D blocks (and rowwise scales), the axis the
      blocks (the amaxes) run along (default -1): the contracting axis of the GEMM the copy is
      for. For 2-D tiles, the pair of axes the tiles
      cover (default ``(-2, -1)``).
    rng: PRNG key for NVFP4's stochastic rounding (``role="grad"`` unless disabled); required
      then, and refused otherwise.
    rht: NVFP4 only: apply the random Hadamard transform along ``axis`` first, as for the
      operands of the weight-gradient GEMM (``role`` ``"x"`` or ``"grad"``).

  Returns:
    A ``ScaledTensor`` with data in ``x``'s layout. Per-tensor: ``scale_inv = 1 / scale``.

  Raises:
    TypeError: ``x`` is not floating point.
    ValueError: an unknown ``role``; a ``q_dtype`` other than FP8, missing without a recipe or
      unlike the recipe's; a ``scale`` given to a block recipe or missing for delayed scaling;
      ``axis``, ``rng`` or ``rht`` where the recipe does not use them; a ``scale`` of more than
      one element.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> t = ta.core.quantize(jnp.array([1.0, -2.0, 4.0]), jnp.float8_e4m3fn)
    >>> t.data.astype(jnp.float32).tolist(), round(1 / float(t.scale_inv[0]), 3)
    ([112.0, -224.0, 448.0], 112.0)
    >>> t = ta.core.quantize(jnp.ones((2, 64)), recipe=ta.MXFP8BlockScaling())
    >>> t.scale_inv.shape, t.scale_inv.dtype
    ((2, 2), dtype(float8_e8m0fnu))
  """
  check_float_operand("x", x)
  x = jnp.asarray(x)
  if recipe is not None:
    recipe = check_recipe(recipe)
    if role not in ("x", "kernel", "grad"):
      raise ValueError(f"role must be 'x', 'kernel' or 'grad', got {role!r}")
    expected = recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype
    if q_dtype is not None and np.dtype(q_dtype) != expected:
      raise ValueError(
        f"q_dtype {np.dtype(q_dtype)} does not match {type(recipe).__name__}'s dtype "
        f"{expected} for role {role!r}; leave q_dtype=None"
      )
    fmt = _registry.format_of(recipe)
    if not fmt.per_tensor and not recipe.block_scaled:
      # A format of its own (rowwise): its copy along ``axis``.
      return _quantize_own(x, recipe, fmt, role, scale, axis, rng, rht)
    if recipe.block_scaled:
      if scale is not None:
        raise ValueError(
          f"{type(recipe).__name__} computes its block scales from x; do not pass scale"
        )
      return _quantize_blocks(x, recipe, role, axis, rng, rht)
    if fmt.state_shapes(recipe) and scale is None:
      # A scaling that keeps state quantizes with the scale it stored (delayed scaling).
      raise ValueError(
        f"{type(recipe).__name__} quantizes with its stored scale: pass "
        "scale=state.role('<role>').scale (state['<role>_scale'])"
      )
    q_dtype = expected
  if q_dtype is None:
    raise ValueError("q_dtype is required when no recipe is given")
  for name, value in (("axis", axis), ("rng", rng)):
    if value is not None:
      raise ValueError(f"{name} is only used by block-scaled recipes; got {name}={value!r}")
  if rht:
    raise ValueError("rht=True needs recipe=NVFP4BlockScaling()")
  q_dtype = check_fp8_dtype(q_dtype)
  a = _scaling.tensor_amax(x)
  if scale is None:
    scale = _scaling.compute_scale(a, _scaling.fp8_max(q_dtype), 1.0)
  else:
    scale = jnp.asarray(scale, jnp.float32)
    if scale.size != 1:
      raise ValueError(f"per-tensor scale must have one element, got shape {scale.shape}")
    scale = scale.reshape(1)
  data = cast_with_scale(x, scale, q_dtype)
  return ScaledTensor(
    data=data,
    scale_inv=_scaling.scale_inverse(scale),
    amax=a,
    scaling_mode="tensor",
    dq_dtype=np.dtype(x.dtype),
  )


def _quantize_own(x, recipe, fmt, role, scale, axis, rng, rht) -> ScaledTensor:
  """``x`` quantized by ``fmt`` along ``axis`` (default -1), the copy ``fmt.quantize`` makes
  for a GEMM contracting that axis (rowwise: one scale per slice along it)."""
  name = type(recipe).__name__
  for arg, value in (("scale", scale), ("rng", rng)):
    if value is not None:
      raise ValueError(f"{name} computes its scales from x; do not pass {arg}")
  if rht:
    raise ValueError("rht=True needs recipe=NVFP4BlockScaling()")
  axis = -1 if axis is None else axis
  if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis!r} is not valid for an array of shape {x.shape} under {name}")
  axis = int(axis)
  moved = jnp.moveaxis(x, axis, -1)
  # TE's quantized values, as every other path of quantize gives them: the NaN inverse scales
  # of a non-finite amax (GemmConfig.non_finite) are how a GEMM passes it on, not part of them.
  saturate = recipes.GemmConfig(non_finite="saturate")
  t = fmt.quantize(QuantizeRequest(moved, role, recipe, config=saturate, cols=False)).rows
  return dataclasses.replace(
    t, data=jnp.moveaxis(t.data, -1, axis), scale_inv=jnp.moveaxis(t.scale_inv, -1, axis)
  )


def _quantize_blocks(x, recipe, role, axis, rng, rht) -> ScaledTensor:
  spec = _block_scaled.operand_spec(recipe, role, wgrad=rht)
  name = type(recipe).__name__
  if rht and not spec.rht:
    raise ValueError(
      f"rht=True: {name} applies the random Hadamard transform only to x and grad, and only "
      f"without disable_rht (role={role!r})"
    )
  rng = recipes.check_rng(recipe, rng) if rng is not None else None
  if spec.stochastic and rng is None:
    raise ValueError(f"{name} rounds role 'grad' stochastically: pass rng=<PRNG key>")
  if rng is not None and not spec.stochastic:
    raise ValueError(f"rng was given but {name} does not round role {role!r} stochastically")
  n = len(spec.block_shape)
  if axis is None:
    axis = -1 if n == 1 else (-2, -1)
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  if len(axes) != n:
    raise ValueError(
      f"{name} quantizes role {role!r} in {'x'.join(map(str, spec.block_shape))} blocks, "
      f"which need {n} axis/axes, got axis={axis!r}"
    )
  axes = tuple(int(a) % x.ndim if -x.ndim <= a < x.ndim else None for a in axes)
  if None in axes or len(set(axes)) != n:
    raise ValueError(f"axis={axis!r} is not valid for an array of shape {x.shape}")
  for a, b in zip(axes, spec.block_shape, strict=True):
    if x.shape[a] % b:
      raise ValueError(
        f"{name}: axis {a} of x (shape {x.shape}) has size {x.shape[a]}, which is not a "
        f"multiple of the block size {b}"
      )
  moved = jnp.moveaxis(x, axes, tuple(range(x.ndim - n, x.ndim)))
  t = _block_scaled.quantize_trailing(moved, spec, rng, what=f"x of shape {x.shape}")
  back = tuple(range(x.ndim - n, x.ndim))
  return dataclasses.replace(
    t,
    data=jnp.moveaxis(t.data, back, axes),
    scale_inv=jnp.moveaxis(t.scale_inv, back, axes),
    dq_dtype=np.dtype(x.dtype),
  )


def dequantize(t: ScaledTensor, dtype: DTypeLike | None = None) -> jax.Array:
  """The high-precision values of ``t`` in ``dtype`` (default: the dtype it was quantized from).

  Per-tensor: ``data * scale_inv``. Block modes: ``data`` times its block's scale (NVFP4 also
  times ``amax / (6 * 448)``, and the random Hadamard transform is undone for ``"nvfp4_rht"``).

  Args:
    t: a ``ScaledTensor`` from ``quantize``.
    dtype: the dtype of the result; ``None``: ``t.dq_dtype``.

  Returns:
    An array of ``t``'s shape.

  Raises:
    TypeError: when ``t`` is not a ``ScaledTensor``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x = jnp.array([1.0, -2.0, 0.5, 448.0])
    >>> t = ta.quantize(x, recipe=ta.Float8CurrentScaling())
    >>> ta.dequantize(t).tolist()
    [1.0, -2.0, 0.5, 448.0]
  """
  if not isinstance(t, ScaledTensor):
    raise TypeError(f"dequantize expects a ScaledTensor, got {type(t).__name__}")
  dtype = t.dq_dtype if dtype is None else dtype
  if t.scaling_mode != "tensor":
    if not _block_scaled.is_block_mode(t.scaling_mode):
      return _registry.format_of_mode(t.scaling_mode).dequantize(t, dtype)
    return _block_scaled.dequantize(t, dtype)
  out = _block.keep_narrow(t.data).astype(jnp.float32) * t.scale_inv.reshape(())
  return out.astype(dtype)
