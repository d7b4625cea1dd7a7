"""Quantizes the ``nn.Dense`` / ``nn.DenseGeneral`` layers of an existing Linen model, no edits.

Flax's ``nn.intercept_methods`` sees every module method call; for the dense layers it sets their
``dot_general_cls`` slot (the one Flax's own FP8 ops use) for the duration of the call, so the
layer creates a ``QuantizedDotGeneral`` child holding its recipe state in the collection
``_overwrite_with_gradient``. Parameters keep their names, shapes and initialisers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import make_dot_general_cls

__all__ = ["QuantizeReport", "quantize"]

_EXCLUDED = "excluded by the filter"
# GEMMs in Linen's own layers that have no dot_general slot to convert.
_UNREACHABLE = {
    (nn.Embed, "attend"): (
        "nn.Embed.attend (a tied output projection) computes its GEMM with jnp.dot, outside any "
        "dot_general slot: it stays in high precision"
    ),
    (nn.Einsum, "__call__"): (
        "nn.Einsum has no dot_general slot in Flax Linen: it stays in high precision (use "
        "nn.DenseGeneral, or te_adapters.nnx.Einsum in NNX)"
    ),
}



QuantizeReport = kit.QuantizeReport  # one report type for every adapter


def _path(module: nn.Module) -> str:
  scope = module.scope
  return "/".join(scope.path) if scope is not None and scope.path else "."


def _gemm_sizes(module, inputs) -> tuple[int, int]:
  """``(K, N)`` of a dense layer's GEMM on ``inputs``."""
  shape = jnp.shape(inputs)
  if isinstance(module, nn.Dense):
    return shape[-1], module.features
  features = module.features if isinstance(module.features, tuple) else (module.features,)
  axis = module.axis if isinstance(module.axis, tuple) else (module.axis,)
  return math.prod(shape[a] for a in axis), math.prod(features)


class quantize(kit.InterceptScope):  # lower case: used like a function
  """Makes every ``nn.Dense`` and ``nn.DenseGeneral`` called in its scope compute with ``recipe``,
  with no edits to the model.

  A context manager or a decorator around ``model.init`` / ``model.apply`` (or around code that
  calls them); it must be active while the model is traced, so wrap the function you ``jit``.
  Each converted layer keeps its parameters and gets a ``QuantizedDotGeneral`` child whose recipe
  state lives in the collection ``_overwrite_with_gradient``, exactly as with
  ``nn.Dense(..., dot_general_cls=make_dot_general_cls(recipe))`` (the ``DenseGeneral``
  projections of ``nn.MultiHeadDotProductAttention`` included). Layers left in high precision
  are listed in ``report.skipped`` with the reason: rejected by ``filter``, K or N not a multiple
  of 16 (with a warning), a ``dot_general`` / ``dot_general_cls`` of their own, and GEMMs
  without a slot to convert (``nn.Embed.attend``, the tied output projection; ``nn.Einsum``).
  The innermost scope wins; ``quantize(None)`` keeps its scope in high precision.

  Args:
    recipe: the recipe for the converted layers, or ``None`` for none.
    filter: optional ``f(path) -> bool`` on the layer's path (``"Block_0/Dense_1"``); layers for
      which it is false stay in high precision.
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` (SPMD).
    config: passed to ``core.dot_general``: a ``core.GemmConfig``, or ``None`` for the default.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16)])
    >>> q = ta_linen.quantize(ta.DelayedScaling(), threshold=None)
    >>> variables = q(model.init)(jax.random.key(0), jnp.ones((4, 16)))
    >>> q.report.quantized, sorted(variables)
    (['layers_0', 'layers_2'], ['_overwrite_with_gradient', 'params'])
  """

  def __init__(
      self,
      recipe: core.Recipe | None,
      *,
      filter: Callable[[str], bool] | None = None,
      threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
      amax_axes=None,
      kernel_all_gather=None,
      config: core.GemmConfig | None = None,
  ):
    self.recipe = kit.check_recipe_or_none(recipe)
    if filter is not None and not callable(filter):
      raise TypeError(f"filter must be callable, got {type(filter).__name__}")
    self.filter = filter
    self.threshold = core.check_threshold(threshold)
    self.dot_general_cls = None
    if self.recipe is not None:
      self.dot_general_cls = make_dot_general_cls(
          self.recipe, threshold=threshold, amax_axes=amax_axes,
          kernel_all_gather=kernel_all_gather, config=config,
      )
    self.report = QuantizeReport()

  def _interceptor(self):
    return nn.intercept_methods(self._intercept)

  def _skip(self, path: str, reason: str) -> None:
    if path not in self.report.skipped:
      self.report.skipped[path] = reason
      if reason != _EXCLUDED:
        warnings.warn(f"te_adapters: {path} stays in high precision: {reason}", stacklevel=4)

  def _intercept(self, next_fun, args, kwargs, context):
    module = context.module
    if self.recipe is None or not self.innermost():
      return next_fun(*args, **kwargs)
    for (cls, method), reason in _UNREACHABLE.items():
      if isinstance(module, cls) and context.method_name == method:
        self._skip(_path(module), reason)
        return next_fun(*args, **kwargs)
    if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral)):
      return next_fun(*args, **kwargs)
    path = _path(module)
    if getattr(module, "recipe", None) is not None:
      return next_fun(*args, **kwargs)  # a te_adapters layer with its own recipe
    if self.filter is not None and not self.filter(path):
      self._skip(path, _EXCLUDED)
      return next_fun(*args, **kwargs)
    current = module.dot_general_cls
    if module.dot_general is not None or (
        current is not None and current is not self.dot_general_cls
    ):
      self._skip(path, "it has a dot_general of its own")
      return next_fun(*args, **kwargs)
    inputs = args[0] if args else kwargs.get("inputs")
    k, n = _gemm_sizes(module, inputs)
    if (refusal := kit.gemm_dims_refusal(k, n)) is not None:
      self._skip(path, refusal)
      return next_fun(*args, **kwargs)
    if path not in self.report.quantized:
      self.report.quantized.append(path)
    m = math.prod(jnp.shape(inputs)) // k
    if (why := core.high_precision_reason(self.threshold, k, n, m)) is not None:
      self.report.high_precision.setdefault(path, why)
    # Linen modules are frozen dataclasses; the slot is set for this call only.
    object.__setattr__(module, "dot_general_cls", self.dot_general_cls)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "dot_general_cls", current)
