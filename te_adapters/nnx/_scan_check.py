"""The one ordinary NNX pattern whose state gradient JAX would add up, refused at trace time.

``nnx.scan`` hands a layer whose state axis is ``None`` (broadcast) or ``nnx.Carry`` to every
iteration through the carry of ``lax.scan``, unchanged. Under a plain ``nnx.grad`` over the
``RecipeState`` variables, the transpose of that carry adds up the iterations' contributions, so
the amax histories would hold a sum, not a max. Nothing inside the scan body can change how JAX
combines them (the values arrive there as ordinary loop inputs), so the layer raises a clear
error at trace time instead, naming the ways out. The library's own ``value_and_grad``/``grad``
mark the state before the scan splits the model, so their state arrives in a dtype that combines
by max, and it is let through.

The scan is found by walking the Python stack for the frame of ``nnx.scan``'s body wrapper and
reading its ``in_axes`` and merged arguments; a Flax whose scan is laid out differently makes the
check find nothing (the behaviour it guards against is then recorded by the test suite).
"""

from __future__ import annotations

import sys
import types

import jax
from flax import nnx
from flax.nnx import filterlib

from te_adapters._kit import is_marked, refuse_state_grad

try:
  from flax.nnx.transforms.iteration import ScanFn as _ScanFn

  _SCAN_BODY_CODE: types.CodeType | None = _ScanFn.__call__.__code__
except (ImportError, AttributeError):  # pragma: no cover - a Flax with another scan layout
  _SCAN_BODY_CODE = None

__all__ = ["refuse_shared_scan_state"]


def _describe_axis(axis) -> str | None:
  """How an ``in_axes`` entry hands state to the iterations: None when one slice per iteration."""
  if axis is None:
    return "None (broadcast)"
  if axis is nnx.Carry:
    return "nnx.Carry"
  return None


def _state_axis(op, names, path, axes) -> str | None:
  if isinstance(axes, nnx.StateAxes):
    for name in names:
      variable = op.state[name]
      for filter_, axis in zip(axes.filters, axes.axes, strict=True):
        if filterlib.to_predicate(filter_)((*path, "state", name), variable):
          described = _describe_axis(axis)
          if described is not None:
            return f"StateAxes {axis!r} for {name}" if axis is not None else described
          break
    return None
  return _describe_axis(axes)


def _shared_in_scan(op, names) -> str | None:
  """The ``in_axes`` entry of an enclosing ``nnx.scan`` giving each iteration ``op``'s state."""
  if _SCAN_BODY_CODE is None:
    return None
  frame: types.FrameType | None = sys._getframe(2)
  while frame is not None:
    if frame.f_code is _SCAN_BODY_CODE:
      scan, args = frame.f_locals.get("self"), frame.f_locals.get("args")
      if scan is not None and isinstance(args, tuple):
        in_axes = scan.in_axes
        for i, arg in enumerate(args):
          axes = in_axes[i] if isinstance(in_axes, tuple) and i < len(in_axes) else in_axes
          if not nnx.graph.is_graph_node(arg):
            continue
          for path, node in nnx.iter_graph(arg):
            if node is op:
              found = _state_axis(op, names, path, axes)
              if found is not None:
                return found
    frame = frame.f_back
  return None


def refuse_shared_scan_state(op, state: dict) -> dict:
  """``state`` unchanged; raises at trace time if a plain gradient would add it up over the
  iterations of an enclosing ``nnx.scan`` (see the module docstring)."""
  if not state or is_marked(state):
    return state  # stateless, or marked for max by the library's helpers
  if not any(isinstance(v, jax.core.Tracer) for v in state.values()):
    return state
  axis = _shared_in_scan(op, tuple(state))
  if axis is None:
    return state
  message = (
    f"te_adapters.nnx: {type(op).__name__}'s {type(op.recipe).__name__} state is handed to "
    f"every iteration of an nnx.scan (its in_axes entry is {axis}), and a plain nnx.grad "
    "over RecipeState would add up the iterations' amax histories instead of taking their "
    "max. Differentiate with te_adapters.nnx.value_and_grad or te_adapters.nnx.grad (they "
    "combine the iterations by max), or scan over stacked layers (in_axes=0), each with its "
    "own state."
  )
  return refuse_state_grad(state, message)
