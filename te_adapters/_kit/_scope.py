"""The scope behind the adapters' ``quantize`` conversions: a framework's method interceptor,
installed while the scope is active, re-entrant, with the innermost active scope in charge."""

from __future__ import annotations

import contextlib
import threading

from te_adapters import core


class InterceptScope(contextlib.ContextDecorator):
  """A context manager (or decorator) that installs ``self._interceptor()`` while active.

  Entering the same scope again (a decorated function calling itself, ``init`` inside
  ``apply``) keeps one interceptor. Scopes of one subclass nest per thread; ``innermost()`` tells
  the interceptor whether this scope is the one to act.
  """

  _active: threading.local  # set per subclass

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls._active = threading.local()  # this kind's active scopes on each thread, innermost last

  @property
  def report(self) -> core.QuantizeReport:
    """What entering the scope gives: the conversion's report (each subclass's own)."""
    raise NotImplementedError

  def _interceptor(self) -> contextlib.AbstractContextManager:
    """The framework's interception context (``nn.intercept_methods(...)``, ...)."""
    raise NotImplementedError

  def _scopes(self) -> list:
    active = type(self)._active
    if not hasattr(active, "scopes"):
      active.scopes = []
    return active.scopes

  def innermost(self) -> bool:
    return self._scopes()[-1] is self

  def __enter__(self):
    if getattr(self, "_depth", 0) == 0:
      self._stack = contextlib.ExitStack()
      self._stack.enter_context(self._interceptor())
    self._depth = getattr(self, "_depth", 0) + 1
    self._scopes().append(self)
    return self.report

  def _finished(self) -> None:
    """Called when the outermost entry of this scope ends without an exception (one pass over
    the model: ``init``, a traced ``apply``)."""

  def __exit__(self, exc_type, *exc) -> None:
    self._scopes().pop()
    self._depth -= 1
    if self._depth == 0:
      self._stack.close()
      if exc_type is None:
        self._finished()
