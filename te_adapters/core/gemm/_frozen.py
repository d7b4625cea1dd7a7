"""A warning when a training step would leave DelayedScaling state silently frozen.

The new state leaves a step as the gradient with respect to the state. A loop that differentiates
the parameters only (``jax.grad`` over params, ``nnx.value_and_grad`` with its default
``wrt=nnx.Param``) runs without error, but the amax histories stay zero and the scales at their
initial values for the whole run. ``watch_state`` is an identity whose forward rule, run only
under differentiation, sees which operands are being differentiated and warns once per GEMM at
trace time when the operands are and the state is not.

A layer with low-rank adaptation trained alone (its frozen base kernel and the input not
differentiated, only the LoRA factors) never differentiates its base GEMM's operands, so that
GEMM cannot see the step. ``watch_lora_state`` watches the factors against the base GEMM's state
in the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp

from te_adapters.core.gemm import _threshold
from te_adapters.core.recipes import caller_stacklevel

if TYPE_CHECKING:
  from te_adapters.core.gemm._threshold import SizeThreshold
  from te_adapters.core.state import State

_State = TypeVar("_State")

__all__ = ["FRAMEWORKS", "FrozenStateWarning", "check_framework", "watch_lora_state", "watch_state"]

# How to differentiate the state too (its gradient is the new state), per framework.
REMEDIES = {
  "linen": (
    "te_adapters.linen.TrainState.value_and_grad (or jax.grad over the params and the "
    "'_overwrite_with_gradient' collection, then put the new collection in the variables)"
  ),
  "nnx": (
    "te_adapters.nnx.value_and_grad (or nnx.grad with argnums=nnx.DiffState(0, "
    "nnx.Any(nnx.Param, te_adapters.nnx.RecipeState)), then "
    "te_adapters.nnx.update_recipe_state)"
  ),
  "haiku": (
    "te_adapters.haiku.value_grad_and_state (or jax.grad over params and state, the state's "
    "gradient being the new state)"
  ),
  None: "jax.grad with respect to the state too (its gradient is the new state)",
}
FRAMEWORKS = ("linen", "nnx", "haiku")
_NAMES = {"linen": "Flax Linen", "nnx": "Flax NNX", "haiku": "Haiku", None: "plain JAX"}

# Every framework's remedy, for callers that do not say which framework they are.
HOW_TO_FIX = (
  "Differentiate the state too: "
  + "; ".join(f"{_NAMES[framework]} {remedy}" for framework, remedy in REMEDIES.items())
  + "."
)


class FrozenStateWarning(UserWarning):
  """A DelayedScaling GEMM is differentiated without its state: the state will not update.

  Issued at trace time, once per GEMM, when its operands are differentiated and its state is
  not (a loop that takes the gradient of the parameters only): the amax histories would stay
  zero and the scales at 1 for the whole run. The message names the layer and gives the remedy
  of its framework.

  Example:
    >>> import warnings, jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> dn = (((1,), (0,)), ((), ()))
    >>> def loss(w, state):
    ...   return ta.core.dot_general(jnp.ones((16, 32)), w, dn, recipe=recipe, state=state,
    ...                              threshold=None).sum()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   grad_w = jax.grad(loss)(jnp.ones((32, 16)), ta.core.init_state(recipe))
    >>> [w.category.__name__ for w in caught]
    ['FrozenStateWarning']
    >>> with warnings.catch_warnings(record=True) as caught:  # the remedy: the state's gradient
    ...   warnings.simplefilter("always")
    ...   grads = jax.grad(loss, argnums=(0, 1))(jnp.ones((32, 16)), ta.core.init_state(recipe))
    >>> caught
    []
  """


def check_framework(framework: str | None) -> str | None:
  """``framework`` if it is one whose remedies messages know (or None), else a ValueError."""
  if framework not in REMEDIES:
    raise ValueError(f"framework must be one of {FRAMEWORKS} or None, got {framework!r}")
  return framework


def _remedy(framework: str | None) -> str:
  if framework is None:
    return HOW_TO_FIX
  return f"Differentiate the state too: {REMEDIES[framework]}."


def _describe(lhs, rhs) -> str:
  return f"x {tuple(lhs.shape)} {lhs.dtype} . kernel {tuple(rhs.shape)} {rhs.dtype}"


def _message(kind: str, lhs, rhs, layer: str | None, framework: str | None) -> str:
  if kind == "lora":
    where = f" of {layer}" if layer else ""
    return (
      f"te_adapters: the low-rank adaptation factors {tuple(lhs.shape)} and "
      f"{tuple(rhs.shape)}{where} are differentiated while the DelayedScaling state of their "
      "layer's base GEMM is not, so its amax histories and scales never update (the scales "
      f"stay as initialised). {_remedy(framework)}"
    )
  where = f"{layer} ({_describe(lhs, rhs)})" if layer else f"the GEMM {_describe(lhs, rhs)}"
  return (
    f"te_adapters: the DelayedScaling state of {where} is not differentiated while its "
    "operands are, so its amax histories and scales never update (the scales stay as "
    f"initialised). {_remedy(framework)}"
  )


def _warn(message: str) -> None:
  # Issued while JAX traces the step: point at the user's line (their loss function's call of
  # the model), not at JAX's or the framework's frames.
  warnings.warn(FrozenStateWarning(message), stacklevel=caller_stacklevel())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _watch(lhs, rhs, state, layer, framework):
  del layer, framework
  return lhs, rhs, state


def _watch_fwd(lhs, rhs, state, layer, framework):
  operands = lhs.perturbed or rhs.perturbed
  leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda v: hasattr(v, "perturbed"))
  if operands and leaves and not all(v.perturbed for v in leaves):
    _warn(_message("gemm", lhs.value, rhs.value, layer, framework))
  values = jax.tree_util.tree_map(
    lambda v: v.value, (lhs, rhs, state), is_leaf=lambda v: hasattr(v, "perturbed")
  )
  return values, None


def _watch_bwd(layer, framework, _, cts):
  del layer, framework
  return jax.tree_util.tree_map(
    lambda c: None if isinstance(c, jax.custom_derivatives.SymbolicZero) else c,
    cts,
    is_leaf=lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero),
  )


_watch.defvjp(_watch_fwd, _watch_bwd, symbolic_zeros=True)


def watch_state(
  lhs: jax.Array,
  rhs: jax.Array,
  state: _State,
  *,
  layer: str | None = None,
  framework: str | None = None,
) -> tuple[jax.Array, jax.Array, _State]:
  """``(lhs, rhs, state)`` unchanged; under differentiation, warns with ``FrozenStateWarning``
  when ``lhs`` or ``rhs`` is differentiated and some leaf of ``state`` is not.

  The warning names ``layer`` (``"layer 'blocks/0/mlp'"``: the layer's path in its model, where
  the caller knows it) beside
  the operands' shapes, gives the remedy of ``framework`` (``"linen"``, ``"nnx"``, ``"haiku"``;
  ``None``: every framework's), and points at the user's line."""
  return _watch(lhs, rhs, state, layer, framework)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _watch_factors(lhs, rhs, state, layer, framework):
  del layer, framework
  return lhs, rhs


def _watch_factors_jvp(layer, framework, primals, tangents):
  # A custom JVP, not a VJP: forward-mode differentiation through the factors keeps working.
  # Tangents of what is not differentiated arrive as symbolic zeros.
  lhs, rhs, state = primals
  t_lhs, t_rhs, t_state = tangents
  zero = lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)  # noqa: E731
  leaves = jax.tree_util.tree_leaves(t_state, is_leaf=zero)
  if (not zero(t_lhs) or not zero(t_rhs)) and leaves and any(zero(t) for t in leaves):
    _warn(_message("lora", lhs, rhs, layer, framework))
  tangents = tuple(jnp.zeros_like(p) if zero(t) else t for p, t in ((lhs, t_lhs), (rhs, t_rhs)))
  return (lhs, rhs), tangents


_watch_factors.defjvp(_watch_factors_jvp, symbolic_zeros=True)


def watch_lora_state(
  lora_a: jax.Array,
  lora_b: jax.Array,
  state: State | Mapping[str, Any] | None,
  *,
  x_shape: Sequence[int],
  kernel_shape: Sequence[int],
  axis: int | Sequence[int] = -1,
  threshold: SizeThreshold | None = _threshold.DEFAULT_SIZE_THRESHOLD,
  layer: str | None = None,
  framework: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(lora_a, lora_b)`` unchanged; under differentiation, warns with ``FrozenStateWarning``
  when a LoRA factor is differentiated and some leaf of ``state`` is not, where the base GEMM
  runs in FP8.

  Args:
    lora_a, lora_b: the layer's LoRA factors.
    state: the recipe state of the layer's base GEMM; ``None`` or empty (no recipe, or a
      stateless one): nothing to watch.
    x_shape, kernel_shape, axis, threshold: the base GEMM, ``x`` contracting ``axis`` with the
      kernel's leading axes (as ``low_rank_adaptation``), under ``dot_general``'s ``threshold``.
      Below the threshold it runs in high precision and its state does not move, so nothing is
      frozen.
    layer, framework: what the warning calls the layer (its path in its model, or None) and
      whose remedy it gives (``"linen"``, ``"nnx"``, ``"haiku"``; None: every framework's).

  A custom JVP: forward-mode differentiation through the factors works, and warns in the same
  case.

  Returns:
    ``(lora_a, lora_b)``, their values unchanged.

  Example:
    >>> import warnings, jax, jax.numpy as jnp, te_adapters as ta
    >>> state = ta.core.init_state(ta.DelayedScaling(amax_history_len=4))
    >>> x = jnp.ones((16, 32))
    >>> def loss(a, b):
    ...   a, b = ta.core.watch_lora_state(a, b, state, x_shape=x.shape, kernel_shape=(32, 16),
    ...                                   threshold=None, layer="dense")
    ...   return (x @ a @ b).sum()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   grads = jax.grad(loss, argnums=(0, 1))(jnp.ones((32, 4)), jnp.zeros((4, 16)))
    >>> [w.category.__name__ for w in caught]
    ['FrozenStateWarning']
  """
  if not state:
    return lora_a, lora_b
  axes = tuple(a % len(x_shape) for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
  dims = ((axes, tuple(range(len(axes)))), ((), ()))
  if not _threshold.runs_in_fp8(tuple(x_shape), tuple(kernel_shape), dims, threshold):
    return lora_a, lora_b
  return _watch_factors(lora_a, lora_b, state, layer, framework)
