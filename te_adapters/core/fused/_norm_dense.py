"""The norm followed by one quantized GEMM (TE's ``LayerNormDenseGeneral``).

``layernorm_dense`` normalizes ``x`` over its last axis and contracts the result with a kernel.
With the GEMM in FP8 it runs as one custom VJP (the one GEMM rule with the norm's producer), the
structure of ``core.layernorm_mlp``'s fused path with one GEMM: the norm's float32 output is
cast straight to the GEMM's FP8 operand in both orientations with its amax (per-tensor recipes:
the CUDA norm cast of ``csrc/act_cast_cuda.cu`` on Hopper, the pure-JAX formula that XLA fuses
elsewhere; block and rowwise recipes quantize the float32 values in their blocks or rows), so the
normalized tensor is never written in the input's dtype, the GEMM's bias (``dense_bias``) gets
its gradient from the pass that casts the output gradient to FP8, and the backward pass computes
the norm's gradients from the GEMM's dgrad. Otherwise (blocks that do not tile the GEMM, a
format without producers, a GEMM the size threshold keeps in high precision, the norm's output
asked for, a block or rowwise recipe under a sharding constraint or inside ``shard_map``,
``GemmConfig(fuse_activation_cast=False)``) the norm's output feeds ``dot_general``. Per-tensor
recipes take the fused path sharded too (a constraint on the norm's output is put on its input,
whose layout the per-row norm keeps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core import gemm, sharding
from te_adapters.core.fused import _fused_mlp
from te_adapters.core.gemm import (
  DEFAULT_SIZE_THRESHOLD,
  check_last_axis,
  check_threshold,
  dot_general,
  gemm_dims_refusal,
)
from te_adapters.core.ops import check_norm_args, layernorm
from te_adapters.core.recipes import GemmConfig, check_config, check_recipe

if TYPE_CHECKING:
  from jax.typing import ArrayLike

  from te_adapters.core.gemm import SizeThreshold
  from te_adapters.core.recipes import Recipe
  from te_adapters.core.state import State

__all__ = ["layernorm_dense"]


def _dense_dims(x_ndim, kernel_ndim, axis, kernel_axes):
  """``dot_general`` dimension numbers of ``x`` (contracting ``axis``) with the kernel
  (contracting ``kernel_axes``), as TE's ``LayerNormDenseGeneral`` contracts them."""
  axis = tuple(a % x_ndim for a in axis)
  kernel_axes = tuple(a % kernel_ndim for a in kernel_axes)
  return ((axis, kernel_axes), ((), ()))


def layernorm_dense(
  x: ArrayLike,
  scale: ArrayLike,
  bias: ArrayLike | None,
  kernel: ArrayLike,
  *,
  layernorm_type: str = "layernorm",
  zero_centered_gamma: bool = False,
  epsilon: float = 1e-6,
  axis: int | Sequence[int] = -1,
  kernel_axes: int | Sequence[int] | None = None,
  recipe: Recipe | None,
  state: State | Mapping[str, ArrayLike] | None = None,
  rng: jax.Array | None = None,
  threshold: SizeThreshold | None = DEFAULT_SIZE_THRESHOLD,
  config: GemmConfig | None = None,
  return_layernorm_output: bool = False,
  dot_input_constraint: Callable[[jax.Array], jax.Array] | None = None,
  dense_bias: ArrayLike | None = None,
  kernel_all_gather: PartitionSpec | NamedSharding | None = None,
  layer: str | None = None,
  framework: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """The norm of ``x`` (``layernorm``), then its quantized GEMM with ``kernel``.

  The GEMM keeps ``core.dot_general``'s contract (recipes, state rule, size threshold and
  ``GemmConfig``): ``z = dot_general(layernorm(x), kernel, ((axis, kernel_axes), ((), ())))``
  plus ``dense_bias``.
  As TE's ``LayerNormDenseGeneral``, the norm runs over the last axis of ``x``, which is also
  the contracting axis (``axis`` must be -1), and the kernel contracts its leading axes.

  With the GEMM in FP8 under ``threshold`` (any recipe of the package whose blocks tile it), the
  norm's float32 output is cast straight to the GEMM's FP8 operand in
  one pass (the norm is never written in ``x``'s dtype), unless it is returned, constrained
  under a block or rowwise recipe, or
  ``config.fuse_activation_cast`` is False; with bfloat16 ``x`` the GEMM's input then differs
  from the composed path's by that rounding. Otherwise the norm's output feeds ``dot_general``
  and only its FP8 copy is kept for the backward pass; with ``return_layernorm_output=True`` it
  is also returned.

  Args:
    x: the input, ``(..., K)``.
    scale, bias: gamma and beta of the norm, ``(K,)`` each (``bias=None`` for rmsnorm).
    kernel: ``(K, *features)`` (or ``(*x.shape[axis], *features)``).
    layernorm_type, zero_centered_gamma, epsilon: as for ``layernorm``.
    axis: the contracting axis of ``x``: -1 (TE accepts no other).
    kernel_axes: the contracting axes of the kernel; default its leading ``len(axis)`` axes.
    recipe, state, rng, threshold, config: as for ``dot_general``.
    return_layernorm_output: also return the norm's output.
    dot_input_constraint: a function applied to the norm's output before the GEMM, for a
      sharding constraint (``lambda y: jax.lax.with_sharding_constraint(y, spec)``); the
      adapters pass TE's ``dot_input_axes`` this way.
    dense_bias: the GEMM's bias (TE's ``bias``; ``bias`` here is the norm's beta), shaped as the
      kernel's features, added to the output in its dtype. On the fused path its gradient is
      summed in the pass that casts the output gradient to FP8 (TE's dbias + quantize).
    kernel_all_gather: FSDP, as for ``dot_general``: a ``PartitionSpec`` (or
      ``NamedSharding``) naming, per dim of ``kernel``, the mesh axes it is sharded over. The
      kernel is quantized shard by shard and its FP8 bytes all-gathered for the GEMM (the
      fused path's own, which keeps the norm's cast), its gradient reduce-scattered back; the
      composed path passes it to ``dot_general``. Inside ``shard_map`` ``kernel`` is the shard.
    layer, framework: as for ``dot_general``: how warnings name the layer, and whose remedy a
      ``FrozenStateWarning`` gives.

  Returns:
    ``(z, ln_out)``: the GEMM's output ``(..., *features)`` in ``x``'s dtype (as TE's), and the
    norm's output (in ``x``'s dtype) or ``None``.

  Raises:
    ValueError: a kernel that does not contract ``x``'s last axis alone (or of another size), a
      ``dense_bias`` of another shape than the kernel's features; and ``layernorm``'s and
      ``dot_general``'s errors for the norm's and the GEMM's arguments.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> z, ln = ta.core.layernorm_dense(x, jnp.ones(32), jnp.zeros(32), w,
    ...                                 recipe=ta.Float8CurrentScaling())
    >>> z.shape, ln
    ((16, 16), None)
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  check_last_axis(axis, x.ndim, "layernorm_dense", "LayerNormDenseGeneral")
  if kernel_axes is None:
    kernel_axes = (0,)
  kernel_axes = (
    tuple(kernel_axes) if isinstance(kernel_axes, (tuple, list)) else (cast(int, kernel_axes),)
  )
  if len(kernel_axes) != 1:
    raise ValueError(
      f"layernorm_dense: the kernel contracts one axis with x's last axis, got kernel_axes="
      f"{kernel_axes}"
    )
  plan = None
  if kernel_all_gather is not None:  # dot_general's checks and errors
    plan = gemm.checked_plan(recipe, kernel.ndim, kernel_all_gather=kernel_all_gather)
  # The whole kernel's shape (inside shard_map with kernel_all_gather: the gathered shard's).
  shape = tuple(kernel.shape if plan is None else sharding.gathered_kernel_type(kernel, plan).shape)
  if kernel.ndim < 1 or shape[kernel_axes[0]] != x.shape[-1]:
    raise ValueError(
      f"layernorm_dense: kernel of shape {shape} does not contract x of shape "
      f"{tuple(x.shape)}: its axis {kernel_axes[0]} must have size {x.shape[-1]}"
    )
  config = check_config(config)
  threshold = check_threshold(threshold)
  k = x.shape[-1]
  features = tuple(n for d, n in enumerate(shape) if d != kernel_axes[0])
  m, n = math.prod(x.shape[:-1]), math.prod(features)
  if dense_bias is not None:
    dense_bias = jnp.asarray(dense_bias)
    if dense_bias.shape != features:
      raise ValueError(
        f"layernorm_dense: dense_bias must have the kernel's feature shape {features}, got "
        f"{dense_bias.shape}"
      )
  if (
    not return_layernorm_output
    and gemm_dims_refusal(k, n) is None
    and _fused_mlp.applies(
      recipe,
      config,
      gemm_shapes=((m, k, n),),
      threshold=threshold,
      dropout_active=False,
      constrained=dot_input_constraint is not None,
      rngs=(rng,),
      layer=layer,
    )
    and _fused_mlp.norm_fuses(x, config)
  ):
    check_norm_args(x, scale, bias, layernorm_type)
    if dot_input_constraint is not None:
      x = dot_input_constraint(x)  # the norm is per row: its output takes the input's layout
    layout = None
    if plan is None:
      w = jnp.moveaxis(kernel, kernel_axes[0], 0).reshape(k, n)  # (K, N), as stored
    else:
      # FSDP: the kernel in dot_general's (N, K) layout, its gathered feature dim first.
      layout, w, plan = gemm.fsdp_gemm_layout(kernel, plan, m, kernel_axes[0], layer)
      if dense_bias is not None:  # its dims in the layout's order of the features
        free = sorted(layout.rhs_free)
        dense_bias = jnp.transpose(dense_bias, [free.index(d) for d in layout.rhs_free])
    z = _fused(
      x.reshape(m, k),
      jnp.asarray(scale),
      None if bias is None else jnp.asarray(bias),
      w,
      None if dense_bias is None else dense_bias.reshape(n),
      state,
      recipe=recipe,
      config=config,
      norm=(layernorm_type, bool(zero_centered_gamma), float(epsilon)),
      rng=rng,
      layer=layer,
      framework=framework,
      plan=plan,
    )
    if layout is not None:  # the features back in the kernel's order
      z = sharding.reshape(z, layout.split_out_shape)
      if layout.out_perm is not None:
        z = jnp.transpose(z, layout.out_perm)
    return z.reshape(*x.shape[:-1], *features), None
  y = layernorm(
    x,
    scale,
    bias,
    layernorm_type=layernorm_type,
    zero_centered_gamma=zero_centered_gamma,
    epsilon=epsilon,
  )
  if dot_input_constraint is not None:
    y = dot_input_constraint(y)
  dims = _dense_dims(x.ndim, kernel.ndim, (x.ndim - 1,), kernel_axes)
  z = dot_general(
    y,
    kernel,
    dims,
    preferred_element_type=x.dtype,
    recipe=recipe,
    state=state,
    rng=rng,
    threshold=threshold,
    config=config,
    kernel_all_gather=kernel_all_gather,
    layer=layer,
    framework=framework,
  )
  if dense_bias is not None:
    z = z + dense_bias.astype(z.dtype)
  return z, (y if return_layernorm_output else None)


def _fused(
  x,
  ln_scale,
  ln_bias,
  w,
  b,
  state,
  *,
  recipe,
  config,
  norm,
  rng=None,
  layer=None,
  framework=None,
  plan=None,
):
  """``q(norm(x)) . q(w) + b`` for ``x (M, K)``, ``w (K, N)``, ``b (N,)`` or None: one custom
  VJP, ``(M, N)`` in ``x``'s dtype; the gradient with respect to ``state`` is its next value.
  FSDP: ``plan`` (``gemm.fsdp_gemm_layout``'s), and ``w`` is ``(N, K)``, gathered in FP8."""
  recipe = check_recipe(recipe)
  x, w, state = _fused_mlp.gemm_state(recipe, x, w, state, layer=layer, framework=framework)
  if ln_bias is None:
    ln_bias = jnp.zeros((0,), ln_scale.dtype)  # rmsnorm: a placeholder, as core.layernorm's
  stage = gemm.Stage(
    np.dtype(x.dtype),
    kernel_kn=plan is None,
    bias_grad=None if b is None else _fused_mlp.BiasGradProducer(),
  )
  plan = _fused_mlp.PLAN if plan is None else plan
  chain = gemm.Chain(recipe, plan, config, None, (stage,), _fused_mlp.NormProducer(norm), layer)
  return gemm.quantized_gemms(
    (x, ln_scale, ln_bias), (w,), (b,), (state,), _fused_mlp.stage_keys(recipe, (rng,)), chain
  )
