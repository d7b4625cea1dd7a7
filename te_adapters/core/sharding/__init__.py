"""The GEMMs on JAX's SPMD engine: mesh context, SPMD plans, global amaxes, FSDP gathers."""

from te_adapters.core.sharding._amax_reduction import (
    check_amax_axes,
    check_block_scaled,
    global_amax,
    shard_key,
)
from te_adapters.core.sharding._cotangents import (
    match_cotangent,
    transposed_out_sharding,
    type_witness,
    wgrad_dtype,
)
from te_adapters.core.sharding._explicit_sharding import (
    explicit_sharding,
    match_sharding,
    reshape,
    reshape_spec,
    reshaped_sharding,
)
from te_adapters.core.sharding._fsdp_gather import (
    gather_kernel,
    gathered_kernel_type,
    scatter_kernel_grad,
)
from te_adapters.core.sharding._mesh import (
    abstract_mesh,
    axis_tuple,
    check_axis_names,
    checks_vma,
    in_mesh_order,
    manual_axes,
    spec_entry,
    varying_axes,
)
from te_adapters.core.sharding._spmd_plan import ROLES, SpmdPlan, make_plan, plan_for_tn_layout

__all__ = [
    "ROLES",
    "SpmdPlan",
    "abstract_mesh",
    "axis_tuple",
    "check_amax_axes",
    "check_axis_names",
    "check_block_scaled",
    "checks_vma",
    "explicit_sharding",
    "gather_kernel",
    "gathered_kernel_type",
    "global_amax",
    "in_mesh_order",
    "make_plan",
    "manual_axes",
    "match_cotangent",
    "match_sharding",
    "plan_for_tn_layout",
    "reshape",
    "reshape_spec",
    "reshaped_sharding",
    "scatter_kernel_grad",
    "shard_key",
    "spec_entry",
    "transposed_out_sharding",
    "type_witness",
    "varying_axes",
    "wgrad_dtype",
]
