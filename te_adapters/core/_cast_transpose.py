"""Per-tensor FP8 cast of one tensor in one pass: the FP8 copy, its transposed copy and its amax.

Two implementations with bit-identical results: the pure-JAX reference (XLA fuses it) and the
XLA FFI kernels of ``csrc/`` (C++ on CPU, CUDA on Hopper), used when the extension is built.

Which one runs is decided at trace time:

- ``TE_ADAPTERS_BACKEND=jax``: always the pure-JAX path.
- ``TE_ADAPTERS_BACKEND=ffi``: the FFI kernel wherever it applies (it is built for the platform
  and the input is float32/bfloat16/float16); the pure-JAX path elsewhere. Raises if the
  extension is not built for the platform at all.
- unset: the FFI kernel on GPU when its CUDA part is built, the pure-JAX path otherwise.

Sharded operands: under ``jit`` over several devices the kernels run on each shard, through the
partitioning rules of ``_partition.py`` (the amax max-reduced over the mesh axes that shard the
input); inside ``shard_map`` every value is a shard and the kernels run as they are.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import _partition, _quantize, _scaling

__all__ = ["amax", "backend", "cast_transpose", "ffi_available"]

BACKEND_ENV = "TE_ADAPTERS_BACKEND"
_CAST_TARGET = "te_adapters_cast_transpose"
_AMAX_TARGET = "te_adapters_amax"
_FFI_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# jax.default_backend() name -> (extension module, XLA platform name).
_MODULES = {"cpu": ("te_adapters._csrc_cpu", "cpu"), "gpu": ("te_adapters._csrc_cuda", "CUDA")}


@functools.cache
def ffi_available(platform: str) -> bool:
  """Whether the FFI kernels are built for ``platform`` (``"cpu"`` or ``"gpu"``) and registered.

  Example:
    >>> import te_adapters as ta
    >>> isinstance(ta.core.ffi_available("cpu"), bool)
    True
  """
  if platform not in _MODULES:
    return False
  module_name, xla_platform = _MODULES[platform]
  try:
    module = importlib.import_module(module_name)
  except ImportError:
    return False
  for name, capsule in module.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
  return True


def backend(platform: str | None = None) -> str:
  """The cast implementation used for ``platform`` (default: JAX's default backend).

  Returns:
    ``"ffi"`` or ``"jax"``, per ``TE_ADAPTERS_BACKEND`` (see the module docstring).
  """
  platform = platform or jax.default_backend()
  value = os.environ.get(BACKEND_ENV, "")
  if value not in ("", "jax", "ffi"):
    raise ValueError(f"{BACKEND_ENV} must be 'jax' or 'ffi', got {value!r}")
  if value == "jax":
    return "jax"
  if value == "ffi":
    if not ffi_available(platform):
      raise RuntimeError(
        f"{BACKEND_ENV}=ffi but the te_adapters extension is not built for {platform!r}; "
        "reinstall with a C++ compiler (and a CUDA compiler for GPUs), or unset the variable"
      )
    return "ffi"
  return "ffi" if platform == "gpu" and ffi_available("gpu") else "jax"


def _use_ffi(x, requested: str | None) -> bool:
  if requested is None:
    choice = backend()
  elif requested in ("jax", "ffi"):
    choice = requested
    if requested == "ffi" and not ffi_available(jax.default_backend()):
      raise RuntimeError(
        f"backend='ffi' but the te_adapters extension is not built for {jax.default_backend()!r}"
      )
  else:
    raise ValueError(f"backend must be 'jax', 'ffi' or None, got {requested!r}")
  if choice == "jax":
    return False
  # A program placed on the host CPU of a GPU machine calls the same target on the CPU platform.
  ffi_available("cpu")
  # Sharded operands run the kernel per shard (the partitioning rules of core/_partition.py).
  ok = np.dtype(x.dtype) in _FFI_INPUT_DTYPES
  if requested == "ffi" and np.dtype(x.dtype) not in _FFI_INPUT_DTYPES:
    raise ValueError(
      f"the FFI cast takes float32, bfloat16 or float16 inputs, got {np.dtype(x.dtype)}"
    )
  return ok


def cast_transpose(
  x: jax.Array,
  scale: jax.Array,
  q_dtype,
  *,
  rowwise: bool = True,
  colwise: bool = True,
  with_amax: bool = False,
  backend: str | None = None,
):
  """FP8 copies of ``x`` (as is, and with its last two dims swapped) with one scale, in one pass.

  Each copy is ``cast(clip(float32(x) * scale, ±fp8_max))``, TE's per-tensor quantization.

  Args:
    x: float32, bfloat16 or float16 array (other float dtypes take the pure-JAX path). Rank >= 1;
      rank >= 2 for the transposed copy.
    scale: float32 of one element, the multiplier applied before the cast.
    q_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    rowwise: return the FP8 copy of ``x``.
    colwise: return the FP8 copy of ``swapaxes(x, -1, -2)``.
    with_amax: also return ``max(|x|)`` (float32, shape (1,), inf if any element is NaN or
      inf), read in the same pass (delayed scaling quantizes with a stored scale and records
      the amax).
    backend: ``"jax"``, ``"ffi"`` or ``None`` (``TE_ADAPTERS_BACKEND`` and the platform decide).

  Returns:
    ``(q, q_t, amax)``, with ``None`` for each output not asked for.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> q, q_t, a = ta.core.cast_transpose(x, jnp.ones((1,)), jnp.float8_e4m3fn, with_amax=True)
    >>> q_t.shape, float(a[0])
    ((3, 2), 5.0)
  """
  _quantize.check_float_operand("x", x)
  q_dtype = _quantize.check_fp8_dtype(q_dtype)
  x = jnp.asarray(x)
  scale = jnp.asarray(scale, jnp.float32)
  if scale.size != 1:
    raise ValueError(f"per-tensor scale must have one element, got shape {scale.shape}")
  if x.ndim < 1:
    raise ValueError("cast_transpose needs an array of rank >= 1")
  if colwise and x.ndim < 2:
    raise ValueError(f"the transposed copy needs rank >= 2, got shape {x.shape}")
  if not (rowwise or colwise or with_amax):
    return None, None, None
  if _use_ffi(x, backend):
    fn = _ffi_cast(x.ndim, q_dtype, rowwise, colwise, with_amax)
    q, q_t, a = fn(x, scale.reshape(1))
  else:
    q, q_t, a = _reference_cast(x, scale, q_dtype, rowwise, colwise, with_amax)
  return (q if rowwise else None), (q_t if colwise else None), (a if with_amax else None)


def amax(x: jax.Array, *, backend: str | None = None) -> jax.Array:
  """``max(|x|)`` as float32 of shape (1,), inf if any element is NaN (current scaling's pass).

  Args:
    x: a real floating-point array.
    backend: ``"jax"``, ``"ffi"`` or ``None`` (as for ``cast_transpose``).

  Returns:
    float32 array of shape (1,).

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> float(ta.core.amax(jnp.array([1.0, -3.0]))[0])
    3.0
  """
  _quantize.check_float_operand("x", x)
  x = jnp.asarray(x)
  if x.size and _use_ffi(x, backend):
    return _ffi_amax()(x)
  return _scaling.amax(x)


def _reference_cast(x, scale, q_dtype, rowwise, colwise, with_amax):
  q = _quantize.cast_with_scale(x, scale, q_dtype) if rowwise else None
  q_t = _quantize.cast_with_scale(jnp.swapaxes(x, -1, -2), scale, q_dtype) if colwise else None
  a = _scaling.amax(x) if with_amax else None
  return q, q_t, a


def _empty(dtype):
  return jax.ShapeDtypeStruct((0,), dtype)


@functools.cache
def _ffi_cast(ndim, q_dtype, rowwise, colwise, with_amax):
  """The FFI cast for one configuration, batched under ``vmap`` without looping where it can."""

  def call(x, scale):
    t_shape = x.shape[:-2] + (x.shape[-1], x.shape[-2]) if x.ndim >= 2 else (0,)
    outs = (
      jax.ShapeDtypeStruct(x.shape, q_dtype) if rowwise else _empty(q_dtype),
      jax.ShapeDtypeStruct(t_shape, q_dtype) if colwise else _empty(q_dtype),
      jax.ShapeDtypeStruct((1,), jnp.float32) if with_amax else _empty(jnp.float32),
    )
    return jax.ffi.ffi_call(_CAST_TARGET, outs)(
      x, scale, rowwise=rowwise, colwise=colwise, compute_amax=with_amax
    )

  @jax.custom_batching.custom_vmap
  def cast(x, scale):
    return _partition.cast_transpose(call, x.ndim, rowwise, colwise, with_amax)(x, scale)

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
def _ffi_amax():
  def call(x):
    return jax.ffi.ffi_call(_AMAX_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32))(x)

  @jax.custom_batching.custom_vmap
  def amax_fn(x):
    return _partition.amax(call, x.ndim)(x)

  @amax_fn.def_vmap
  def _amax_vmap(axis_size, in_batched, x):
    del axis_size, in_batched
    return jax.lax.map(amax_fn, x), True

  return amax_fn
