"""Per-tensor FP8 cast of one tensor in one pass: the FP8 copy, its transposed copy and its amax.

Two implementations with bit-identical results: the pure-JAX reference (XLA fuses it) and the
XLA FFI kernels of ``csrc/`` (C++ on CPU, CUDA on Hopper), used when the extension is built.

The ``backend`` argument (``GemmConfig.backend`` for ``dot_general``) decides which one runs:

- ``"jax"``: always the pure-JAX path.
- ``"ffi"``: the FFI kernel wherever it applies (it is built for the platform, the input is
  float32/bfloat16/float16 and not sharded over several devices); the pure-JAX path elsewhere.
  Raises if the extension is not built for the platform at all.
- ``"auto"`` or ``None``: the FFI kernel on GPU when its CUDA part is built, pure JAX otherwise.

Sharded operands: under ``jit`` over several devices the kernels run on each shard, through the
partitioning rules of ``_partition.py`` (the amax max-reduced over the mesh axes that shard the
input); inside ``shard_map`` every value is a shard and the kernels run as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import kernels
from te_adapters.core.formats import _scaled_tensor, _scaling
from te_adapters.core.kernels import ffi_available

__all__ = [
  "FFI_INPUT_DTYPES",
  "amax",
  "backend",
  "cast_transpose",
  "cast_transpose_per_batch",
  "ffi_available",
]

FFI_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def backend(platform: str | None = None, requested: str | None = "auto") -> str:
  """The cast implementation used for ``platform`` (default: JAX's default backend).

  Args:
    platform: ``"cpu"``, ``"gpu"``, ...; ``None`` for JAX's default backend.
    requested: ``"auto"`` (or ``None``), ``"jax"`` or ``"ffi"`` (see the module docstring).

  Returns:
    ``"ffi"`` or ``"jax"``.
  """
  platform = platform or jax.default_backend()
  requested = "auto" if requested is None else requested
  if requested not in ("auto", "jax", "ffi"):
    raise ValueError(f"backend must be 'auto', 'jax', 'ffi' or None, got {requested!r}")
  if requested == "jax":
    return "jax"
  if requested == "ffi":
    if not ffi_available(platform):
      raise RuntimeError(
        f"backend='ffi' but the te_adapters extension is not built for {platform!r}; "
        "reinstall with a C++ compiler (and a CUDA compiler for GPUs), or choose 'auto'"
      )
    return "ffi"
  return "ffi" if platform == "gpu" and ffi_available("gpu") else "jax"


def _use_ffi(x, requested: str | None) -> bool:
  if backend(requested=requested) == "jax":
    return False
  # A program placed on the host CPU of a GPU machine calls the same target on the CPU platform.
  ffi_available("cpu")
  # Sharded operands run the kernel per shard (the partitioning rules of core/_partition.py).
  ok = np.dtype(x.dtype) in FFI_INPUT_DTYPES
  if requested == "ffi" and np.dtype(x.dtype) not in FFI_INPUT_DTYPES:
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
  amax_over_mesh: bool = False,
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
    backend: ``"jax"``, ``"ffi"``, or ``"auto"``/``None`` (the platform decides).
    amax_over_mesh: in a sharded program, reduce the amax over every mesh axis
      (``GemmConfig.fold_amax``; the same value).

  Returns:
    ``(q, q_t, amax)``, with ``None`` for each output not asked for.

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters.core.formats import _cast_transpose
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> q, q_t, a = _cast_transpose.cast_transpose(x, jnp.ones((1,)), jnp.float8_e4m3fn,
    ...                                            with_amax=True)
    >>> q_t.shape, float(a[0])
    ((3, 2), 5.0)
  """
  _scaled_tensor.check_float_operand("x", x)
  q_dtype = _scaled_tensor.check_fp8_dtype(q_dtype)
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
    fn = kernels.cast_transpose_call(x.ndim, q_dtype, rowwise, colwise, with_amax, amax_over_mesh)
    q, q_t, a = fn(x, scale.reshape(1))
  else:
    fold = with_amax and amax_over_mesh
    q, q_t, a = _reference_cast(x, scale, q_dtype, rowwise, colwise, with_amax and not fold)
    if fold:
      a = amax(x, backend="jax", over_mesh=True)
  return (q if rowwise else None), (q_t if colwise else None), (a if with_amax else None)


def cast_transpose_per_batch(
  x: jax.Array,
  scales: jax.Array,
  q_dtype,
  *,
  with_amax: bool = False,
  backend: str | None = None,
):
  """FP8 copies of each ``x[b]`` of ``x`` (B, R, C), as is and transposed, with its own scale.

  The grouped GEMM's kernels (one per expert, each with its expert's scale) in one pass over
  ``x``: ``q[b] = cast(clip(float32(x[b]) * scales[b], ±fp8_max))``, ``q_t[b]`` the same of
  ``x[b].T``, and with ``with_amax`` the amax of each ``x[b]`` (inf where it holds a NaN or
  inf, as ``amax``). The FFI kernel runs where ``cast_transpose``'s would (per shard in a
  sharded program); the pure-JAX path, bit for bit the same, elsewhere.

  Args:
    x: float32, bfloat16 or float16 array of shape (B, R, C).
    scales: float32 of shape (B,).
    q_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    with_amax: also return the amaxes, float32 (B,).
    backend: ``"jax"``, ``"ffi"``, ``"auto"`` or ``None`` (as for ``cast_transpose``).

  Returns:
    ``(q, q_t, amax)``, ``amax`` None unless ``with_amax``.

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters.core.formats import _cast_transpose
    >>> x = jnp.arange(12.0).reshape(2, 2, 3)
    >>> q, q_t, a = _cast_transpose.cast_transpose_per_batch(
    ...     x, jnp.array([1.0, 0.5]), jnp.float8_e4m3fn, with_amax=True)
    >>> q_t.shape, a.tolist(), float(q[1, 1, 2])
    ((2, 3, 2), [5.0, 11.0], 5.5)
  """
  _scaled_tensor.check_float_operand("x", x)
  q_dtype = _scaled_tensor.check_fp8_dtype(q_dtype)
  x = jnp.asarray(x)
  scales = jnp.asarray(scales, jnp.float32)
  if x.ndim != 3:
    raise ValueError(f"cast_transpose_per_batch needs a (B, R, C) array, got shape {x.shape}")
  if scales.shape != x.shape[:1]:
    raise ValueError(
      f"scales must have shape ({x.shape[0]},), one per batch index, got {scales.shape}"
    )
  if x.size and _use_ffi(x, backend):
    q, q_t, a = kernels.cast_transpose_per_batch_call(q_dtype, with_amax)(x, scales)
    return q, q_t, (a if with_amax else None)
  limit = _scaling.fp8_max(q_dtype)
  q = jnp.clip(x.astype(jnp.float32) * scales[:, None, None], -limit, limit).astype(q_dtype)
  # The cast is elementwise, so the transposed copy is the copy transposed.
  return q, jnp.swapaxes(q, 1, 2), (_scaling.leading_amax(x) if with_amax else None)


def amax(x: jax.Array, *, backend: str | None = None, over_mesh: bool = False) -> jax.Array:
  """``max(|x|)`` as float32 of shape (1,), inf if any element is NaN (current scaling's pass).

  Args:
    x: a real floating-point array.
    backend: ``"jax"``, ``"ffi"``, ``"auto"`` or ``None`` (as for ``cast_transpose``).
    over_mesh: in a sharded program, reduce over every mesh axis (``GemmConfig.fold_amax``; the
      same value), through the amax's partitioning rule.

  Returns:
    float32 array of shape (1,).

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters.core.formats import _cast_transpose
    >>> float(_cast_transpose.amax(jnp.array([1.0, -3.0]))[0])
    3.0
  """
  _scaled_tensor.check_float_operand("x", x)
  x = jnp.asarray(x)
  if x.size and _use_ffi(x, backend):
    return kernels.amax_call(over_mesh)(x)
  if over_mesh and x.size:
    return kernels.amax(_scaling.tensor_amax, x.ndim, True)(x)
  return _scaling.tensor_amax(x)


def _reference_cast(x, scale, q_dtype, rowwise, colwise, with_amax):
  q = _scaled_tensor.cast_with_scale(x, scale, q_dtype) if rowwise else None
  q_t = _scaled_tensor.cast_with_scale(jnp.swapaxes(x, -1, -2), scale, q_dtype) if colwise else None
  a = _scaling.tensor_amax(x) if with_amax else None
  return q, q_t, a
