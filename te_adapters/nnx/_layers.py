"""Drop-in quantized versions of ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``.

Each class subclasses its NNX counterpart and takes every one of its arguments, plus
``recipe=``. Parameters (``kernel``, ``bias``) are created by the NNX parent exactly as there, so
they load from and into the NNX layer; the quantized GEMM is the parent's ``dot_general`` /
``einsum_op`` slot, filled with a ``DotGeneral`` / ``EinsumOp`` submodule that owns the recipe
state. With ``recipe=None`` the layer is its NNX parent, unchanged.
"""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import linear as nnx_linear

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._ops import DotGeneral, EinsumOp, _RecipeOp, call_rngs, kernel_annotation
from te_adapters.nnx._variables import OptionalGemms

__all__ = ["Linear", "LinearGeneral", "Einsum"]

_DEFAULT_RECIPE = kit.DEFAULT_RECIPE


def _init_parent(layer, parent, slot: str, op_cls, args, kwargs, given, recipe, **options):
  """Runs ``parent.__init__`` (the NNX layer) with its ``slot`` (``dot_general`` or
  ``einsum_op``) holding ``op_cls(recipe, **options)``; with no recipe, as given."""
  name = parent.__name__
  if recipe is None:
    kit.check_needs_recipe(
      None, name, amax_axes=options["amax_axes"], kernel_all_gather=options["kernel_all_gather"]
    )
  elif given[slot] is not inspect.signature(parent.__init__).parameters[slot].default:
    raise ValueError(
      f"{name}: pass either recipe= or a custom {slot}=, not both (recipe={recipe!r} "
      f"replaces the {slot})"
    )
  else:
    kwargs[slot] = op_cls(recipe, **options)
  parent.__init__(layer, *args, **kwargs)
  layer.recipe = recipe
  if recipe is None and getattr(layer, slot) is None:
    # No GEMM slot in the graph (OptionalGemms: it reads as None, as NNX's layer left it), so
    # that recipe state given to the layer reaches its refusal.
    delattr(layer, slot)
  layer.threshold = options["threshold"]
  # After the NNX parent drew the parameters, so they equal those of the NNX layer.
  if isinstance(op := getattr(layer, slot), _RecipeOp):
    op.set_rngs(given["rngs"])
    op.kernel_sharding = kernel_annotation(layer.kernel, 0)
    op._set_owner(layer, layer.kernel.shape)


def _add_lora(layer, in_shape, features, given, what: str, enable: bool, rank: int, alpha):
  """Creates TE's ``lora_a_kernel`` / ``lora_b_kernel`` as ``nnx.LoRAParam`` when enabled.

  ``lora_a_kernel`` takes the layer's ``kernel_init`` on its matrix view (fan-in = the
  contracted size), ``lora_b_kernel`` zeros, so the layer starts equal to its base.
  """
  layer.enable_low_rank_adaptation = bool(enable)
  layer.low_rank_adaptation_alpha = alpha
  if not layer.enable_low_rank_adaptation:
    return
  core.check_lora_rank(rank, in_shape, features, what)
  a_shape, b_shape = core.lora_shapes(in_shape, features, rank)
  flat = (math.prod(in_shape), math.prod(a_shape[len(in_shape) :]))
  rngs, dtype = given["rngs"], given["param_dtype"]
  a = given["kernel_init"](rngs.params(), flat, dtype).reshape(a_shape)
  layer.lora_a_kernel = nnx.LoRAParam(a)
  layer.lora_b_kernel = nnx.LoRAParam(jnp.zeros(b_shape, dtype))


def _lora_term(layer, inputs, y, axis):
  """``y`` plus the layer's LoRA term (``kit.add_lora``) when it has one."""
  if not layer.enable_low_rank_adaptation:
    return y
  op_state = getattr(layer.dot_general, "recipe_state", None)  # None: no recipe
  return kit.add_lora(
    y,
    inputs,
    layer.lora_a_kernel[...],
    layer.lora_b_kernel[...],
    state=op_state() if op_state is not None else None,
    kernel_shape=layer.kernel.shape,
    axis=axis,
    threshold=layer.threshold,
    alpha=layer.low_rank_adaptation_alpha,
    promote=lambda *arrays: layer.promote_dtype(arrays, dtype=layer.dtype),
    layer=layer.dot_general._layer_name() if isinstance(layer.dot_general, _RecipeOp) else None,
    framework="nnx",
  )


def _parent_arguments(parent_init, layer, args, kwargs) -> dict:
  """The parent's arguments by name, with its defaults (the parent's TypeError on bad ones)."""
  try:
    bound = inspect.signature(parent_init).bind(layer, *args, **kwargs)
  except TypeError:
    # Arguments that do not bind: the parent's own call raises the error Flax users know
    # ("Linear.__init__() missing 1 required keyword-only argument: 'rngs'") before its body
    # runs.
    parent_init(layer, *args, **kwargs)
    raise

  bound.apply_defaults()
  return bound.arguments


class Linear(OptionalGemms, nnx.Linear):
  """``nnx.Linear`` with a quantized GEMM.

  Takes every argument of ``flax.nnx.Linear`` with the same defaults, and creates the same
  parameters (``kernel`` (in, out), ``bias`` (out,)) with the same initialisers, so weights load
  from and into an ``nnx.Linear``. The recipe state lives in ``RecipeState`` variables of the
  ``dot_general`` submodule (``layer.dot_general.state.x_scale``, ...), which
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never touches.

  Under a recipe that rounds stochastically (``NVFP4BlockScaling``), the layer keeps an RNG
  stream of its own, forked from the ``"sr_rng"`` stream of ``rngs`` (or its ``"default"``
  one), and each call draws a fresh key from it; ``layer(x, rngs=...)`` (an ``nnx.Rngs``,
  ``nnx.RngStream`` or key) overrides it for that call, as for ``nnx.Dropout``.

  Args:
    in_features: the number of input features (a multiple of 16 when quantized).
    out_features: the number of output features (a multiple of 16 when quantized).
    recipe: a te_adapters recipe (default ``Float8CurrentScaling()``); ``None`` gives a plain
      ``nnx.Linear``, numerically identical.
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    config: passed to ``core.dot_general``: a ``core.GemmConfig``, or ``None`` for the default.
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` (SPMD: the mesh axes amaxes are
      reduced over inside ``shard_map``; FSDP's FP8 kernel all-gather).
    enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: TE's LoRA
      (default off, rank 32, alpha None): ``nnx.LoRAParam`` variables ``lora_a_kernel``
      (in, r) and ``lora_b_kernel`` (r, out, zeros) whose term ``core.low_rank_adaptation``
      adds in high precision; ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` trains them
      alone, leaving the quantized base kernel frozen.
    **others: as for ``flax.nnx.Linear``. ``dot_general`` cannot be combined with a recipe.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=16),
    ...                       rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape
    (4, 16)
    >>> layer.dot_general.state.x_amax_history.shape
    (16,)
  """

  _gemm_slots = ("dot_general",)

  def __init__(
    self,
    *args,
    recipe=_DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    amax_axes=None,
    kernel_all_gather=None,
    config=None,
    enable_low_rank_adaptation=False,
    low_rank_adaptation_dim=32,
    low_rank_adaptation_alpha=None,
    **kwargs,
  ):
    given = _parent_arguments(nnx.Linear.__init__, self, args, kwargs)
    k, n = given["in_features"], given["out_features"]
    what = f"Linear({k}, {n})"
    if recipe is not None:
      kit.check_gemm_dims(k, n, what)
    _init_parent(
      self,
      nnx.Linear,
      "dot_general",
      DotGeneral,
      args,
      kwargs,
      given,
      recipe,
      threshold=threshold,
      amax_axes=amax_axes,
      kernel_all_gather=kernel_all_gather,
      config=config,
    )
    _add_lora(
      self,
      (k,),
      (n,),
      given,
      what,
      enable_low_rank_adaptation,
      low_rank_adaptation_dim,
      low_rank_adaptation_alpha,
    )

  __init__.__signature__ = kit.signature_with_keywords(nnx.Linear.__init__, __init__)  # type: ignore[attr-defined]

  def __call__(self, inputs, out_sharding=None, *, rngs=None):
    """As ``nnx.Linear.__call__``; ``rngs`` overrides the layer's rounding stream for this call.

    Args:
      inputs: a floating-point array ``[..., in_features]``.
      out_sharding: as for ``nnx.Linear``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      ``[..., out_features]``: the quantized GEMM plus the bias, and the LoRA term where enabled.
    """
    with call_rngs(rngs):
      y = super().__call__(inputs, out_sharding=out_sharding)
    return _lora_term(self, inputs, y, -1)


class LinearGeneral(OptionalGemms, nnx.LinearGeneral):
  """``nnx.LinearGeneral`` with a quantized GEMM.

  Takes every argument of ``flax.nnx.LinearGeneral`` with the same defaults and creates the same
  parameters. The recipe state and the rounding stream live in the ``dot_general`` submodule,
  as for ``Linear``.

  Args:
    in_features: int or tuple of input features; their product is a multiple of 16 when
      quantized.
    out_features: int or tuple of output features; their product is a multiple of 16 when
      quantized.
    recipe: a te_adapters recipe (default ``Float8CurrentScaling()``); ``None`` gives a plain
      ``nnx.LinearGeneral``.
    threshold, amax_axes, kernel_all_gather, config: as for ``Linear``.
    enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: as for
      ``Linear``; ``lora_a_kernel`` ``(*in_features, *out_features[:-1], r)``,
      ``lora_b_kernel`` ``(*out_features[:-1], r, out_features[-1])`` (TE's shapes).
    **others: as for ``flax.nnx.LinearGeneral``. ``dot_general`` and ``dot_general_cls`` cannot be
      combined with a recipe.

  Raises:
    ValueError: both ``recipe`` and ``dot_general_cls``, or LoRA with ``batch_axis``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.LinearGeneral(32, (2, 16), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape
    (4, 2, 16)
  """

  _gemm_slots = ("dot_general",)

  def __init__(
    self,
    *args,
    recipe=_DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    amax_axes=None,
    kernel_all_gather=None,
    config=None,
    enable_low_rank_adaptation=False,
    low_rank_adaptation_dim=32,
    low_rank_adaptation_alpha=None,
    **kwargs,
  ):
    given = _parent_arguments(nnx.LinearGeneral.__init__, self, args, kwargs)
    in_features = nnx_linear._canonicalize_tuple(given["in_features"])
    out_features = nnx_linear._canonicalize_tuple(given["out_features"])
    what = f"LinearGeneral({given['in_features']}, {given['out_features']})"
    if recipe is not None:
      if given["dot_general_cls"] is not None:
        raise ValueError("LinearGeneral: pass either recipe= or dot_general_cls=, not both")
      kit.check_gemm_dims(math.prod(in_features), math.prod(out_features), what)
    _init_parent(
      self,
      nnx.LinearGeneral,
      "dot_general",
      DotGeneral,
      args,
      kwargs,
      given,
      recipe,
      threshold=threshold,
      amax_axes=amax_axes,
      kernel_all_gather=kernel_all_gather,
      config=config,
    )
    if enable_low_rank_adaptation and given["batch_axis"]:
      raise ValueError("LinearGeneral: low-rank adaptation does not take batch_axis")
    _add_lora(
      self,
      in_features,
      out_features,
      given,
      what,
      enable_low_rank_adaptation,
      low_rank_adaptation_dim,
      low_rank_adaptation_alpha,
    )

  __init__.__signature__ = kit.signature_with_keywords(nnx.LinearGeneral.__init__, __init__)  # type: ignore[attr-defined]

  def __call__(self, inputs, out_sharding=None, *, rngs=None):
    """As ``nnx.LinearGeneral.__call__``; ``rngs`` overrides the rounding stream for this call.

    Args:
      inputs: the input, contracted over the layer's ``axis``.
      out_sharding: as for ``nnx.LinearGeneral``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      The quantized GEMM plus the bias, and the LoRA term where enabled, as
      ``nnx.LinearGeneral`` shapes it.
    """
    with call_rngs(rngs):
      y = super().__call__(inputs, out_sharding=out_sharding)
    return _lora_term(self, inputs, y, self.axis)


class Einsum(OptionalGemms, nnx.Einsum):
  """``nnx.Einsum`` with a quantized GEMM, through ``jnp.einsum(..., _dot_general=...)``.

  Takes every argument of ``flax.nnx.Einsum`` with the same defaults and creates the same
  parameters. The recipe state (and the rounding stream, as for ``Linear``) lives in the
  ``einsum_op`` submodule (``layer.einsum_op.state.x_scale``, ...). The equation must contract the
  input with the kernel in one GEMM: no label repeated in an operand, and every summed label
  present in both operands.

  Args:
    einsum_str: the equation, input first and kernel second (``None`` to give it at call time).
    kernel_shape: the kernel shape; the contracted and output-feature sizes are multiples of 16
      when quantized.
    bias_shape: the bias shape, or ``None`` for no bias.
    recipe: a te_adapters recipe (default ``Float8CurrentScaling()``); ``None`` gives a plain
      ``nnx.Einsum``.
    threshold, amax_axes, kernel_all_gather, config: as for ``Linear``.
    **others: as for ``flax.nnx.Einsum``. ``einsum_op`` cannot be combined with a recipe.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.Einsum("btd,dhk->bthk", (32, 2, 16), (2, 16), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4, 32))).shape
    (2, 4, 2, 16)
  """

  _gemm_slots = ("einsum_op",)

  def __init__(
    self,
    *args,
    recipe=_DEFAULT_RECIPE,
    threshold=kit.DEFAULT_THRESHOLD,
    amax_axes=None,
    kernel_all_gather=None,
    config=None,
    **kwargs,
  ):
    given = _parent_arguments(nnx.Einsum.__init__, self, args, kwargs)
    einsum_str, kernel_shape = given["einsum_str"], given["kernel_shape"]
    if recipe is not None and einsum_str is not None:
      dims = kit.einsum_gemm_dims(einsum_str, kernel_shape)
      if dims is not None:
        kit.check_gemm_dims(*dims, f"Einsum({einsum_str!r}, kernel_shape={tuple(kernel_shape)})")
    _init_parent(
      self,
      nnx.Einsum,
      "einsum_op",
      EinsumOp,
      args,
      kwargs,
      given,
      recipe,
      threshold=threshold,
      amax_axes=amax_axes,
      kernel_all_gather=kernel_all_gather,
      config=config,
    )

  __init__.__signature__ = kit.signature_with_keywords(nnx.Einsum.__init__, __init__)  # type: ignore[attr-defined]

  def __call__(self, inputs, einsum_str=None, out_sharding=None, *, rngs=None):
    """As ``nnx.Einsum.__call__``; ``rngs`` overrides the layer's rounding stream for this call.

    Args:
      inputs: the input.
      einsum_str: the equation; None: the layer's.
      out_sharding: as for ``nnx.Einsum``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      The result of the equation (plus the bias, as ``nnx.Einsum`` adds it).
    """
    with call_rngs(rngs):
      return super().__call__(inputs, einsum_str, out_sharding=out_sharding)
