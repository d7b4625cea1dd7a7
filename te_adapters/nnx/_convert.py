"""Converting the linear layers of an existing NNX model to quantized GEMMs, in place."""

from __future__ import annotations

import math

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

_UNREACHABLE_ATTEND = (
    "not converted: {}.attend (a tied output projection) computes its GEMM outside any "
    "dot_general slot, so it stays in high precision"
)


def _gemm_plan(layer) -> tuple[str, int | None, tuple[int, int] | None, str | None]:
  """``(slot, kernel_ndim, (K, N), reason_to_skip)`` of an NNX linear layer."""
  if isinstance(layer, nnx.Linear):
    if layer.dot_general is not lax.dot_general:
      return "dot_general", None, None, "it has a custom dot_general"
    return "dot_general", 2, (layer.in_features, layer.out_features), None
  if isinstance(layer, nnx.LinearGeneral):
    if layer.dot_general is not None or layer.dot_general_cls is not None:
      return "dot_general", None, None, "it has a custom dot_general"
    ndim = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    return "dot_general", ndim, (math.prod(layer.in_features), math.prod(layer.out_features)), None
  if layer.einsum_op is not jnp.einsum:
    return "einsum_op", None, None, "it has a custom einsum_op"
  if layer.einsum_str is None:
    return "einsum_op", None, None, "its equation is given at call time"
  dims = kit.einsum_gemm_dims(layer.einsum_str, layer.kernel_shape)
  if dims is None:
    return "einsum_op", None, None, f"its equation {layer.einsum_str!r} is not one GEMM"
  return "einsum_op", len(layer.kernel_shape), dims, None


def quantize_model(
    model: nnx.Module,
    recipe: core.Recipe,
    *,
    filter=None,
    threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    amax_axes=None,
    kernel_all_gather=None,
    config: core.GemmConfig | None = None,
) -> QuantizeReport:
  """Makes the ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of ``model`` use
  quantized GEMMs, in place, keeping their parameters.

  Each converted layer gets a ``DotGeneral`` (or ``EinsumOp``) submodule in its ``dot_general``
  (``einsum_op``) slot, holding fresh recipe state; for layers stacked by ``nnx.vmap`` (for
  ``nnx.scan``) the state is stacked the same way. Layers stay as they are, and are listed in the
  report, when the filter excludes them, when the GEMM's K or N is not a multiple of 16, when they
  already have a custom ``dot_general`` / ``einsum_op`` (a quantized one included), or when an
  Einsum's equation cannot be checked. Modules with an ``attend`` method (``nnx.Embed``, a model's
  own tied embedding) are listed there too: that GEMM has no slot to convert.

  A recipe that rounds stochastically (``NVFP4BlockScaling``) needs ``rngs``: each converted
  layer gets a stream of its own from its ``"sr_rng"`` (or ``"default"``) stream, stacked like
  the state for stacked layers, and draws a fresh key from it at each call.

  Args:
    model: the NNX model, changed in place.
    recipe: a te_adapters recipe.
    filter: an NNX filter called with ``(path, layer)`` selecting the layers to quantize (for
      example ``nnx.PathContains("mlp")``, or a function); default every linear layer.
    threshold: passed to ``core.dot_general`` by every converted layer: GEMMs below this
      ``SizeThreshold`` stay in high precision (default ``core.DEFAULT_SIZE_THRESHOLD``);
      ``None`` quantizes every GEMM.
    rngs: an ``nnx.Rngs`` or ``nnx.RngStream``, required when ``recipe.uses_rng``; unused
      otherwise.
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` by every converted layer
      (SPMD: the mesh axes amaxes are reduced over inside ``shard_map``; FSDP's FP8 gather).
    config: passed to ``core.dot_general`` by every converted layer: a ``core.GemmConfig``, or
      ``None`` for the default.

  Returns:
    A ``te_adapters.core.QuantizeReport`` (the type every adapter's conversion returns) listing
    the quantized and the skipped layers (with reasons), and the quantized layers that the size
    threshold keeps in high precision on this backend.

  Example:
    >>> import te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(64, 10, rngs=nnx.Rngs(1)))
    >>> report = ta_nnx.quantize_model(model, ta.Float8CurrentScaling())
    >>> report.quantized, list(report.skipped)
    (['layers/0'], ['layers/1'])
  """
  recipe = core.check_recipe(recipe)
  options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
  if recipe.uses_rng and source_stream(rngs) is None:
    raise ValueError(kit.missing_key_message(
        recipe, f", so every converted layer needs a key stream: pass rngs=nnx.Rngs({SR_RNG}=seed)"
        f" (an Rngs with a {SR_RNG!r} or 'default' stream), ", "quantize_model: "))
  predicate = nnx.filterlib.to_predicate(filter) if filter is not None else None
  layers, quantized, skipped, high_precision = [], [], [], []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)):
      layers.append((path, node))
    elif callable(getattr(node, "attend", None)):
      # A tied embedding's output projection (nnx.Embed.attend, or a model's own
      # Embedder.attend) computes a GEMM outside any dot_general slot: say so rather than count
      # it as covered.
      name = "/".join(str(p) for p in path) or "."
      skipped.append((name, _UNREACHABLE_ATTEND.format(type(node).__name__)))
  for path, layer in layers:
    name = "/".join(str(p) for p in path) or "."
    if predicate is not None and not predicate(path, layer):
      skipped.append((name, "excluded by the filter"))
      continue
    slot, ndim, dims, reason = _gemm_plan(layer)
    if isinstance(getattr(layer, slot), _RecipeOp):
      skipped.append((name, "it is already quantized"))
      continue
    if reason is not None:
      skipped.append((name, reason))
      continue
    k, n = dims
    if (refusal := kit.gemm_dims_refusal(k, n)) is not None:
      skipped.append((name, refusal))
      continue
    kernel = layer.kernel.get_value()
    stack_shape = tuple(kernel.shape[: kernel.ndim - ndim])
    op_cls = EinsumOp if slot == "einsum_op" else DotGeneral
    op = op_cls(recipe, **options.keywords())
    op.set_rngs(rngs, stack_shape)
    op.layer_path = name
    op.kernel_sharding = kernel_annotation(layer.kernel, len(stack_shape))
    for variable in jax.tree.leaves(op.state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
      value = variable.get_value()
      variable.set_value(jnp.broadcast_to(value, stack_shape + value.shape))
    # The slot held a function (static); mark the submodule as data so NNX tracks its state.
    setattr(layer, slot, nnx.data(op))
    if isinstance(layer, (Linear, LinearGeneral, Einsum)):
      layer.recipe = recipe  # a te_adapters layer built with recipe=None
      layer.threshold = options.threshold
    quantized.append(name)
    if (why := core.high_precision_reason(options.threshold, k, n)) is not None:
      high_precision.append((name, why))
  return QuantizeReport(
      quantized=quantized, skipped=dict(skipped), high_precision=dict(high_precision)
  )
