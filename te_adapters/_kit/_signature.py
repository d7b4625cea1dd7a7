"""The signature a quantized layer shows: its framework parent's, then the quantization keywords."""

from __future__ import annotations

import inspect
from collections.abc import Callable

__all__ = ["signature_with_keywords"]


def signature_with_keywords(parent: Callable, own: Callable) -> inspect.Signature:
  """``parent``'s signature followed by the keyword-only parameters of ``own``.

  A layer whose ``__init__(self, *args, recipe=..., **kwargs)`` passes the parent's arguments
  on sets ``__init__.__signature__`` to this, so ``inspect.signature`` and ``help`` show the
  parent's arguments and then its own.

  Example:
    >>> import inspect
    >>> from te_adapters._kit import signature_with_keywords
    >>> def parent(self, features, use_bias=True): ...
    >>> def own(self, *args, recipe=None, **kwargs): ...
    >>> str(signature_with_keywords(parent, own))
    '(self, features, use_bias=True, *, recipe=None)'
  """
  params = list(inspect.signature(parent).parameters.values())
  params += [p for p in inspect.signature(own).parameters.values() if p.kind is p.KEYWORD_ONLY]
  return inspect.Signature(params)
