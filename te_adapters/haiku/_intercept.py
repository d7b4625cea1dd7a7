"""Quantizes every ``hk.Linear`` of an existing model through Haiku's method interception."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import haiku as hk

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku import _linear

__all__ = ["QuantizeReport", "quantize"]


QuantizeReport = kit.QuantizeReport  # one report type for every adapter


def _refusal(module: hk.Linear, inputs) -> str | None:
  """Why ``module`` cannot be quantized on ``inputs``, or None."""
  refusal = kit.input_dtype_refusal(getattr(inputs, "dtype", None))
  if refusal is not None:
    return refusal
  shape = getattr(inputs, "shape", ())
  if not shape:
    return "scalar input"
  return kit.gemm_dims_refusal(shape[-1], module.output_size)


class quantize(kit.GemmOptionAttributes, kit.InterceptScope):  # lower case: used like a function
  """Makes the ``hk.Linear`` layers called in its scope compute with a recipe, chosen per layer
  by ``rules``, with no model edits.

  Works as a context manager or a decorator around the function given to ``hk.transform`` (or
  around the code that calls it; it must be active while the model is traced). Each quantized
  ``hk.Linear`` keeps its parameters (``w``, ``b``: same names, shapes and initialisers) and, for
  a stateful recipe, gets recipe state with ``hk.get_state`` under its own name, exactly like
  ``te_adapters.haiku.Linear``.

  Each layer's path is its Haiku module name (``"transformer/multi_head_attention/query"``,
  ``"mlp/~/linear_0"``: Haiku's own names, ``~`` scopes included); the first rule whose pattern
  matches it decides its recipe (``None``: high precision) and GEMM options, and a layer no rule
  matches stays in high precision. ``report`` (a ``QuantizeReport``, filled in as the model is
  traced) lists the quantized layers with their recipes, the layers kept in high precision with
  the rule that keeps them, and the layers a rule gave a recipe that could not be quantized (dims
  not multiples of 16, non-float input), with the reason; those get one ``SkippedLayersWarning``
  per pass over the model, pointing at the line that ran it. A ``te_adapters.haiku.Linear`` with
  a recipe of its own that a rule selects is a ``ValueError`` naming it. Subclasses of
  ``hk.Linear`` that override ``__call__`` are left alone unless they call
  ``hk.Linear.__call__``. The innermost scope wins; ``quantize(None)`` keeps its scope in high
  precision. Other method interceptors registered inside this scope do not see the quantized
  layers' calls.

  Args:
    recipe: the recipe of every layer (the rule ``Rule(".*", recipe)``), or ``None`` for none.
      Leave it out when giving ``rules``. One that rounds stochastically draws a key per layer
      call with ``hk.next_rng_key()`` (``apply`` needs an ``rng``).
    rules: a list of ``te_adapters.Rule`` (or tuples ``(path, recipe)``, ``(path, recipe,
      {options})``): each a regular expression matched against a layer's whole module name, or
      a function of that string, with its recipe (``None`` keeps the layer in high precision)
      and optional GEMM options; first match wins.
    threshold: passed to ``core.dot_general`` by every layer whose rule does not set it: GEMMs
      below this ``SizeThreshold`` stay in high precision (default
      ``core.DEFAULT_SIZE_THRESHOLD``, with a ``core.HighPrecisionGemmWarning``); ``None``
      quantizes every GEMM.
    amax_axes, kernel_all_gather, config: passed to ``core.dot_general`` by every layer whose
      rule does not set them (SPMD options; a ``core.GemmConfig``).
    module_filter: deprecated (a ``DeprecationWarning``), removed in the next release:
      ``module_filter=f, recipe`` is ``rules=[(f, recipe)]``.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> q = ta_hk.quantize(rules=[(r"mlp/~/linear_0", ta.Float8CurrentScaling()),
    ...                           (r".*", None)], threshold=None)
    >>> f = hk.transform(q(lambda x: hk.nets.MLP([32, 16])(x)))
    >>> params = f.init(jax.random.key(0), jnp.ones((4, 16)))
    >>> q.report.quantized, q.report.high_precision
    (['mlp/~/linear_0'], {'mlp/~/linear_1': "rule 1 ('.*') keeps it in high precision"})
  """

  def __init__(
    self,
    recipe: core.Recipe | None | kit.Unset = kit.UNSET,
    *,
    rules=None,
    threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
    amax_axes=None,
    kernel_all_gather=None,
    config: core.GemmConfig | None = None,
    module_filter: Callable[[str], bool] | None = None,
  ):
    self.options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
    self._conversion = kit.Conversion(
      "te_adapters.haiku.quantize", recipe, rules, self.options, ("module_filter", module_filter)
    )

  @property
  def report(self) -> QuantizeReport:
    """The conversion's ``QuantizeReport``, filled in as the model is traced in the scope."""
    return self._conversion.report

  @property
  def rules(self) -> tuple[kit.Rule, ...]:
    """The conversion's rules, as ``Rule`` objects."""
    return self._conversion.rules

  def _interceptor(self):
    return hk.intercept_methods(self._intercept)

  def _finished(self) -> None:
    self._conversion.finish()

  def _intercept(self, next_f, args, kwargs, context):
    module = context.module
    conversion = self._conversion
    if context.method_name != "__call__" or not conversion.active or not self.innermost():
      return next_f(*args, **kwargs)
    if isinstance(module, _linear.Linear):
      if module.recipe is not None and conversion.selects(module.module_name):
        conversion.already_quantized(module.module_name)
      return next_f(*args, **kwargs)
    if context.orig_class is not hk.Linear:
      return next_f(*args, **kwargs)
    name = module.module_name
    choice = conversion.choose(name)
    if choice.recipe is None:
      conversion.keep(name, choice.reason)
      return next_f(*args, **kwargs)
    inputs = args[0] if args else kwargs.get("inputs")
    if (refusal := _refusal(module, inputs)) is not None:
      conversion.skip(name, refusal)
      return next_f(*args, **kwargs)
    m = math.prod(inputs.shape[:-1])
    conversion.quantized(
      name,
      choice.recipe,
      core.high_precision_reason(choice.options.threshold, inputs.shape[-1], module.output_size, m),
    )
    call = functools.partial(
      _linear.linear_forward, module, recipe=choice.recipe, options=choice.options
    )
    return _call_like_linear(call, *args, **kwargs)


def _call_like_linear(call, inputs, *, precision=None):
  return call(inputs, precision)
