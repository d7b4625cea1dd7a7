"""Sums over devices as pairwise exchanges (``GemmConfig.device_sums="exchange"``).

A GEMM whose contracting dim is split over mesh axes leaves each device a partial product that
is summed over those axes. XLA's all-reduce and reduce-scatter run as NCCL kernels, which need
SMs: beside cuBLASLt's persistent FP8 GEMMs, which hold every SM, they mostly wait. Written as
exchanges (``lax.ppermute``) the same sums move by collective permutes, which XLA runs as
device-to-device copies over the copy engines (no SMs) when it is compiled with
``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY`` (GPUs of one process with peer
access); otherwise as NCCL's send and receive.

Over ``n = 2**p`` devices:

- ``exchange_sum`` (all-reduce) is recursive doubling: ``p`` steps, in each every device swaps its
  running sum with the device whose index differs in one bit and adds. Each step moves the whole
  tensor (a ring all-reduce moves ``2 (n - 1) / n`` of it in all: the same at n = 2, 3/4 of
  this at n = 4). Floating-point addition commutes, so every device ends with the same bits.
- ``exchange_sum_scatter`` (reduce-scatter, tiled like ``lax.psum_scatter``) is recursive
  halving: ``p`` steps, in each every device sends the half it will not keep to its partner
  and adds the half it receives (``(n - 1) / n`` of the tensor in all, as a ring's).
- ``exchange_gather`` (all-gather, tiled) is recursive doubling without the add: what a device
  holds doubles in each step (a ring's bytes).

A device count that is not a power of two has no such pairing: these functions refuse it, and
their callers in the GEMM sum over XLA's collectives (``psum`` / ``psum_scatter``) instead, said
by a ``ShardingFallbackWarning``.
"""

from __future__ import annotations

import math

from jax import lax


def is_power_of_two(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def _pairs(n: int, bit: int) -> list[tuple[int, int]]:
  return [(i, i ^ bit) for i in range(n)]


def exchange_sum(y, axes: tuple[str, ...], n: int):
  """``lax.psum(y, axes)`` over ``n`` (a power of two) devices by recursive doubling."""
  if not is_power_of_two(n):
    raise ValueError(f"exchange_sum needs a power-of-two device count, got {n}")
  bit = 1
  while bit < n:
    y = y + lax.ppermute(y, axes, _pairs(n, bit))
    bit <<= 1
  return y


def exchange_sum_scatter(y, axes: tuple[str, ...], n: int, dim: int):
  """``lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)`` over ``n`` (a power of
  two) devices by recursive halving: device i keeps the i-th of n equal slices of ``dim``."""
  if not is_power_of_two(n):
    raise ValueError(f"exchange_sum_scatter needs a power-of-two device count, got {n}")
  if y.shape[dim] % n:
    raise ValueError(f"dim {dim} of {y.shape} does not split into {n} equal slices")
  index = lax.axis_index(axes)
  bit = n >> 1
  while bit:
    half = y.shape[dim] // 2
    # The device whose index has this bit set keeps the high half (the slices' order is the
    # devices' order, most significant bit first), and sends the low half to its partner.
    kept = ((index & bit) != 0).astype(index.dtype) * half
    keep = lax.dynamic_slice_in_dim(y, kept, half, axis=dim)
    send = lax.dynamic_slice_in_dim(y, half - kept, half, axis=dim)
    y = keep + lax.ppermute(send, axes, _pairs(n, bit))
    bit >>= 1
  return y


def exchange_gather(x, axes: tuple[str, ...], n: int, dim: int):
  """``lax.all_gather(x, axes, axis=dim, tiled=True)`` over ``n`` (a power of two) devices by
  recursive doubling: in each step every device swaps what it holds with its partner and joins
  the two in the devices' order. The result is typed as varying over ``axes`` (inside
  ``shard_map``), where the all-gather's may be invariant."""
  if not is_power_of_two(n):
    raise ValueError(f"exchange_gather needs a power-of-two device count, got {n}")
  index = lax.axis_index(axes)
  bit = 1
  while bit < n:
    other = lax.ppermute(x, axes, _pairs(n, bit))
    upper = (index & bit) != 0
    first, second = lax.select(upper, other, x), lax.select(upper, x, other)
    x = lax.concatenate([first, second], dim)
    bit <<= 1
  return x


def device_count(mesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)
