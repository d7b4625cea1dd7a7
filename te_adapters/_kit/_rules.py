"""Conversion rules, and the half of every adapter's conversion that knows no framework.

A conversion (``te_adapters.linen.quantize``, ``te_adapters.nnx.quantize_model``,
``te_adapters.haiku.quantize``) takes ``rules``: ``Rule(path, recipe, ...)`` entries, each a
regular expression on a layer's path (the names the framework gives its modules, joined by
``/``) with the recipe for the layers it matches (``None`` keeps them in high precision) and
GEMM options; the first rule that matches a layer decides, and a layer no rule matches stays in
high precision. The adapter finds the layers and their paths; ``Conversion`` decides what each
gets, keeps the report, and says what went wrong the same way in every adapter.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from te_adapters import core
from te_adapters._kit._options import GemmOptions, check_needs_recipe
from te_adapters._kit._recipe import check_recipe_or_none

__all__ = [
  "Conversion",
  "Rule",
  "SkippedLayersWarning",
  "attend_reason",
  "own_slot_reason",
]


class _Inherit:
  """A rule's GEMM option left to the conversion's."""

  def __repr__(self) -> str:
    return "<the conversion's>"


INHERIT = _Inherit()

# The reasons a report gives, the same in every adapter.
NO_RULE = "no rule selects it"
_OPTIONS = ("threshold", "amax_axes", "kernel_all_gather", "config")


def own_slot_reason(slot: str = "dot_general") -> str:
  """Why a layer whose GEMM slot holds a function of its own is left alone."""
  return f"it has a {slot} of its own"


def attend_reason(owner: str, called: bool = True) -> str:
  """Why a module's ``attend`` (a tied output projection) is not converted; ``called=False``
  where the adapter cannot tell whether the model calls it (NNX converts before it runs)."""
  return (
    f"{owner}.attend (a tied output projection){'' if called else ', if the model calls it,'} "
    "computes its GEMM outside any dot_general slot, where no conversion reaches it"
  )


class SkippedLayersWarning(UserWarning):
  """A conversion could not quantize layers that a rule gave a recipe; they run in high
  precision. One warning per conversion lists them with the reasons (``report.skipped``).

  Each adapter's conversion issues it (``te_adapters.linen.quantize``,
  ``te_adapters.nnx.quantize_model``, ``te_adapters.haiku.quantize``); make it an error where
  every matched layer must be quantized.

  Example:
    >>> import warnings, jax, jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = nnx.Sequential(nnx.Linear(32, 16, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(16, 10, rngs=nnx.Rngs(1)))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   report = ta_nnx.quantize_model(model, ta.Float8CurrentScaling())
    >>> [w.category.__name__ for w in caught], len(report.skipped)  # N=10: not a multiple of 16
    (['SkippedLayersWarning'], 1)
  """


@dataclasses.dataclass(frozen=True)
class Rule:
  """Which layers a conversion quantizes, and how.

  Args:
    path: a regular expression that must match a layer's whole path (``re.fullmatch``), the
      names the framework gives its modules joined by ``/``: Linen
      ``"decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0"``, NNX ``"layers/0/mlp/up_proj"``,
      Haiku ``"transformer/multi_head_attention/query"`` (``~`` scopes included, as in
      ``"mlp/~/linear_0"``). Or a function of that path string returning a bool.
    recipe: the recipe of the layers it matches, or ``None`` to keep them in high precision.
    threshold, amax_axes, kernel_all_gather, config: the GEMM options of those layers (as for
      ``core.dot_general``); left out, the conversion's own.

  Raises:
    ValueError: ``path`` is a string that is not a regular expression.
    TypeError: ``path`` is neither a string nor a callable.

  Example:
    >>> import te_adapters as ta
    >>> rule = ta.Rule(r".*/mlp/.*", ta.Float8CurrentScaling(), threshold=None)
    >>> rule.matches("layers/0/mlp/up_proj"), rule.matches("layers/0/attn/q_einsum")
    (True, False)
  """

  path: str | Callable[[str], bool]
  recipe: core.Recipe | None
  threshold: Any = INHERIT
  amax_axes: Any = INHERIT
  kernel_all_gather: Any = INHERIT
  config: Any = INHERIT

  def __post_init__(self):
    if isinstance(self.path, str):
      try:
        re.compile(self.path)
      except re.error as e:
        raise ValueError(f"Rule: path {self.path!r} is not a regular expression: {e}") from e
    elif not callable(self.path):
      raise TypeError(
        "Rule: path must be a regular expression (str) or a function of the path string, got "
        f"{type(self.path).__name__}"
      )
    object.__setattr__(self, "recipe", check_recipe_or_none(self.recipe))
    if self.threshold is not INHERIT:
      object.__setattr__(self, "threshold", core.check_threshold(self.threshold))
    if self.config is not INHERIT:
      object.__setattr__(self, "config", core.check_config(self.config))
    spmd = {o: getattr(self, o) for o in ("amax_axes", "kernel_all_gather")}
    check_needs_recipe(
      self.recipe,
      f"Rule({self.describe()})",
      **{o: None if v is INHERIT else v for o, v in spmd.items()},
    )

  def matches(self, path: str) -> bool:
    """Whether this rule selects the layer at ``path``.

    Args:
      path: the layer's path in its model, as the conversion spells it (``"layers/0"``).

    Returns:
      True where the regex matches the whole path (or the function returns true).
    """
    if isinstance(self.path, str):
      return re.fullmatch(self.path, path) is not None
    return bool(self.path(path))

  def describe(self) -> str:
    """The rule's pattern as messages show it: the regex, or the function's name.

    Returns:
      The regex in quotes, or the function's qualified name.
    """
    if isinstance(self.path, str):
      return f"'{self.path}'"
    return getattr(self.path, "__qualname__", None) or repr(self.path)

  def options(self, base: GemmOptions) -> GemmOptions:
    """This rule's GEMM options, those it leaves out taken from ``base``.

    Args:
      base: the conversion's options (its ``threshold``, ``amax_axes``, ``kernel_all_gather``
        and ``config``).

    Returns:
      The options a layer this rule selects is built with.
    """
    return GemmOptions(
      **{name: getattr(base if getattr(self, name) is INHERIT else self, name) for name in _OPTIONS}
    )


def as_rule(entry) -> Rule:
  """``entry`` as a ``Rule``: a ``Rule``, or a tuple ``(path, recipe)`` /
  ``(path, recipe, {options})``."""
  if isinstance(entry, Rule):
    return entry
  if isinstance(entry, tuple) and len(entry) in (2, 3):
    options = entry[2] if len(entry) == 3 else {}
    if not isinstance(options, dict):
      raise TypeError(f"a rule's third entry is a dict of GEMM options, got {options!r}")
    return Rule(entry[0], entry[1], **options)
  raise TypeError(
    f"each rule is a te_adapters.Rule or a tuple (path, recipe[, options]), got {entry!r}"
  )


@dataclasses.dataclass(frozen=True)
class Quantized:
  """A layer a rule quantizes: the rule's recipe and GEMM options."""

  recipe: core.Recipe
  options: GemmOptions
  index: int  # the rule that decided


@dataclasses.dataclass(frozen=True)
class HighPrecision:
  """A layer that stays in high precision, and why (``recipe`` is always None)."""

  recipe: None
  reason: str
  index: int | None  # the rule that decided, None when no rule matched


# What a conversion does with one layer; ``choice.recipe is None`` tells the two apart.
Choice = Quantized | HighPrecision


class Unset:
  """The type of ``UNSET``, the default of an argument the caller did not pass."""

  def __repr__(self) -> str:
    return "<unset>"


UNSET = Unset()


class Conversion:
  """One conversion: its rules, its report, its warnings and errors.

  Args:
    caller: how messages name the conversion (``"te_adapters.nnx.quantize_model"``).
    recipe: the recipe of every layer (the rule ``Rule(".*", recipe)``), ``None`` for none; or
      ``UNSET`` when ``rules`` are given.
    rules: a sequence of ``Rule`` (or tuples), or ``None``.
    options: the conversion's GEMM options, those of every rule that leaves them out.
    deprecated_filter: the old filter argument, a function of the path string, and its name
      (``("filter", f)``); warns with a ``DeprecationWarning`` at the caller's line.
  """

  def __init__(
    self,
    caller: str,
    recipe,
    rules: Sequence | None,
    options: GemmOptions,
    deprecated_filter: tuple[str, Callable[[str], bool] | None] = ("filter", None),
  ):
    self.caller = caller
    filter_name, filter_fn = deprecated_filter
    if rules is not None and recipe is not UNSET:
      raise TypeError(f"{caller}: pass either a recipe or rules=[...], not both")
    if rules is not None and filter_fn is not None:
      raise TypeError(f"{caller}: pass either rules=[...] or {filter_name}=, not both")
    if filter_fn is not None:
      if not callable(filter_fn):
        raise TypeError(f"{filter_name} must be callable, got {type(filter_fn).__name__}")
      warnings.warn(
        f"{caller}: {filter_name}= is deprecated and will be removed in the next release; pass "
        "rules=[(pattern, recipe)], each pattern a regular expression on the layer's path or "
        "a function of the path string (first match wins; recipe None keeps a layer in high "
        "precision)",
        DeprecationWarning,
        stacklevel=core.caller_stacklevel(),
      )
    if rules is None:
      if recipe is UNSET:
        raise TypeError(f"{caller}: pass a recipe or rules=[...]")
      recipe = check_recipe_or_none(recipe)
      if recipe is None:
        rules = ()
      else:
        rules = (Rule(".*" if filter_fn is None else filter_fn, recipe),)
    elif isinstance(rules, (str, Rule)) or not isinstance(rules, Sequence):
      raise TypeError(f"{caller}: rules must be a list of rules, got {type(rules).__name__}")
    self.rules = tuple(as_rule(r) for r in rules)
    self.options = options
    self.active = any(rule.recipe is not None for rule in self.rules)
    self.report = core.QuantizeReport()
    self._rule_options = [rule.options(options) for rule in self.rules]
    self._warned: set[str] = set()
    self._conflicts: list[str] = []

  def choose(self, path: str) -> Choice:
    """What the first rule matching ``path`` gives the layer there."""
    for index, rule in enumerate(self.rules):
      if rule.matches(path):
        if rule.recipe is None:
          return HighPrecision(
            None, f"rule {index} ({rule.describe()}) keeps it in high precision", index
          )
        return Quantized(rule.recipe, self._rule_options[index], index)
    return HighPrecision(None, NO_RULE, None)

  def selects(self, path: str) -> bool:
    """Whether some rule matches ``path`` (with a recipe or ``None``)."""
    return any(rule.matches(path) for rule in self.rules)

  def keep(self, path: str, reason: str) -> None:
    """Records a layer kept in high precision by the rules."""
    self.report.high_precision.setdefault(path, reason)

  def skip(self, path: str, reason: str) -> None:
    """Records a layer a rule gave a recipe that the conversion could not quantize."""
    self.report.skipped.setdefault(path, reason)

  def quantized(self, path: str, recipe, below_threshold: str | None = None) -> None:
    """Records a quantized layer, and why its GEMM runs in high precision all the same (below
    the size threshold), if it does."""
    if path not in self.report.quantized:
      self.report.quantized.append(path)
      self.report.recipes[path] = recipe
    if below_threshold is not None:
      self.report.high_precision.setdefault(path, below_threshold)

  def already_quantized(self, path: str) -> None:
    """Records a layer a rule selects that computes with a recipe already."""
    if path not in self._conflicts:
      self._conflicts.append(path)

  def finish(self) -> None:
    """Ends one pass over the model: an error naming the layers that were quantized already,
    else one ``SkippedLayersWarning`` (at the user's line) listing the layers skipped since the
    last pass."""
    if self._conflicts:
      names = ", ".join(self._conflicts)
      self._conflicts = []
      raise ValueError(
        f"{self.caller}: these layers are quantized already, by an earlier conversion or a "
        f"recipe of their own: {names}. Convert each layer once: give every rule to one "
        "conversion, or write the rules so that none matches these layers"
      )
    new = {p: r for p, r in self.report.skipped.items() if p not in self._warned}
    if not new:
      return
    self._warned.update(new)
    lines = "".join(f"\n  {path}: {reason}" for path, reason in new.items())
    warnings.warn(
      SkippedLayersWarning(
        f"{self.caller}: {len(new)} layer(s) that a rule gave a recipe stay in high "
        f"precision:{lines}\n(listed in the report's skipped; a rule with recipe None keeps "
        "a layer in high precision without this warning)"
      ),
      stacklevel=core.caller_stacklevel(),
    )
