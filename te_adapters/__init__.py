"""te_adapters: TransformerEngine-grade quantized GEMMs for every JAX framework.

``te_adapters.core`` is pure JAX; ``te_adapters.linen``, ``te_adapters.nnx`` and
``te_adapters.haiku`` adapt it to Flax Linen, Flax NNX and Haiku (import them explicitly).
"""

from te_adapters import core, inspect
from te_adapters._kit import QuantizeReport, Rule, SkippedLayersWarning
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

__version__ = "0.1.0"

__all__ = [
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
    "core",
    "dequantize",
    "dot_general",
    "init_state",
    "inspect",
    "quantize",
]
