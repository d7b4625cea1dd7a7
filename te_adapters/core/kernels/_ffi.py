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
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core.kernels import _partition

__all__ = [
  "ACT_AMAX_TARGET",
  "ACT_CAST_TARGET",
  "AMAX_TARGET",
  "BLOCK_ACT_CAST_TARGET",
  "BLOCK_CAST_TARGET",
  "BLOCK_DACT_CAST_TARGET",
  "BLOCK_NORM_CAST_TARGET",
  "CAST_TRANSPOSE_TARGET",
  "DACT_AMAX_TARGET",
  "DACT_CAST_TARGET",
  "GEMM_TARGET",
  "GROUPED_BLOCK_GEMM_TARGET",
  "NORM_CAST_TARGET",
  "act_amax_call",
  "act_cast_call",
  "amax_call",
  "block_act_cast_call",
  "block_cast_call",
  "block_dact_cast_call",
  "block_norm_cast_call",
  "cast_transpose_call",
  "cast_transpose_per_batch_call",
  "cublas_gemm_available",
  "dact_amax_call",
  "dact_cast_call",
  "ffi_available",
  "gemm_call",
  "gpu_kernels_unusable_reason",
  "grouped_block_gemm_call",
  "grouped_gemm_call",
  "hopper_target_available",
  "norm_cast_call",
  "padded_transpose_call",
  "ROW_COL_AMAX_TARGET",
  "ROWWISE_CAST_TARGET",
  "registered",
  "row_col_amax_call",
  "rowwise_cast_call",
  "single_device",
]

CAST_TRANSPOSE_TARGET = "te_adapters_cast_transpose"
AMAX_TARGET = "te_adapters_amax"
# Float8BlockScaling's cast: 1x128 blocks in both orientations, or 128x128 tiles, in one pass.
BLOCK_CAST_TARGET = "te_adapters_block_cast"
# The same cast of the fused MLP's operands as they are computed, in 1x128 blocks (GPU only): the
# norm's output, the activation, and the activation's gradient with the bias gradient.
BLOCK_NORM_CAST_TARGET = "te_adapters_block_norm_cast"
BLOCK_ACT_CAST_TARGET = "te_adapters_block_act_cast"
BLOCK_DACT_CAST_TARGET = "te_adapters_block_dact_cast"
# Rowwise scaling (GPU only): the amax of every row and every column in one read, then the cast
# into both orientations with one scale per row of each copy.
ROW_COL_AMAX_TARGET = "te_adapters_row_col_amax"
ROWWISE_CAST_TARGET = "te_adapters_rowwise_cast"
# The MLP's fused activation casts (GPU only): act(h + b) to FP8, and dact to FP8 with dbias.
ACT_CAST_TARGET = "te_adapters_act_cast"
DACT_CAST_TARGET = "te_adapters_dact_cast"
# Their amax alone (current scaling's pass before the cast; GPU only).
ACT_AMAX_TARGET = "te_adapters_act_amax"
DACT_AMAX_TARGET = "te_adapters_dact_amax"
# The norm's output (from its row statistics) to FP8 in both orientations (GPU only).
NORM_CAST_TARGET = "te_adapters_norm_cast"
# The cuBLASLt FP8 GEMM: per-tensor scales and 1x128 / 128x128 block scales.
GEMM_TARGET = "te_adapters_block_gemm"
# The CUTLASS grouped FP8 GEMM and its operand layout kernel (built with TE_ADAPTERS_CUTLASS_DIR).
GROUPED_GEMM_TARGET = "te_adapters_grouped_gemm"
PADDED_TRANSPOSE_TARGET = "te_adapters_padded_transpose"
# Float8BlockScaling's grouped FP8 GEMM (CUTLASS, blockwise scaling; built with the grouped GEMM).
GROUPED_BLOCK_GEMM_TARGET = "te_adapters_grouped_block_gemm"
# jax.default_backend() name -> (extension module, XLA platform name).
_MODULES = {"cpu": ("te_adapters._csrc_cpu", "cpu"), "gpu": ("te_adapters._csrc_cuda", "CUDA")}
_GEMM_WORKSPACE_BYTES = 32 * 1024 * 1024


def _compute_capability(arch: str) -> str:
  """A compiled GPU target's compute capability: ``"sm_90a"`` -> ``"9.0"``."""
  digits = "".join(c for c in arch if c.isdigit())
  number = int(digits) if digits else 0
  return f"{number // 10}.{number % 10}"


@functools.cache
def gpu_kernels_unusable_reason() -> str | None:
  """Why the installed CUDA kernels cannot run on this process's GPUs, or None when they can
  (or when JAX's backend is not a GPU, or no CUDA kernels are installed: nothing to decide).

  The kernels link the CUDA runtime they were built with, so they need a driver of that CUDA
  major release or newer, and hold machine code for the GPUs they were built for only.

  Example:
    >>> from te_adapters.core import kernels
    >>> reason = kernels.gpu_kernels_unusable_reason()
    >>> reason is None or isinstance(reason, str)
    True
  """
  if jax.default_backend() != "gpu":
    return None
  try:
    module = importlib.import_module(_MODULES["gpu"][0])
  except ImportError:
    return None
  if not hasattr(module, "build_info"):
    return None  # built before the module described itself: Hopper only, as it always was
  info = module.build_info()
  runtime, driver = int(info["cuda_runtime_version"]), int(info["cuda_driver_version"])
  if driver // 1000 < runtime // 1000:
    return (
      f"te_adapters's CUDA kernels were built with CUDA {runtime // 1000}.{runtime % 1000 // 10} "
      f"and need a driver for CUDA {runtime // 1000} or newer; this one supports "
      f"{driver // 1000}.{driver % 1000 // 10}: the casts run in pure JAX"
    )
  archs = [a for a in str(info["archs"]).split(",") if a]
  built = {_compute_capability(a) for a in archs}
  try:
    found = {str(d.compute_capability) for d in jax.local_devices()}
  except AttributeError:
    return None
  if not found <= built:
    return (
      f"te_adapters's CUDA kernels are built for {', '.join(archs)} (compute capability "
      f"{', '.join(sorted(built))}), and this process's GPUs are compute capability "
      f"{', '.join(sorted(found))}: the casts run in pure JAX"
    )
  return None


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
  if platform == "gpu":
    reason = gpu_kernels_unusable_reason()
    if reason is not None:
      warnings.warn(reason, RuntimeWarning, stacklevel=2)
      return frozenset()
  targets = module.registrations()
  for name, capsule in targets.items():
    jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
  return frozenset(targets)


def ffi_available(platform: str) -> bool:
  """Whether the FFI kernels are built for ``platform`` (``"cpu"`` or ``"gpu"``) and registered.

  Example:
    >>> from te_adapters.core.kernels import _ffi
    >>> isinstance(_ffi.ffi_available("cpu"), bool)
    True
  """
  return bool(_registrations(platform))


def hopper_target_available(target: str) -> bool:
  """Whether the GPU ``target`` is built here and every local device is a Hopper GPU."""
  if jax.default_backend() != "gpu" or target not in _registrations("gpu"):
    return False
  try:
    capabilities = {str(d.compute_capability) for d in jax.local_devices()}
  except AttributeError:
    return False
  return capabilities == {"9.0"}


def cublas_gemm_available() -> bool:
  """Whether the cuBLASLt FP8 GEMM is built here and the devices are Hopper GPUs (cuBLAS runs
  the 1x128 / 128x128 modes on compute capability 9.0 only)."""
  return hopper_target_available(GEMM_TARGET)


def single_device(x) -> bool:
  """False when ``x`` is known to be spread over several devices (a kernel without a
  partitioning rule, the grouped GEMM's, cannot take it)."""
  sharding = getattr(x, "sharding", None)  # concrete arrays
  if sharding is None:
    try:
      sharding = jax.typeof(x).sharding  # explicit-mode types under jit
    except Exception:
      sharding = None
  if sharding is not None:
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None and spec is not None and getattr(mesh, "size", 1) > 1:
      if any(s is not None for s in spec):
        return False
    num = getattr(sharding, "num_devices", None)
    if isinstance(num, int) and num > 1 and not getattr(sharding, "is_fully_replicated", True):
      return False
  # Under jit the sharding of a traced value is unknown: only a one-device program is safe.
  if isinstance(x, jax.core.Tracer):
    return jax.device_count() == 1 or _tracing_single_device()
  return True


def _tracing_single_device() -> bool:
  # Inside a shard_map body every value is a per-device shard, so the kernel is safe there.
  try:
    from jax._src import core as jax_core

    return bool(jax_core.get_axis_env().axis_sizes)
  except Exception:
    return False


def _empty(dtype):
  return jax.ShapeDtypeStruct((0,), dtype)


@functools.cache
def cast_transpose_call(ndim, q_dtype, rowwise, colwise, with_amax, amax_over_mesh=False):
  """The FFI cast for one configuration, ``f(x, scale) -> (q, q_t, amax)`` (an output not asked
  for is an empty array), batched under ``vmap`` without looping where it can. In a sharded
  program the amax is reduced over every mesh axis with ``amax_over_mesh``
  (``_partition.cast_transpose``)."""

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
  per_shard = _partition.cast_transpose(call, ndim, rowwise, colwise, with_amax, amax_over_mesh)

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
def cast_transpose_per_batch_call(q_dtype, with_amax):
  """The FFI cast with one scale per leading index, ``f(x (B, R, C), scales (B,)) -> (q (B, R, C),
  q_t (B, C, R), amax (B,))`` (amax empty unless ``with_amax``): the grouped GEMM's kernels, each
  with its expert's scale, read once. In a sharded program, per shard
  (``_partition.cast_transpose_per_batch``: each amax of its whole ``x[b]``); looped under
  ``vmap``."""

  def call(x, scales):
    b, r, c = x.shape
    outs = (
      jax.ShapeDtypeStruct((b, r, c), q_dtype),
      jax.ShapeDtypeStruct((b, c, r), q_dtype),
      jax.ShapeDtypeStruct((b,), jnp.float32) if with_amax else _empty(jnp.float32),
    )
    return jax.ffi.ffi_call(CAST_TRANSPOSE_TARGET, outs, vmap_method="sequential")(
      x, scales, rowwise=True, colwise=True, compute_amax=with_amax
    )

  # Per shard in a sharded program (the partitioning rule of _partition.py).
  return _partition.cast_transpose_per_batch(call, with_amax)


@functools.cache
def amax_call(over_mesh=False):
  """The FFI amax, ``f(x) -> max(|x|)`` as float32 of shape (1,), looped under ``vmap`` (in a
  sharded program reduced over every mesh axis with ``over_mesh``)."""

  def call(x):
    return jax.ffi.ffi_call(AMAX_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32))(x)

  @jax.custom_batching.custom_vmap
  def amax_fn(x):
    return _partition.amax(call, x.ndim, over_mesh)(x)

  @amax_fn.def_vmap
  def _amax_vmap(axis_size, in_batched, x):
    del axis_size, in_batched
    return jax.lax.map(amax_fn, x), True

  return amax_fn


def block_cast_call(
  x, q_dtype, *, rowwise: bool, colwise: bool, tile: bool, power_2: bool, source_rows=None
):
  """The FP8 block cast (``csrc/block_cast_cuda.cu``) of ``x`` (.., R, C), R and C multiples of
  128: ``(q, q_scale_inv, q_t, q_t_scale_inv, amax)``. 1x128 mode: ``q`` (.., R, C) with scales
  (.., R, C/128), ``q_t`` (.., C, R) with scales (.., C, R/128). Tile mode: ``q`` and ``q_t``
  with one scale per 128x128 tile of ``q``, (.., R/128, C/128) (``q_t_scale_inv`` is empty).
  Outputs not asked for are empty arrays.

  ``source_rows`` (R,) int32: the cast's row r is row ``source_rows[r]`` of ``x`` (.., M, C),
  any M, or zeros where it is negative; the gather happens as the cast reads, so the gathered
  copy is never written (the group-padded layouts of the grouped GEMMs)."""
  lead, c = x.shape[:-2], x.shape[-1]
  r = x.shape[-2] if source_rows is None else source_rows.shape[0]
  if source_rows is None:
    source_rows = jnp.zeros((0,), jnp.int32)
  f32 = jnp.float32
  q_scales = (*lead, r // 128, c // 128) if tile else (*lead, r, c // 128)
  outs = (
    jax.ShapeDtypeStruct((*lead, r, c), q_dtype) if rowwise else _empty(q_dtype),
    jax.ShapeDtypeStruct(q_scales, f32) if rowwise else _empty(f32),
    jax.ShapeDtypeStruct((*lead, c, r), q_dtype) if colwise else _empty(q_dtype),
    jax.ShapeDtypeStruct((*lead, c, r // 128), f32) if colwise and not tile else _empty(f32),
    jax.ShapeDtypeStruct((1,), f32),
  )
  return jax.ffi.ffi_call(BLOCK_CAST_TARGET, outs, vmap_method="sequential")(
    x, source_rows.astype(jnp.int32), rowwise=rowwise, colwise=colwise, tile=tile, power_2=power_2
  )


def _block_outs(m, n, q_dtype):
  """The 1x128 block casts' outputs for an (M, N) operand: ``q`` (M, N), its scales (M, N/128),
  ``q_t`` (N, M), its scales (N, M/128), the amax (1,)."""
  f32 = jnp.float32
  return (
    jax.ShapeDtypeStruct((m, n), q_dtype),
    jax.ShapeDtypeStruct((m, n // 128), f32),
    jax.ShapeDtypeStruct((n, m), q_dtype),
    jax.ShapeDtypeStruct((n, m // 128), f32),
    jax.ShapeDtypeStruct((1,), f32),
  )


def block_norm_cast_call(x, mean, rsigma, gamma, beta, q_dtype, *, power_2: bool):
  """The norm's output ``(x - mean) * rsigma * gamma (+ beta)`` of ``x`` (M, K) cast into 1x128
  blocks as it is computed (``csrc/block_cast_cuda.cu``), M and K multiples of 128, one device:
  ``block_cast_call``'s five outputs in 1x128 mode, as ``_float8_block.quantize`` gives them of
  the float32 values."""
  m, k = x.shape
  f32 = jnp.float32
  has_beta = beta is not None
  beta = jnp.zeros((0,), f32) if beta is None else beta.astype(f32)
  return jax.ffi.ffi_call(
    BLOCK_NORM_CAST_TARGET, _block_outs(m, k, q_dtype), vmap_method="sequential"
  )(
    x,
    mean.reshape(m).astype(f32),
    rsigma.reshape(m).astype(f32),
    gamma.astype(f32),
    beta,
    has_beta=has_beta,
    tile=False,
    power_2=power_2,
  )


def block_act_cast_call(h, bias, q_dtype, acts, *, power_2: bool):
  """The activation ``act(h + bias)`` (M, F) of ``h`` (M, n_act*F) cast into 1x128 blocks as it
  is computed (``acts`` as ``act_cast_call``'s), M and F multiples of 128, one device:
  ``block_cast_call``'s five outputs in 1x128 mode."""
  m, f = h.shape[0], h.shape[1] // len(acts)
  return jax.ffi.ffi_call(
    BLOCK_ACT_CAST_TARGET, _block_outs(m, f, q_dtype), vmap_method="sequential"
  )(
    h,
    _flat_bias(bias),
    has_bias=bias is not None,
    tile=False,
    power_2=power_2,
    **_act_attrs(tuple(int(a) for a in acts)),
  )


def block_dact_cast_call(dz, h, bias, q_dtype, acts, *, power_2: bool):
  """``dh = dz * act'(h + bias)`` (M, n_act*F) cast into 1x128 blocks as it is computed, with
  its float32 column sums (the bias gradient, (n_act*F,)), M and F multiples of 128, one device:
  ``block_cast_call``'s five outputs in 1x128 mode, then the sums. With one linear activation
  ``dh`` is ``dz`` and ``h`` is not read."""
  m, n = h.shape
  f32 = jnp.float32
  outs = (
    *_block_outs(m, n, q_dtype),
    jax.ShapeDtypeStruct((n,), f32),
    jax.ShapeDtypeStruct((m // 128 * n,), f32),  # per-tile column sums (workspace)
  )
  *cast, dbias, _ = jax.ffi.ffi_call(BLOCK_DACT_CAST_TARGET, outs, vmap_method="sequential")(
    dz,
    h,
    _flat_bias(bias),
    has_bias=bias is not None,
    tile=False,
    power_2=power_2,
    **_act_attrs(tuple(int(a) for a in acts)),
  )
  return (*cast, dbias)


def row_col_amax_call(x, *, rows: bool, cols: bool):
  """``max(|x|)`` over each row and over each column of ``x (.., P, C)``
  (``csrc/cast_transpose_cuda.cu``, one read): float32 ``(.., P)`` and ``(.., C)``, inf where a
  NaN or an infinity is; an output not asked for is an empty array. In a sharded program, per
  shard (``_partition.row_col_amax``: each amax of its whole row or column)."""
  rule = _partition.row_col_amax(_row_col_amax_kernel(rows, cols), x.ndim, rows, cols)
  return rule(x)


def rowwise_cast_call(x, row_scale, col_scale, q_dtype, *, rowwise: bool, colwise: bool):
  """``x (.., P, C)`` to FP8 in one read: ``q (.., P, C)`` with ``row_scale (.., P)`` (each row
  times its scale) and ``q_t (.., C, P)``, the swapped copy, with ``col_scale (.., C)``, as
  ``cast(clip(float32(x) * scale, ±fp8_max))``. A copy not asked for is an empty array (and its
  scales may be). In a sharded program, per shard (``_partition.rowwise_cast``)."""
  f32 = jnp.float32
  row_scale = row_scale.astype(f32) if rowwise else _zeros_f32()
  col_scale = col_scale.astype(f32) if colwise else _zeros_f32()
  kernel = _rowwise_cast_kernel(np.dtype(q_dtype), rowwise, colwise)
  return _partition.rowwise_cast(kernel, x.ndim, rowwise, colwise)(x, row_scale, col_scale)


# The FFI calls of the rowwise passes, one per configuration, for the shapes they are given (one
# shard's in a sharded program).


@functools.cache
def _row_col_amax_kernel(rows, cols):
  def call(x):
    lead, (p, c) = x.shape[:-2], x.shape[-2:]
    f32 = jnp.float32
    outs = (
      jax.ShapeDtypeStruct((*lead, p), f32) if rows else _empty(f32),
      jax.ShapeDtypeStruct((*lead, c), f32) if cols else _empty(f32),
    )
    return jax.ffi.ffi_call(ROW_COL_AMAX_TARGET, outs, vmap_method="sequential")(
      x, rows=rows, cols=cols
    )

  return call


@functools.cache
def _rowwise_cast_kernel(q_dtype, rowwise, colwise):
  def call(x, row_scale, col_scale):
    lead, (p, c) = x.shape[:-2], x.shape[-2:]
    outs = (
      jax.ShapeDtypeStruct(x.shape, q_dtype) if rowwise else _empty(q_dtype),
      jax.ShapeDtypeStruct((*lead, c, p), q_dtype) if colwise else _empty(q_dtype),
    )
    return jax.ffi.ffi_call(ROWWISE_CAST_TARGET, outs, vmap_method="sequential")(
      x, row_scale, col_scale, rowwise=rowwise, colwise=colwise
    )

  return call


def _zeros_f32():
  return jnp.zeros((0,), jnp.float32)


def _act_attrs(acts):
  act0, act1 = (*acts, -1) if len(acts) == 1 else acts
  return dict(act0=np.int32(act0), act1=np.int32(act1))


def _flat_bias(bias):
  """The activation kernels' bias operand: float32 (n_act * F,), or a (0,) placeholder."""
  return jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32).reshape(-1)


def act_amax_call(h, bias, acts):
  """The amax (1,) of ``act_cast_call``'s values, with no FP8 output; in a sharded program, per
  shard (the global amax on every device)."""
  acts, has_bias = tuple(int(a) for a in acts), bias is not None
  rule = _partition.act_amax(_act_amax_kernel(acts, has_bias), len(acts), has_bias)
  return rule(h, _flat_bias(bias))


def dact_amax_call(dz, h, bias, acts):
  """The amax (1,) of ``dact_cast_call``'s values, with no FP8 output or bias gradient; in a
  sharded program, per shard (the global amax on every device)."""
  acts, has_bias = tuple(int(a) for a in acts), bias is not None
  rule = _partition.dact_amax(_dact_amax_kernel(acts, has_bias), len(acts), has_bias)
  return rule(dz, h, _flat_bias(bias))


def act_cast_call(h, bias, scale, q_dtype, acts, with_amax):
  """The activation cast (``csrc/act_cast_cuda.cu``): ``h`` (M, n_act*F), ``bias`` (n_act, F) or
  None, ``acts`` the activation ids (``_fused_mlp.KERNEL_ACTIVATIONS``) -> ``(q (M, F),
  q_t (F, M), amax (1,) or empty)``; in a sharded program, per shard (``_partition.act_cast``:
  the global amax on every device)."""
  acts, has_bias = tuple(int(a) for a in acts), bias is not None
  kernel = _act_cast_kernel(np.dtype(q_dtype), acts, has_bias, with_amax)
  rule = _partition.act_cast(kernel, len(acts), has_bias, with_amax)
  return rule(h, _flat_bias(bias), scale.reshape(1).astype(jnp.float32))


def dact_cast_call(dz, h, bias, scale, q_dtype, acts, with_amax):
  """The activation's backward cast (``csrc/act_cast_cuda.cu``): ``dz`` (M, F), ``h``
  (M, n_act*F) -> ``(q (M, n_act*F), q_t (n_act*F, M), amax (1,) or empty, dbias (n_act*F,)
  float32)``; in a sharded program, per shard (``_partition.dact_cast``: the global amax and the
  column sums of every row on every device)."""
  acts, has_bias = tuple(int(a) for a in acts), bias is not None
  kernel = _dact_cast_kernel(np.dtype(q_dtype), acts, has_bias, with_amax)
  rule = _partition.dact_cast(kernel, len(acts), has_bias, with_amax)
  return rule(dz, h, _flat_bias(bias), scale.reshape(1).astype(jnp.float32))


# The FFI calls of the activation kernels, one per configuration, for the shapes they are given
# (one shard's in a sharded program).


@functools.cache
def _act_amax_kernel(acts, has_bias):
  def call(h, bias):
    out = jax.ShapeDtypeStruct((1,), jnp.float32)
    return jax.ffi.ffi_call(ACT_AMAX_TARGET, out, vmap_method="sequential")(
      h, bias, has_bias=has_bias, **_act_attrs(acts)
    )

  return call


@functools.cache
def _dact_amax_kernel(acts, has_bias):
  def call(dz, h, bias):
    out = jax.ShapeDtypeStruct((1,), jnp.float32)
    return jax.ffi.ffi_call(DACT_AMAX_TARGET, out, vmap_method="sequential")(
      dz, h, bias, has_bias=has_bias, **_act_attrs(acts)
    )

  return call


@functools.cache
def _act_cast_kernel(q_dtype, acts, has_bias, with_amax):
  def call(h, bias, scale):
    m, f = h.shape[0], h.shape[1] // len(acts)
    outs = (
      jax.ShapeDtypeStruct((m, f), q_dtype),
      jax.ShapeDtypeStruct((f, m), q_dtype),
      jax.ShapeDtypeStruct((1,), jnp.float32) if with_amax else _empty(jnp.float32),
    )
    return jax.ffi.ffi_call(ACT_CAST_TARGET, outs, vmap_method="sequential")(
      h, bias, scale, has_bias=has_bias, compute_amax=with_amax, **_act_attrs(acts)
    )

  return call


@functools.cache
def _dact_cast_kernel(q_dtype, acts, has_bias, with_amax):
  def call(dz, h, bias, scale):
    m, n = h.shape
    tiles = -(-m // 64)
    outs = (
      jax.ShapeDtypeStruct((m, n), q_dtype),
      jax.ShapeDtypeStruct((n, m), q_dtype),
      jax.ShapeDtypeStruct((1,), jnp.float32) if with_amax else _empty(jnp.float32),
      jax.ShapeDtypeStruct((n,), jnp.float32),
      jax.ShapeDtypeStruct((tiles * n,), jnp.float32),  # per-tile column sums (workspace)
    )
    q, q_t, a, dbias, _ = jax.ffi.ffi_call(DACT_CAST_TARGET, outs, vmap_method="sequential")(
      dz, h, bias, scale, has_bias=has_bias, compute_amax=with_amax, **_act_attrs(acts)
    )
    return q, q_t, a, dbias

  return call


def norm_cast_call(x, mean, rsigma, gamma, beta, scale, q_dtype, with_amax):
  """The norm's cast (``csrc/act_cast_cuda.cu``): ``x`` (M, K), the row statistics ``mean`` and
  ``rsigma`` (M,), float32 ``gamma`` (K,) and ``beta`` (K,) or None -> ``(q (M, K), q_t (K, M),
  amax (1,) or empty)`` of ``(x - mean) * rsigma * gamma + beta``; in a sharded program, per
  shard (the global amax on every device)."""
  m = x.shape[0]
  f32 = jnp.float32
  has_beta = beta is not None
  beta = jnp.zeros((0,), f32) if beta is None else beta.astype(f32)
  # Per shard in a sharded program (the partitioning rule of _partition.py).
  cast = _partition.norm_cast(_norm_cast_kernel(q_dtype, has_beta, with_amax), has_beta, with_amax)
  return cast(
    x,
    mean.reshape(m).astype(f32),
    rsigma.reshape(m).astype(f32),
    gamma.astype(f32),
    beta,
    scale.reshape(1).astype(f32),
  )


@functools.cache
def _norm_cast_kernel(q_dtype, has_beta, with_amax):
  """The FFI norm cast of one configuration, ``f(x, mean, rsigma, gamma, beta, scale)``, for the
  shapes it is given (one shard's in a sharded program)."""

  def call(x, mean, rsigma, gamma, beta, scale):
    m, k = x.shape
    f32 = jnp.float32
    outs = (
      jax.ShapeDtypeStruct((m, k), q_dtype),
      jax.ShapeDtypeStruct((k, m), q_dtype),
      jax.ShapeDtypeStruct((1,), f32) if with_amax else _empty(f32),
    )
    return jax.ffi.ffi_call(NORM_CAST_TARGET, outs, vmap_method="sequential")(
      x, mean, rsigma, gamma, beta, scale, has_beta=has_beta, compute_amax=with_amax
    )

  return call


def _with_workspace(target, out_shape, out_dtype, workspace_bytes, *operands, **attrs):
  """``target``'s one output, called with a scratch workspace of ``workspace_bytes`` as its
  second output (XLA allocates it; the handler may use it for the call's length)."""
  outs = (
    jax.ShapeDtypeStruct(out_shape, out_dtype),
    jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8),
  )
  y, _ = jax.ffi.ffi_call(target, outs, vmap_method="sequential")(*operands, **attrs)
  return y


def gemm_call(
  a, b, a_scales, b_scales, out_dtype, lhs_mode, rhs_mode, fast_accum=False, sm_margin=0
):
  """The cuBLASLt FP8 GEMM (``csrc/block_gemm_cuda.cc``): ``a (.., M, K)`` times ``b (.., N, K)``
  into ``(.., M, N)`` of ``out_dtype``, with no or one leading batch dim. ``sm_margin`` > 0:
  cuBLASLt targets the device's SM count less that many (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``),
  leaving them to a collective running beside the GEMM.

  Scale mode 0 (both operands): one float32 scale each, shape (1,), applied in the epilogue.
  Modes 1 and 2: 1x128 blocks and 128x128 tiles, scales in cuBLAS's layout (see
  ``_float8_block``).
  """
  return _with_workspace(
    GEMM_TARGET,
    (*a.shape[:-1], b.shape[-2]),
    out_dtype,
    _GEMM_WORKSPACE_BYTES,
    a,
    b,
    a_scales,
    b_scales,
    lhs_mode=np.int32(lhs_mode),
    rhs_mode=np.int32(rhs_mode),
    fast_accum=np.int32(fast_accum),
    sm_margin=np.int32(sm_margin),
  )


def registered(target: str, platform: str = "gpu") -> bool:
  """Whether ``target`` is built and registered for ``platform``."""
  return ffi_available(platform) and target in _registrations(platform)


def grouped_gemm_call(
  a, b, group_sizes, alpha, out_shape, out_dtype, workspace_bytes, *, mode, fast_accum, config
):
  """The grouped FP8 GEMM (``csrc/grouped_gemm_cuda.cu``), ``mode`` 0 (rows) or 1 (wgrad); see
  ``_grouped_kernel`` for the operand layouts."""
  return _with_workspace(
    GROUPED_GEMM_TARGET,
    out_shape,
    out_dtype,
    workspace_bytes,
    a,
    b,
    group_sizes.astype(jnp.int32),
    alpha.astype(jnp.float32),
    mode=np.int32(mode),
    fast_accum=np.int32(fast_accum),
    config=np.int32(config),
  )


def grouped_block_gemm_call(
  a, b, sfa, sfb, group_sizes, out_shape, out_dtype, workspace_bytes, *, mode
):
  """Float8BlockScaling's grouped FP8 GEMM (``csrc/grouped_block_gemm_cuda.cu``), ``mode`` 0
  (rows) or 1 (wgrad); see ``_grouped_kernel`` for the operand and scale layouts."""
  return _with_workspace(
    GROUPED_BLOCK_GEMM_TARGET,
    out_shape,
    out_dtype,
    workspace_bytes,
    a,
    b,
    sfa.astype(jnp.float32),
    sfb.astype(jnp.float32),
    group_sizes.astype(jnp.int32),
    mode=np.int32(mode),
  )


def padded_transpose_call(q, src):
  """``q`` (M, F) gathered by column sources ``src`` (P,) into (F, P), zeros where ``src < 0``."""
  out = jax.ShapeDtypeStruct((q.shape[1], src.shape[0]), q.dtype)
  return jax.ffi.ffi_call(PADDED_TRANSPOSE_TARGET, out, vmap_method="sequential")(q, src)
