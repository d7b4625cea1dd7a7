"""Quantization recipes: frozen, hashable descriptions of how a GEMM is quantized.

Names, fields and defaults follow TransformerEngine's common recipes, so a recipe written for TE
reads the same here.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

import jax.numpy as jnp
import numpy as np

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling"]


class Format(enum.Enum):
  """FP8 formats of a recipe.

  ``E4M3`` quantizes every tensor to ``float8_e4m3fn``. ``HYBRID`` uses ``float8_e4m3fn`` for the
  forward operands (x and kernel) and ``float8_e5m2`` for the output gradient. ``E5M2`` exists for
  name compatibility with TE and is rejected by every recipe, as in TE's JAX layer.
  """

  E4M3 = "E4M3"
  E5M2 = "E5M2"
  HYBRID = "HYBRID"

  @property
  def fwd_dtype(self) -> np.dtype:
    """Dtype of x and kernel."""
    if self is Format.E5M2:
      return np.dtype(jnp.float8_e5m2)
    return np.dtype(jnp.float8_e4m3fn)

  @property
  def bwd_dtype(self) -> np.dtype:
    """Dtype of the output gradient."""
    if self is Format.E4M3:
      return np.dtype(jnp.float8_e4m3fn)
    return np.dtype(jnp.float8_e5m2)


def _check_format(name: str, value: object) -> None:
  if not isinstance(value, Format):
    raise TypeError(f"{name}.fp8_format must be a te_adapters.Format, got {value!r}")
  if value is Format.E5M2:
    raise ValueError(
        f"{name}: pure E5M2 training is not supported; use Format.HYBRID (E4M3 forward, "
        "E5M2 gradients) or Format.E4M3"
    )


class Recipe:
  """Base class of every recipe. A recipe is a frozen dataclass, usable as a static argument."""

  fp8_format: Format

  @property
  def stateful(self) -> bool:
    """Whether the recipe keeps state between steps (amax histories and scales)."""
    return False

  @property
  def fwd_dtype(self) -> np.dtype:
    return self.fp8_format.fwd_dtype

  @property
  def bwd_dtype(self) -> np.dtype:
    return self.fp8_format.bwd_dtype


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
  """Per-tensor FP8 scaling from a history of past amaxes (TE's ``DelayedScaling``).

  Each quantized tensor role (``x``, ``kernel``, ``grad``) keeps a ``scale`` of shape (1,) and an
  ``amax_history`` of shape (``amax_history_len``,). A GEMM quantizes with the stored scale, then
  records the current amax and computes the scale for the next step:
  ``scale = fp8_max / amax / 2**margin``, where ``amax`` is the maximum over the history window
  (``"max"``) or the current amax (``"most_recent"``). The old scale is kept when that amax is zero
  or not finite.

  Args:
    margin: the scale is divided by ``2**margin``; a non-negative number.
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
    amax_history_len: length of the amax history window, at least 1.
    amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
  """

  margin: float = 0
  fp8_format: Format = Format.HYBRID
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"

  def __post_init__(self):
    name = type(self).__name__
    if isinstance(self.margin, bool) or not isinstance(self.margin, numbers.Real):
      raise TypeError(f"{name}.margin must be a real number, got {self.margin!r}")
    if not np.isfinite(self.margin) or self.margin < 0:
      raise ValueError(f"{name}.margin must be finite and >= 0, got {self.margin!r}")
    _check_format(name, self.fp8_format)
    if isinstance(self.amax_history_len, bool) or not isinstance(
        self.amax_history_len, numbers.Integral
    ):
      raise TypeError(
          f"{name}.amax_history_len must be an int, got {self.amax_history_len!r}"
      )
    if self.amax_history_len < 1:
      raise ValueError(
          f"{name}.amax_history_len must be >= 1, got {self.amax_history_len}"
      )
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(
          f"{name}.amax_compute_algo must be 'max' or 'most_recent', got "
          f"{self.amax_compute_algo!r} (callables are not supported)"
      )

  @property
  def stateful(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
  """Per-tensor FP8 scaling from the tensor's own amax (TE's ``Float8CurrentScaling``).

  ``scale = fp8_max / amax(|x|)``, or 1 when the amax is zero or not finite. No state.

  Args:
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
  """

  fp8_format: Format = Format.HYBRID

  def __post_init__(self):
    _check_format(type(self).__name__, self.fp8_format)


def check_recipe(recipe: object) -> Recipe:
  """Returns ``recipe`` if it is a supported recipe instance, else raises a TypeError."""
  if isinstance(recipe, type) and issubclass(recipe, Recipe):
    raise TypeError(
        f"recipe must be a recipe instance, got the class {recipe.__name__}; "
        f"write {recipe.__name__}()"
    )
  if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
    raise TypeError(
        "recipe must be te_adapters.DelayedScaling or te_adapters.Float8CurrentScaling, got "
        f"{type(recipe).__module__}.{type(recipe).__name__}"
    )
  return recipe
