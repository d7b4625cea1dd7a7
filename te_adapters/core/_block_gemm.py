"""The block-scaled ``dot_general`` (MXFP8, NVFP4, FP8 1x128/128x128) with its custom VJP.

Both operands are brought to the layout of ``jax.nn.scaled_matmul``: ``x`` as ``(B, M, K)`` and the
kernel as ``(B, N, K)`` (batch dims first, then the free dims, then the contracting dims, each
group flattened). Every GEMM then contracts the last axes of its operands, with blocks along
them:

- forward ``y = x · W``: x in blocks along K, W along K (or in tiles);
- dgrad ``dx = g · W``: g ``(B, M, N)`` along N, W as ``(B, K, N)`` along N;
- wgrad ``dW = g · x``: g as ``(B, N, M)`` and x as ``(B, K, M)``, along M (NVFP4: after the
  random Hadamard transform, which cancels in the product).

Each 1-D copy is quantized from the high-precision tensor; a tiled operand is quantized once
and transposed (its tiles are the same either way). The backward copies of x and W are made
in the forward pass and saved (checkpoint names ``QUANTIZED_X``, ``QUANTIZED_KERNEL``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_adapters.core import (
  _amax_reduction,
  _block_scaled,
  _cotangents,
  _explicit_sharding,
  _ffi,
  _remat,
)
from te_adapters.core._block_scaled import operand_spec
from te_adapters.core._scaled_tensor import ScaledTensor

__all__ = ["block_dot_general"]


class _Layout:
  """The canonical (B, rows, K) views of the two operands for one set of dimension numbers."""

  def __init__(self, dn, lhs_shape, rhs_shape):
    (lc, rc), (lb, rb) = dn
    self.lhs_free = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    self.rhs_free = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    self.lhs_perm = tuple(lb) + tuple(self.lhs_free) + tuple(lc)
    self.rhs_perm = tuple(rb) + tuple(self.rhs_free) + tuple(rc)
    self.batch_shape = tuple(lhs_shape[d] for d in lb)
    self.lhs_free_shape = tuple(lhs_shape[d] for d in self.lhs_free)
    self.rhs_free_shape = tuple(rhs_shape[d] for d in self.rhs_free)
    self.b = math.prod(self.batch_shape)
    self.m = math.prod(self.lhs_free_shape)
    self.n = math.prod(self.rhs_free_shape)
    self.k = math.prod(lhs_shape[d] for d in lc)
    self.lhs_shape, self.rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    self.dn = dn

  # The reshapes name their output sharding under Explicit mesh axes (_explicit_sharding.reshape).

  def lhs3(self, lhs):
    return _explicit_sharding.reshape(jnp.transpose(lhs, self.lhs_perm), (self.b, self.m, self.k))

  def rhs3(self, rhs):
    return _explicit_sharding.reshape(jnp.transpose(rhs, self.rhs_perm), (self.b, self.n, self.k))

  @property
  def out_shape(self):
    return self.batch_shape + self.lhs_free_shape + self.rhs_free_shape

  def out(self, y3):
    return _explicit_sharding.reshape(y3, self.out_shape)

  @property
  def rhs_stored_kn(self) -> bool:
    """Whether ``rhs`` is stored batch, contracting, then free dims (a Dense layer's kernel), so
    that (B, K, N) is a reshape of it with no transpose."""
    (_, rc), (_, rb) = self.dn
    return tuple(rb) + tuple(rc) + tuple(self.rhs_free) == tuple(range(len(self.rhs_shape)))

  def rhs_kn(self, rhs):
    """``rhs`` as (B, K, N) where ``rhs_stored_kn``, else None."""
    if not self.rhs_stored_kn:
      return None
    return _explicit_sharding.reshape(rhs, (self.b, self.k, self.n))

  def out3(self, g):
    return _explicit_sharding.reshape(g, (self.b, self.m, self.n))

  def lhs_from3(self, d3):
    shape = tuple(self.lhs_shape[d] for d in self.lhs_perm)
    return jnp.transpose(_explicit_sharding.reshape(d3, shape), np.argsort(self.lhs_perm))

  def rhs_from3(self, d3):
    shape = tuple(self.rhs_shape[d] for d in self.rhs_perm)
    return jnp.transpose(_explicit_sharding.reshape(d3, shape), np.argsort(self.rhs_perm))

  def _shards(self, lhs, rhs) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Under Explicit mesh axes, per GEMM dim (M, N, K): the device count and mesh axes."""
    (lc, _), _ = self.dn
    out = {}
    groups = (("M", lhs, self.lhs_free), ("K", lhs, lc), ("N", rhs, self.rhs_free))
    for letter, operand, dims in groups:
      sharding = _explicit_sharding.explicit_sharding(operand)
      if sharding is None:
        continue
      sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
      entries = [sharding.spec[d] for d in dims]
      axes = tuple(a for e in entries for a in ((e,) if isinstance(e, str) else (e or ())))
      out[letter] = (math.prod(sizes[a] for a in axes), axes)
    return out

  def check(self, recipe, *, backward: bool, lhs=None, rhs=None):
    """Raises a ValueError naming the dimension a recipe's blocks cannot tile.

    With ``lhs`` and ``rhs`` sharded over Explicit mesh axes, each device's part must hold whole
    blocks too.
    """
    (lc, rc), _ = self.dn
    shards = {} if lhs is None else self._shards(lhs, rhs)
    name = type(recipe).__name__
    x_tiled = len(operand_spec(recipe, "x").block_shape) == 2
    w_tiled = len(operand_spec(recipe, "kernel").block_shape) == 2
    block = operand_spec(recipe, "kernel").block_size
    tiles = f"{block}x{block} tiles"
    checks = [
      (
        "K",
        self.k,
        f"the contracting size K (lhs dims {tuple(lc)}, rhs dims {tuple(rc)})",
        "the forward GEMM quantizes both operands in blocks along K",
      )
    ]
    if backward or w_tiled:
      why = "the dgrad GEMM quantizes the gradient and the kernel in blocks along N"
      if not backward:
        why = f"the kernel is quantized in {tiles} over (N, K)"
      checks.append(("N", self.n, f"the rhs free size N (rhs dims {tuple(self.rhs_free)})", why))
    if backward or x_tiled:
      why = "the wgrad GEMM quantizes x and the gradient in blocks along M"
      if operand_spec(recipe, "x", wgrad=True).rht:
        why += " (and applies the 16-point random Hadamard transform along M)"
      if not backward:
        why = f"x is quantized in {tiles} over (M, K)"
      checks.append(("M", self.m, f"the lhs free size M (lhs dims {tuple(self.lhs_free)})", why))
    for letter, size, text, why in checks:
      if size % block:
        raise ValueError(f"{name}: {text} is {size}, which is not a multiple of {block}; {why}")
      count, axes = shards.get(letter, (1, ()))
      if (size // count) % block:
        raise ValueError(
          f"{name}: {text} is {size}, split over {count} devices (mesh axes {axes}): "
          f"{size // count} per device, which is not a multiple of {block}; {why}"
        )


def check_operands(lhs, rhs, dn, recipe):
  """Raises the forward GEMM's ValueError where ``recipe``'s blocks cannot tile the operands."""
  _Layout(dn, lhs.shape, rhs.shape).check(recipe, backward=False, lhs=lhs, rhs=rhs)


def _check_backward(dn, lhs_shape, rhs_shape, recipe, no_rng):
  """Raises what the block recipe's backward pass would: untileable M or N, a missing key."""
  _Layout(dn, lhs_shape, rhs_shape).check(recipe, backward=True)
  _check_grad_rng(recipe, no_rng)


def _check_grad_rng(recipe, no_rng):
  if recipe.uses_rng and no_rng:
    raise ValueError(
      f"{type(recipe).__name__} rounds the gradient stochastically: pass rng=<PRNG key> to "
      "dot_general (a fresh key per step), or use disable_stochastic_rounding=True"
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def checked_under_grad(y, dn, lhs_shape, rhs_shape, recipe, no_rng):
  """``y``; under differentiation, first the checks of the block recipe's backward pass.

  A GEMM below the size threshold runs in high precision and needs none of them, but the same
  input must get the same error at every size.
  """
  del dn, lhs_shape, rhs_shape, recipe, no_rng
  return y


def _checked_fwd(y, dn, lhs_shape, rhs_shape, recipe, no_rng):
  _check_backward(dn, lhs_shape, rhs_shape, recipe, no_rng)
  return y, None


def _checked_bwd(dn, lhs_shape, rhs_shape, recipe, no_rng, residuals, g):
  del dn, lhs_shape, rhs_shape, recipe, no_rng, residuals
  return (g,)


checked_under_grad.defvjp(_checked_fwd, _checked_bwd)


def block_dot_general(lhs, rhs, dn, out, recipe, rng, plan, choice="auto", cast="auto"):
  """``lax.dot_general(lhs, rhs, dn)`` under a block recipe; ``rng`` feeds stochastic rounding.

  ``out``: the ``ShapeDtypeStruct`` that ``lax.dot_general`` gives (its dtype, and under Explicit
  mesh axes its sharding). ``plan``: the ``SpmdPlan`` (amax axes for NVFP4 inside shard_map).
  ``choice``: ``GemmConfig.block_gemm``, which GEMM kernel runs. ``cast``:
  ``GemmConfig.backend``, whether FP8 blocks may be cast by the extension's CUDA kernel.
  """
  layout = _Layout(dn, lhs.shape, rhs.shape)  # dot_general checked it (check_operands)
  # Static facts the backward pass needs: operand shapes (for the layout) and dtypes.
  operands = ((tuple(lhs.shape), np.dtype(lhs.dtype)), (tuple(rhs.shape), np.dtype(rhs.dtype)))
  # Explicit mesh axes: the forward GEMM's output sharding, in the (B, M, N) layout.
  y3_sharding = _explicit_sharding.reshaped_sharding(
    _explicit_sharding.explicit_sharding(out), layout.out_shape, (layout.b, layout.m, layout.n)
  )
  plan = dataclasses.replace(plan, out_sharding=y3_sharding)
  kernels = (choice, cast)
  return _block_vjp(lhs, rhs, rng, dn, np.dtype(out.dtype), operands, recipe, plan, kernels)


def _amax_reducer(x, role, plan):
  """For NVFP4 inside shard_map: the global amax of ``x``'s tensor from its shard's."""
  return functools.partial(
      _amax_reduction.global_amax, x=x, role=role, plan=plan, state_varying=None
  )


def _quantize(x, spec, role, plan, key=None, stream=0, what="x"):
  return _block_scaled.quantize_trailing(
    x, spec, key, stream=stream, what=what, reduce_amax=_amax_reducer(x, role, plan)
  )


def _quantize_fwd_operands(lhs, rhs, layout, recipe, plan):
  x3, w3 = layout.lhs3(lhs), layout.rhs3(rhs)
  x_spec, w_spec = operand_spec(recipe, "x"), operand_spec(recipe, "kernel")
  qx = _quantize(x3, x_spec, "x", plan, what="lhs (x)")
  qw = _quantize(w3, w_spec, "kernel", plan, what="rhs (kernel)")
  return x3, w3, qx, qw


def _swapped_sharding(t):
  """Explicit axes: the sharding of the (B, P, Q) tensor whose (B, Q, P) copy ``t`` holds."""
  return _cotangents.transposed_out_sharding(t.data, (0, 2, 1))


def _name_quantized(t, name):
  """Tags the leaves of a quantized tensor with a checkpoint name, narrow floats as their bits.

  Remat may pass saved floating-point residuals through ``reduce_precision`` with the dtype's
  exponent and mantissa widths, whose IEEE rules have no room for the top binade of
  ``float8_e4m3fn`` (448 becomes NaN) or ``float8_e8m0fnu``. Bitcasts are free in XLA.
  """

  def name_leaf(leaf):
    bits = {8: jnp.uint8, 4: jnp.uint4}.get(jnp.finfo(leaf.dtype).bits)
    if leaf.dtype == jnp.float32 or bits is None:
      return checkpoint_name(leaf, name)
    named = checkpoint_name(lax.bitcast_convert_type(leaf, bits), name)
    return lax.bitcast_convert_type(named, leaf.dtype)

  return jax.tree.map(name_leaf, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _block_vjp(lhs, rhs, rng, dn, out_dtype, operands, recipe, plan, kernels):
  del rng, operands
  layout = _Layout(dn, lhs.shape, rhs.shape)
  _, _, qx, qw = _quantize_fwd_operands(lhs, rhs, layout, recipe, plan)
  y3 = _block_scaled.gemm(qx, qw, out_dtype, plan.out_sharding, kernels[0])
  return layout.out(y3).astype(out_dtype)


def _cast_both(x3, spec, spec_t, cast: str):
  """``(q, q_t)``: ``x3`` (B, P, Q) quantized with ``spec`` and its (B, Q, P) copy with
  ``spec_t``, both from one pass of the extension's CUDA block cast; None where it does not
  apply (another format, the CPU, a shape or dtype it does not take, several devices, or
  ``GemmConfig(backend="jax")``). The values are those of ``quantize_trailing``."""
  if cast == "jax" or spec.mode != "float8_block" or spec_t.mode != "float8_block":
    return None
  if spec.stochastic or spec_t.stochastic:
    return None
  if (spec.q_dtype, spec.power_2) != (spec_t.q_dtype, spec_t.power_2):
    return None
  tile = spec.block_shape == (128, 128)
  if spec.block_shape != spec_t.block_shape or spec.block_shape not in ((128,), (128, 128)):
    return None
  if x3.shape[-1] % 128 or x3.shape[-2] % 128 or np.dtype(x3.dtype) not in _CAST_DTYPES:
    return None
  if jax.default_backend() != "gpu" or not _ffi.registered(_ffi.BLOCK_CAST_TARGET):
    return None
  if not _ffi.single_device(x3):
    return None
  q, s, q_t, s_t, amax = _ffi.block_cast_call(
    x3, spec.q_dtype, rowwise=True, colwise=True, tile=tile, power_2=spec.power_2)
  if tile:
    s_t = jnp.swapaxes(s, -1, -2)
  dq = np.dtype(x3.dtype)
  return (ScaledTensor(q, s, amax, scaling_mode="float8_block", dq_dtype=dq),
          ScaledTensor(q_t, s_t, amax, scaling_mode="float8_block", dq_dtype=dq))


_CAST_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _block_fwd(lhs, rhs, rng, dn, out_dtype, operands, recipe, plan, kernels):
  del operands
  choice, cast = kernels
  layout = _Layout(dn, lhs.shape, rhs.shape)
  layout.check(recipe, backward=True, lhs=lhs, rhs=rhs)
  _check_grad_rng(recipe, rng is None)
  x_spec = operand_spec(recipe, "x", wgrad=True)
  w_spec = operand_spec(recipe, "kernel")
  x3, w3 = layout.lhs3(lhs), layout.rhs3(rhs)
  # The forward copies and the backward ones (blocks along M for x, for wgrad, and along N
  # for the kernel, for dgrad): one CUDA pass each where the kernel applies.
  both_x = _cast_both(x3, operand_spec(recipe, "x"), x_spec, cast)
  if both_x is not None:
    qx, qx_t = both_x
  else:
    qx = _quantize(x3, operand_spec(recipe, "x"), "x", plan, what="lhs (x)")
    if len(x_spec.block_shape) == 2:
      qx_t = _block_scaled.transpose_tiles(qx)
    else:
      qx_t = _quantize(jnp.swapaxes(x3, 1, 2), x_spec, "x", plan, what="lhs (x)")
  # The kernel as it is stored, (K, N) in a Dense layer: the cast's transposed copy is the
  # (N, K) operand, with no transpose of the high-precision kernel before it.
  w_kn = layout.rhs_kn(rhs)
  both_kn = None if w_kn is None else _cast_both(w_kn, w_spec, w_spec, cast)
  both_w = _cast_both(w3, w_spec, w_spec, cast) if both_kn is None else both_kn[::-1]
  if both_w is not None:
    qw, qw_t = both_w
  else:
    qw = _quantize(w3, w_spec, "kernel", plan, what="rhs (kernel)")
    if len(w_spec.block_shape) == 2:
      qw_t = _block_scaled.transpose_tiles(qw)
    else:
      qw_t = _quantize(jnp.swapaxes(w3, 1, 2), w_spec, "kernel", plan, what="rhs (kernel)")
  y3 = _block_scaled.gemm(qx, qw, out_dtype, plan.out_sharding, choice)
  y = layout.out(y3).astype(out_dtype)
  y = checkpoint_name(y, _remat.GEMM_OUTPUT)
  qx_t = _name_quantized(qx_t, _remat.QUANTIZED_X)
  qw_t = _name_quantized(qw_t, _remat.QUANTIZED_KERNEL)
  # Inside shard_map: the primals' varying mesh axes, for the cotangents' sums (else None).
  witness = (_cotangents.type_witness(lhs), _cotangents.type_witness(rhs))
  return y, (qx_t, qw_t, rng, witness)


def _block_bwd(dn, out_dtype, operands, recipe, plan, kernels, residuals, g):
  del out_dtype
  choice, cast = kernels
  qx_t, qw_t, rng, witness = residuals
  (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = operands
  layout = _Layout(dn, lhs_shape, rhs_shape)
  g3 = layout.out3(g)
  g_spec = operand_spec(recipe, "grad")
  # Inside shard_map each shard of the gradient rounds with its own key.
  rng = _amax_reduction.shard_key(rng, g3)
  # One key, two random streams: the dgrad copy (0) and the wgrad copy (1) of the gradient.
  g_wspec = operand_spec(recipe, "grad", wgrad=True)
  both_g = _cast_both(g3, g_spec, g_wspec, cast)
  if both_g is not None:
    qg, qg_t = both_g
  else:
    qg = _quantize(g3, g_spec, "grad", plan, rng, stream=0, what="output gradient")
    if len(g_wspec.block_shape) == 2:
      qg_t = _block_scaled.transpose_tiles(qg)
    else:
      qg_t = _quantize(
        jnp.swapaxes(g3, 1, 2), g_wspec, "grad", plan, rng, stream=1, what="output gradient"
      )
  # Explicit axes: each cotangent gets its primal's sharding (as x3 and w3 had). Inside
  # shard_map a cotangent is summed over the mesh axes its primal is replicated on, in float32.
  dx_dtype = lhs_dtype if witness[0] is None else jnp.float32
  dw_dtype = rhs_dtype if witness[1] is None else jnp.float32
  dx3 = _block_scaled.gemm(qg, qw_t, dx_dtype, _swapped_sharding(qx_t), choice)
  if layout.rhs_stored_kn:
    # A kernel stored (K, N): the wgrad GEMM writes (B, K, N), the kernel's own layout, so that
    # nothing transposes the gradient after it (the optimizer's update would read it strided).
    dw_kn = _block_scaled.gemm(qx_t, qg_t, dw_dtype, _cotangents.transposed_out_sharding(
      qw_t.data, None), choice)
    dw = _explicit_sharding.reshape(dw_kn, rhs_shape)
  else:
    dw3 = _block_scaled.gemm(qg_t, qx_t, dw_dtype, _swapped_sharding(qw_t), choice)
    dw = layout.rhs_from3(dw3)
  dx = _cotangents.match_cotangent(layout.lhs_from3(dx3), witness[0]).astype(lhs_dtype)
  dw = _cotangents.match_cotangent(dw, witness[1]).astype(rhs_dtype)
  return dx, dw, None


_block_vjp.defvjp(_block_fwd, _block_bwd)
