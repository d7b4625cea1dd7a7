"""The one map from a recipe to its ``QuantizationFormat``: an unknown recipe is an error.

The package registers delayed and current scaling (per-tensor), MXFP8, NVFP4 and FP8
1x128/128x128 blocks. ``register`` adds a format for a new recipe class (``Recipe`` subclass),
after which ``dot_general``, ``layernorm_dense``, ``layernorm_mlp`` and ``ragged_dot`` take that
recipe like any other, as far as the format serves them.
"""

from __future__ import annotations

from te_adapters.core import _block_scaled, _float8_block, _mxfp8, _nvfp4, _tensor_format
from te_adapters.core._format import QuantizationFormat
from te_adapters.core._recipes import DelayedScaling, Float8CurrentScaling, Recipe
from te_adapters.core._tensor_scaling import CURRENT, DELAYED

__all__ = ["format_of", "formats", "register", "unregister"]

_FORMATS: list[QuantizationFormat] = [
    _tensor_format.tensor_format(DelayedScaling, DELAYED),
    _tensor_format.tensor_format(Float8CurrentScaling, CURRENT),
    _block_scaled.block_format(_mxfp8.FORMAT),
    _block_scaled.block_format(_nvfp4.FORMAT),
    _block_scaled.block_format(_float8_block.FORMAT),
]


def formats() -> tuple[QuantizationFormat, ...]:
  """The registered formats, the package's first."""
  return tuple(_FORMATS)


def format_of(recipe) -> QuantizationFormat:
  """The ``QuantizationFormat`` of ``recipe`` (an instance of a registered recipe class).

  Raises:
    TypeError: for an object no registered format takes.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters.core import _registry
    >>> _registry.format_of(ta.DelayedScaling()).per_tensor
    True
  """
  for fmt in _FORMATS:
    if type(recipe) is fmt.recipe_type:
      return fmt
  for fmt in _FORMATS:
    if isinstance(recipe, fmt.recipe_type):
      return fmt
  names = ", ".join(f.recipe_type.__name__ for f in _FORMATS)
  raise TypeError(
      f"no quantization format is registered for {type(recipe).__module__}."
      f"{type(recipe).__name__}; registered recipes: {names} "
      "(te_adapters.core.register_format adds one)"
  )


def register(fmt: QuantizationFormat) -> None:
  """Registers ``fmt`` for its ``recipe_type`` (a ``Recipe`` subclass not registered yet)."""
  if not isinstance(fmt, QuantizationFormat):
    raise TypeError(f"register takes a QuantizationFormat, got {type(fmt).__name__}")
  if not (isinstance(fmt.recipe_type, type) and issubclass(fmt.recipe_type, Recipe)):
    raise TypeError(f"Format.recipe_type must be a Recipe subclass, got {fmt.recipe_type!r}")
  if any(f.recipe_type is fmt.recipe_type for f in _FORMATS):
    raise ValueError(f"a format for {fmt.recipe_type.__name__} is already registered")
  _FORMATS.append(fmt)
  if fmt.block is not None:
    _block_scaled.register_block(fmt.block)


def unregister(recipe_type: type) -> None:
  """Removes the format registered for ``recipe_type`` (not one of the package's own)."""
  for fmt in _FORMATS[5:]:
    if fmt.recipe_type is recipe_type:
      _FORMATS.remove(fmt)
      if fmt.block is not None:
        _block_scaled.unregister_block(fmt.block)
      return
  raise ValueError(f"no format registered by register() for {recipe_type!r}")
