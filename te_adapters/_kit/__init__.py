"""The adapters' kit: what Linen, NNX and Haiku layers share, with no framework in it.

An adapter's layer creates its parameters and recipe state the framework's way and asks the kit
for the rest: the options it forwards to the core's GEMM (``GemmOptions``), when a GEMM draws a
stochastic-rounding key (``rounding_key``), one GEMM's recipe state by TE's names
(``recipe_state``), the forward of TE's ``LayerNormDenseGeneral`` once its parameters exist
(``layernorm_dense_general``), TE's LoRA term (``add_lora``), and the rules on sizes, dtypes and
arguments every quantized layer applies. Also the plumbing behind the adapters: the scope of a
``quantize`` conversion (``InterceptScope``), the guard on recipe state shared by a scan's
iterations (``refuse_state_grad``) and the check that an adapter's framework is installed
(``require``), and the framework-free half of every conversion: its rules (``Rule``), what
each layer gets, its report and its warnings (``Conversion``).

The kit imports no framework and nothing of the core but ``te_adapters.core``'s public names;
the numerics stay in the core.
"""

from te_adapters._kit._lora import add_lora
from te_adapters._kit._norm_dense import layernorm_dense_general
from te_adapters._kit._options import GemmOptionAttributes, GemmOptions, check_needs_recipe
from te_adapters._kit._recipe import check_layernorm_type, check_recipe_or_none
from te_adapters._kit._requires import require
from te_adapters._kit._rng import SR_RNG, missing_key_message, rounding_key
from te_adapters._kit._rules import (
  UNSET,
  Conversion,
  Rule,
  SkippedLayersWarning,
  Unset,
  attend_reason,
  own_slot_reason,
)
from te_adapters._kit._scan_guard import is_marked, refuse_state_grad
from te_adapters._kit._scope import InterceptScope
from te_adapters._kit._signature import signature_with_keywords
from te_adapters._kit._state import initial_state, recipe_state

# The rules every adapter applies, which the core defines and exports today.
from te_adapters.core import (
  DEFAULT_RECIPE,
  DEFAULT_THRESHOLD,
  QuantizeReport,
  check_gemm_dims,
  check_input_dtype,
  check_kernel_gemm_dims,
  check_last_axis,
  einsum_gemm_dims,
  gemm_dims_refusal,
  input_dtype_refusal,
)

__all__ = [
  "DEFAULT_RECIPE",
  "DEFAULT_THRESHOLD",
  "GemmOptionAttributes",
  "GemmOptions",
  "Conversion",
  "InterceptScope",
  "QuantizeReport",
  "Rule",
  "SR_RNG",
  "SkippedLayersWarning",
  "UNSET",
  "Unset",
  "add_lora",
  "attend_reason",
  "check_gemm_dims",
  "check_input_dtype",
  "check_kernel_gemm_dims",
  "check_last_axis",
  "check_layernorm_type",
  "check_needs_recipe",
  "check_recipe_or_none",
  "einsum_gemm_dims",
  "gemm_dims_refusal",
  "initial_state",
  "input_dtype_refusal",
  "is_marked",
  "layernorm_dense_general",
  "missing_key_message",
  "own_slot_reason",
  "recipe_state",
  "refuse_state_grad",
  "require",
  "rounding_key",
  "signature_with_keywords",
]
