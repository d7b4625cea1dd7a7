"""The rounding-key policy: a recipe that rounds stochastically draws one fresh key per GEMM call.

Where the key comes from is the framework's business (a Linen RNG stream, an NNX stream the
layer owns, ``hk.next_rng_key()``); this module decides when one is drawn and what a layer says
when there is none to draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SR_RNG", "missing_key_message", "rounding_key"]

# The RNG stream stochastic rounding draws its keys from (TE's name).
SR_RNG = "sr_rng"


def missing_key_message(recipe, how: str, where: str = "") -> str:
  """The error of a layer whose ``recipe`` rounds stochastically and finds no key.

  ``where`` (the layer, with its separator) comes first; ``how`` follows "stochastically" and
  tells how this framework provides keys, with its own separators before the common way out.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters._kit import missing_key_message
    >>> print(missing_key_message(ta.NVFP4BlockScaling(), " and needs a key, ", "f: "))
    ... # doctest: +NORMALIZE_WHITESPACE
    f: NVFP4BlockScaling rounds the gradient stochastically and needs a key,
    or use disable_stochastic_rounding=True
  """
  return (
    f"{where}{type(recipe).__name__} rounds the gradient stochastically{how}"
    "or use disable_stochastic_rounding=True"
  )


def rounding_key(recipe, draw: Callable[[], Any], how: str, where: str = ""):
  """A fresh key for one GEMM call when ``recipe`` rounds stochastically, else None.

  Args:
    recipe: the layer's recipe, or None.
    draw: the framework's draw: called once, only when the recipe uses a key; returns a key,
      or None when the framework has no source of keys here.
    how, where: the error's wording when ``draw`` finds none (``missing_key_message``).

  Returns:
    The key, or None when the recipe does not round stochastically (``draw`` is not called).

  Raises:
    ValueError: the recipe needs a key and ``draw`` returned None.

  Example:
    >>> import jax, te_adapters as ta
    >>> from te_adapters._kit import rounding_key
    >>> rounding_key(ta.DelayedScaling(), lambda: 1 / 0, "") is None  # never drawn
    True
    >>> key = rounding_key(ta.NVFP4BlockScaling(), lambda: jax.random.key(0), "")
  """
  if recipe is None or not recipe.uses_rng:
    return None
  key = draw()
  if key is None:
    raise ValueError(missing_key_message(recipe, how, where))
  return key
