"""The quantized ``dot_general``: FP8 operands straight into ``lax.dot_general``, with a custom VJP.

Forward: ``y = (q(x) · q(kernel)) * sinv_x * sinv_kernel``. Backward, with the output gradient
quantized once to the recipe's backward dtype: ``dx = q(g) · q(kernel)^T`` and
``dkernel = q(x)^T · q(g)``, each rescaled. The FP8 arrays themselves go into the GEMMs (no
quantize-dequantize pattern for XLA to recognise), so a GPU that has FP8 GEMMs runs them.

On a Hopper GPU with the extension's CUDA part built, each GEMM (both operands contracting-last)
runs through the extension's cuBLASLt call, as TE's does: both scales in the epilogue, one
rounding of the float32 sums to the output dtype, and the accumulation the recipe's
``MMParams`` ask for; in a sharded ``jit`` program, on each shard (``_partition.py``). Elsewhere
(CPU, other GPUs, odd sizes, a named ``out_sharding``) XLA runs ``lax.dot_general`` on the FP8
arrays and the output is rescaled in float32 after it.
``GemmConfig(fp8_gemm="xla")`` forces XLA's; ``"native"`` requires the extension's (an error
where it cannot run).

Recipe state travels through the gradient channel: the cotangent returned for ``state`` is the
state for the next step ("overwrite with gradient").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core import (
  _amax_reduction,
  _batching,
  _block,
  _block_gemm,
  _cast_transpose,
  _cotangents,
  _dimension_numbers,
  _explicit_sharding,
  _ffi,
  _frozen,
  _fsdp_gather,
  _partition,
  _remat,
  _rng,
  _scaled_tensor,
  _scaling,
  _spmd_plan,
  _tensor_scaling,
  _threshold,
)
from te_adapters.core._accumulate import is_accumulating
from te_adapters.core._config import GemmConfig, check_config
from te_adapters.core._recipes import check_recipe
from te_adapters.core._state import ROLES, check_state, shared_max_grad
from te_adapters.core._threshold import DEFAULT_SIZE_THRESHOLD

__all__ = ["dot_general"]


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe,
    state=None,
    rng=None,
    out_sharding=None,
    amax_axes=None,
    kernel_all_gather=None,
    threshold=DEFAULT_SIZE_THRESHOLD,
    config: GemmConfig | None = None,
):
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
      ``NVFP4BlockScaling``, ``Float8BlockScaling``), or ``None`` for a plain
      ``lax.dot_general``.
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
      and need no reduction (each shard must hold whole blocks).
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

  Returns:
    The product, with the dtype and shape ``lax.dot_general`` gives. Under differentiation, the
    gradient with respect to ``state`` is the state for the next step.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> y = ta.core.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling())
    >>> round(float(y[0, 0]), 4)
    32.0
  """
  _scaled_tensor.check_float_operand("lhs", lhs)
  _scaled_tensor.check_float_operand("rhs", rhs)
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  threshold = _threshold.check_threshold(threshold)
  config = check_config(config)
  if recipe is None:
    if state:
      raise ValueError("state was given but recipe is None")
    if rng is not None:
      raise ValueError("rng was given but recipe is None")
    if amax_axes is not None or kernel_all_gather is not None:
      raise ValueError("amax_axes and kernel_all_gather need a recipe; recipe is None")
    dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, rhs.shape)
    return lax.dot_general(
        lhs, rhs, dn, precision, preferred_element_type, out_sharding=out_sharding
    )
  plan = _spmd_plan.make_plan(amax_axes, kernel_all_gather, out_sharding, rhs_ndim=rhs.ndim)
  recipe = check_recipe(recipe)
  if recipe.block_scaled:
    _amax_reduction.check_block_scaled(recipe, plan)
  else:
    _amax_reduction.check_amax_axes(plan)
  # The kernel as the GEMM sees it: inside shard_map, kernel_all_gather gathers the shard first.
  gemm_rhs = _fsdp_gather.gathered_kernel_type(rhs, plan)
  dn = _dimension_numbers.normalize(dimension_numbers, lhs.shape, gemm_rhs.shape)
  state = check_state(recipe, state)
  if state:
    # Every use of one traced state gets the same max-marked arrays, so a plain jax.grad
    # combines several uses by max, never by sum (see core.with_max_grad).
    state = shared_max_grad(state)
  rng = _rng.check_rng(recipe, rng)
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
  out_dtype = out.dtype
  # What the recipe cannot take is refused before the size decides the precision, so bad input
  # gets the same error at every size (the backward's checks under differentiation).
  if recipe.block_scaled:
    _block_gemm.check_operands(lhs, rhs, dn, recipe)
  m, k, n = _threshold.gemm_mkn(lhs.shape, gemm_rhs.shape, dn)
  dtypes = str(lhs.dtype) if lhs.dtype == rhs.dtype else f"{lhs.dtype} x {rhs.dtype}"
  if _threshold.keeps_high_precision(threshold, m, k, n, recipe, dtypes, stacklevel=2):
    y = _high_precision_dot_general(lhs, rhs, state, dn, precision, preferred_element_type, plan)
    if recipe.block_scaled:
      y = _block_gemm.checked_under_grad(y, dn, lhs.shape, gemm_rhs.shape, recipe, rng is None)
    return y
  if recipe.block_scaled:
    return _block_gemm.block_dot_general(
        lhs, rhs, dn, out, recipe, rng, plan, config.block_gemm, cast=config.backend)
  if state:
    # Under differentiation: warns at trace time when the state would stay frozen.
    lhs, rhs, state = _frozen.watch_state(lhs, rhs, state)
  operand_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  if config.layout == "tn":
    return _tn_dot_general(
        lhs, rhs, state, dn, precision, np.dtype(out_dtype), recipe, plan, gemm_rhs.shape, config
    )
  return _fp8_dot_general(
      lhs, rhs, state, dn, precision, np.dtype(out_dtype), operand_dtypes, recipe, plan, config
  )


def _high_precision_dot_general(lhs, rhs, state, dn, precision, preferred_element_type, plan):
  """The GEMM below the size threshold: ``lax.dot_general`` on the unquantized operands."""
  # FSDP inside shard_map: the kernel is a shard, gathered (and its gradient reduce-scattered by
  # autodiff) in high precision; under jit the gather is a sharding constraint.
  rhs = _fsdp_gather.gather_kernel(rhs, plan)
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
  return y, (state, jax.tree_util.tree_map(_cotangents.type_witness, state))


def _keep_state_bwd(residuals, g):
  state, witness = residuals
  return g, _match_state(jax.tree_util.tree_map(_unchanged, state), witness)


def _match_state(new_state, witness):
  """The new state, each leaf with its old leaf's varying mesh axes (see ``match_cotangent``)."""
  return jax.tree_util.tree_map(_cotangents.match_cotangent, new_state, witness)


def _unchanged(leaf):
  # Marked for max (always, under differentiation): the identity of the max/scale combination
  # (-inf): this use contributes nothing, so other uses of the state win, and alone it decodes
  # to the old state. Plain float32: the old value itself.
  if is_accumulating(leaf):
    return lax.convert_element_type(jnp.full(leaf.shape, -jnp.inf, jnp.float32), leaf.dtype)
  return leaf


_keep_state.defvjp(_keep_state_fwd, _keep_state_bwd)


def _output_mode(config: GemmConfig, gemm: str = "fwd") -> str:
  # "f32": the FP8 GEMM accumulates into float32, rescaled there, then cast (one rounding).
  # "direct32": the GEMM emits the output dtype, rescaled in float32 and rounded again.
  # "direct": the GEMM emits the output dtype and is rescaled in it. The scale is rounded to the
  #   output dtype first, which biases every output by up to 2**-9 in bfloat16 (a 0.4% change of
  #   sum(y**2) in a test): kept only to measure it.
  # "mixed" / "mixed32": direct / direct32 for the forward and dgrad GEMMs, f32 for wgrad.
  # (Dequantized operands, float32 convert times scale, which XLA rewrites into one FP8 GEMM
  # with both scales in its epilogue, fail for bfloat16 outputs on jax 0.11.2: XLA takes a
  # float32 x float32 -> bfloat16 dot to be unsupported by cuBLASLt before its FP8 rewrite.)
  mode = config.output
  if mode in ("mixed", "mixed32"):
    return "f32" if gemm == "wgrad" else mode.replace("mixed", "direct")
  return mode


def _gemm_precision(precision, gemm: str, recipe):
  # XLA runs an FP8 cuBLASLt GEMM with fast accumulation when its precision is DEFAULT, and
  # promotes the sums to float32 with HIGHEST: the recipe's MMParams choose, per GEMM; without a
  # split accumulator the caller's precision decides.
  params = getattr(recipe, {"fwd": "fp8_gemm_fprop", "dgrad": "fp8_gemm_dgrad",
                            "wgrad": "fp8_gemm_wgrad"}[gemm])
  return lax.Precision.HIGHEST if params.use_split_accumulator else precision


_CUBLAS_OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _cublas_refusal(a, b, out_dtype, out_sharding) -> str | None:
  """Why the extension's cuBLASLt GEMM cannot run ``a (.., M, K) . b (.., N, K)^T`` (None: it
  can). XLA runs it then."""
  if not _ffi.cublas_gemm_available():
    return "the extension's cuBLASLt GEMM is not built here or the GPU is not a Hopper GPU"
  if np.dtype(out_dtype) not in _CUBLAS_OUT_DTYPES:
    return f"it writes bfloat16, float16 or float32, not {np.dtype(out_dtype)}"
  m, n, k = a.shape[-2], b.shape[-2], a.shape[-1]
  if m % 16 or n % 16 or k % 16:
    return f"it needs M, N and K multiples of 16, got M={m}, N={n}, K={k}"
  if out_sharding is not None:  # Explicit mesh axes naming the output's sharding
    return "the output's sharding is named (out_sharding), which its partitioning rule ignores"
  return None


def _cublas_tn_dot(a, b, sinv_a, sinv_b, out_dtype, precision):
  """``a (.., M, K) . b (.., N, K)^T * sinv_a * sinv_b`` by cuBLASLt: both scales in the
  epilogue, one rounding to ``out_dtype`` (TE's GEMM)."""
  lead = a.shape[:-2]
  (m, k), n = a.shape[-2:], b.shape[-2]
  # 2-D operands go in as they are: a reshape between the call and a cast of its output (the
  # float32 wgrad cast to bf16 and back to a float32 parameter's dtype) stops XLA from dropping
  # that round trip.
  batch = (math.prod(lead),) if lead else ()
  # Fast sums where XLA would use them: every operand precision DEFAULT (XLA's rule).
  pair = precision if isinstance(precision, (tuple, list)) else (precision, precision)
  fast = all(p is None or str(p).upper().split(".")[-1] in ("DEFAULT", "FASTEST") for p in pair)
  # Per shard in a sharded program (_partition.py).
  y = _partition.tensor_scaled_gemm(
      _ffi.gemm_call, a.reshape(*batch, m, k), b.reshape(*batch, n, k),
      sinv_a.reshape(1).astype(jnp.float32), sinv_b.reshape(1).astype(jnp.float32),
      out_dtype, fast,
  )
  return y.reshape(*lead, m, n) if lead else y


def _scaled_dot(
    a, b, dims, scales_inv, out_dtype, precision, gemm, recipe, config, out_sharding=None
):
  """``(a * sinv_a) . (b * sinv_b)`` for FP8 ``a``, ``b``; ``scales_inv = (sinv_a, sinv_b)``."""
  precision = _gemm_precision(precision, gemm, recipe)
  sinv_a, sinv_b = scales_inv
  choice = config.fp8_gemm
  batch = tuple(range(a.ndim - 2))
  if choice != "xla" and dims == (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch)):
    refusal = _cublas_refusal(a, b, out_dtype, out_sharding)
    if refusal is None:
      # wgrad: float32, then cast. Where the caller casts the gradient back to a float32
      # parameter (nn.Dense computing in bf16), XLA drops the bf16 round trip, and the
      # parameter's gradient is the GEMM's float32 output, with no pass of its own.
      gemm_dtype = jnp.float32 if gemm == "wgrad" else out_dtype
      y = _cublas_tn_dot(a, b, sinv_a, sinv_b, gemm_dtype, precision)
      return y.astype(out_dtype)
    if choice == "native":
      raise RuntimeError(f"fp8_gemm='native', but {refusal}")
  mode = _output_mode(config, gemm)
  scale_inv = sinv_a * sinv_b
  if mode in ("direct", "direct32"):
    out = lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=out_dtype,
        out_sharding=out_sharding,
    )
    if mode == "direct32":
      # The barrier keeps the GEMM's rounding to out_dtype, which XLA would otherwise drop in
      # some fusions and not in others (its "excess precision"), so results would depend on
      # how a program is fused or sharded.
      out = _block.keep_narrow(out) if np.dtype(out_dtype).itemsize < 4 else out
      return (out.astype(jnp.float32) * scale_inv.reshape(())).astype(out_dtype)
    return out * scale_inv.reshape(()).astype(out_dtype)
  out = lax.dot_general(
      a, b, dims, precision=precision, preferred_element_type=jnp.float32,
      out_sharding=out_sharding,
  )
  return (out * scale_inv.reshape(())).astype(out_dtype)


def _role_scale(x, role, q_dtype, recipe, state, plan, a=None):
  """The scale one operand is quantized with; returns (scale, the role's new ``RoleState``).

  ``a``: the operand's amax when already computed (by a fused cast), else computed here. On a
  mesh it is made global first (``_amax_reduction.global_amax``).
  """
  scaling = _tensor_scaling.of(recipe)
  limit = _scaling.fp8_max(q_dtype)
  a = _scaling.amax(x) if a is None else a
  a = _amax_reduction.global_amax(a, x, role, plan, scaling.state_varying(state, role))
  return scaling.next_scale(recipe, a, state, role, limit)


def _quantize_role(x, role, q_dtype, recipe, state, plan):
  """Quantizes one operand; returns (data, scale_inv, the role's new state)."""
  scale, new = _role_scale(x, role, q_dtype, recipe, state, plan)
  data = _scaled_tensor.cast_with_scale(x, scale, q_dtype)
  return data, _scaling.scale_inverse(scale), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _fp8_dot_general(
    lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe, plan, config
):
  y, _ = _fp8_fwd(lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe, plan, config)
  return y


def _fp8_fwd(lhs, rhs, state, dn, precision, out_dtype, operand_dtypes, recipe, plan, config):
  del operand_dtypes
  q_x, sinv_x, new_x = _quantize_role(lhs, "x", recipe.fwd_dtype, recipe, state, plan)
  q_w, sinv_w, new_w = _quantize_role(rhs, "kernel", recipe.fwd_dtype, recipe, state, plan)
  q_x, sinv_x = _remat.name_quantized((q_x, sinv_x), _remat.QUANTIZED_X)
  # With kernel_all_gather this is the FP8 shard; a remat policy that saves it and not the rest
  # re-gathers the kernel in the backward pass (ZeRO-3 memory).
  q_w, sinv_w = _remat.name_quantized((q_w, sinv_w), _remat.QUANTIZED_KERNEL)
  q_w_full = _fsdp_gather.gather_kernel(q_w, plan)
  y = _scaled_dot(
      q_x, q_w_full, dn, (sinv_x, sinv_w), out_dtype, precision, "fwd", recipe, config,
      out_sharding=plan.out_sharding,
  )
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  # Zero-size arrays with the primals' varying mesh axes (shard_map only; None elsewhere).
  witness = jax.tree_util.tree_map(_cotangents.type_witness, (lhs, rhs, state))
  gathered = None if q_w_full is q_w else q_w_full
  residuals = (q_x, sinv_x, q_w, gathered, sinv_w, {"x": new_x, "kernel": new_w}, state, witness)
  return y, residuals


def _fp8_bwd(dn, precision, out_dtype, operand_dtypes, recipe, plan, config, residuals, g):
  q_x, sinv_x, q_w, q_w_full, sinv_w, new_fwd_state, state, witness = residuals
  lhs_dtype, rhs_dtype = operand_dtypes
  del out_dtype
  q_g, sinv_g, new_g = _quantize_role(g, "grad", recipe.bwd_dtype, recipe, state, plan)
  q_w_full = q_w if q_w_full is None else q_w_full
  dims, perm = _dimension_numbers.transpose_lhs(dn, q_x.ndim, q_w.ndim)
  out_sharding = _cotangents.transposed_out_sharding(q_x, perm)
  dx = _scaled_dot(
      q_g, q_w_full, dims, (sinv_g, sinv_w), lhs_dtype, precision, "dgrad", recipe, config,
      out_sharding,
  )
  dx = _cotangents.match_cotangent(jnp.transpose(dx, perm), witness[0])
  dims, perm = _dimension_numbers.transpose_rhs(dn, q_x.ndim, q_w.ndim)
  out_sharding = _cotangents.transposed_out_sharding(q_w, perm)
  dw_dtype = _cotangents.wgrad_dtype(rhs_dtype, witness[1])
  dw = _scaled_dot(
      q_g, q_x, dims, (sinv_g, sinv_x), dw_dtype, precision, "wgrad", recipe, config,
      out_sharding,
  )
  dw = _fsdp_gather.scatter_kernel_grad(jnp.transpose(dw, perm), q_w, plan)
  dw = _cotangents.match_cotangent(dw, witness[1]).astype(rhs_dtype)
  new_state = next_gemm_state(recipe, state, {**new_fwd_state, "grad": new_g})
  return dx, dw, _match_state(new_state, witness[2])


_fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)

# For tests and tools: roles in the order the state lists them.
STATE_ROLES = ROLES


# ---------------------------------------------------------------------------------------------
# Contracting-last ("TN") formulation: cuBLASLt's FP8 GEMMs take both operands with the
# contracting dimension last. The operands are brought to x3 (B, M, K) and w3 (B, N, K) outside
# the VJP (plain JAX transposes/reshapes, which XLA fuses into the casts), and inside it each
# tensor is quantized in the two orientations its GEMMs need, in the pass that reads it:
#   y  (M, N) = q(x3)     . q(w3)^T      contracting K
#   dx (M, K) = q(g)      . q(w3^T)^T    contracting N
#   dw (K, N) = q(x3^T)   . q(g^T)^T     contracting M  (then transposed back to (N, K), which
#                                                       cancels against the caller's transpose)


def _canonical_plan(dn, lhs_shape, rhs_shape):
  (lc, rc), (lb, rb) = dn
  lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  size = lambda shape, dims: math.prod(shape[d] for d in dims)
  b, m, k, n = size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf)
  lhs_perm, rhs_perm = (*lb, *lf, *lc), (*rb, *rf, *rc)
  batch_shape = tuple(lhs_shape[d] for d in lb)
  out_shape = batch_shape + tuple(lhs_shape[d] for d in lf) + tuple(rhs_shape[d] for d in rf)
  lead = (b,) if lb else ()
  return lhs_perm, rhs_perm, lead + (m, k), lead + (n, k), out_shape


def _tn_dot_general(
    lhs, rhs, state, dn, precision, out_dtype, recipe, plan, gemm_rhs_shape, config
):
  # Contracting pairs in the input's dimension order (jnp.einsum may give them in another):
  # merging (N, H) with N sharded keeps whole shards, merging (H, N) would split them.
  (lc, rc), batch_dims = dn
  pairs = sorted(zip(lc, rc, strict=True))
  dn = ((tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)), batch_dims)
  lhs_perm, rhs_perm, x3_shape, w3_shape, out_shape = _canonical_plan(
      dn, lhs.shape, gemm_rhs_shape
  )
  # The kernel's own shape: inside shard_map with kernel_all_gather, that of its shard.
  (_, rc), (_, rb) = dn
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  local = (math.prod(rhs.shape[d] for d in rf), math.prod(rhs.shape[d] for d in rc))
  w3_shape = w3_shape[:-2] + local
  plan = _spmd_plan.plan_for_tn_layout(plan, dn, lhs.ndim, rhs.ndim)
  # A kernel stored contracting-first (a Dense kernel (K, N)) goes in as it is, as wk (B, K, N):
  # the cast writes both orientations anyway, so a transpose here would be a pass for nothing
  # (1 GB of float32 read and written for seed 000's kernel).
  identity = tuple(range(rhs.ndim))
  kernel_kn = (
      plan.kernel_all_gather is None and rhs_perm != identity and (*rb, *rc, *rf) == identity
  )
  # Under Explicit mesh axes the reshapes name their output sharding (a clear error where a
  # merge would split a sharded dimension's shards).
  x3 = _explicit_sharding.reshape(jnp.transpose(lhs, lhs_perm), x3_shape)
  if kernel_kn:
    w3 = _explicit_sharding.reshape(rhs, w3_shape[:-2] + local[::-1])
  else:
    w3 = _explicit_sharding.reshape(jnp.transpose(rhs, rhs_perm), w3_shape)
  y3 = _tn_vjp(x3, w3, state, precision, out_dtype, recipe, plan, kernel_kn, config)
  return _explicit_sharding.reshape(y3, out_shape)


def _swap_last(a):
  return jnp.swapaxes(a, -1, -2)


def _tn_dot(a, b, scales_inv, out_dtype, precision, gemm, recipe, config, out_sharding=None):
  """``a (.., P, C) . b (.., Q, C)^T``: both operands contracting-last."""
  batch = tuple(range(a.ndim - 2))
  dims = (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
  return _scaled_dot(
      a, b, dims, scales_inv, out_dtype, precision, gemm, recipe, config, out_sharding
  )


def _cast_both(x, scale, q_dtype, config, with_amax=False):
  """FP8 copies of ``x`` and of ``x`` with its last two dims swapped (and the amax of ``x``).

  One pass over ``x``: the FFI kernel or XLA's fusion, per ``config.backend``.
  """
  if config.transpose == "fp8":
    q = _scaled_tensor.cast_with_scale(x, scale, q_dtype)
    return q, _swap_last(q), (_scaling.amax(x) if with_amax else None)  # transpose 1-byte copy
  return _cast_transpose.cast_transpose(
      x, scale, q_dtype, with_amax=with_amax, backend=config.backend
  )


def _quantize_both(x, role, q_dtype, recipe, state, plan, config, cast=None, amax=None):
  """Both FP8 orientations of one operand; returns (q, q_t, scale, the role's new state).

  ``cast(scale, with_amax) -> (q, q_t, amax or None)`` and ``amax() -> amax`` replace the cast
  and the amax pass of ``x`` when the operand is made inside them from other arrays (the MLP's
  activation); ``x`` then only gives the operand's type.
  """
  if cast is None:
    cast = lambda scale, with_amax: _cast_both(x, scale, q_dtype, config, with_amax)  # noqa: E731
  scale = _tensor_scaling.of(recipe).stored_scale(state, role)
  if scale is not None:
    # Delayed scaling: the stored scale is known before the pass, so the amax comes out of the
    # cast itself.
    q, q_t, a = cast(scale, True)
    _, new = _role_scale(x, role, q_dtype, recipe, state, plan, a)
  else:
    # Current scaling: an amax pass, then the cast. XLA's reduce ran as fast as the FFI amax
    # kernel (seed 000 Dense on an H100: 22.17-22.32 ms against 22.38-22.67 ms), and it can fuse
    # into the op that produces x, so it is the default.
    if amax is None:
      amax_backend = config.backend if config.amax == "ffi" else "jax"
      a = _cast_transpose.amax(x, backend=amax_backend)
    else:
      a = amax()
    scale, new = _role_scale(x, role, q_dtype, recipe, state, plan, a)
    q, q_t, _ = cast(scale, False)
  return q, q_t, scale, new


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _tn_vjp(x3, w3, state, precision, out_dtype, recipe, plan, kernel_kn, config):
  y, _ = _tn_fwd(x3, w3, state, precision, out_dtype, recipe, plan, kernel_kn, config)
  return y


def _tn_fwd(x3, w3, state, precision, out_dtype, recipe, plan, kernel_kn, config):
  """``kernel_kn``: ``w3`` is (.., K, N), not (.., N, K) (its two FP8 copies trade places)."""
  fwd = recipe.fwd_dtype
  # Each operand in both orientations: this one for the forward GEMM, the transposed copy
  # (kept for the backward pass) for wgrad (x) and dgrad (kernel).
  q_x, q_xt, scale_x, new_x = _quantize_both(x3, "x", fwd, recipe, state, plan, config)
  shard = None
  if plan.kernel_all_gather is None:
    q_w, q_wt, scale_w, new_w = _quantize_both(w3, "kernel", fwd, recipe, state, plan, config)
    if kernel_kn:
      q_w, q_wt = q_wt, q_w
  else:
    # FSDP: the FP8 shard is cast, named (a remat policy that saves only it gathers again in
    # the backward pass) and all-gathered; the gathered kernel is transposed in FP8.
    scale_w, new_w = _role_scale(w3, "kernel", fwd, recipe, state, plan)
    shard = _scaled_tensor.cast_with_scale(w3, scale_w, fwd)
  sinv_x, sinv_w = _scaling.scale_inverse(scale_x), _scaling.scale_inverse(scale_w)
  q_xt, sinv_xt = _remat.name_quantized((q_xt, sinv_x), _remat.QUANTIZED_X)
  if shard is None:
    q_wt, sinv_wt = _remat.name_quantized((q_wt, sinv_w), _remat.QUANTIZED_KERNEL)
  else:
    shard, sinv_wt = _remat.name_quantized((shard, sinv_w), _remat.QUANTIZED_KERNEL)
    q_w = _fsdp_gather.gather_kernel(shard, plan)
    q_wt = _swap_last(q_w)
  y = _tn_dot(
      q_x, q_w, (sinv_x, sinv_w), out_dtype, precision, "fwd", recipe, config, plan.out_sharding
  )
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  dtypes = (np.zeros((0,), x3.dtype), np.zeros((0,), w3.dtype))
  # Zero-size arrays with the primals' varying mesh axes (shard_map only; None elsewhere).
  witness = jax.tree_util.tree_map(_cotangents.type_witness, (x3, w3, state))
  new_fwd_state = {"x": new_x, "kernel": new_w}
  residuals = (q_xt, sinv_xt, q_wt, sinv_wt, new_fwd_state, state, dtypes, shard, witness)
  return y, residuals


def _tn_bwd(precision, out_dtype, recipe, plan, kernel_kn, config, residuals, g):
  q_xt, sinv_x, q_wt, sinv_w, new_fwd_state, state, protos, shard, witness = residuals
  x_proto, w_proto = protos
  del out_dtype
  bwd = recipe.bwd_dtype
  q_g, q_gt, scale_g, new_g = _quantize_both(g, "grad", bwd, recipe, state, plan, config)
  sinv_g = _scaling.scale_inverse(scale_g)
  swap = tuple(range(q_xt.ndim - 2)) + (q_xt.ndim - 1, q_xt.ndim - 2)
  # With Explicit mesh axes each cotangent gets its primal's sharding.
  dx_sharding = _cotangents.transposed_out_sharding(q_xt, swap)
  w3_layout = q_wt if shard is None else shard
  dw_sharding = _cotangents.transposed_out_sharding(w3_layout, swap if shard is not None else None)
  dx = _tn_dot(
      q_g, q_wt, (sinv_g, sinv_w), x_proto.dtype, precision, "dgrad", recipe, config, dx_sharding
  )
  dw_dtype = _cotangents.wgrad_dtype(w_proto.dtype, witness[1])
  dw = _tn_dot(
      q_xt, q_gt, (sinv_x, sinv_g), dw_dtype, precision, "wgrad", recipe, config, dw_sharding
  )
  if not kernel_kn:
    dw = _swap_last(dw)  # (.., N, K); cancels against the caller's transpose
  dw = _fsdp_gather.scatter_kernel_grad(dw, shard, plan)
  # Inside shard_map: sums over the mesh axes a primal is replicated on (pvary's transpose).
  dx = _cotangents.match_cotangent(dx, witness[0])  # (.., M, K)
  dw = _cotangents.match_cotangent(dw, witness[1]).astype(w_proto.dtype)
  new_state = next_gemm_state(recipe, state, {**new_fwd_state, "grad": new_g})
  return dx, dw, _match_state(new_state, witness[2])


def next_gemm_state(recipe, state, roles):
  """One GEMM's next recipe state from its roles' new states (``{role: RoleState or None}``),
  combined over a ``vmap``-ped batch as TE's rule would have it (``_batching``)."""
  new = _tensor_scaling.of(recipe).next_state(state, roles)
  return _batching.combine_over_batch(new, state, functools.partial(_rescale, recipe))


def _rescale(recipe, role, history, old_history, old_scale):
  """The scale TE's rule gives after ``old_history`` -> ``history`` (for ``_batching``)."""
  limit = _scaling.fp8_max(recipe.bwd_dtype if role == "grad" else recipe.fwd_dtype)
  current = history[-1:]  # the step's amax sits at the end after the roll
  window = current if recipe.amax_compute_algo == "most_recent" else jnp.maximum(
      current, jnp.max(old_history[1:], initial=0.0, keepdims=True)[:1])
  updated = (window > 0) & jnp.isfinite(window)
  return _scaling.compute_scale(window, limit, old_scale, recipe.margin), updated


_tn_vjp.defvjp(_tn_fwd, _tn_bwd)
