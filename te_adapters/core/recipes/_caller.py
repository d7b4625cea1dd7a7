"""Where a warning points: the user's line, past the frames of te_adapters, JAX and the
frameworks. The lowest subpackage holds it, so that every layer of the core (the kernels'
partitioning rules included) can point its warnings at the caller."""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["caller_site", "caller_stacklevel"]

# Where a warning's caller is looked for: frames of these packages are passed over. Named, not
# imported: the core imports no framework.
_INTERNAL_PACKAGES = frozenset(
  {
    "te_adapters",
    "jax",
    "jaxlib",
    "flax",
    "haiku",
    "optax",
    "contextlib",
    "functools",
  }
)


def caller_stacklevel() -> int:
  """The ``stacklevel`` that points a warning issued by the calling function at the user's line:
  the first frame outside te_adapters, JAX and the frameworks (through any ``jit``, ``grad``,
  ``model.apply`` or ``hk.transform`` in between).

  Returns:
    The ``stacklevel`` to pass to ``warnings.warn`` from the calling function.

  Example:
    >>> import warnings
    >>> from te_adapters import core
    >>> def check():
    ...   warnings.warn("careful", stacklevel=core.caller_stacklevel())
  """
  return _user_frame(sys._getframe(1))[1]


def caller_site() -> tuple[str, int, str] | None:
  """The user's line that led to the calling function, as ``(filename, lineno, module)``: what
  ``warnings.warn_explicit`` takes for a warning issued later, away from the user's call (as the
  partitioning rules' warnings are, at compile time). None where no frame is the user's."""
  frame = _user_frame(sys._getframe(1))[0]
  if frame is None:
    return None
  return frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", "")


def _user_frame(frame: FrameType | None) -> tuple[FrameType | None, int]:
  """The first frame from ``frame`` outward outside te_adapters, JAX and the frameworks, and
  the ``stacklevel`` that names it from ``frame``'s function."""
  level = 1
  while frame is not None and (
    frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL_PACKAGES
  ):
    frame, level = frame.f_back, level + 1
  return frame, level
