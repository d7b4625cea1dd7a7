"""Rows grouped contiguously: which group each row is in, and a layout aligning groups to blocks.

Everything is computed on the device from ``group_sizes`` with static shapes, so the group sizes
may come from a router under ``jit`` without a host transfer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
  "ROWS_TIMES_GROUP_KERNEL_DIMS",
  "PER_GROUP_WGRAD_DIMS",
  "row_groups",
  "GroupPadding",
  "group_padding",
  "padded_rows",
]

# Rows [M, C] times one kernel per group stored as [G, F, C], contracting C: the dgrad of a
# grouped GEMM (C = N), and its forward pass when the kernel copy has K last.
ROWS_TIMES_GROUP_KERNEL_DIMS = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (2,)), ((), ())),
  lhs_ragged_dimensions=(0,),
  rhs_group_dimensions=(0,),
)
# Rows [M, K] and [M, N] contracted over their rows group by group: one [K, N] weight gradient
# per group.
PER_GROUP_WGRAD_DIMS = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((0,), (0,)), ((), ())),
  lhs_ragged_dimensions=(0,),
  rhs_group_dimensions=(),
)


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """The group of each row, [num_rows] int32; ``G`` for rows past ``sum(group_sizes)``."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  # The number of groups that end at or before each row: an [M, G] compare, cheap for MoE G.
  return jnp.sum(rows[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


class GroupPadding(NamedTuple):
  """A layout in which every group starts on a block boundary and fills whole blocks.

  Group g occupies ``padded_sizes[g]`` (its size rounded up to a multiple of the block) padded
  rows, groups one after another from padded row 0; its rows come first, zero rows fill the
  rest of its last block, and padded rows past the groups are zero too. A block of the padded
  layout therefore never holds rows of two groups.

  Attributes:
    source: [P] int32, the row of the unpadded array that padded row p holds (0 where
      ``valid`` is false).
    valid: [P] bool, whether padded row p holds a row (else it is zero padding).
    padded_sizes: [G] int32, the group sizes rounded up to multiples of the block.
  """

  source: jax.Array
  valid: jax.Array
  padded_sizes: jax.Array


def group_padding(group_sizes: jax.Array, num_rows: int, block: int) -> GroupPadding:
  """The padded layout of ``num_rows`` rows in groups of ``group_sizes`` (sum <= num_rows).

  The layout has the static size ``P = block * ((num_rows + (block - 1) * G) // block)``: the
  padding adds at most ``block - 1`` rows per group, so every group fits whatever the sizes.
  """
  sizes = group_sizes.astype(jnp.int32)
  num_groups = sizes.shape[0]
  padded_sizes = (sizes + (block - 1)) // block * block
  num_padded = block * ((num_rows + (block - 1) * num_groups) // block)
  groups = row_groups(padded_sizes, num_padded)
  g = jnp.minimum(groups, num_groups - 1)
  offset = jnp.arange(num_padded, dtype=jnp.int32) - (jnp.cumsum(padded_sizes) - padded_sizes)[g]
  valid = (groups < num_groups) & (offset < sizes[g])
  source = jnp.where(valid, (jnp.cumsum(sizes) - sizes)[g] + offset, 0)
  return GroupPadding(source, valid, padded_sizes)


def padded_rows(x: jax.Array, padding: GroupPadding) -> jax.Array:
  """The rows of ``x`` [M, F] in the padded layout, [P, F], with zeros in the padding."""
  return jnp.where(padding.valid[:, None], x[padding.source], jnp.zeros((), x.dtype))
