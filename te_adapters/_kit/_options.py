"""The options every quantized layer takes for its GEMM and hands to the core unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

from te_adapters import core

__all__ = ["GemmOptions", "GemmOptionAttributes", "check_needs_recipe"]


@dataclasses.dataclass(frozen=True)
class GemmOptions:
  """``threshold``, ``amax_axes``, ``kernel_all_gather`` and ``config`` of one layer's GEMMs.

  Every adapter's quantized layer takes these four keywords and passes them, as they are, to
  ``core.dot_general`` (the fused ``core.layernorm_dense`` and ``core.layernorm_mlp`` take
  ``threshold``, ``kernel_all_gather`` and ``config``). Construction checks them with the
  core's rules: ``threshold`` is a ``core.SizeThreshold`` or ``None``, ``config`` a
  ``core.GemmConfig`` or ``None`` (kept as the default ``GemmConfig()``).

  Attributes:
    threshold: GEMMs below this ``core.SizeThreshold`` stay in high precision; ``None``
      quantizes every GEMM.
    amax_axes: inside ``shard_map``, the mesh axes each amax is max-reduced over.
    kernel_all_gather: FSDP: the kernel's sharding, gathered as FP8.
    config: which kernels cast and multiply.

  Example:
    >>> from te_adapters import core
    >>> from te_adapters._kit import GemmOptions
    >>> options = GemmOptions(threshold=None)
    >>> sorted(options.keywords())
    ['amax_axes', 'config', 'kernel_all_gather', 'threshold']
    >>> options.keywords(spmd=False) == {"threshold": None, "config": core.GemmConfig()}
    True
    >>> sorted(options.fused_keywords())
    ['config', 'kernel_all_gather', 'threshold']
  """

  threshold: core.SizeThreshold | None = core.DEFAULT_THRESHOLD
  amax_axes: Any = None
  kernel_all_gather: Any = None
  config: core.GemmConfig | None = None

  def __post_init__(self):
    object.__setattr__(self, "threshold", core.check_threshold(self.threshold))
    object.__setattr__(self, "config", core.check_config(self.config))

  def keywords(self, *, spmd: bool = True) -> dict[str, Any]:
    """The options as keyword arguments: all four for ``core.dot_general``; with
    ``spmd=False``, ``threshold`` and ``config`` only, for a function that takes no SPMD
    options (a ValueError if any is set)."""
    if spmd:
      return {
        "threshold": self.threshold,
        "amax_axes": self.amax_axes,
        "kernel_all_gather": self.kernel_all_gather,
        "config": self.config,
      }
    if self.amax_axes is not None or self.kernel_all_gather is not None:
      raise ValueError(
        "amax_axes and kernel_all_gather go to core.dot_general only; this function takes "
        "threshold and config"
      )
    return {"threshold": self.threshold, "config": self.config}

  def fused_keywords(self) -> dict[str, Any]:
    """The options as keyword arguments for the fused ``core.layernorm_dense`` and
    ``core.layernorm_mlp``: ``threshold``, ``kernel_all_gather`` and ``config`` (a ValueError
    if ``amax_axes`` is set: inside ``shard_map`` the fused paths reduce each amax over the
    manual axes its operand varies over, ``dot_general``'s default)."""
    if self.amax_axes is not None:
      raise ValueError(
        "amax_axes goes to core.dot_general only; the fused core functions take threshold, "
        "kernel_all_gather and config"
      )
    return {
      "threshold": self.threshold,
      "kernel_all_gather": self.kernel_all_gather,
      "config": self.config,
    }


class GemmOptionAttributes:
  """A layer that keeps its ``GemmOptions`` in ``self.options`` and shows each option as a
  read-only attribute (``layer.threshold``, ...), as a layer with four attributes would.

  Example:
    >>> from te_adapters._kit import GemmOptions, GemmOptionAttributes
    >>> class Layer(GemmOptionAttributes):
    ...   def __init__(self, threshold):
    ...     self.options = GemmOptions(threshold)
    >>> Layer(None).threshold is None
    True
  """

  threshold = property(lambda self: self.options.threshold, doc="``GemmOptions.threshold``")
  amax_axes = property(lambda self: self.options.amax_axes, doc="``GemmOptions.amax_axes``")
  kernel_all_gather = property(
    lambda self: self.options.kernel_all_gather, doc="``GemmOptions.kernel_all_gather``"
  )
  config = property(lambda self: self.options.config, doc="``GemmOptions.config``")


def check_needs_recipe(recipe, layer: str, *, amax_axes=None, kernel_all_gather=None) -> None:
  """Raises a ValueError naming ``layer`` when SPMD options are given without a recipe: they
  describe how a quantized GEMM reduces its amaxes and gathers its FP8 kernel.

  Example:
    >>> from te_adapters._kit import check_needs_recipe
    >>> check_needs_recipe(None, "Dense", amax_axes="dp")
    Traceback (most recent call last):
    ...
    ValueError: Dense: amax_axes and kernel_all_gather need a recipe
  """
  if recipe is None and (amax_axes is not None or kernel_all_gather is not None):
    raise ValueError(f"{layer}: amax_axes and kernel_all_gather need a recipe")
