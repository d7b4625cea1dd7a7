"""The layout arithmetic of one ``dot_general``: its M, K, N and the contracting-last views.

Every quantized GEMM multiplies ``x3 (.., M, K)`` by ``w3 (.., N, K)``: batch dims first, then
the free dims, then the contracting dims, each group flattened (the leading batch axis only when
there are batch dims). ``GemmLayout`` computes these views once for a set of dimension numbers.
"""

from __future__ import annotations

import math

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
  """

  def __init__(self, dn, lhs_shape, rhs_shape):
    (lc, rc), (lb, rb) = dn
    self.dn = dn
    self.lhs_shape, self.rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    self.lhs_free = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    self.rhs_free = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
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
    self.out_shape = (
        batch_shape
        + tuple(lhs_shape[d] for d in self.lhs_free)
        + tuple(rhs_shape[d] for d in self.rhs_free)
    )
    self.rhs_stored_kn = (*rb, *rc, *self.rhs_free) == tuple(range(len(rhs_shape)))

  def kernel_shape(self, rhs_shape) -> tuple[int, int]:
    """``(N, K)`` of a kernel of ``rhs_shape`` (a shard's, inside ``shard_map`` with FSDP)."""
    (_, rc), _ = self.dn
    return (math.prod(rhs_shape[d] for d in self.rhs_free), math.prod(rhs_shape[d] for d in rc))
