"""The one map from a recipe to its ``QuantizationFormat``: an unknown recipe is an error.

The package registers delayed and current scaling (per-tensor), MXFP8, NVFP4, FP8 1x128/128x128
blocks and rowwise FP8. ``register_format`` adds a format for a new recipe class (a ``Recipe``
subclass), after which ``dot_general``, ``layernorm_dense``, ``layernorm_mlp`` and ``ragged_dot``
take that recipe like any other, as far as the format serves them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax

from te_adapters.core.formats import (
  _block_scaled,
  _float8_block,
  _grouped_block,
  _grouped_rowwise,
  _mxfp8,
  _nvfp4,
  _rowwise,
  _tensor_format,
)
from te_adapters.core.formats._format import QuantizationFormat
from te_adapters.core.formats._tensor_scaling import CURRENT, DELAYED
from te_adapters.core.recipes import DelayedScaling, Float8CurrentScaling, Recipe, check_recipe
from te_adapters.core.state import DelayedScalingState, EmptyState, check_leaves, warn_dict_state

State = DelayedScalingState | EmptyState

__all__ = [
  "check_state",
  "format_of",
  "format_of_mode",
  "formats",
  "init_state",
  "register_format",
  "state_names",
  "typed_state",
  "unregister_format",
]

_FORMATS: list[QuantizationFormat] = [
  _tensor_format.tensor_format(DelayedScaling, DELAYED),
  _tensor_format.tensor_format(Float8CurrentScaling, CURRENT),
  _block_scaled.block_format(_mxfp8.FORMAT, _grouped_block.grouped_format(_mxfp8.FORMAT)),
  _block_scaled.block_format(_nvfp4.FORMAT),
  _block_scaled.block_format(
    _float8_block.FORMAT, _grouped_block.grouped_format(_float8_block.FORMAT, native=True)
  ),
  _rowwise.FORMAT._replace(grouped=_grouped_rowwise.GROUPED),
]
_PACKAGE_FORMATS = len(_FORMATS)


def formats() -> tuple[QuantizationFormat, ...]:
  """The registered formats, the package's first."""
  return tuple(_FORMATS)


def format_of(recipe: Recipe) -> QuantizationFormat:
  """The ``QuantizationFormat`` of ``recipe`` (an instance of a registered recipe class).

  Args:
    recipe: a recipe instance, such as ``DelayedScaling()``.

  Returns:
    The format registered for the recipe's class (or, failing that, for its nearest base class).

  Raises:
    TypeError: for an object no registered format takes.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.format_of(ta.DelayedScaling()).per_tensor
    True
  """
  for fmt in _FORMATS:
    if type(recipe) is fmt.recipe_type:
      return fmt
  for fmt in _FORMATS:
    if isinstance(recipe, fmt.recipe_type):
      return fmt
  names = ", ".join(f.recipe_type.__name__ for f in _FORMATS)
  raise TypeError(
    f"no quantization format is registered for {type(recipe).__module__}."
    f"{type(recipe).__name__}; registered recipes: {names} "
    "(te_adapters.core.register_format adds one)"
  )


def format_of_mode(scaling_mode: str) -> QuantizationFormat:
  """The registered format whose tensors have ``scaling_mode`` (a ValueError for none)."""
  for fmt in _FORMATS:
    if scaling_mode in fmt.scaling_modes:
      return fmt
  raise ValueError(f"unknown scaling mode {scaling_mode!r}")


def register_format(fmt: QuantizationFormat) -> None:
  """Registers ``fmt`` for its ``recipe_type`` (a ``Recipe`` subclass not registered yet).

  From then on ``format_of`` gives ``fmt`` for that class (and its subclasses without a format
  of their own), so ``dot_general``, ``layernorm_dense``, ``layernorm_mlp`` and ``ragged_dot``
  take the recipe as far as the format serves them.

  Args:
    fmt: the ``QuantizationFormat``.

  Returns:
    None.

  Raises:
    TypeError: ``fmt`` is not a ``QuantizationFormat``, or its ``recipe_type`` not a ``Recipe``
      subclass.
    ValueError: a format for that class is registered already.

  Example:
    >>> import dataclasses, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class MyScaling(ta.Float8CurrentScaling):
    ...   pass
    >>> fmt = ta.core.format_of(ta.Float8CurrentScaling())._replace(recipe_type=MyScaling)
    >>> ta.core.register_format(fmt)
    >>> ta.core.format_of(MyScaling()) is fmt
    True
    >>> ta.core.register_format(fmt)
    Traceback (most recent call last):
      ...
    ValueError: a format for MyScaling is already registered
    >>> ta.core.unregister_format(MyScaling)
  """
  if not isinstance(fmt, QuantizationFormat):
    raise TypeError(f"register takes a QuantizationFormat, got {type(fmt).__name__}")
  if not (isinstance(fmt.recipe_type, type) and issubclass(fmt.recipe_type, Recipe)):
    raise TypeError(f"Format.recipe_type must be a Recipe subclass, got {fmt.recipe_type!r}")
  if any(f.recipe_type is fmt.recipe_type for f in _FORMATS):
    raise ValueError(f"a format for {fmt.recipe_type.__name__} is already registered")
  _FORMATS.append(fmt)
  if fmt.block is not None:
    _block_scaled.register_block(fmt.block)


def unregister_format(recipe_type: type) -> None:
  """Removes the format registered for ``recipe_type`` (not one of the package's own).

  Args:
    recipe_type: the recipe class given to ``register_format``.

  Returns:
    None.

  Raises:
    ValueError: no format was registered by ``register_format`` for that class (the package's
      own formats cannot be removed).

  Example:
    >>> import dataclasses, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class MyScaling(ta.Float8CurrentScaling):
    ...   pass
    >>> fmt = ta.core.format_of(ta.Float8CurrentScaling())._replace(recipe_type=MyScaling)
    >>> ta.core.register_format(fmt)
    >>> ta.core.unregister_format(MyScaling)
    >>> ta.core.format_of(MyScaling()) is fmt  # back to its base class's format
    False
    >>> ta.core.unregister_format(ta.DelayedScaling)
    Traceback (most recent call last):
      ...
    ValueError: no format registered by register_format() for <class '...DelayedScaling'>
  """
  for fmt in _FORMATS[_PACKAGE_FORMATS:]:
    if fmt.recipe_type is recipe_type:
      _FORMATS.remove(fmt)
      if fmt.block is not None:
        _block_scaled.unregister_block(fmt.block)
      return
  raise ValueError(f"no format registered by register_format() for {recipe_type!r}")


# --- a recipe's state, as its format keeps it ----------------------------------------------------


def state_names(recipe: Recipe) -> tuple[str, ...]:
  """The variable names of ``recipe``'s state, in TE's spelling (empty for stateless recipes).

  Args:
    recipe: a recipe instance.

  Returns:
    A tuple of names, in the order of the format's ``state_shapes``.

  Raises:
    TypeError: no registered format takes ``recipe``.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.state_names(ta.DelayedScaling())[:2]
    ('x_scale', 'x_amax_history')
    >>> len(ta.core.state_names(ta.DelayedScaling()))  # the same two for kernel and grad
    6
    >>> ta.core.state_names(ta.MXFP8BlockScaling())
    ()
  """
  return tuple(format_of(recipe).state_shapes(recipe))


def init_state(recipe: Recipe) -> State:
  """The initial state of one GEMM under ``recipe``, of its format's state type.

  For ``DelayedScaling`` a ``DelayedScalingState`` with ``{x,kernel,grad}_scale`` (float32
  (1,), initialised to 1) and ``{x,kernel,grad}_amax_history`` (float32 (L,), zeros), which
  reads as a mapping of those names; for stateless recipes an ``EmptyState`` (equal to ``{}``).

  Args:
    recipe: the GEMM's recipe.

  Returns:
    The state to pass as ``dot_general(..., state=)`` on the first step.

  Example:
    >>> import te_adapters as ta
    >>> sorted(ta.core.init_state(ta.DelayedScaling(amax_history_len=4)))[:2]
    ['grad_amax_history', 'grad_scale']
    >>> ta.core.init_state(ta.MXFP8BlockScaling())
    EmptyState()
  """
  recipe = check_recipe(recipe)
  return format_of(recipe).init_state(recipe)


@functools.lru_cache(maxsize=64)
def _state_template(recipe):
  """The format's state type for ``recipe``, by name: ``(names, treedef, type)``."""
  shapes = jax.eval_shape(lambda: format_of(recipe).init_state(recipe))
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  names = tuple(jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in paths)
  return names, treedef, type(shapes)


def typed_state(recipe: Recipe, state: Mapping[str, Any]) -> State:
  """``state`` as the state type of ``recipe``'s format: a mapping of TE's names (a saved dict,
  a Linen collection, an old checkpoint) becomes a ``DelayedScalingState``, an empty one an
  ``EmptyState``; a state of the format's type comes back as it is. Shapes are not checked
  (one GEMM's state and a grouped GEMM's stacked state both convert); the core's functions check
  them where the state is used.

  Args:
    recipe: the recipe the state belongs to.
    state: a mapping of TE's names (``x_scale``, ``x_amax_history``, ...), or a typed state.

  Returns:
    The state, of ``recipe``'s state type.

  Raises:
    TypeError: ``state`` is not a mapping.
    ValueError: its names are not the recipe's (the message lists the missing and unexpected).

  Example:
    >>> import numpy as np, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> saved = {k: np.asarray(v) for k, v in ta.core.init_state(recipe).items()}
    >>> type(ta.core.typed_state(recipe, saved)).__name__
    'DelayedScalingState'
  """
  names, treedef, state_type = _state_template(check_recipe(recipe))
  if isinstance(state, state_type):
    return state
  if not isinstance(state, Mapping):
    raise TypeError(
      f"state must be a mapping of {type(recipe).__name__}'s state names or its typed state, "
      f"got {type(state).__name__}"
    )
  missing = [n for n in names if n not in state]
  extra = sorted(str(k) for k in state if k not in names)
  if missing or extra:
    raise ValueError(
      f"state does not match {recipe!r}: missing {missing}, unexpected {extra}; the state of "
      f"{type(recipe).__name__} has the entries {list(names)}"
    )
  return treedef.unflatten([state[n] for n in names])


def _expected_shapes(recipe) -> dict[str, tuple[int, ...]]:
  return format_of(recipe).state_shapes(recipe)


def check_state(recipe: Recipe, state: Mapping[str, Any] | None, layer: str | None = None) -> State:
  """Validates ``state`` against ``recipe``; returns it typed (``typed_state``). The core's
  functions call it once, where a call enters the core. A dict of TE's names (the spelling before
  the typed state) is accepted with a ``DeprecationWarning``. Raises naming the mismatch, and
  ``layer`` where given.

  Args:
    recipe: the recipe the state belongs to.
    state: one GEMM's state (typed, or a dict of TE's names), or None for a stateless recipe.
    layer: what the GEMM's messages call its layer (``dot_general``'s ``layer``), which then
      starts every error message; None: the messages name no layer.

  Returns:
    The state, of ``recipe``'s state type (an ``EmptyState`` for None).

  Raises:
    ValueError: None for a stateful recipe, missing or unexpected entries, or an entry of the
      wrong shape.
    TypeError: ``state`` is not a mapping.

  Example:
    >>> import te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> ta.core.check_state(recipe, ta.core.init_state(recipe))["x_scale"].shape
    (1,)
    >>> ta.core.check_state(recipe, ta.core.init_state(ta.DelayedScaling(amax_history_len=8)))
    Traceback (most recent call last):
      ...
    ValueError: state['x_amax_history'] has shape (8,) but DelayedScaling(...) needs (4,)
  """
  expected = _expected_shapes(recipe)
  if state is None:
    if expected:
      lead = f"{layer}: " if layer else ""
      raise ValueError(
        f"{lead}{type(recipe).__name__} keeps state: pass state=te_adapters.core.init_state(recipe)"
      )
    return typed_state(recipe, {})
  warn_dict_state(
    state,
    "te_adapters.core.init_state(recipe), or te_adapters.core.typed_state(recipe, "
    "saved) for a saved dict",
  )
  check_leaves(
    state,
    expected,
    mismatch=f"state does not match {recipe!r}",
    bad_shape=lambda name, got, shape: (
      f"state[{name!r}] has shape {got} but {recipe!r} needs {shape}"
    ),
    layer=layer,
  )
  return typed_state(recipe, state)
