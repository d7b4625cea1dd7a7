"""Quantizes the ``nn.Dense`` / ``nn.DenseGeneral`` layers of an existing Linen model, no edits.

Flax's ``nn.intercept_methods`` sees every module method call; for the dense layers it sets their
``dot_general_cls`` slot (the one Flax's own FP8 ops use) for the duration of the call, so the
layer creates a ``QuantizedDotGeneral`` child holding its recipe state in the collection
``_overwrite_with_gradient``. Parameters keep their names, shapes and initialisers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import QuantizedDotGeneral, make_dot_general_cls

__all__ = ["QuantizeReport", "quantize"]

# GEMMs in Linen's own layers that have no dot_general slot to convert.
_UNREACHABLE: dict[tuple[type[nn.Module], str], str] = {
  (nn.Embed, "attend"): kit.attend_reason("nn.Embed"),
  (nn.Einsum, "__call__"): (
    "nn.Einsum has no dot_general slot in Flax Linen (use nn.DenseGeneral, or "
    "te_adapters.nnx.Einsum in NNX)"
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


def _quantized_already(module) -> bool:
  """Whether a dense layer computes with a te_adapters recipe already: a layer of ours built
  with a recipe, or a ``QuantizedDotGeneral`` in its slot."""
  current = module.dot_general_cls
  return (
    getattr(module, "recipe", None) is not None
    or isinstance(module.dot_general, QuantizedDotGeneral)
    or (isinstance(current, type) and issubclass(current, QuantizedDotGeneral))
  )


class quantize(kit.InterceptScope):  # lower case: used like a function
  """Makes the ``nn.Dense`` and ``nn.DenseGeneral`` layers called in its scope compute with a
  recipe, chosen per layer by ``rules``, with no edits to the model.

  A context manager or a decorator around ``model.init`` / ``model.apply`` (or around code that
  calls them); it must be active while the model is traced, so wrap the function you ``jit``.
  Each converted layer keeps its parameters and gets a ``QuantizedDotGeneral`` child whose recipe
  state lives in the collection ``_overwrite_with_gradient``, exactly as with
  ``nn.Dense(..., dot_general_cls=make_dot_general_cls(recipe))`` (the ``DenseGeneral``
  projections of ``nn.MultiHeadDotProductAttention`` included).

  Each layer's path is its scope's path, the module names joined by ``/``
  (``"decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0"``); the first rule whose pattern matches
  it decides its recipe (``None``: high precision) and GEMM options, and a layer no rule matches
  stays in high precision. ``report`` (a ``QuantizeReport``, filled in as the model is traced)
  lists the quantized layers with their recipes, the layers kept in high precision with the rule
  that keeps them, and the layers a rule gave a recipe that could not be quantized, with the
  reason: K or N not a multiple of 16, a ``dot_general`` / ``dot_general_cls`` of their own, or a
  GEMM without a slot to convert (``nn.Embed.attend``, the tied output projection;
  ``nn.Einsum``). Those skipped layers get one ``SkippedLayersWarning`` per pass over the model,
  pointing at the line that ran it. A layer a rule selects that computes with a recipe already
  (a te_adapters layer, a ``QuantizedDotGeneral`` in its slot) is a ``ValueError`` naming it.
  The innermost scope wins; ``quantize(None)`` keeps its scope in high precision.

  Args:
    recipe: the recipe of every layer (the rule ``Rule(".*", recipe)``), or ``None`` for none.
      Leave it out when giving ``rules``.
    rules: a list of ``te_adapters.Rule`` (or tuples ``(path, recipe)``, ``(path, recipe,
      {options})``): each a regular expression matched against a layer's whole path, or a
      function of the path string, with its recipe (``None`` keeps the layer in high precision)
      and optional GEMM options; first match wins.
    threshold: passed to ``core.dot_general`` by every layer whose rule does not set it: GEMMs
      below this ``SizeThreshold`` stay in high precision (default
      ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    amax_axes, kernel_all_gather, config: passed to ``core.dot_general`` by every layer whose
      rule does not set them (SPMD options; a ``core.GemmConfig``).
    filter: deprecated (a ``DeprecationWarning``), removed in the next release:
      ``filter=f, recipe`` is ``rules=[(f, recipe)]``.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16)])
    >>> q = ta_linen.quantize(rules=[("layers_0", ta.DelayedScaling()),
    ...                              ("layers_2", ta.Float8CurrentScaling())], threshold=None)
    >>> variables = q(model.init)(jax.random.key(0), jnp.ones((4, 16)))
    >>> q.report.quantized, sorted(variables)
    (['layers_0', 'layers_2'], ['_overwrite_with_gradient', 'params'])
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
    filter: Callable[[str], bool] | None = None,
  ):
    options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
    self._conversion = kit.Conversion(
      "te_adapters.linen.quantize", recipe, rules, options, ("filter", filter)
    )
    self._classes: dict[int, type[QuantizedDotGeneral]] = {}

  @property
  def report(self) -> QuantizeReport:
    """The conversion's ``QuantizeReport``, filled in as the model is traced in the scope."""
    return self._conversion.report

  @property
  def rules(self) -> tuple[kit.Rule, ...]:
    """The conversion's rules, as ``Rule`` objects."""
    return self._conversion.rules

  def _interceptor(self):
    return nn.intercept_methods(self._intercept)

  def _finished(self) -> None:
    self._conversion.finish()

  def _dot_general_cls(self, choice):
    if choice.index not in self._classes:
      self._classes[choice.index] = make_dot_general_cls(choice.recipe, **choice.options.keywords())
    return self._classes[choice.index]

  def _intercept(self, next_fun, args, kwargs, context):
    module = context.module
    conversion = self._conversion
    if not conversion.active or not self.innermost():
      return next_fun(*args, **kwargs)
    for (cls, method), reason in _UNREACHABLE.items():
      if isinstance(module, cls) and context.method_name == method:
        path = _path(module)
        choice = conversion.choose(path)
        if choice.recipe is None:
          conversion.keep(path, choice.reason)
        else:
          conversion.skip(path, reason)
        return next_fun(*args, **kwargs)
    if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral)):
      return next_fun(*args, **kwargs)
    path = _path(module)
    if module.dot_general_cls in self._classes.values():
      return next_fun(*args, **kwargs)  # set by this scope, further up the same call
    if _quantized_already(module):
      if conversion.selects(path):
        conversion.already_quantized(path)
      return next_fun(*args, **kwargs)
    choice = conversion.choose(path)
    if choice.recipe is None:
      conversion.keep(path, choice.reason)
      return next_fun(*args, **kwargs)
    if module.dot_general is not None or module.dot_general_cls is not None:
      conversion.skip(path, kit.own_slot_reason())
      return next_fun(*args, **kwargs)
    inputs = args[0] if args else kwargs.get("inputs")
    k, n = _gemm_sizes(module, inputs)
    if (refusal := kit.gemm_dims_refusal(k, n)) is not None:
      conversion.skip(path, refusal)
      return next_fun(*args, **kwargs)
    m = math.prod(jnp.shape(inputs)) // k
    conversion.quantized(
      path, choice.recipe, core.high_precision_reason(choice.options.threshold, k, n, m)
    )
    # Linen modules are frozen dataclasses; the slot is set for this call only.
    object.__setattr__(module, "dot_general_cls", self._dot_general_cls(choice))
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "dot_general_cls", None)
