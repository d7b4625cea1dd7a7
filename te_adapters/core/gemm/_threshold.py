"""The size threshold below which a quantized GEMM stays in high precision.

Quantizing costs passes over the operands (amax, cast, transpose) that grow with the operand sizes,
while the GEMM time that FP8 saves grows with M*K*N; below some size the FP8 step is slower than
the plain one. ``dot_general`` then runs ``lax.dot_general`` on the unquantized operands and says
so with a ``HighPrecisionGemmWarning``; ``runs_in_fp8`` tells in advance.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Sequence

import jax

from te_adapters.core.gemm import _dimension_numbers
from te_adapters.core.gemm._layout import GemmLayout
from te_adapters.core.recipes import caller_stacklevel

__all__ = [
  "DEFAULT_SIZE_THRESHOLD",
  "HighPrecisionGemmWarning",
  "SizeThreshold",
  "check_threshold",
  "gemm_mkn",
  "high_precision_reason",
  "runs_in_fp8",
]

# The platform names ``jax.default_backend()`` gives.
PLATFORMS = ("cpu", "gpu", "tpu")


class HighPrecisionGemmWarning(UserWarning):
  """A quantized ``dot_general`` ran in high precision: the GEMM is below the size threshold.

  Issued once per trace of such a GEMM, naming its M, K and N, the recipe and the rule; pass
  ``threshold=None`` to quantize it anyway. ``warnings.simplefilter("error",
  HighPrecisionGemmWarning)`` turns it into an error (a run that must be FP8 throughout).

  Example:
    >>> import dataclasses, warnings, jax.numpy as jnp, te_adapters as ta
    >>> everywhere = dataclasses.replace(ta.core.DEFAULT_SIZE_THRESHOLD,
    ...                                  platforms=("cpu", "gpu", "tpu"))
    >>> dn = (((1,), (0,)), ((), ()))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   y = ta.core.dot_general(jnp.ones((16, 32)), jnp.ones((32, 16)), dn,
    ...                           recipe=ta.Float8CurrentScaling(), threshold=everywhere)
    >>> [w.category.__name__ for w in caught]
    ['HighPrecisionGemmWarning']
    >>> str(caught[0].message)[:64]
    'te_adapters: a GEMM with M=16, K=32, N=16 runs in high precision'
  """


@dataclasses.dataclass(frozen=True)
class SizeThreshold:
  """When a quantized GEMM is large enough to run in FP8; smaller ones stay in high precision.

  A GEMM of an ``(M, K)`` activation and a ``(K, N)`` kernel runs in FP8 when
  ``M * K * N >= min_mkn`` and ``min(M, K, N) >= min_dim``, or when the JAX backend at trace time
  (``jax.default_backend()``) is not one of ``platforms``. With general dimension numbers, M
  multiplies the lhs batch and free dims, K the contracting dims, N the rhs free dims.

  Frozen and hashable. Derive variants from the default with ``dataclasses.replace``, for example
  ``dataclasses.replace(DEFAULT_SIZE_THRESHOLD, platforms=("gpu", "cpu"))``.

  Args:
    min_mkn: the smallest ``M * K * N`` that runs in FP8; a positive int.
    min_dim: the smallest of M, K and N that runs in FP8; a positive int.
    platforms: the JAX platforms (``"cpu"``, ``"gpu"``, ``"tpu"``) on which the threshold applies;
      elsewhere every GEMM is quantized.

  Raises:
    TypeError: a size that is not an int, or ``platforms`` given as a string.
    ValueError: a size below 1, or an unknown platform.

  Example:
    >>> import te_adapters as ta
    >>> t = ta.core.SizeThreshold(min_mkn=1024**3, min_dim=512, platforms=("gpu", "cpu"))
    >>> t.allows_fp8(1024, 1024, 1024, "cpu"), t.allows_fp8(256, 4096, 4096, "cpu")
    (True, False)
    >>> t.allows_fp8(16, 16, 16, "tpu")  # not one of its platforms: always FP8
    True
    >>> t.rule()
    'FP8 only where M*K*N >= 1073741824 = 1024**3 and min(M, K, N) >= 512, on gpu, cpu'
  """

  min_mkn: int
  min_dim: int
  platforms: tuple[str, ...] = ("gpu",)

  def __post_init__(self):
    for field in ("min_mkn", "min_dim"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SizeThreshold.{field} must be an int, got {value!r}")
      if value < 1:
        raise ValueError(f"SizeThreshold.{field} must be >= 1, got {value}")
      object.__setattr__(self, field, int(value))
    platforms = self.platforms
    if isinstance(platforms, str) or not isinstance(platforms, Sequence):
      raise TypeError(
        f"SizeThreshold.platforms must be a tuple of platform names such as ('gpu',), got "
        f"{platforms!r}"
      )
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown:
      raise ValueError(
        f"SizeThreshold.platforms: unknown platform(s) {unknown}; known: {list(PLATFORMS)}"
      )
    object.__setattr__(self, "platforms", tuple(platforms))

  def applies_to(self, backend: str) -> bool:
    """Whether the threshold applies on the JAX platform ``backend`` (``"gpu"``, ...).

    Args:
      backend: a JAX platform name, as ``jax.default_backend()`` gives it.

    Returns:
      True where ``backend`` is one of ``platforms``.
    """
    return backend in self.platforms

  def allows_fp8(self, m: int, k: int, n: int, backend: str) -> bool:
    """Whether an M x K x N GEMM runs in FP8 on ``backend`` under this threshold.

    Args:
      m, k, n: the GEMM's sizes.
      backend: a JAX platform name.

    Returns:
      True where the threshold does not apply on ``backend``, or the sizes reach it.
    """
    if not self.applies_to(backend):
      return True
    return m * k * n >= self.min_mkn and min(m, k, n) >= self.min_dim

  def rule(self) -> str:
    """The rule in words, as the warning states it.

    Returns:
      A sentence with ``min_mkn``, ``min_dim`` and the platforms.
    """
    root = round(self.min_mkn ** (1 / 3))
    cube = f" = {root}**3" if root**3 == self.min_mkn else ""
    return (
      f"FP8 only where M*K*N >= {self.min_mkn}{cube} and min(M, K, N) >= {self.min_dim}, "
      f"on {', '.join(self.platforms) or 'no platform'}"
    )


# FP8 from 4096**3 = 2**36 up, every dim at least 2048: where an H100 sweep of fwd+bwd x @ w ran
# faster in FP8 than in bf16 (bench/RESULTS.md, 2026-11-25). Calibrate with
# ``python -m bench --cases sweep --shapes MxKxN,...``.
DEFAULT_SIZE_THRESHOLD = SizeThreshold(min_mkn=4096**3, min_dim=2048, platforms=("gpu",))


def check_threshold(threshold: object) -> SizeThreshold | None:
  """Returns ``threshold`` if it is a ``SizeThreshold`` or ``None``, else raises a TypeError.

  Args:
    threshold: the object to check.

  Returns:
    ``threshold`` itself.

  Raises:
    TypeError: ``threshold`` is neither.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.check_threshold(None) is None
    True
    >>> ta.core.check_threshold(4096)
    Traceback (most recent call last):
      ...
    TypeError: threshold must be a te_adapters.core.SizeThreshold or None (always FP8), got 4096
  """
  if threshold is not None and not isinstance(threshold, SizeThreshold):
    raise TypeError(
      f"threshold must be a te_adapters.core.SizeThreshold or None (always FP8), got {threshold!r}"
    )
  return threshold


def gemm_mkn(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int]:
  """``(M, K, N)`` of a ``dot_general``: M multiplies the lhs batch and free dims, K the
  contracting dims, N the rhs free dims."""
  dn = _dimension_numbers.normalize(dimension_numbers, lhs_shape, rhs_shape)
  layout = GemmLayout(dn, lhs_shape, rhs_shape)
  return int(layout.b * layout.m), int(layout.k), int(layout.n)


def runs_in_fp8(
  lhs_shape: Sequence[int],
  rhs_shape: Sequence[int],
  dimension_numbers: jax.lax.DotDimensionNumbers,
  threshold: SizeThreshold | None = DEFAULT_SIZE_THRESHOLD,
  backend: str | None = None,
) -> bool:
  """Whether ``dot_general`` with these shapes runs in FP8 (True) or stays in high precision.

  Args:
    lhs_shape: shape of the activation (or the array itself).
    rhs_shape: shape of the kernel (or the array itself).
    dimension_numbers: as for ``lax.dot_general``.
    threshold: as given to ``dot_general``; ``None`` always quantizes.
    backend: the JAX platform; default ``jax.default_backend()``, which ``dot_general`` uses.

  Returns:
    True where the GEMM runs in FP8; False where it stays in high precision.

  Raises:
    TypeError: ``threshold`` is neither a ``SizeThreshold`` nor None.

  Example:
    >>> import te_adapters as ta
    >>> dn = (((1,), (0,)), ((), ()))
    >>> ta.core.runs_in_fp8((1024, 1024), (1024, 1024), dn, backend="gpu")
    False
    >>> ta.core.runs_in_fp8((8192, 8192), (8192, 8192), dn, backend="gpu")
    True
  """
  threshold = check_threshold(threshold)
  lhs_shape = tuple(getattr(lhs_shape, "shape", lhs_shape))
  rhs_shape = tuple(getattr(rhs_shape, "shape", rhs_shape))
  m, k, n = gemm_mkn(lhs_shape, rhs_shape, dimension_numbers)
  if threshold is None:
    return True
  return threshold.allows_fp8(m, k, n, jax.default_backend() if backend is None else backend)


def high_precision_reason(
  threshold: SizeThreshold | None,
  k: int,
  n: int,
  m: int | None = None,
  backend: str | None = None,
) -> str | None:
  """Why a GEMM with a (K, N) kernel stays in high precision under ``threshold``, or None.

  With ``m``, for that GEMM; without, for every M (a layer whose kernel alone keeps it below the
  threshold), so that a conversion can say so before the model runs.

  Args:
    threshold: a ``SizeThreshold``, or None (always FP8).
    k: the GEMM's contracting size K.
    n: its output-feature size N.
    m: its row count M, or None for every M.
    backend: the JAX platform; default ``jax.default_backend()``.

  Returns:
    A sentence with the sizes and the rule, or None where the GEMM (some GEMM, without ``m``)
    runs in FP8.

  Raises:
    TypeError: ``threshold`` is neither a ``SizeThreshold`` nor None.

  Example:
    >>> import te_adapters as ta
    >>> t = ta.core.DEFAULT_SIZE_THRESHOLD
    >>> ta.core.high_precision_reason(t, 128, 256, backend="gpu")[:52]
    'K=128, N=256: below the size threshold (FP8 only whe'
    >>> ta.core.high_precision_reason(t, 4096, 4096, backend="gpu") is None
    True
  """
  threshold = check_threshold(threshold)
  backend = jax.default_backend() if backend is None else backend
  if threshold is None or not threshold.applies_to(backend):
    return None
  if m is None:
    if min(k, n) >= threshold.min_dim:
      return None  # a large enough M runs in FP8
    return f"K={k}, N={n}: below the size threshold ({threshold.rule()}) for any M"
  if threshold.allows_fp8(m, k, n, backend):
    return None
  return f"M={m}, K={k}, N={n}: below the size threshold ({threshold.rule()})"


def keeps_high_precision(
  threshold, m, k, n, recipe, dtype, stacklevel: int | None = None, layer: str | None = None
) -> bool:
  """True (after a ``HighPrecisionGemmWarning``) if ``threshold`` keeps this GEMM unquantized.

  The warning names ``layer`` where given, and points ``stacklevel`` frames up, by default at
  the user's line (``caller_stacklevel``)."""
  backend = jax.default_backend()
  if threshold is None or threshold.allows_fp8(m, k, n, backend):
    return False
  what = f"{layer}: a GEMM" if layer else "a GEMM"
  warnings.warn(
    f"te_adapters: {what} with M={m}, K={k}, N={n} runs in high precision ({dtype}), not with "
    f"{type(recipe).__name__}: it is below the size threshold ({threshold.rule()}), under "
    "which FP8 is slower than high precision. Pass threshold=None to quantize it anyway, or a "
    "te_adapters.core.SizeThreshold to change the rule.",
    HighPrecisionGemmWarning,
    stacklevel=caller_stacklevel() if stacklevel is None else stacklevel + 1,
  )
  return True
