"""Haiku's ``hk.scan`` carries all Haiku state through the iterations, so a plain gradient over
the recipe state of a layer inside it would add up the iterations' amaxes (see
``te_adapters._kit.refuse_state_grad``). Such a layer refuses to be differentiated that way at
trace time.

The scan is found by walking the Python stack for the frame of ``hk.scan``'s body wrapper; a
Haiku whose scan is laid out differently makes the check find nothing.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import jax

from te_adapters._kit import is_marked, refuse_state_grad

__all__ = ["refuse_state_in_hk_scan"]


def _scan_body_code():
  try:
    from haiku._src import stateful
  except ImportError:  # pragma: no cover - a Haiku with another layout
    return None
  scan = getattr(stateful, "scan", None)
  for const in getattr(getattr(scan, "__code__", None), "co_consts", ()):
    if isinstance(const, types.CodeType) and const.co_name == "stateful_fun":
      return const
  return None  # pragma: no cover


_SCAN_BODY_CODE = _scan_body_code()


def _inside_hk_scan() -> bool:
  if _SCAN_BODY_CODE is None:
    return False
  frame: types.FrameType | None = sys._getframe(2)
  while frame is not None:
    if frame.f_code is _SCAN_BODY_CODE:
      return True
    frame = frame.f_back
  return False


def refuse_state_in_hk_scan(module_name: str, recipe, state: Any) -> Any:
  """``state`` unchanged; inside ``hk.scan``, tracing a plain gradient over it raises."""
  if not state or is_marked(state):
    return state
  if not any(isinstance(v, jax.core.Tracer) for v in state.values()) or not _inside_hk_scan():
    return state
  message = (
    f"te_adapters.haiku: {module_name}'s {type(recipe).__name__} state is read inside "
    "hk.scan, which carries it unchanged through every iteration, and a plain jax.grad over "
    "the Haiku state would add up the iterations' amax histories instead of taking their max. "
    "Differentiate with te_adapters.haiku.value_grad_and_state (it combines the iterations by "
    "max), or stack the layers with hk.layer_stack outside any hk.scan, each with its own state."
  )
  return refuse_state_grad(state, message)
