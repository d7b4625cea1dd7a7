"""The layout arithmetic of one ``dot_general``: its M, K, N and the contracting-last views.

Every quantized GEMM multiplies ``x3 (.., M, K)`` by ``w3 (.., N, K)``: batch dims first, then
the free dims, then the contracting dims, each group flattened (the leading batch axis only when
there are batch dims). ``GemmLayout`` computes these views once for a set of dimension numbers.

A flattened group keeps whole shards only when its first (most major) dim is the one sharded. So
the dims within a group are ordered with a sharded dim first (the free dims of each operand, the
contracting pairs and the batch pairs, stable otherwise): the GEMM's result is the same, and the
output's split and transpose put its dims back where ``lax.dot_general`` has them. A group with
more than one sharded dim keeps the first; ``GemmLayout.unserved`` lists the others.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["GemmLayout", "sorted_contracting"]


def sorted_contracting(dn):
  """``dn`` with its contracting pairs in the lhs's dimension order (``jnp.einsum`` may give them
  in another): merging (N, H) with N sharded keeps whole shards, merging (H, N) would split
  them."""
  (lc, rc), batch_dims = dn
  pairs = sorted(zip(lc, rc, strict=True))
  return (tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)), batch_dims


class GemmLayout:
  """The contracting-last views of ``lhs`` and ``rhs`` for normalized dimension numbers ``dn``.

  Attributes:
    lhs_free, rhs_free: the operands' free dims.
    lhs_perm, rhs_perm: the transposes to (batch, free, contracting).
    b, m, k, n: the batch size and the GEMM's M, K and N.
    lead: ``(b,)`` when there are batch dims, else ``()``.
    x3_shape, w3_shape, out3_shape: ``lead + (m, k)``, ``lead + (n, k)``, ``lead + (m, n)``.
    out_shape: ``lax.dot_general``'s output shape.
    rhs_stored_kn: whether ``rhs`` is stored batch, contracting, then free dims (a Dense
      layer's kernel), so that ``lead + (k, n)`` is a reshape of it with no transpose.
    dn: the dimension numbers in the GEMM's order (pairs sharded first).
    out_order: per dim of the GEMM's output split back into dims (batch, lhs free, rhs free, in
      the GEMM's order), its dim in ``out_shape``; ``out_perm`` the transpose that puts them
      there (None: the identity), ``split_out_shape`` the split shape.
    unserved: ``(lhs dims, rhs dims, out dims)`` sharded beside the first sharded dim of their
      group, which the flattened group cannot keep (empty without ``sharded``).

  ``sharded``, when given, is ``(lhs dims, rhs dims, out dims)``: the dims of each operand and of
  ``lax.dot_general``'s output that are sharded (or gathered, FSDP).
  """

  def __init__(self, dn, lhs_shape, rhs_shape, sharded=((), (), ())):
    (lc, rc), (lb, rb) = dn
    self.lhs_shape, self.rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    lhs_free = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    # lax.dot_general's output dims: batch pairs, lhs free, rhs free, each in the caller's order.
    out_of = {("b", i): i for i in range(len(lb))}
    out_of.update({("l", d): len(lb) + i for i, d in enumerate(lhs_free)})
    out_of.update({("r", d): len(lb) + len(lhs_free) + i for i, d in enumerate(rhs_free)})
    s_lhs, s_rhs, s_out = (set(dims) for dims in sharded)
    unserved: tuple[list[int], list[int], list[int]] = ([], [], [])

    def order(members, is_sharded, unserve):
      """``members`` with a sharded one first (stable); the other sharded ones unserved."""
      hit = [m for m in members if is_sharded(m)]
      for m in hit[1:]:
        unserve(m)
      return hit[:1] + [m for m in members if m not in hit[:1]]

    def unserve_pair(lhs_dim, rhs_dim, out_dim=None):
      if lhs_dim in s_lhs:
        unserved[0].append(lhs_dim)
      if rhs_dim in s_rhs:
        unserved[1].append(rhs_dim)
      if out_dim is not None and out_dim in s_out:
        unserved[2].append(out_dim)

    batch = order(
      list(range(len(lb))),
      lambda i: lb[i] in s_lhs or rb[i] in s_rhs or i in s_out,
      lambda i: unserve_pair(lb[i], rb[i], i),
    )
    contracting = order(
      sorted(range(len(lc)), key=lambda i: lc[i]),
      lambda i: lc[i] in s_lhs or rc[i] in s_rhs,
      lambda i: unserve_pair(lc[i], rc[i]),
    )

    def free(side, dims, own, which):
      def unserve(d):
        if d in own:
          unserved[which].append(d)
        if out_of[(side, d)] in s_out:
          unserved[2].append(out_of[(side, d)])

      return order(dims, lambda d: d in own or out_of[(side, d)] in s_out, unserve)

    self.lhs_free = free("l", lhs_free, s_lhs, 0)
    self.rhs_free = free("r", rhs_free, s_rhs, 1)
    lb, rb = tuple(lb[i] for i in batch), tuple(rb[i] for i in batch)
    lc, rc = tuple(lc[i] for i in contracting), tuple(rc[i] for i in contracting)
    self.dn = ((lc, rc), (lb, rb))
    self.unserved = tuple(tuple(sorted(set(u))) for u in unserved)
    self.out_order = tuple(
      [batch[i] for i in range(len(batch))]
      + [out_of[("l", d)] for d in self.lhs_free]
      + [out_of[("r", d)] for d in self.rhs_free]
    )
    identity = tuple(range(len(self.out_order)))
    self.out_perm = (
      None if self.out_order == identity else tuple(int(i) for i in np.argsort(self.out_order))
    )
    self.lhs_perm = (*lb, *self.lhs_free, *lc)
    self.rhs_perm = (*rb, *self.rhs_free, *rc)
    size = lambda shape, dims: math.prod(shape[d] for d in dims)  # noqa: E731
    self.b = size(lhs_shape, lb)
    self.m = size(lhs_shape, self.lhs_free)
    self.k = size(lhs_shape, lc)
    self.n = size(rhs_shape, self.rhs_free)
    self.lead = (self.b,) if lb else ()
    self.x3_shape = self.lead + (self.m, self.k)
    self.w3_shape = self.lead + (self.n, self.k)
    self.out3_shape = self.lead + (self.m, self.n)
    batch_shape = tuple(lhs_shape[d] for d in lb)
    self.split_out_shape = (
      batch_shape
      + tuple(lhs_shape[d] for d in self.lhs_free)
      + tuple(rhs_shape[d] for d in self.rhs_free)
    )
    self.out_shape = tuple(
      self.split_out_shape[self.out_order.index(i)] for i in range(len(self.out_order))
    )
    self.rhs_stored_kn = (*rb, *rc, *self.rhs_free) == tuple(range(len(rhs_shape)))

  def in_gemm_order(self, entries):
    """Per-dim ``entries`` of ``out_shape`` (a spec's) in the order of ``split_out_shape``."""
    entries = tuple(entries) + (None,) * (len(self.out_order) - len(tuple(entries)))
    return tuple(entries[i] for i in self.out_order)

  def kernel_shape(self, rhs_shape) -> tuple[int, int]:
    """``(N, K)`` of a kernel of ``rhs_shape`` (a shard's, inside ``shard_map`` with FSDP)."""
    (_, rc), _ = self.dn
    return (math.prod(rhs_shape[d] for d in self.rhs_free), math.prod(rhs_shape[d] for d in rc))
