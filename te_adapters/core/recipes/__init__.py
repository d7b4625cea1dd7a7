"""What a user chooses: the quantization recipe, how the GEMMs run, the PRNG key rule; and the
user's line that the core's warnings point at."""

from te_adapters.core.recipes._caller import caller_site, caller_stacklevel
from te_adapters.core.recipes._config import GemmConfig, check_config
from te_adapters.core.recipes._recipes import (
  DelayedScaling,
  Float8BlockScaling,
  Float8CurrentScaling,
  Float8RowwiseScaling,
  Format,
  MMParams,
  MXFP8BlockScaling,
  NVFP4BlockScaling,
  Recipe,
  check_recipe,
)
from te_adapters.core.recipes._rng import check_rng

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
  "Recipe",
  "caller_site",
  "caller_stacklevel",
  "check_config",
  "check_recipe",
  "check_rng",
]
