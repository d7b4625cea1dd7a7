"""The collectives in compiled HLO text (for tests and benchmarks)."""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Collective", "hlo_collectives"]


class Collective(NamedTuple):
  """One collective in compiled HLO text.

  Attributes:
    op: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` or
      ``collective-permute`` (asynchronous ``-start`` forms are reported under these names).
    arrays: ``(dtype, shape)`` of each array in the op's result type; for a ``-start`` op the
      operand's arrays come first.
    line: the HLO instruction.
  """

  op: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]
  line: str


_COLLECTIVE_RE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)


_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def hlo_collectives(hlo_text: str) -> list[Collective]:
  """The collectives of compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

  Example:
    >>> import jax, te_adapters as ta
    >>> ta.core.hlo_collectives(jax.jit(lambda x: x + 1).lower(1.0).compile().as_text())
    []
  """
  found = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE_RE.search(line)
    if m is None:
      continue
    arrays = tuple(
        (dtype, tuple(int(n) for n in dims.split(",") if n))
        for dtype, dims in _ARRAY_RE.findall(m.group("type"))
    )
    found.append(Collective(m.group("op"), arrays, line.strip()))
  return found
