"""The quantized GEMM on JAX's SPMD engine: global amaxes, sharded transposes, FSDP FP8 gathers.

Per-tensor scaling needs the amax of the *global* tensor, so that every device uses one scale and
the sharded result equals the single-device one.

- Under ``jax.jit`` with sharded inputs (``NamedSharding``, Auto or Explicit mesh axes), JAX sees
  global arrays: ``max(|x|)`` is already global, and XLA inserts the all-reduce. Nothing to do,
  except giving the backward GEMMs the primal operands' shardings, as JAX's own ``dot_general``
  transpose does (Explicit axes require it).
- Inside ``shard_map`` every device sees its shard. The amax of each operand is max-reduced over
  the manual mesh axes it varies over (or over the axes the caller names), and the custom VJP
  reduces cotangents the way JAX's implicit ``pvary`` transposes would.

``kernel_all_gather`` (FSDP) quantizes the kernel shard by shard and all-gathers the FP8 bytes:
half of bf16's traffic. The FP8 data travel as ``uint8`` so no backend can widen them before the
collective (XLA's CPU backend turns FP8 GEMM operands into float16 early). The gathered FP8
kernel is kept for the backward pass (under a remat policy that saves only the named FP8 shard,
it is gathered again there instead), and the kernel gradient is reduce-scattered onto the shard.

All mesh information comes from the arguments and from JAX's own mesh context
(``jax.set_mesh``, ``shard_map``); no module keeps state.

One module per concern; this face gathers their names:

- ``_spmd_plan``: the checked plan of one GEMM (``SpmdPlan``, ``make_plan``).
- ``_mesh``: the mesh context (manual and varying axes, axis names in mesh order).
- ``_amax_reduction``: global amaxes inside ``shard_map`` and the checks of ``amax_axes``.
- ``_explicit_sharding``: reshapes that carry Explicit shardings.
- ``_cotangents``: cotangents with their primals' types (the backward passes' sums).
- ``_fsdp_gather``: ``kernel_all_gather``, the FP8 gather and the gradient's reduce-scatter.
- ``_exchange``: sums over devices as pairwise exchanges (``GemmConfig.device_sums``).
"""

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
from te_adapters.core.sharding._exchange import (
  device_count,
  exchange_gather,
  exchange_sum,
  exchange_sum_scatter,
  is_power_of_two,
)
from te_adapters.core.sharding._explicit_sharding import (
  explicit_out_sharding,
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
  whole_where_gathered,
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
  "device_count",
  "exchange_gather",
  "exchange_sum",
  "exchange_sum_scatter",
  "explicit_out_sharding",
  "explicit_sharding",
  "gather_kernel",
  "gathered_kernel_type",
  "global_amax",
  "in_mesh_order",
  "is_power_of_two",
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
  "whole_where_gathered",
]
