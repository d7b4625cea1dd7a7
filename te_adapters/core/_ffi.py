"""The extension's XLA FFI targets: their registration, their names and their calls.

``csrc/`` builds ``te_adapters._csrc_cpu`` (C++ handlers) and ``te_adapters._csrc_cuda`` (CUDA
handlers; with CUDA 12.9+ also the cuBLASLt FP8 GEMM). Each module lists its handlers in
``registrations()``; they are registered with XLA the first time a platform is asked for. Every
``jax.ffi.ffi_call`` of the package is in this module, and nothing here decides whether to call:
the callers do (``_cast_transpose``, ``_float8_block``, ``_gemm``).

In a sharded ``jit`` program the cast, the amax and the GEMMs run on each shard through the
partitioning rules of ``_partition.py``, which these calls are wrapped in (the GEMM callers wrap
``gemm_call`` themselves).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import _partition

__all__ = [
  "AMAX_TARGET",
  "CAST_TRANSPOSE_TARGET",
  "GEMM_TARGET",
  "amax_call",
  "cast_transpose_call",
  "cublas_gemm_available",
  "ffi_available",
  "gemm_call",
]

CAST_TRANSPOSE_TARGET = "te_adapters_cast_transpose"
AMAX_TARGET = "te_adapters_amax"
# The cuBLASLt FP8 GEMM: per-tensor scales and 1x128 / 128x128 block scales.
GEMM_TARGET = "te_adapters_block_gemm"
# jax.default_backend() name -> (extension module, XLA platform name).
_MODULES = {"cpu": ("te_adapters._csrc_cpu", "cpu"), "gpu": ("te_adapters._csrc_cuda", "CUDA")}
_GEMM_WORKSPACE_BYTES = 32 * 1024 * 1024


@functools.cache
def _registrations(platform: str) -> frozenset[str]:
  """Registers ``platform``'s handlers with XLA (once); returns their target names."""
  if platform not in _MODULES:
    return frozenset()
  module_name, xla_platform = _MODULES[platform]
  try:
    module = importlib.import_module(module_name)
  except ImportError:
    return frozenset()
  targets = module.registrations()
  for name, capsule in targets.items():
    jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
  return frozenset(targets)


def ffi_available(platform: str) -> bool:
  """Whether the FFI kernels are built for ``platform`` (``"cpu"`` or ``"gpu"``) and registered.

  Example:
    >>> from te_adapters.core import _ffi
    >>> isinstance(_ffi.ffi_available("cpu"), bool)
    True
  """
  return bool(_registrations(platform))


def cublas_gemm_available() -> bool:
  """Whether the cuBLASLt FP8 GEMM is built here and the devices are Hopper GPUs."""
  if jax.default_backend() != "gpu" or GEMM_TARGET not in _registrations("gpu"):
    return False
  try:
    capabilities = {str(d.compute_capability) for d in jax.local_devices()}
  except AttributeError:
    return False
  # cuBLAS runs the 1x128 / 128x128 modes on compute capability 9.0 only.
  return capabilities == {"9.0"}


def _empty(dtype):
  return jax.ShapeDtypeStruct((0,), dtype)


@functools.cache
def cast_transpose_call(ndim, q_dtype, rowwise, colwise, with_amax):
  """The FFI cast for one configuration, ``f(x, scale) -> (q, q_t, amax)`` (an output not asked
  for is an empty array), batched under ``vmap`` without looping where it can."""
  def call(x, scale):
    t_shape = x.shape[:-2] + (x.shape[-1], x.shape[-2]) if x.ndim >= 2 else (0,)
    outs = (
      jax.ShapeDtypeStruct(x.shape, q_dtype) if rowwise else _empty(q_dtype),
      jax.ShapeDtypeStruct(t_shape, q_dtype) if colwise else _empty(q_dtype),
      jax.ShapeDtypeStruct((1,), jnp.float32) if with_amax else _empty(jnp.float32),
    )
    return jax.ffi.ffi_call(CAST_TRANSPOSE_TARGET, outs)(
      x, scale, rowwise=rowwise, colwise=colwise, compute_amax=with_amax
    )

  # Per shard in a sharded program (the partitioning rules of _partition.py).
  per_shard = _partition.cast_transpose(call, ndim, rowwise, colwise, with_amax)

  @jax.custom_batching.custom_vmap
  def cast(x, scale):
    return per_shard(x, scale)

  @cast.def_vmap
  def _cast_vmap(axis_size, in_batched, x, scale):
    x_batched, scale_batched = in_batched
    out_batched = (rowwise, colwise, with_amax)
    if x_batched and not scale_batched and not with_amax:
      # One scale for every element: the batch dim is one more leading dim for the kernel
      # (which only swaps the last two). A 1-D input gains a row dim that is dropped after.
      outs = _partition.cast_transpose(call, x.ndim, rowwise, colwise, with_amax)(x, scale)
      return tuple(outs), out_batched
    x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
    scale = scale if scale_batched else jnp.broadcast_to(scale, (axis_size, *scale.shape))
    outs = jax.lax.map(lambda args: cast(*args), (x, scale))
    return tuple(outs), (True, True, True)

  return cast


@functools.cache
def amax_call():
  """The FFI amax, ``f(x) -> max(|x|)`` as float32 of shape (1,), looped under ``vmap``."""

  def call(x):
    return jax.ffi.ffi_call(AMAX_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32))(x)

  @jax.custom_batching.custom_vmap
  def amax_fn(x):
    return _partition.amax(call, x.ndim)(x)

  @amax_fn.def_vmap
  def _amax_vmap(axis_size, in_batched, x):
    del axis_size, in_batched
    return jax.lax.map(amax_fn, x), True

  return amax_fn


def gemm_call(a, b, a_scales, b_scales, out_dtype, lhs_mode, rhs_mode, fast_accum=False):
  """The cuBLASLt FP8 GEMM (``csrc/block_gemm_cuda.cc``): ``a (.., M, K)`` times ``b (.., N, K)``
  into ``(.., M, N)`` of ``out_dtype``, with no or one leading batch dim.

  Scale mode 0 (both operands): one float32 scale each, shape (1,), applied in the epilogue.
  Modes 1 and 2: 1x128 blocks and 128x128 tiles, scales in cuBLAS's layout (see
  ``_float8_block``).
  """
  outs = (
    jax.ShapeDtypeStruct((*a.shape[:-1], b.shape[-2]), out_dtype),
    jax.ShapeDtypeStruct((_GEMM_WORKSPACE_BYTES,), jnp.uint8),
  )
  y, _ = jax.ffi.ffi_call(GEMM_TARGET, outs, vmap_method="sequential")(
    a, b, a_scales, b_scales,
    lhs_mode=np.int32(lhs_mode), rhs_mode=np.int32(rhs_mode), fast_accum=np.int32(fast_accum),
  )
  return y
