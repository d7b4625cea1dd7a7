"""The MLP's norm, two per-tensor FP8 GEMMs and activation in one custom VJP (TE's structure).

``out = q(act(h + b)) . q(wo)`` with ``h = q(y) . q(wi)``: the activation of GEMM 1's output and
its bias is computed in float32 and cast straight to GEMM 2's FP8 operand in both orientations
(no activation buffer in the input's dtype), and in the backward pass
``dh = dz * act'(h + b)`` is cast straight to GEMM 1's FP8 output gradient in both orientations,
with its amax and the bias gradient, from one read of ``dz`` and ``h``; the block's output
gradient is cast for GEMM 2 in the pass that sums the output bias's gradient (the same kernel
with a linear activation, which reads the gradient alone). Each GEMM keeps its own
recipe state with ``dot_general``'s contract (the gradient with respect to it is the next
state). With ``norm``, the norm runs inside too: its float32 output is cast straight to GEMM 1's
FP8 operand, and the backward pass computes the norm's gradients from GEMM 1's dgrad.
``core.layernorm_mlp`` takes this path where it applies (``applies``, ``norm_fuses``).

The casts run as the pure-JAX formulas here (XLA fuses them), or on Hopper GPUs with the
extension's CUDA part built as the kernels of ``csrc/act_cast_cuda.cu`` (``_kernels_run``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core import (
  _cast_transpose,
  _ffi,
  _frozen,
  _gemm,
  _mesh,
  _norm,
  _remat,
  _scaled_tensor,
  _scaling,
  _spmd_plan,
)
from te_adapters.core._activation import _product
from te_adapters.core._recipes import check_recipe
from te_adapters.core._state import check_state, shared_max_grad

__all__ = ["KERNEL_ACTIVATIONS", "applies", "fused_mlp"]

# The activations the CUDA kernels compute (one, or a gated pair), by their id there.
KERNEL_ACTIVATIONS = {
    "linear": 0, "gelu": 1, "relu": 2, "silu": 3, "swish": 3, "quick_gelu": 4, "squared_relu": 5,
}


def applies(recipe, config, *, gemm_shapes, threshold, dropout_active, constrained, rngs) -> bool:
  """Whether ``layernorm_mlp`` takes the fused path: a per-tensor recipe, both GEMMs in FP8
  (``gemm_shapes``: their ``(M, K, N)``), no dropout, no sharding constraint, no PRNG keys, not
  inside ``shard_map``, and ``config.fuse_activation_cast`` not ``False``."""
  if recipe is None or config.fuse_activation_cast is False or config.layout != "tn":
    return False
  if check_recipe(recipe).block_scaled:
    return False
  if dropout_active or constrained or any(r is not None for r in rngs) or _mesh.manual_axes():
    return False
  if threshold is not None:
    backend = jax.default_backend()
    if not all(threshold.allows_fp8(m, k, n, backend) for m, k, n in gemm_shapes):
      return False
  return True


def norm_fuses(x, config) -> bool:
  """Whether the norm's output is cast inside the fused path (from float32, never written):
  where the casts are pure JAX (XLA fuses the norm into them) or the CUDA norm cast runs."""
  if _cast_transpose.backend(requested=config.backend) == "jax":
    return True
  return _kernels_run(x, config, _ffi.NORM_CAST_TARGET)


def fused_mlp(y, wi, wi_bias, wo, states, names, *, recipe, config, norm=None, ln_scale=None,
              ln_bias=None, ffn1_ckpt_name="ffn1", wo_bias=None):
  """``q(act(q(y) . q(wi) + wi_bias)) . q(wo) + wo_bias`` with both GEMMs' per-tensor FP8
  scaling.

  Args:
    y: GEMM 1's input ``(M, K)``, or with ``norm`` the norm's input.
    wi: ``(K, n_act, F)``. wi_bias: ``(n_act, F)`` or None. wo: ``(F, K_out)``.
    states: ``(state_0, state_1)`` (``None`` entries for a stateless recipe).
    names: normalized activation names (``normalize_activations``).
    recipe: ``DelayedScaling`` or ``Float8CurrentScaling``.
    config: a ``GemmConfig``.
    norm: ``(layernorm_type, zero_centered_gamma, epsilon)`` to normalize ``y`` first (as
      ``core.layernorm``, with gamma ``ln_scale`` and beta ``ln_bias``, None for rmsnorm) and
      cast the float32 result to GEMM 1's FP8 operand; None: ``y`` is GEMM 1's input.
    ffn1_ckpt_name: ``checkpoint_name`` of GEMM 1's output (before the bias), the residual the
      backward pass reads.
    wo_bias: ``(K_out,)`` or None: GEMM 2's bias, whose gradient is summed in the pass that casts
      the output gradient to FP8 (TE's dbias + quantize).

  Returns:
    ``(M, K_out)`` in ``y``'s dtype. The gradients with respect to the states are their next
    values.
  """
  recipe = check_recipe(recipe)
  k, n_act, f = wi.shape
  state_0, state_1 = states
  wi2 = wi.reshape(k, n_act * f)
  y, wi2, state_0 = gemm_state(recipe, y, wi2, state_0)
  y, wo, state_1 = gemm_state(recipe, y, wo, state_1)
  if norm is not None and ln_bias is None:
    ln_bias = jnp.zeros((0,), ln_scale.dtype)  # rmsnorm: a placeholder, as core.layernorm's
  static = (tuple(names), recipe, config, ffn1_ckpt_name, norm)
  return _mlp(y, ln_scale, ln_bias, wi2, wi_bias, wo, wo_bias, state_0, state_1, static)


_PLAN = _spmd_plan.SpmdPlan()


def gemm_state(recipe, lhs, rhs, state):
  """One GEMM's recipe state checked against ``recipe``, its reused-GEMM gradient rule set
  (``shared_max_grad``), and ``(lhs, rhs, state)`` watched for a state left out of
  differentiation (``_frozen.watch_state``), as ``dot_general`` does; returns them."""
  state = check_state(recipe, state)
  if state:
    state = shared_max_grad(state)
    lhs, rhs, state = _frozen.watch_state(lhs, rhs, state)
  return lhs, rhs, state


def _hb(h, b, n_act):
  """GEMM 1's output (M, n_act * F) plus its bias, float32 (M, n_act, F)."""
  m = h.shape[0]
  hb = h.astype(jnp.float32).reshape(m, n_act, -1)
  return hb if b is None else hb + b.astype(jnp.float32)


def activation_f32(h, b, names):
  """The activation (gated product) of ``h (M, n_act*F)`` plus ``b``: float32 (M, F)."""
  return _product(_hb(h, b, len(names)), names)


def dact_f32(dz, h, b, names):
  """``dz * act'(h + b)``: float32 (M, n_act, F)."""
  _, vjp = jax.vjp(lambda a: _product(a, names), _hb(h, b, len(names)))
  return vjp(dz.astype(jnp.float32))[0]


def _both(v, scale, q_dtype, with_amax):
  q = _scaled_tensor.cast_with_scale(v, scale, q_dtype)
  q_t = _scaled_tensor.cast_with_scale(v.T, scale, q_dtype)
  return q, q_t, (_scaling.amax(v) if with_amax else None)


def _kernels_run(x, config, target) -> bool:
  """Whether the CUDA kernel ``target`` casts ``x``: on a GPU with it built, ``config.backend``
  not ``"jax"``, a float32/bfloat16/float16 ``x`` on one device."""
  if jax.default_backend() != "gpu" or not _ffi.registered(target, "gpu"):
    return False
  if np.dtype(x.dtype) not in _cast_transpose._FFI_INPUT_DTYPES:
    return False
  return _cast_transpose.backend(requested=config.backend) == "ffi" and _ffi.single_device(x)


def kernel_activations(h, names, config, target):
  """The CUDA kernels' activation ids where the kernel ``target`` runs on ``h``'s activation (one
  or two activations they know, ``_kernels_run``), else None (pure JAX)."""
  if len(names) > 2 or not all(isinstance(n, str) and n in KERNEL_ACTIVATIONS for n in names):
    return None
  if not _kernels_run(h, config, target):
    return None
  return tuple(KERNEL_ACTIVATIONS[n] for n in names)


def _act_cast(h, b, names, q_dtype, scale, with_amax, config):
  """The FP8 activation in both orientations (and its amax): (M, F), (F, M), (1,)."""
  acts = kernel_activations(h, names, config, _ffi.ACT_CAST_TARGET)
  if acts is not None:
    q, q_t, a = _ffi.act_cast_call(h, b, scale, q_dtype, acts, with_amax)
    return q, q_t, (a if with_amax else None)
  return _both(activation_f32(h, b, names), scale, q_dtype, with_amax)


def _dact_cast(dz, h, b, names, q_dtype, scale, with_amax, config):
  """GEMM 1's FP8 output gradient in both orientations, its amax and the float32 bias gradient:
  (M, n_act*F), (n_act*F, M), (1,), (n_act, F)."""
  acts = kernel_activations(h, names, config, _ffi.DACT_CAST_TARGET)
  if acts is not None:
    q, q_t, a, db = _ffi.dact_cast_call(dz, h, b, scale, q_dtype, acts, with_amax)
    return q, q_t, (a if with_amax else None), db.reshape(len(names), -1)
  dh = dact_f32(dz, h, b, names)
  q, q_t, a = _both(dh.reshape(dh.shape[0], -1), scale, q_dtype, with_amax)
  return q, q_t, a, jnp.sum(dh, axis=0)


def _dbias_cast(g, q_dtype, scale, with_amax, config):
  """The output gradient ``g (M, N)`` in FP8 in both orientations, its amax and its float32 column
  sums (the output bias's gradient): the activation-gradient kernel with a linear activation,
  which then reads ``g`` alone, where it runs; the ordinary cast and XLA's sum otherwise."""
  if _kernels_run(g, config, _ffi.DACT_CAST_TARGET):
    q, q_t, a, db = _ffi.dact_cast_call(g, g, None, scale, q_dtype, (KERNEL_ACTIVATIONS["linear"],),
                                        with_amax)
    return q, q_t, (a if with_amax else None), db
  q, q_t, a = _gemm._cast_both(g, scale, q_dtype, config, with_amax)
  return q, q_t, a, jnp.sum(g.astype(jnp.float32), axis=0)


def quantizer(recipe, config):
  """``_gemm._quantize_both`` with the recipe, the fused paths' SPMD plan and the config bound:
  ``quantize(x, role, q_dtype, state=..., cast=..., amax=...)``."""
  return functools.partial(_gemm._quantize_both, recipe=recipe, plan=_PLAN, config=config)


def quantize_norm_output(y, ln_scale, ln_bias, norm, q_dtype, quantize, state, config):
  """A GEMM's FP8 operand made from the norm of its input ``y`` (``norm``: ``(layernorm_type,
  zero_centered_gamma, epsilon)``), cast from float32 in the pass that computes it
  (``quantize``: a ``quantizer``). Returns ``(q, q_t, scale, new_state, norm_residuals)``; the
  backward pass keeps the input and the row statistics, as ``core.layernorm``'s does
  (``_norm._norm_bwd``'s residuals)."""
  layernorm_type, zero_centered_gamma, epsilon = norm
  mean, rsigma = _norm._stats(y.astype(jnp.float32), layernorm_type, epsilon)
  args = (y, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma)
  q, q_t, scale, new = quantize(
      y, "x", q_dtype, state=state,
      cast=lambda scale, with_amax: _norm_cast(*args, q_dtype, scale, with_amax, config),
      amax=lambda: _scaling.amax(_norm.normalized(*args)))
  return q, q_t, scale, new, (y, mean, rsigma, ln_scale, (np.zeros((0,), ln_bias.dtype),))


def quantize_output_grad(g, q_dtype, quantize, state, config, *, with_bias):
  """A GEMM's output gradient ``g (M, N)`` in FP8 (``quantize``: a ``quantizer``):
  ``(q, q_t, scale, new_state, dbias)``. ``with_bias``: the bias gradient, float32 ``(N,)``,
  summed in the pass that casts ``g`` (``_dbias_cast``); else the ordinary cast and None."""
  if not with_bias:
    return (*quantize(g, "grad", q_dtype, state=state), None)
  sums = []

  def cast(scale, with_amax):
    q, q_t, a, db = _dbias_cast(g, q_dtype, scale, with_amax, config)
    sums.append(db)
    return q, q_t, a

  q, q_t, scale, new = quantize(g, "grad", q_dtype, state=state, cast=cast)
  return q, q_t, scale, new, sums[0]


def _act_amax(h, b, names, config):
  """The amax of the activation (current scaling's pass before ``_act_cast``): the kernel's own
  float32 values where it runs, XLA's reduce over the formula otherwise."""
  acts = kernel_activations(h, names, config, _ffi.ACT_AMAX_TARGET)
  if acts is not None:
    return _ffi.act_amax_call(h, b, acts)
  return _scaling.amax(activation_f32(h, b, names))


def _dact_amax(dz, h, b, names, config):
  """The amax of ``dz * act'(h + b)`` (current scaling's pass before ``_dact_cast``)."""
  acts = kernel_activations(h, names, config, _ffi.DACT_AMAX_TARGET)
  if acts is not None:
    return _ffi.dact_amax_call(dz, h, b, acts)
  return _scaling.amax(dact_f32(dz, h, b, names))


def _norm_cast(x, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma, q_dtype, scale,
               with_amax, config):
  """The norm's FP8 output in both orientations (and its amax): (M, K), (K, M), (1,)."""
  if _kernels_run(x, config, _ffi.NORM_CAST_TARGET):
    gamma = _norm._gamma(ln_scale, zero_centered_gamma)
    beta = ln_bias if ln_bias.size else None
    q, q_t, a = _ffi.norm_cast_call(x, mean, rsigma, gamma, beta, scale, q_dtype, with_amax)
    return q, q_t, (a if with_amax else None)
  y = _norm.normalized(x, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma)
  return _both(y, scale, q_dtype, with_amax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _mlp(y, ln_scale, ln_bias, wi2, wi_bias, wo, wo_bias, state_0, state_1, static):
  out, _ = _mlp_fwd(y, ln_scale, ln_bias, wi2, wi_bias, wo, wo_bias, state_0, state_1, static)
  return out


def _mlp_fwd(y, ln_scale, ln_bias, wi2, wi_bias, wo, wo_bias, state_0, state_1, static):
  names, recipe, config, ffn1_ckpt_name, norm = static
  fwd = recipe.fwd_dtype
  out_dtype = np.dtype(y.dtype)
  quantize = quantizer(recipe, config)
  # GEMM 1: y (M, K) and wi (K, N); the copy of wi as stored is dgrad's operand, its transposed
  # copy the forward's.
  norm_residuals = None
  if norm is None:
    q_y, q_yt, scale_y, new_y = quantize(y, "x", fwd, state=state_0)
  else:
    q_y, q_yt, scale_y, new_y, norm_residuals = quantize_norm_output(
        y, ln_scale, ln_bias, norm, fwd, quantize, state_0, config)
  q_wi, q_wit, scale_wi, new_wi = quantize(wi2, "kernel", fwd, state=state_0)
  sinv_y, sinv_wi = _scaling.scale_inverse(scale_y), _scaling.scale_inverse(scale_wi)
  h = _gemm._tn_dot(q_y, q_wit, (sinv_y, sinv_wi), out_dtype, None, "fwd", recipe, config)
  h = checkpoint_name(h, ffn1_ckpt_name)
  # GEMM 2's input, cast from h in the pass that computes it.
  q_z, q_zt, scale_z, new_z = quantize(
      h, "x", fwd, state=state_1,
      cast=lambda scale, with_amax: _act_cast(h, wi_bias, names, fwd, scale, with_amax, config),
      amax=lambda: _act_amax(h, wi_bias, names, config))
  q_wo, q_wot, scale_wo, new_wo = quantize(wo, "kernel", fwd, state=state_1)
  sinv_z, sinv_wo = _scaling.scale_inverse(scale_z), _scaling.scale_inverse(scale_wo)
  out = _gemm._tn_dot(q_z, q_wot, (sinv_z, sinv_wo), out_dtype, None, "fwd", recipe, config)
  out = checkpoint_name(out, _remat.GEMM_OUTPUT)
  if wo_bias is not None:
    out = out + wo_bias.astype(out.dtype)
  del q_y, q_z
  q_yt, sinv_y = _remat.name_quantized((q_yt, sinv_y), _remat.QUANTIZED_X)
  q_zt, sinv_z = _remat.name_quantized((q_zt, sinv_z), _remat.QUANTIZED_X)
  q_wi, sinv_wi = _remat.name_quantized((q_wi, sinv_wi), _remat.QUANTIZED_KERNEL)
  q_wo, sinv_wo = _remat.name_quantized((q_wo, sinv_wo), _remat.QUANTIZED_KERNEL)
  protos = tuple(np.zeros((0,), a.dtype) for a in (y, wi2, wo))
  bias_proto = tuple(None if b is None else np.zeros((0,), b.dtype) for b in (wi_bias, wo_bias))
  new_fwd = ({"x": new_y, "kernel": new_wi}, {"x": new_z, "kernel": new_wo})
  residuals = (q_yt, sinv_y, q_wi, sinv_wi, h, wi_bias, q_zt, sinv_z, q_wo, sinv_wo, new_fwd,
               (state_0, state_1), protos, bias_proto, norm_residuals)
  return out, residuals


def _mlp_bwd(static, residuals, g):
  names, recipe, config, _, norm = static
  (q_yt, sinv_y, q_wi, sinv_wi, h, wi_bias, q_zt, sinv_z, q_wo, sinv_wo, new_fwd, states,
   protos, bias_proto, norm_residuals) = residuals
  state_0, state_1 = states
  y_proto, wi_proto, wo_proto = protos
  bwd = recipe.bwd_dtype
  quantize = quantizer(recipe, config)
  # GEMM 2's backward; with an output bias, its gradient is summed in g's cast.
  wi_bias_proto, wo_bias_proto = bias_proto
  q_g, q_gt, scale_g, new_g1, g_sum = quantize_output_grad(
      g, bwd, quantize, state_1, config, with_bias=wo_bias_proto is not None)
  sinv_g = _scaling.scale_inverse(scale_g)
  dz = _gemm._tn_dot(q_g, q_wo, (sinv_g, sinv_wo), h.dtype, None, "dgrad", recipe, config)
  dwo = _gemm._tn_dot(q_zt, q_gt, (sinv_z, sinv_g), wo_proto.dtype, None, "wgrad", recipe, config)
  # The activation's backward, cast straight to GEMM 1's FP8 output gradient.
  dbias = []

  def cast(scale, with_amax):
    q, q_t, a, db = _dact_cast(dz, h, wi_bias, names, bwd, scale, with_amax, config)
    dbias.append(db)
    return q, q_t, a

  q_dh, q_dht, scale_dh, new_g0 = quantize(
      h, "grad", bwd, state=state_0, cast=cast,
      amax=lambda: _dact_amax(dz, h, wi_bias, names, config))
  sinv_dh = _scaling.scale_inverse(scale_dh)
  dy = _gemm._tn_dot(q_dh, q_wi, (sinv_dh, sinv_wi), y_proto.dtype, None, "dgrad", recipe, config)
  dwi = _gemm._tn_dot(q_yt, q_dht, (sinv_y, sinv_dh), wi_proto.dtype, None, "wgrad", recipe,
                      config)
  new_state_0 = _gemm.next_gemm_state(recipe, state_0, {**new_fwd[0], "grad": new_g0})
  new_state_1 = _gemm.next_gemm_state(recipe, state_1, {**new_fwd[1], "grad": new_g1})
  db = None if wi_bias_proto is None else dbias[0].astype(wi_bias_proto.dtype)
  db_out = None if wo_bias_proto is None else g_sum.astype(wo_bias_proto.dtype)
  dgamma = dbeta = None
  if norm is not None:
    dy, dgamma, dbeta = _norm._norm_bwd(*norm, norm_residuals, dy)
  return (dy, dgamma, dbeta, dwi.astype(wi_proto.dtype), db, dwo.astype(wo_proto.dtype), db_out,
          new_state_0, new_state_1)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
