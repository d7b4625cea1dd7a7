"""The recipe and norm arguments of a layer, checked once for every adapter."""

from __future__ import annotations

from te_adapters import core

__all__ = ["check_layernorm_type", "check_recipe_or_none"]


def check_recipe_or_none(recipe) -> core.Recipe | None:
  """``recipe`` if it is a recipe instance (``core.check_recipe``'s TypeError otherwise), or None
  for a layer kept in high precision.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters._kit import check_recipe_or_none
    >>> check_recipe_or_none(None) is None, check_recipe_or_none(ta.DelayedScaling()).margin
    (True, 0)
  """
  return None if recipe is None else core.check_recipe(recipe)


def check_layernorm_type(layernorm_type: str, layer: str) -> None:
  """Raises a ValueError naming ``layer`` unless ``layernorm_type`` is one of TE's norms.

  Example:
    >>> from te_adapters._kit import check_layernorm_type
    >>> check_layernorm_type("batchnorm", "LayerNorm")
    Traceback (most recent call last):
    ...
    ValueError: LayerNorm: layernorm_type must be one of ('layernorm', 'rmsnorm'), got 'batchnorm'
  """
  if layernorm_type not in core.LAYERNORM_TYPES:
    raise ValueError(
      f"{layer}: layernorm_type must be one of {core.LAYERNORM_TYPES}, got {layernorm_type!r}"
    )
