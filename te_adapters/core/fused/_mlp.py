"""The LayerNorm + MLP block as one function: TE's ``layernorm_mlp``.

``norm -> GEMM 1 (wi_kernel, n_act stacked kernels) -> bias -> activation (gated product) ->
dropout -> GEMM 2 (wo_kernel) -> bias``, each GEMM with its own recipe state.

With both GEMMs in FP8 (no dropout, any recipe whose blocks tile the GEMMs; per-tensor recipes
sharded too) the norm, the two GEMMs and the activation between them are one custom VJP
(``_fused_mlp``): the norm's output is cast straight to GEMM 1's FP8 operand, the activation
straight to GEMM 2's, and the
activation's gradient straight to GEMM 1's FP8 output gradient with the bias gradient, as TE
does. Elsewhere (or with ``GemmConfig(fuse_activation_cast=False)``) each GEMM is a
``dot_general`` and the activation sits between them inside one jitted computation, which leaves
XLA free to fuse it into the amax and FP8 cast of GEMM 2's input (``bench/mlp_fusion.py`` lists
the activation-sized buffers the compiled forward writes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from te_adapters.core import sharding
from te_adapters.core.fused import _fused_mlp
from te_adapters.core.gemm import (
  DEFAULT_SIZE_THRESHOLD,
  check_kernel_gemm_dims,
  check_threshold,
  checked_plan,
  dot_general,
  fsdp_gemm_layout,
)
from te_adapters.core.ops import activation, check_norm_args, layernorm, normalize_activations
from te_adapters.core.recipes import GemmConfig, check_config

if TYPE_CHECKING:
  from jax.typing import ArrayLike

  from te_adapters.core.gemm import SizeThreshold
  from te_adapters.core.ops import Activation
  from te_adapters.core.recipes import Recipe
  from te_adapters.core.sharding import SpmdPlan
  from te_adapters.core.state import State

__all__ = ["dropout", "layernorm_mlp"]


def dropout(
  x: jax.Array,
  rate: float,
  rng: jax.Array | None,
  *,
  broadcast_dims: Sequence[int] = (),
  deterministic: bool = False,
) -> jax.Array:
  """Inverted dropout of ``x``, as ``flax.linen.Dropout`` computes it (same mask for a key).

  Keeps each element with probability ``1 - rate`` and scales it by ``1 / (1 - rate)``;
  ``broadcast_dims`` share one mask. ``rate == 0`` or ``deterministic`` returns ``x``; otherwise
  ``rng`` (a PRNG key) is required.

  Args:
    x: the array.
    rate: the probability of dropping an element, in ``[0, 1]`` (1 drops every element).
    rng: a PRNG key; may be None where ``rate`` is 0 or ``deterministic``.
    broadcast_dims: the dims along which the mask is shared (as ``flax.linen.Dropout``'s).
    deterministic: return ``x`` unchanged (evaluation).

  Returns:
    ``x`` with dropped elements zeroed and kept ones scaled by ``1 / (1 - rate)``.

  Raises:
    ValueError: ``rate`` outside ``[0, 1]``, or no key where one is needed.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> y = ta.core.dropout(jnp.ones((2, 8)), 0.5, jax.random.key(0), broadcast_dims=(0,))
    >>> sorted(set(y.ravel().tolist())), bool((y[0] == y[1]).all())  # one mask for both rows
    ([0.0, 2.0], True)
    >>> ta.core.dropout(jnp.ones(3), 0.5, None, deterministic=True).tolist()
    [1.0, 1.0, 1.0]
  """
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"dropout rate must be in [0, 1], got {rate!r}")
  if rate == 0.0 or deterministic:
    return x
  if rate == 1.0:
    return jnp.zeros_like(x)
  if rng is None:
    raise ValueError(
      f"dropout with rate {rate} needs a PRNG key (dropout_rng=...), or deterministic=True"
    )
  keep = 1.0 - rate
  shape = list(x.shape)
  for d in broadcast_dims:
    shape[d] = 1
  mask = jnp.broadcast_to(jax.random.bernoulli(rng, p=keep, shape=shape), x.shape)
  return lax.select(mask, x / keep, jnp.zeros_like(x))


def _pair(value, what):
  value = (None, None) if value is None else tuple(value)
  if len(value) != 2:
    raise ValueError(f"layernorm_mlp: {what} must be a pair (one per GEMM), got {value!r}")
  return value


def layernorm_mlp(
  x: ArrayLike,
  scale: ArrayLike | None,
  ln_bias: ArrayLike | None,
  wi_kernel: ArrayLike,
  wo_kernel: ArrayLike,
  wi_bias: ArrayLike | None = None,
  wo_bias: ArrayLike | None = None,
  *,
  activations: Activation | Sequence[Activation] = ("gelu",),
  layernorm_type: str = "layernorm",
  zero_centered_gamma: bool = False,
  epsilon: float = 1e-6,
  enable_layernorm: bool = True,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
  dropout_broadcast_dims: Sequence[int] = (),
  deterministic: bool = False,
  recipe: Recipe | None,
  states: Sequence[State | Mapping[str, ArrayLike] | None] | None = None,
  rngs: Sequence[jax.Array | None] | None = None,
  threshold: SizeThreshold | None = DEFAULT_SIZE_THRESHOLD,
  config: GemmConfig | None = None,
  return_layernorm_output: bool = False,
  ffn1_ckpt_name: str = "ffn1",
  ffn2_ckpt_name: str = "ffn2",
  dot_1_input_constraint: Callable[[jax.Array], jax.Array] | None = None,
  dot_2_input_constraint: Callable[[jax.Array], jax.Array] | None = None,
  kernel_all_gather: PartitionSpec | NamedSharding | None = None,
  layer: str | None = None,
  framework: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """LayerNorm, then the MLP of two quantized GEMMs around an activation (TE's ``layernorm_mlp``).

  Args:
    x: the input ``(..., K)``; normalized and contracted over its last axis.
    scale, ln_bias: gamma and beta of the norm, ``(K,)`` (``ln_bias=None`` for rmsnorm).
    wi_kernel: GEMM 1's kernel, ``(K, n_act, F)`` with ``n_act = len(activations)``.
    wo_kernel: GEMM 2's kernel, ``(F, K)``.
    wi_bias: ``(n_act, F)`` or None. wo_bias: ``(K,)`` or None.
    activations: as for ``core.activation`` (``("gelu",)``, ``("silu", "linear")``, ...).
    layernorm_type, zero_centered_gamma, epsilon: as for ``core.layernorm``.
    enable_layernorm: False skips the norm (``scale`` and ``ln_bias`` are then unused).
    dropout_rate, dropout_rng, dropout_broadcast_dims, deterministic: dropout on the
      activation's output (see ``dropout``); a rate above 0 needs ``dropout_rng`` unless
      ``deterministic``.
    recipe: the recipe of both GEMMs (``None``: high precision).
    states: ``(state_0, state_1)``, each GEMM's recipe state (``init_state(recipe)``), or None
      for a stateless recipe. The gradient with respect to them is the next step's states.
    rngs: ``(key_0, key_1)`` for a recipe that rounds stochastically, else None.
    threshold, config: as for ``dot_general``, for both GEMMs. ``config.fuse_activation_cast``
      (default None: as True, the faster path on an H100 under every recipe) takes the fused
      path where it applies: a recipe whose format
      takes producers (every recipe of the package; its blocks must tile both GEMMs, and a
      recipe that rounds stochastically needs both ``rngs``), both GEMMs in FP8 under
      ``threshold``, no dropout (rate 0 or ``deterministic``); with input constraints and inside
      ``shard_map`` for per-tensor recipes (block and rowwise ones compose there). It
      casts the float32 activation (and its gradient) to FP8 without rounding it to ``x``'s
      dtype first, and the norm's float32 output too unless it is asked for, so with bfloat16
      ``x`` its results differ from the composed path's by those roundings; the states follow
      the same contract.
    return_layernorm_output: also return the norm's output.
    ffn1_ckpt_name, ffn2_ckpt_name: ``checkpoint_name`` tags of GEMM 1's output (before the
      activation) and of the block's output, for remat policies (TE's names).
    dot_1_input_constraint, dot_2_input_constraint: functions applied to each GEMM's input (the
      norm's output; the activation's, after dropout), for sharding constraints; the adapters
      pass TE's ``dot_1_input_axes`` and ``dot_2_input_axes`` this way.
    kernel_all_gather: FSDP, as for ``dot_general``, for both kernels: a ``PartitionSpec``
      (or ``NamedSharding``) naming, per kernel dim, the mesh axes each kernel is sharded over
      (``P("fsdp")``: ``wi_kernel``'s K and ``wo_kernel``'s F, each kernel's first dim; a
      shorter spec is padded with None, as ``dot_general`` pads it). Each kernel is quantized
      shard by shard and its FP8 bytes all-gathered for its GEMM (the fused path's own), its
      gradient reduce-scattered back; the composed path passes it to each ``dot_general``.
      Inside ``shard_map`` the kernels are the shards.
    layer, framework: as for ``dot_general``: how warnings name the layer, and whose remedy a
      ``FrozenStateWarning`` gives.

  Returns:
    ``(out, ln_out)``: ``out`` of ``x``'s shape and dtype, and the norm's output or None.

  Raises:
    ValueError: ``x`` without a feature axis, or kernels and biases whose shapes do not match
      ``x`` and the activations (each message gives the shape expected); and ``layernorm``'s
      and ``dot_general``'s errors for the norm's and the GEMMs' arguments.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x = jnp.ones((16, 32))
    >>> out, ln = ta.core.layernorm_mlp(
    ...     x, jnp.ones(32), jnp.zeros(32), jnp.ones((32, 2, 64)), jnp.ones((64, 32)),
    ...     activations=("silu", "linear"), recipe=ta.Float8CurrentScaling())
    >>> out.shape, ln
    ((16, 32), None)
  """
  x, wi_kernel, wo_kernel = jnp.asarray(x), jnp.asarray(wi_kernel), jnp.asarray(wo_kernel)
  names = normalize_activations(activations)
  n_act = len(names)
  if x.ndim < 1:
    raise ValueError("layernorm_mlp: x must have a feature axis")
  k = x.shape[-1]
  plans: tuple[SpmdPlan | None, ...] = (None, None)
  if kernel_all_gather is not None:  # dot_general's checks and errors, for each kernel
    plans = tuple(
      checked_plan(recipe, w.ndim, kernel_all_gather=kernel_all_gather)
      for w in (wi_kernel, wo_kernel)
    )
  # The whole kernels' shapes (inside shard_map with kernel_all_gather: the gathered shards').
  wi_shape, wo_shape = (
    tuple(w.shape if p is None else sharding.gathered_kernel_type(w, p).shape)
    for w, p in zip((wi_kernel, wo_kernel), plans, strict=True)
  )
  if len(wi_shape) != 3 or wi_shape[:2] != (k, n_act):
    raise ValueError(
      f"layernorm_mlp: wi_kernel must have shape (K={k}, n_act={n_act}, F) for x of shape "
      f"{x.shape} and activations {names}, got {wi_shape}"
    )
  f = wi_shape[2]
  if wo_shape != (f, k):
    raise ValueError(f"layernorm_mlp: wo_kernel must have shape (F={f}, K={k}), got {wo_shape}")
  if wi_bias is not None and jnp.shape(wi_bias) != (n_act, f):
    raise ValueError(
      f"layernorm_mlp: wi_bias must have shape ({n_act}, {f}), got {jnp.shape(wi_bias)}"
    )
  if wo_bias is not None and jnp.shape(wo_bias) != (k,):
    raise ValueError(f"layernorm_mlp: wo_bias must have shape ({k},), got {jnp.shape(wo_bias)}")
  if enable_layernorm and scale is None:
    raise ValueError(
      "layernorm_mlp: scale is None: pass the norm's gamma, or enable_layernorm=False"
    )
  state_0, state_1 = _pair(states, "states")
  rng_0, rng_1 = _pair(rngs, "rngs")
  dims = (((x.ndim - 1,), (0,)), ((), ()))  # x's last axis with the kernel's first
  check_kernel_gemm_dims(recipe, wi_shape, dims, "layernorm_mlp's first GEMM")
  check_kernel_gemm_dims(recipe, wo_shape, dims, "layernorm_mlp's second GEMM")

  config = check_config(config)
  threshold = check_threshold(threshold)
  m = math.prod(x.shape[:-1])
  fused = _fused_mlp.applies(
    recipe,
    config,
    gemm_shapes=((m, k, n_act * f), (m, f, k)),
    threshold=threshold,
    # An out-of-range rate takes the composed path, whose dropout raises the error.
    dropout_active=not 0.0 <= dropout_rate <= 1.0 or (dropout_rate != 0.0 and not deterministic),
    constrained=dot_1_input_constraint is not None or dot_2_input_constraint is not None,
    rngs=(rng_0, rng_1),
    layer=layer,
  )
  kernels, chain_plan = (wi_kernel, wo_kernel), None
  if fused and plans[0] is not None:
    kernels, chain_plan = _fsdp_kernels(wi_kernel, wo_kernel, plans, m, layer)
  # On the fused path the constraints apply to the same layouts: GEMM 1's on the norm's input
  # (the norm is per row, so its output takes the input's layout), GEMM 2's on the activation's
  # FP8 copy that GEMM 2 reads.
  act_constraint = None
  if fused and dot_2_input_constraint is not None:
    act_constraint = _fused_mlp.on_rows(dot_2_input_constraint, x.shape[:-1])
  if (
    fused and enable_layernorm and not return_layernorm_output and _fused_mlp.norm_fuses(x, config)
  ):
    # The norm inside the fused path: its output is cast to FP8 as it is computed.
    check_norm_args(x, scale, ln_bias, layernorm_type)
    if dot_1_input_constraint is not None:
      x = dot_1_input_constraint(x)
    out = _fused_mlp.fused_mlp(
      x.reshape(m, k),
      kernels[0],
      wi_bias,
      kernels[1],
      (state_0, state_1),
      names,
      recipe=recipe,
      config=config,
      norm=(layernorm_type, bool(zero_centered_gamma), float(epsilon)),
      ln_scale=jnp.asarray(scale),
      ln_bias=None if ln_bias is None else jnp.asarray(ln_bias),
      ffn1_ckpt_name=ffn1_ckpt_name,
      wo_bias=_as_array(wo_bias),
      rngs=(rng_0, rng_1),
      layer=layer,
      framework=framework,
      act_constraint=act_constraint,
      plan=chain_plan,
    ).reshape(x.shape)
    return _output(out, None, ffn2_ckpt_name), None
  if enable_layernorm:
    assert scale is not None  # refused above
    y = layernorm(
      x,
      scale,
      ln_bias,
      layernorm_type=layernorm_type,
      zero_centered_gamma=zero_centered_gamma,
      epsilon=epsilon,
    )
  else:
    y = x
  if dot_1_input_constraint is not None:
    y = dot_1_input_constraint(y)
  if fused:
    out = _fused_mlp.fused_mlp(
      y.reshape(m, k),
      kernels[0],
      wi_bias,
      kernels[1],
      (state_0, state_1),
      names,
      recipe=recipe,
      config=config,
      ffn1_ckpt_name=ffn1_ckpt_name,
      wo_bias=_as_array(wo_bias),
      rngs=(rng_0, rng_1),
      layer=layer,
      framework=framework,
      act_constraint=act_constraint,
      plan=chain_plan,
    ).reshape(x.shape)
    return _output(out, None, ffn2_ckpt_name), (y if return_layernorm_output else None)
  h = dot_general(
    y,
    wi_kernel,
    dims,
    preferred_element_type=x.dtype,
    recipe=recipe,
    state=state_0,
    rng=rng_0,
    threshold=threshold,
    config=config,
    kernel_all_gather=kernel_all_gather,
    layer=layer,
    framework=framework,
  )
  if wi_bias is not None:
    h = h + jnp.asarray(wi_bias).astype(h.dtype)
  h = checkpoint_name(h, ffn1_ckpt_name)
  z = activation(h, names)
  z = dropout(
    z, dropout_rate, dropout_rng, broadcast_dims=dropout_broadcast_dims, deterministic=deterministic
  )
  if dot_2_input_constraint is not None:
    z = dot_2_input_constraint(z)
  out = dot_general(
    z,
    wo_kernel,
    dims,
    preferred_element_type=x.dtype,
    recipe=recipe,
    state=state_1,
    rng=rng_1,
    threshold=threshold,
    config=config,
    kernel_all_gather=kernel_all_gather,
    layer=layer,
    framework=framework,
  )
  return _output(out, wo_bias, ffn2_ckpt_name), (y if return_layernorm_output else None)


def _fsdp_kernels(wi_kernel, wo_kernel, plans, m, layer):
  """FSDP on the fused path: both kernels in ``dot_general``'s ``(N, K)`` layout and the
  chain's plan (``gemm.fsdp_gemm_layout``). One spec for both kernels gathers the same GEMM dims
  of each (its third entry, ``wi_kernel``'s F, must be None: ``wo_kernel`` has two dims), so one
  plan serves the chain, and GEMM 1's output keeps ``(n_act, F)`` with F last, as the activation
  reads it."""
  wi_layout, wi3, wi_plan = fsdp_gemm_layout(wi_kernel, plans[0], m, 0, layer)
  _, wo3, wo_plan = fsdp_gemm_layout(wo_kernel, plans[1], m, 0, layer)
  assert wi_plan == wo_plan and tuple(wi_layout.rhs_free) == (1, 2), (wi_plan, wo_plan)
  return (wi3, wo3), wi_plan


def _as_array(b):
  return None if b is None else jnp.asarray(b)


def _output(out, wo_bias, ffn2_ckpt_name):
  """The block's output: GEMM 2's plus its bias, tagged for remat policies."""
  if wo_bias is not None:
    out = out + jnp.asarray(wo_bias).astype(out.dtype)
  return checkpoint_name(out, ffn2_ckpt_name)
