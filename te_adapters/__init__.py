"""te_adapters: TransformerEngine-grade quantized GEMMs for every JAX framework.

``te_adapters.core`` is pure JAX; ``te_adapters.linen``, ``te_adapters.nnx`` and
``te_adapters.haiku`` adapt it to Flax Linen, Flax NNX and Haiku (import them explicitly).
"""

from te_adapters import core, inspect
from te_adapters._build_info import BuildInfo, build_info
from te_adapters._kit import QuantizeReport, Rule, SkippedLayersWarning
from te_adapters._version import __version__ as __version__
from te_adapters.core import (
  DelayedScaling,
  Float8BlockScaling,
  Float8CurrentScaling,
  Float8RowwiseScaling,
  Format,
  GemmConfig,
  MMParams,
  MXFP8BlockScaling,
  NVFP4BlockScaling,
  Recipe,
  dequantize,
  dot_general,
  init_state,
  quantize,
)

__all__ = [
  "BuildInfo",
  "DelayedScaling",
  "Float8BlockScaling",
  "Float8CurrentScaling",
  "Float8RowwiseScaling",
  "Format",
  "GemmConfig",
  "MMParams",
  "MXFP8BlockScaling",
  "NVFP4BlockScaling",
  "QuantizeReport",
  "Recipe",
  "Rule",
  "SkippedLayersWarning",
  "build_info",
  "core",
  "dequantize",
  "dot_general",
  "init_state",
  "inspect",
  "quantize",
]
