"""Dimension-number bookkeeping for ``dot_general`` and its two transposes."""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["normalize", "transpose_lhs", "transpose_rhs"]


def normalize(dimension_numbers, lhs_shape, rhs_shape):
  """Checks ``dimension_numbers`` against the operand shapes; returns them as tuples of ints."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb))
  except (TypeError, ValueError) as e:
    raise TypeError(
      "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
      f"got {dimension_numbers!r}"
    ) from e
  for name, dims, shape in (("lhs", lc + lb, lhs_shape), ("rhs", rc + rb, rhs_shape)):
    bad = [d for d in dims if not 0 <= d < len(shape)]
    if bad:
      raise ValueError(f"{name} dimension(s) {bad} out of range for shape {tuple(shape)}")
    if len(set(dims)) != len(dims):
      raise ValueError(f"{name} dimensions repeated in dimension_numbers: {dims}")
  if len(lc) != len(rc):
    raise ValueError(f"lhs contracts {len(lc)} dims but rhs contracts {len(rc)}")
  if len(lb) != len(rb):
    raise ValueError(f"lhs has {len(lb)} batch dims but rhs has {len(rb)}")
  for kind, ld, rd in (("contracting", lc, rc), ("batch", lb, rb)):
    ls = tuple(lhs_shape[d] for d in ld)
    rs = tuple(rhs_shape[d] for d in rd)
    if ls != rs:
      raise ValueError(
        f"{kind} dimension sizes differ: lhs {ls} (dims {ld}) vs rhs {rs} (dims {rd})"
      )
  return (lc, rc), (lb, rb)


def _remaining(ndim, *removed):
  gone = set(itertools.chain(*removed))
  return [d for d in range(ndim) if d not in gone]


def _consecutive_ranges(*groups):
  start = 0
  for group in groups:
    yield list(range(start, start + len(group)))
    start += len(group)


def _transpose_lhs(dimension_numbers, lhs_ndim, rhs_ndim, swap_ans=False):
  (lc, rc), (lb, rb) = dimension_numbers
  lhs_free = _remaining(lhs_ndim, lc, lb)
  rhs_free = _remaining(rhs_ndim, rc, rb)
  # Output of the forward op: batch dims, then lhs free dims, then rhs free dims.
  if swap_ans:
    out_batch, out_rhs_free, _ = _consecutive_ranges(lb, rhs_free, lhs_free)
  else:
    out_batch, _, out_rhs_free = _consecutive_ranges(lb, lhs_free, rhs_free)
  dims = ((tuple(out_rhs_free), tuple(rhs_free)), (tuple(out_batch), tuple(rb)))
  # The product comes out as (batch, lhs free, lhs contracting in rhs order); put dims back.
  lc_in_rhs_order = [lc[i] for i in np.argsort(rc)]
  perm = tuple(int(i) for i in np.argsort(list(lb) + lhs_free + lc_in_rhs_order))
  return dims, perm


def transpose_lhs(dimension_numbers, lhs_ndim, rhs_ndim):
  """``(dims, perm)`` so that ``transpose(dot_general(g, rhs, dims), perm)`` is d(lhs)."""
  return _transpose_lhs(dimension_numbers, lhs_ndim, rhs_ndim)


def transpose_rhs(dimension_numbers, lhs_ndim, rhs_ndim):
  """``(dims, perm)`` so that ``transpose(dot_general(g, lhs, dims), perm)`` is d(rhs)."""
  (lc, rc), (lb, rb) = dimension_numbers
  swapped = ((rc, lc), (rb, lb))
  return _transpose_lhs(swapped, rhs_ndim, lhs_ndim, swap_ans=True)
