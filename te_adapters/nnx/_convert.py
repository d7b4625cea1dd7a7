"""Converting the linear layers of an existing NNX model to quantized GEMMs, in place."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._layers import Einsum, Linear, LinearGeneral
from te_adapters.nnx._ops import (
  SR_RNG,
  DotGeneral,
  EinsumOp,
  _RecipeOp,
  kernel_annotation,
  source_stream,
)

__all__ = ["QuantizeReport", "quantize_model"]


QuantizeReport = kit.QuantizeReport  # one report type for every adapter


def _gemm_plan(layer) -> tuple[str, int, tuple[int, int]] | tuple[str, str]:
  """``(slot, kernel_ndim, (K, N))`` of an NNX linear layer, or ``(slot, reason_to_skip)``."""
  if isinstance(layer, nnx.Linear):
    if layer.dot_general is not lax.dot_general:
      return "dot_general", kit.own_slot_reason("dot_general")
    return "dot_general", 2, (layer.in_features, layer.out_features)
  if isinstance(layer, nnx.LinearGeneral):
    if layer.dot_general is not None or layer.dot_general_cls is not None:
      return "dot_general", kit.own_slot_reason("dot_general")
    ndim = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    return "dot_general", ndim, (math.prod(layer.in_features), math.prod(layer.out_features))
  if layer.einsum_op is not jnp.einsum:
    return "einsum_op", kit.own_slot_reason("einsum_op")
  if layer.einsum_str is None:
    return "einsum_op", "its equation is given at call time"
  dims = kit.einsum_gemm_dims(layer.einsum_str, layer.kernel_shape)
  if dims is None:
    return "einsum_op", f"its equation {layer.einsum_str!r} is not one GEMM"
  return "einsum_op", len(layer.kernel_shape), dims


def _path_filter(model: nnx.Module, filter) -> Callable[[str], bool]:
  """The deprecated NNX ``filter`` (called with ``(path, layer)``) as a function of the path
  string."""
  predicate = nnx.filterlib.to_predicate(filter)
  accepted = {
    "/".join(str(p) for p in path) or "."
    for path, node in nnx.iter_graph(model)
    if predicate(path, node)
  }
  return accepted.__contains__


def quantize_model(
  model: nnx.Module,
  recipe: core.Recipe | None | kit.Unset = kit.UNSET,
  *,
  rules=None,
  threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
  rngs: nnx.Rngs | nnx.RngStream | None = None,
  amax_axes=None,
  kernel_all_gather=None,
  config: core.GemmConfig | None = None,
  filter=None,
) -> QuantizeReport:
  """Makes the ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of ``model`` use
  quantized GEMMs, with a recipe chosen per layer by ``rules``, in place, keeping their
  parameters.

  Each layer's path is its attribute path in the model, joined by ``/``
  (``"layers/0/mlp/up_proj"``); the first rule whose pattern matches it decides its recipe
  (``None``: high precision) and GEMM options, and a layer no rule matches stays in high
  precision. Each quantized layer gets a ``DotGeneral`` (or ``EinsumOp``) submodule in its
  ``dot_general`` (``einsum_op``) slot, holding fresh recipe state; for layers stacked by
  ``nnx.vmap`` (for ``nnx.scan``) the state is stacked the same way. A layer a rule gave a recipe
  stays as it is, listed in the report's ``skipped`` with the reason, when its GEMM's K or N is
  not a multiple of 16, when it has a ``dot_general`` / ``einsum_op`` of its own, or when an
  Einsum's equation cannot be checked; so does the GEMM of a module with an ``attend`` method
  (``nnx.Embed``, a model's own tied embedding), which has no slot to convert. The skipped layers
  get one ``SkippedLayersWarning``, pointing at the caller's line. A layer a rule selects that is
  quantized already (by an earlier conversion, or a te_adapters layer with a recipe) is a
  ``ValueError`` naming it, and nothing is converted.

  A recipe that rounds stochastically (``NVFP4BlockScaling``) needs ``rngs``: each converted
  layer gets a stream of its own from its ``"sr_rng"`` (or ``"default"``) stream, stacked like
  the state for stacked layers, and draws a fresh key from it at each call.

  Args:
    model: the NNX model, changed in place.
    recipe: the recipe of every layer (the rule ``Rule(".*", recipe)``). Leave it out when
      giving ``rules``.
    rules: a list of ``te_adapters.Rule`` (or tuples ``(path, recipe)``, ``(path, recipe,
      {options})``): each a regular expression matched against a layer's whole path, or a
      function of the path string, with its recipe (``None`` keeps the layer in high precision)
      and optional GEMM options; first match wins.
    threshold: passed to ``core.dot_general`` by every layer whose rule does not set it: GEMMs
      below this ``SizeThreshold`` stay in high precision (default
      ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    rngs: an ``nnx.Rngs`` or ``nnx.RngStream``, required when a rule's recipe ``uses_rng``;
      unused otherwise.
    amax_axes, kernel_all_gather, config: passed to ``core.dot_general`` by every layer whose
      rule does not set them (SPMD: the mesh axes amaxes are reduced over inside
      ``shard_map``; FSDP's FP8 gather; a ``core.GemmConfig``).
    filter: deprecated (a ``DeprecationWarning``), removed in the next release: an NNX filter
      on ``(path, layer)``; ``filter=f, recipe`` converts as ``rules=[(g, recipe)]`` with ``g``
      true on the paths ``f`` selects.

  Returns:
    A ``te_adapters.core.QuantizeReport`` (the type every adapter's conversion returns) listing
    the quantized layers and their recipes, the layers kept in high precision (by a rule, or the
    size threshold on this backend) and the skipped ones, with reasons.

  Raises:
    ValueError: a rule's recipe rounds stochastically and no ``rngs`` stream gives keys; and
      the errors of ``te_adapters.Rule`` for malformed rules.

  Example:
    >>> import te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(64, 16, rngs=nnx.Rngs(1)))
    >>> report = ta_nnx.quantize_model(model, rules=[("layers/0", ta.DelayedScaling()),
    ...                                              ("layers/.*", None)], threshold=None)
    >>> report.quantized, report.high_precision
    (['layers/0'], {'layers/1': "rule 1 ('layers/.*') keeps it in high precision"})
  """
  options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
  if filter is not None:
    filter = _path_filter(model, filter)
  conversion = kit.Conversion(
    "te_adapters.nnx.quantize_model", recipe, rules, options, ("filter", filter)
  )
  if any(r.recipe is not None and r.recipe.uses_rng for r in conversion.rules) and (
    source_stream(rngs) is None
  ):
    uses = next(r.recipe for r in conversion.rules if r.recipe is not None and r.recipe.uses_rng)
    raise ValueError(
      kit.missing_key_message(
        uses,
        f", so every converted layer needs a key stream: pass rngs=nnx.Rngs({SR_RNG}=seed)"
        f" (an Rngs with a {SR_RNG!r} or 'default' stream), ",
        "quantize_model: ",
      )
    )
  plan = []
  for path, node in nnx.iter_graph(model):
    name = "/".join(str(p) for p in path) or "."
    if isinstance(node, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)):
      plan.append((name, node))
    elif callable(getattr(node, "attend", None)):
      # A tied embedding's output projection (nnx.Embed.attend, or a model's own
      # Embedder.attend) computes a GEMM outside any dot_general slot: say so rather than count
      # it as covered.
      choice = conversion.choose(name)
      if choice.recipe is None:
        conversion.keep(name, choice.reason)
      else:
        conversion.skip(name, kit.attend_reason(type(node).__name__, called=False))
  todo = []
  for name, layer in plan:
    gemm = _gemm_plan(layer)
    slot = gemm[0]
    if isinstance(getattr(layer, slot), _RecipeOp):
      if conversion.selects(name):
        conversion.already_quantized(name)
      continue
    choice = conversion.choose(name)
    if choice.recipe is None:
      conversion.keep(name, choice.reason)
      continue
    if len(gemm) == 2:
      conversion.skip(name, gemm[1])
      continue
    _, ndim, dims = gemm
    reason = kit.gemm_dims_refusal(*dims)
    if reason is not None:
      conversion.skip(name, reason)
      continue
    todo.append((name, layer, slot, ndim, dims, choice))
  conversion.finish()  # raises before any change when layers are quantized already
  for name, layer, slot, ndim, (k, n), choice in todo:
    kernel = layer.kernel.get_value()
    stack_shape = tuple(kernel.shape[: kernel.ndim - ndim])
    op_cls = EinsumOp if slot == "einsum_op" else DotGeneral
    op = op_cls(choice.recipe, **choice.options.keywords())
    op.set_rngs(rngs, stack_shape)
    op.layer_path = name
    op._set_owner(layer, kernel.shape)
    op.kernel_sharding = kernel_annotation(layer.kernel, len(stack_shape))
    for variable in jax.tree.leaves(op.state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
      value = variable.get_value()
      variable.set_value(jnp.broadcast_to(value, stack_shape + value.shape))
    # The slot held a function (static); mark the submodule as data so NNX tracks its state.
    setattr(layer, slot, nnx.data(op))
    if isinstance(layer, (Linear, LinearGeneral, Einsum)):
      # A te_adapters layer built with recipe=None; its constructor sets these attributes
      # through a helper, where mypy does not see them.
      layer.recipe = choice.recipe
      layer.threshold = choice.options.threshold  # type: ignore[union-attr]
    conversion.quantized(
      name, choice.recipe, core.high_precision_reason(choice.options.threshold, k, n)
    )
  return conversion.report
