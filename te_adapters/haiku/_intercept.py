"""Quantizes every ``hk.Linear`` of an existing model through Haiku's method interception."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import haiku as hk

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku import _linear

__all__ = ["QuantizeReport", "quantize"]

_EXCLUDED = "excluded by module_filter"


QuantizeReport = kit.QuantizeReport  # one report type for every adapter


def _skip_reason(module: hk.Linear, inputs, module_filter) -> str | None:
  name = module.module_name
  if module_filter is not None and not module_filter(name):
    return _EXCLUDED
  refusal = kit.input_dtype_refusal(getattr(inputs, "dtype", None))
  if refusal is not None:
    return refusal
  shape = getattr(inputs, "shape", ())
  if not shape:
    return "scalar input"
  return kit.gemm_dims_refusal(shape[-1], module.output_size)


class quantize(kit.GemmOptionAttributes, kit.InterceptScope):  # lower case: used like a function
  """Makes every ``hk.Linear`` called in its scope compute with ``recipe``, with no model edits.

  Works as a context manager or a decorator around the function given to ``hk.transform`` (or
  around the code that calls it; it must be active while the model is traced). Each intercepted
  ``hk.Linear`` keeps its parameters (``w``, ``b``: same names, shapes and initialisers) and, for a
  stateful recipe, gets recipe state with ``hk.get_state`` under its own name, exactly like
  ``te_adapters.haiku.Linear``. A layer that cannot be quantized (dims not multiples of 16,
  non-float input) stays in high precision, is listed in the report's ``skipped`` with the reason
  and triggers a warning; one that ``module_filter`` rejects is listed there too, without a
  warning. ``te_adapters.haiku.Linear`` layers keep their own recipe. Subclasses of
  ``hk.Linear`` that override ``__call__`` are left alone unless they call
  ``hk.Linear.__call__``. The innermost scope wins; ``quantize(None)`` keeps its scope in high
  precision. Other method interceptors registered inside this scope do not see the quantized
  layers' calls.

  Args:
    recipe: the recipe for the intercepted layers, or ``None`` for none. One that rounds
      stochastically draws a key per layer call with ``hk.next_rng_key()`` (``apply`` needs an
      ``rng``).
    module_filter: optional ``f(module_name) -> bool``; layers for which it is false stay in high
      precision.
    threshold: passed to ``core.dot_general`` by every intercepted layer: GEMMs below this
      ``SizeThreshold`` stay in high precision (default ``core.DEFAULT_SIZE_THRESHOLD``, with a
      ``core.HighPrecisionGemmWarning``); ``None`` quantizes every GEMM.
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` by every quantized layer (SPMD:
      the mesh axes amaxes are reduced over inside ``shard_map``; FSDP's FP8 gather of ``w``).
    config: passed to ``core.dot_general`` by every quantized layer: a ``core.GemmConfig``, or
      ``None`` for the default.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> q = ta_hk.quantize(ta.Float8CurrentScaling())
    >>> f = hk.transform(q(lambda x: hk.nets.MLP([32, 16])(x)))
    >>> params = f.init(jax.random.key(0), jnp.ones((4, 16)))
    >>> q.report.quantized
    ['mlp/~/linear_0', 'mlp/~/linear_1']
  """

  def __init__(
      self,
      recipe: core.Recipe | None,
      *,
      module_filter: Callable[[str], bool] | None = None,
      threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
      amax_axes=None,
      kernel_all_gather=None,
      config: core.GemmConfig | None = None,
  ):
    self.recipe = kit.check_recipe_or_none(recipe)
    self.options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
    if module_filter is not None and not callable(module_filter):
      raise TypeError(f"module_filter must be callable, got {type(module_filter).__name__}")
    self.module_filter = module_filter
    self.report = QuantizeReport()

  def _interceptor(self):
    return hk.intercept_methods(self._intercept)

  def _intercept(self, next_f, args, kwargs, context):
    module = context.module
    if (
        context.method_name != "__call__"
        or context.orig_class is not hk.Linear
        or isinstance(module, _linear.Linear)
        or not self.innermost()
    ):
      return next_f(*args, **kwargs)
    if self.recipe is None:
      return next_f(*args, **kwargs)
    inputs = args[0] if args else kwargs.get("inputs")
    reason = _skip_reason(module, inputs, self.module_filter)
    name = module.module_name
    if reason is not None:
      if name not in self.report.skipped:
        self.report.skipped[name] = reason
        if reason != _EXCLUDED:  # the user asked for that one
          warnings.warn(f"te_adapters: {name} stays in high precision: {reason}", stacklevel=2)
      return next_f(*args, **kwargs)
    if name not in self.report.quantized:
      self.report.quantized.append(name)
    m = math.prod(inputs.shape[:-1])
    why = core.high_precision_reason(self.threshold, inputs.shape[-1], module.output_size, m)
    if why is not None:
      self.report.high_precision.setdefault(name, why)
    call = functools.partial(
        _linear.linear_forward, module, recipe=self.recipe, options=self.options)
    return _call_like_linear(call, *args, **kwargs)


def _call_like_linear(call, inputs, *, precision=None):
  return call(inputs, precision)
