"""Checks that GEMMs really received FP8 operands: in the jaxpr and in compiled HLO."""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import numpy as np
from jax.extend import core as jax_core

__all__ = ["dot_general_operand_dtypes", "count_fp8_dot_generals", "count_fp8_cublas_gemms"]

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


def dot_general_operand_dtypes(fn: Callable, *args, **kwargs) -> list[tuple[str, str]]:
  """The operand dtypes of every ``dot_general`` in ``fn``'s jaxpr (sub-jaxprs included)."""
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  out = []
  for eqn in _walk(closed.jaxpr):
    if eqn.primitive.name == "dot_general":
      out.append(tuple(str(np.dtype(v.aval.dtype)) for v in eqn.invars[:2]))
  return out


def count_fp8_dot_generals(fn: Callable, *args, **kwargs) -> tuple[int, int]:
  """``(number of dot_generals with two FP8 operands, number of dot_generals)`` in the jaxpr."""
  dtypes = dot_general_operand_dtypes(fn, *args, **kwargs)
  fp8 = sum(all(d in _FP8_NAMES for d in pair) for pair in dtypes)
  return fp8, len(dtypes)


def count_fp8_cublas_gemms(hlo_text: str) -> int:
  """Number of cuBLASLt FP8 GEMM custom calls in compiled GPU HLO text."""
  return len(re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', hlo_text))
