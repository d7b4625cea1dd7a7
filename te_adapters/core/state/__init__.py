"""Recipe state as explicit pytrees: its type, checks and updates, max-combined gradients."""

from te_adapters.core.state._accumulate import (
  MAX_F32,
  SCALE_F32,
  cast_like,
  encode_scale,
  is_accumulating,
  to_accumulating,
  to_accumulating_shared,
  to_float32,
)
from te_adapters.core.state._batching import combine_over_batch
from te_adapters.core.state._recipe_state import (
  ROLES,
  DelayedScalingState,
  EmptyState,
  RoleState,
  is_state_mapping,
  leaf_kind,
)
from te_adapters.core.state._state import (
  State,
  check_leaves,
  shared_max_grad,
  updated_state,
  warn_dict_state,
  with_max_grad,
)

__all__ = [
  "DelayedScalingState",
  "EmptyState",
  "MAX_F32",
  "ROLES",
  "RoleState",
  "SCALE_F32",
  "State",
  "cast_like",
  "check_leaves",
  "combine_over_batch",
  "encode_scale",
  "is_accumulating",
  "is_state_mapping",
  "leaf_kind",
  "shared_max_grad",
  "to_accumulating",
  "to_accumulating_shared",
  "to_float32",
  "updated_state",
  "warn_dict_state",
  "with_max_grad",
]
