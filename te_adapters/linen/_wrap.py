"""TE's ``wrap_function_in_te_state_module``: a function that calls the core, given recipe state
by a Linen module that owns it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.linen._module import gemm_state, layer_label, rounding_key

__all__ = ["wrap_function_in_te_state_module"]


def wrap_function_in_te_state_module(
  f: Callable,
  recipe: core.Recipe | None,
  name: str | None = None,
  *,
  threshold=kit.DEFAULT_THRESHOLD,
  config: core.GemmConfig | None = None,
) -> type[nn.Module]:
  """A Linen module class that runs ``f`` with recipe state it owns (TE's function of this name).

  Calling an instance, ``Wrapper()(*args, **kwargs)``, returns
  ``f(quantization, *args, **kwargs)``. Each call of ``quantization(postfix="", n_groups=None)``
  inside ``f`` declares one GEMM's recipe state in the ``"_overwrite_with_gradient"``
  collection, under TE's names with ``postfix`` (``x{postfix}_scale``,
  ``kernel{postfix}_amax_history``, ...), and returns the keyword arguments that quantize one
  core call with that state:

  - ``core.dot_general(x, w, dims, **quantization())`` and ``core.layernorm_dense(...)`` take
    ``recipe``, ``state``, ``rng`` (a key from the ``"sr_rng"`` stream where the recipe rounds
    stochastically), ``threshold`` and ``config``;
  - with ``n_groups=G``, ``core.ragged_dot(lhs, rhs, group_sizes, **quantization(n_groups=G))``
    takes ``recipe`` and a grouped GEMM's ``state``;
  - both also take ``layer`` (the wrapper's path, with ``postfix``) and ``framework``
    (``"linen"``), so warnings name the GEMM and give Linen's remedy;
  - ``core.layernorm_mlp`` takes one state per GEMM: with ``q0, q1 = quantization("_0"),
    quantization("_1")`` pass ``recipe=q0["recipe"], states=(q0["state"], q1["state"])``, the
    names TE's ``LayerNormMLP`` uses.

  As with every Linen module here, the gradient of the loss with respect to
  ``"_overwrite_with_gradient"`` is that state's value for the next step
  (``te_adapters.linen.value_and_grad`` and ``TrainState`` apply it). The module owns no
  parameters: pass them to ``f`` as arguments, or declare them in the module that calls it.
  A GEMM's state is declared once per call of the wrapper; two calls of ``quantization`` with
  the same postfix in one call of ``f`` are an error, not a shared state.

  Args:
    f: ``f(quantization, *args, **kwargs)``.
    recipe: a te_adapters recipe, or ``None`` (``quantization()`` then returns ``recipe=None``
      and no state: high precision).
    name: the class is named ``TEWrapper_<name>`` (default ``f.__name__``), as TE's.
    threshold, config: what ``quantization()`` passes to ``core.dot_general``: GEMMs below the
      ``SizeThreshold`` stay in high precision (``None`` quantizes every GEMM); a
      ``core.GemmConfig`` or ``None``.

  Returns:
    A subclass of ``nn.Module`` taking no required constructor arguments.

  Raises:
    TypeError: ``f`` is not callable.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import core, linen as ta_linen
    >>> def matmul(quantization, x, w):
    ...   return core.dot_general(x, w, (((1,), (0,)), ((), ())), **quantization())
    >>> Matmul = ta_linen.wrap_function_in_te_state_module(
    ...     matmul, ta.DelayedScaling(amax_history_len=4), threshold=None)
    >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> variables = Matmul().init(jax.random.PRNGKey(0), x, w)
    >>> sorted(variables["_overwrite_with_gradient"])[:3]
    ['grad_amax_history', 'grad_scale', 'kernel_amax_history']
  """
  if not callable(f):
    raise TypeError(f"wrap_function_in_te_state_module: f must be callable, got {f!r}")
  recipe = kit.check_recipe_or_none(recipe)
  options = kit.GemmOptions(threshold, config=config)
  label = name if name is not None else getattr(f, "__name__", "function")

  class Wrapper(nn.Module):
    """Runs the wrapped function with recipe state it owns."""

    @nn.compact
    def __call__(self, *args, **kwargs):
      declared: set[str] = set()

      def quantization(postfix: str = "", n_groups: int | None = None) -> dict[str, Any]:
        if not isinstance(postfix, str):
          raise TypeError(f"{type(self).__name__}: postfix must be a str, got {postfix!r}")
        if n_groups is not None and (
          isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1
        ):
          raise ValueError(
            f"{type(self).__name__}: n_groups must be a positive int or None, got {n_groups!r}"
          )
        if postfix in declared:
          raise ValueError(
            f"{type(self).__name__}: the state of GEMM postfix {postfix!r} was already "
            "declared in this call; give each GEMM its own postfix"
          )
        declared.add(postfix)
        state = gemm_state(self, recipe, postfix, n_groups)
        # How the core's warnings name this GEMM: the wrapper's path, and the GEMM's postfix.
        layer = layer_label(self)
        if layer is not None and postfix:
          layer = f"{layer}, GEMM {postfix!r}"
        named = {"layer": layer, "framework": "linen"}
        if n_groups is not None:
          return {"recipe": recipe, "state": state, **named}
        return {
          "recipe": recipe,
          "state": state,
          "rng": rounding_key(self, recipe),
          **options.keywords(spmd=False),
          **named,
        }

      return f(quantization, *args, **kwargs)

  Wrapper.__name__ = Wrapper.__qualname__ = f"TEWrapper_{label}"
  Wrapper.recipe = recipe  # type: ignore[attr-defined]  # an attribute of the made class
  return Wrapper
