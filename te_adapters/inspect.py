"""What a compiled program really runs: FP8 GEMMs in the jaxpr and in compiled HLO, and its
collectives (for tests, benchmarks and users checking their own models)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jax_core

from te_adapters.core import kernels

__all__ = [
  "Collective",
  "count_fp8_cublas_gemms",
  "count_fp8_dot_generals",
  "count_fp8_gemms",
  "dot_general_operand_dtypes",
  "equations",
  "hlo_collectives",
  "hlo_dot_operand_types",
]


_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax_core.Jaxpr):
        yield item


def _walk(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _sub_jaxprs(eqn):
      yield from _walk(sub)


def equations(jaxpr) -> Iterator:
  """Every equation of a jaxpr, those of its sub-jaxprs included (``jit``, ``scan``, ``cond``
  branches, custom VJPs), depth first in the jaxpr's order: what the counts of this module
  walk.

  Args:
    jaxpr: a ``ClosedJaxpr`` (what ``jax.make_jaxpr`` returns) or a ``Jaxpr``.

  Returns:
    An iterator over the equations (``eqn.primitive.name``, ``eqn.params``, ``eqn.invars``,
    ``eqn.outvars``).

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
    >>> names = [e.primitive.name for e in ta.inspect.equations(closed)]
    >>> names.index("sin") < names.index("mul")
    True
  """
  return _walk(jaxpr.jaxpr if isinstance(jaxpr, jax_core.ClosedJaxpr) else jaxpr)


# The extension's cuBLASLt FP8 GEMM (per-tensor and block-scaled), called through the FFI.
_FFI_GEMM_TARGET = kernels.GEMM_TARGET


def _is_gemm(eqn) -> bool:
  if eqn.primitive.name == "dot_general":
    return True
  return eqn.primitive.name == "ffi_call" and eqn.params.get("target_name") == _FFI_GEMM_TARGET


def dot_general_operand_dtypes(fn: Callable, *args, **kwargs) -> list[tuple[str, str]]:
  """The operand dtypes of every GEMM in ``fn``'s jaxpr (sub-jaxprs included): each
  ``dot_general``, and each call of the extension's cuBLASLt FP8 GEMM (used on Hopper GPUs).

  Args:
    fn: the function to trace.
    *args: its arguments (arrays, or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Returns:
    A list of ``(lhs dtype, rhs dtype)`` names, one per GEMM, in the jaxpr's order.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> f = lambda x, w: ta.dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                                 recipe=ta.Float8CurrentScaling(), threshold=None)
    >>> ta.inspect.dot_general_operand_dtypes(f, jnp.ones((16, 32)), jnp.ones((32, 16)))
    [('float8_e4m3fn', 'float8_e4m3fn')]
    >>> ta.inspect.dot_general_operand_dtypes(jnp.dot, jnp.ones((2, 2)), jnp.ones((2, 2)))
    [('float32', 'float32')]
  """
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  out: list[tuple[str, str]] = []
  for eqn in _walk(closed.jaxpr):
    if _is_gemm(eqn):
      lhs, rhs = (str(np.dtype(v.aval.dtype)) for v in eqn.invars[:2])
      out.append((lhs, rhs))
  return out


def count_fp8_dot_generals(fn: Callable, *args, **kwargs) -> tuple[int, int]:
  """Counts the GEMMs of ``fn`` that get FP8 operands, from its jaxpr (before XLA compiles it).

  Args:
    fn: the function to trace, such as a training step.
    *args: its arguments (arrays, or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Returns:
    ``(number of dot_generals with two FP8 operands, number of dot_generals)``, sub-jaxprs
    (``jit``, ``scan``, custom VJPs) included, the extension's cuBLASLt FP8 GEMM counted as one.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> f = lambda x, w: ta.dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                                 recipe=ta.Float8CurrentScaling(), threshold=None)
    >>> ta.inspect.count_fp8_dot_generals(f, jnp.ones((16, 32)), jnp.ones((32, 16)))
    (1, 1)
  """
  dtypes = dot_general_operand_dtypes(fn, *args, **kwargs)
  fp8 = sum(all(d in _FP8_NAMES for d in pair) for pair in dtypes)
  return fp8, len(dtypes)


def count_fp8_cublas_gemms(hlo_text: str) -> int:
  """Number of cuBLASLt FP8 GEMM custom calls in compiled GPU HLO text: XLA's, and the
  extension's (whose operands are always FP8).

  Args:
    hlo_text: compiled HLO, ``jax.jit(f).lower(*args).compile().as_text()``.

  Returns:
    The number of such calls (0 on CPU, which has none).

  Example:
    >>> import te_adapters as ta
    >>> hlo = (
    ...   '%gemm = (f32[16,16]{1,0}, s8[0]{0}) custom-call(%x, %w), '
    ...   'custom_call_target="__cublas$lt$matmul$f8"')
    >>> ta.inspect.count_fp8_cublas_gemms(hlo)
    1
  """
  xla = re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', hlo_text)
  return len(xla) + hlo_text.count(f'custom_call_target="{_FFI_GEMM_TARGET}"')


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?(\w+)\[")
_DOT_ARGS = re.compile(r"\bdot\(([^)]*)\)")


def hlo_dot_operand_types(hlo_text: str) -> list[tuple[str, str]]:
  """Operand element types of every ``dot`` instruction left in compiled HLO text.

  On GPU, dots that XLA did not turn into cuBLAS calls remain as ``dot`` instructions inside
  (Triton) GEMM fusions; their operand types show whether they run in FP8.

  Args:
    hlo_text: compiled HLO text.

  Returns:
    A list of ``(lhs type, rhs type)`` in HLO's spelling (``"f8e4m3fn"``, ``"bf16"``), one per
    ``dot``; ``"?"`` for an operand defined outside the text.

  Example:
    >>> import te_adapters as ta
    >>> hlo = "\\n".join([
    ...   "%x = f8e4m3fn[16,32]{1,0} parameter(0)",
    ...   "%w = f8e4m3fn[16,32]{1,0} parameter(1)",
    ...   "ROOT %y = f32[16,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}",
    ... ])
    >>> ta.inspect.hlo_dot_operand_types(hlo)
    [('f8e4m3fn', 'f8e4m3fn')]
  """
  types = {}
  for line in hlo_text.splitlines():
    if m := _DEF.match(line):
      types[m.group(1)] = m.group(2)
  out: list[tuple[str, str]] = []
  for line in hlo_text.splitlines():
    if " dot(" not in line or not (m := _DOT_ARGS.search(line)):
      continue
    names = [a.strip().split()[-1].lstrip("%") for a in m.group(1).split(",")[:2]]
    lhs, rhs = (types.get(n, "?") for n in names)
    out.append((lhs, rhs))
  return out


def count_fp8_gemms(hlo_text: str) -> tuple[int, int]:
  """Counts the GEMMs of compiled HLO that run in FP8, against the others.

  Args:
    hlo_text: compiled HLO, ``jax.jit(f).lower(*args).compile().as_text()``.

  Returns:
    ``(FP8 GEMMs, other GEMMs)``: cuBLASLt FP8 calls (XLA's and the extension's) plus dots with
    two FP8 operands left in fusions, against cuBLAS calls and dots of other types. On CPU, where
    XLA emulates FP8 in higher precision, every GEMM counts as other.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> hlo = jax.jit(jnp.dot).lower(jnp.ones((16, 32)), jnp.ones((32, 16))).compile().as_text()
    >>> ta.inspect.count_fp8_gemms(hlo)[0]
    0
  """
  fp8_dots = sum(
    a.startswith("f8") and b.startswith("f8") for a, b in hlo_dot_operand_types(hlo_text)
  )
  other_dots = len(hlo_dot_operand_types(hlo_text)) - fp8_dots
  other_calls = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"', hlo_text))
  return count_fp8_cublas_gemms(hlo_text) + fp8_dots, other_dots + other_calls


class Collective(NamedTuple):
  """One collective in compiled HLO text.

  Attributes:
    op: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` or
      ``collective-permute`` (asynchronous ``-start`` forms are reported under these names).
    arrays: ``(dtype, shape)`` of each array in the op's result type; for a ``-start`` op the
      operand's arrays come first.
    line: the HLO instruction.

  Example:
    >>> import te_adapters as ta
    >>> hlo = "%ag = f32[8,16]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}"
    >>> (c,) = ta.inspect.hlo_collectives(hlo)
    >>> c.op, c.arrays
    ('all-gather', (('f32', (8, 16)),))
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

  Args:
    hlo_text: compiled HLO text.

  Returns:
    A list of ``Collective``, in the text's order.

  Example:
    >>> import jax, te_adapters as ta
    >>> ta.inspect.hlo_collectives(jax.jit(lambda x: x + 1).lower(1.0).compile().as_text())
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
