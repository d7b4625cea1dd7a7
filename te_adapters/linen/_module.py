"""Flax Linen modules around the core's quantized ``dot_general``."""

from __future__ import annotations

import re
from typing import Any

import flax.errors
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from te_adapters import _kit as kit
from te_adapters import core

__all__ = ["OVERWRITE_WITH_GRADIENT", "SR_RNG", "make_dot_general_cls", "Dense", "DenseGeneral"]

# The collection that holds recipe state; its gradient is its new value (the name Flax and TE use).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
# The RNG stream stochastic rounding draws its keys from (TE's name).
SR_RNG = kit.SR_RNG
# How a Linen layer gets its rounding keys, said when it has none.
_HOW_TO_GIVE_KEYS = (
  f" and draws a key per call from the Linen RNG stream {SR_RNG!r}: pass "
  f"rngs={{{SR_RNG!r}: key}} to apply (a fresh key per step), "
)


def rounding_key(module: nn.Module, recipe):
  """A fresh key from the ``sr_rng`` stream when ``recipe`` rounds stochastically, else None."""

  def draw():
    # make_rng falls back to the "params" stream (Flax's rule), which init always has.
    if module.has_rng(SR_RNG) or module.has_rng("params"):
      return module.make_rng(SR_RNG)
    return None

  return kit.rounding_key(recipe, draw, _HOW_TO_GIVE_KEYS)


def _layer_name(module: nn.Module) -> str:
  """The path of the layer that owns this dot_general module, for error messages."""
  scope = module.scope
  path = scope.path[:-1] if scope is not None else ()
  return "/".join(path) or type(module).__name__


def layer_label(module: nn.Module, owner: bool = False) -> str | None:
  """How the core's warnings name a layer (``layer=``): its path, ``owner`` the path of the
  layer owning ``module`` (a dot_general child); None for a top-level layer (no path), which the
  core then names by its operands' shapes."""
  path = module.scope.path if module.scope is not None else ()
  path = path[:-1] if owner else path
  return f"layer {'/'.join(path)!r}" if path else None


def kernel_annotation(module: nn.Module, kernel) -> tuple | None:
  """The sharding annotation of the layer's ``kernel`` parameter, in mesh axes, where the layer
  that owns this dot_general module created it annotated (``nn.with_partitioning``, or
  ``nn.with_logical_partitioning`` mapped by the logical axis rules in effect); None otherwise,
  or where the parameter is not the GEMM's kernel."""
  scope = getattr(module.parent, "scope", None)
  if scope is None or not scope.has_variable("params", "kernel"):
    return None
  box = scope.get_variable("params", "kernel")
  if not isinstance(box, nn.Partitioned) or jnp.shape(box.value) != jnp.shape(kernel):
    return None
  names = tuple(box.names)
  if isinstance(box, nn.LogicallyPartitioned):
    try:
      mesh_axes = nn.logical_to_mesh_axes(names, box.rules)
    except ValueError:  # a name the rules do not map: no annotation in mesh axes
      return None
    if mesh_axes is None:  # no rules in effect: no annotation in mesh axes
      return None
    names = tuple(mesh_axes)
  return names if any(n is not None for n in names) else None


def postfixed(name: str, postfix: str) -> str:
  """TE's name of a state variable of the GEMM ``postfix``: ``x_scale`` -> ``x_0_scale``."""
  role, rest = name.split("_", 1)
  return f"{role}{postfix}_{rest}"


def gemm_state(module: nn.Module, recipe, postfix: str, n_groups: int | None = None):
  """One GEMM's recipe state (a grouped GEMM's with ``n_groups``) as variables of ``module`` in
  ``_overwrite_with_gradient`` under TE's postfixed names; ``None`` where the recipe keeps none."""

  def variable(name, initial):
    entry = postfixed(name, postfix)
    try:
      return module.variable(OVERWRITE_WITH_GRADIENT, entry, lambda: initial).value
    except (flax.errors.ScopeCollectionNotFound, flax.errors.ScopeVariableNotFoundError) as e:
      raise ValueError(_missing_state_message(module, recipe, entry)) from e

  if recipe is None or not core.state_names(recipe):
    _refuse_ignored_state(module, recipe)
  return kit.recipe_state(recipe, variable, n_groups)


def _missing_state_message(module: nn.Module, recipe, entry: str) -> str:
  """The error for a layer whose recipe keeps state that the variables given to ``apply`` lack
  (where Flax said the collection is empty, or has no such variable)."""
  owner = isinstance(module, QuantizedDotGeneral)
  layer = layer_label(module, owner=owner) or type(module).__name__
  collection = repr(OVERWRITE_WITH_GRADIENT)
  return (
    f"{layer}: its recipe {type(recipe).__name__} keeps recipe state ({entry!r} and the other "
    f"entries of its GEMM, in {OVERWRITE_WITH_GRADIENT!r}), but the variables given to apply "
    "have none for it: they come from a model that keeps none (high precision, or a recipe "
    "without state) or from another model. Pass the variables init returned (or the previous "
    "step's); to start from another model's parameters, take the recipe state from init: "
    f"{{**variables, {collection}: model.init(key, x)[{collection}]}}."
  )


def _refuse_ignored_state(module: nn.Module, recipe) -> None:
  """Raises where variables hold recipe state that ``recipe`` (stateless, or None: high
  precision) would ignore: a checkpoint made with ``DelayedScaling``, applied with
  ``Float8CurrentScaling`` or without a recipe. The layer's own
  entries, and for a ``make_dot_general_cls`` GEMM inside a dense layer those of another
  recipe's GEMM in that layer (``DelayedScalingDotGeneral_0`` where this layer's is
  ``Float8CurrentScalingDotGeneral_0``)."""
  found = [_joined(module, name) for name in module.variables.get(OVERWRITE_WITH_GRADIENT, {})]
  parent = module.parent if isinstance(module, QuantizedDotGeneral) else None
  # Only where the parent is a layer with one dot_general slot (ta_linen.Dense, a converted or
  # dot_general_cls-filled nn.Dense): a model of the user's may hold GEMMs of several recipes
  # side by side, whose state this GEMM cannot tell from a checkpoint's.
  if isinstance(parent, _ONE_GEMM_LAYERS):
    mine = f"{type(recipe).__name__}DotGeneral_"
    found += [
      _joined(parent, name)
      for name in parent.variables.get(OVERWRITE_WITH_GRADIENT, {})
      if re.fullmatch(r"\w+DotGeneral_\d+", name) and not name.startswith(mine)
    ]
  if found:
    if recipe is None:
      keeps, go_on = "this layer has no recipe (high precision) and keeps none", "without one"
    else:
      keeps = f"this layer's recipe {type(recipe).__name__} keeps none"
      go_on = f"with {type(recipe).__name__}"
    owner = isinstance(module, QuantizedDotGeneral)
    layer = layer_label(module, owner=owner) or type(module).__name__
    raise ValueError(
      f"{layer}: the variables hold recipe state in {OVERWRITE_WITH_GRADIENT!r} "
      f"({', '.join(sorted(found))}), but {keeps}, so it would be silently ignored: the "
      "variables come from a model with another recipe (DelayedScaling keeps state). Apply the "
      "model with that recipe, or leave the collection out of the variables "
      f"(variables.pop({OVERWRITE_WITH_GRADIENT!r})) to go on {go_on}."
    )


# Flax's layers with a dot_general slot: one GEMM each.
_ONE_GEMM_LAYERS = tuple(
  getattr(nn, name) for name in ("Dense", "DenseGeneral", "Einsum") if hasattr(nn, name)
)


def _joined(module: nn.Module, name: str) -> str:
  """The path of ``module``'s entry ``name`` in its model, joined by ``/``."""
  path = module.scope.path if module.scope is not None else ()
  return "/".join((*path, name))


def _options(module) -> kit.GemmOptions:
  return kit.GemmOptions(
    module.threshold, module.amax_axes, module.kernel_all_gather, module.config
  )


class QuantizedDotGeneral(nn.Module):
  """A ``dot_general`` module: pass an instance as ``nn.Dense(..., dot_general=...)``.

  Holds the recipe state of one GEMM in the ``_overwrite_with_gradient`` collection, with TE's
  variable names (``x_scale``, ``x_amax_history``, ...). Use ``make_dot_general_cls(recipe)``.
  Under a recipe that rounds stochastically (``recipe.uses_rng``), each call draws a key from
  the RNG stream ``"sr_rng"``: pass ``rngs={"sr_rng": key}`` to ``apply``.

  Args:
    recipe: the GEMM's recipe (``make_dot_general_cls`` fills it in).
    threshold, amax_axes, kernel_all_gather, config: passed to ``core.dot_general`` (as for
      ``make_dot_general_cls``).

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> cls = ta_linen.make_dot_general_cls(ta.DelayedScaling(amax_history_len=4))
    >>> issubclass(cls, ta_linen.QuantizedDotGeneral), cls.__name__
    (True, 'DelayedScalingDotGeneral')
    >>> variables = nn.Dense(16, dot_general=cls()).init(jax.random.key(0), jnp.ones((8, 32)))
    >>> variables["_overwrite_with_gradient"]["dot_general"]["x_amax_history"].shape
    (4,)
  """

  recipe: Any = None
  threshold: Any = kit.DEFAULT_THRESHOLD
  amax_axes: Any = None
  kernel_all_gather: Any = None
  config: Any = None

  def __new__(cls, *args, **kwargs):
    # nn.Dense(dot_general=cls) calls the class with the GEMM's operands (and precision=...).
    if (args and hasattr(args[0], "shape")) or "precision" in kwargs:
      raise TypeError(
        f"{cls.__name__} is a module class and was called as a dot_general: pass an instance, "
        f"nn.Dense(..., dot_general={cls.__name__}()), or the class itself as "
        f"nn.Dense(..., dot_general_cls={cls.__name__})"
      )
    return super().__new__(cls)

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``core.dot_general(lhs, rhs, ...)`` with this module's recipe, state and options.

    Args:
      lhs: the activation.
      rhs: the kernel.
      dimension_numbers: as for ``lax.dot_general``.
      precision: as for ``lax.dot_general`` (see ``core.dot_general``).
      preferred_element_type: the output dtype; default as ``lax.dot_general`` gives.

    Returns:
      The product, as ``lax.dot_general`` gives it.
    """
    kit.check_input_dtype(self.recipe, lhs.dtype, _layer_name(self))
    kit.check_kernel_gemm_dims(self.recipe, rhs.shape, dimension_numbers, _layer_name(self))
    return core.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision,
      preferred_element_type,
      recipe=self.recipe,
      state=gemm_state(self, self.recipe, ""),
      rng=rounding_key(self, self.recipe),
      **_options(self).keywords(),
      layer=layer_label(self, owner=True),
      framework="linen",
      kernel_sharding=kernel_annotation(self, rhs),
    )


def make_dot_general_cls(
  recipe,
  *,
  threshold=kit.DEFAULT_THRESHOLD,
  amax_axes=None,
  kernel_all_gather=None,
  config=None,
) -> type[QuantizedDotGeneral]:
  """A Linen module class whose instances run ``dot_general`` quantized by ``recipe``.

  Used as in TransformerEngine's JAX tutorials:

    cls = make_dot_general_cls(te_adapters.DelayedScaling())
    y = nn.Dense(features, dot_general=cls())(x)

  Args:
    recipe: a te_adapters recipe. One that rounds stochastically (``NVFP4BlockScaling``) draws
      a key per call from the RNG stream ``"sr_rng"``: ``apply(..., rngs={"sr_rng": key})``.
    amax_axes: passed to ``core.dot_general`` (inside ``shard_map``: the mesh axes each amax is
      max-reduced over).
    kernel_all_gather: passed to ``core.dot_general`` (FSDP: the kernel's sharding, gathered as
      FP8).
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    config: passed to ``core.dot_general``: a ``core.GemmConfig`` (which kernels run), or
      ``None`` for the default.

  Returns:
    A subclass of ``nn.Module`` taking no required constructor arguments.

  Raises:
    TypeError: ``recipe`` is not a recipe instance.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> cls = ta_linen.make_dot_general_cls(ta.Float8CurrentScaling(), threshold=None)
    >>> layer = nn.Dense(16, dot_general_cls=cls)
    >>> x = jnp.ones((8, 32))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> fp8, gemms = ta.inspect.count_fp8_dot_generals(lambda x: layer.apply(variables, x), x)
    >>> fp8, gemms
    (1, 1)
  """
  recipe = core.check_recipe(recipe)
  options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
  fields = {"recipe": recipe, **options.keywords()}
  annotations = dict.fromkeys(fields, Any)
  name = f"{type(recipe).__name__}DotGeneral"
  return type(name, (QuantizedDotGeneral,), {"__annotations__": annotations, **fields})


def _with_recipe_dot_general(module):
  """Fills a dense layer's ``dot_general_cls`` slot with its recipe's GEMM (once: a clone
  arrives with the slot filled)."""
  if module.recipe is None:
    kit.check_needs_recipe(
      None,
      type(module).__name__,
      amax_axes=module.amax_axes,
      kernel_all_gather=module.kernel_all_gather,
    )
    return
  options = _options(module)
  current = module.dot_general_cls
  if isinstance(current, type) and issubclass(current, QuantizedDotGeneral):
    if current.recipe == module.recipe and _options(current) == options:
      return  # a clone of a module already set up
  if module.dot_general is not None or current is not None:
    raise ValueError(f"{type(module).__name__}: give either recipe or dot_general, not both")
  object.__setattr__(
    module, "dot_general_cls", make_dot_general_cls(module.recipe, **options.keywords())
  )


class Dense(nn.Dense):
  """``flax.linen.Dense`` with a ``recipe``: same parameters, the GEMM quantized by the recipe.

  The default recipe is every adapter's, ``core.DEFAULT_RECIPE`` (``Float8CurrentScaling()``);
  ``recipe=None`` is exactly ``nn.Dense``. Recipe state lives in ``_overwrite_with_gradient``;
  ``threshold`` (GEMMs below it stay in high precision), ``amax_axes``, ``kernel_all_gather`` and
  ``config`` go to ``core.dot_general``; a recipe that rounds stochastically draws keys from the
  RNG stream ``"sr_rng"``.

  Args:
    features: the number of output features; ``nn.Dense``'s other fields (``use_bias``,
      ``dtype``, ``param_dtype``, ``precision``, ``kernel_init``, ``bias_init``) keep their
      meaning and defaults.
    recipe: a te_adapters recipe (default ``Float8CurrentScaling()``); None: ``nn.Dense``.
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_THRESHOLD``); None quantizes every GEMM.
    amax_axes: passed to ``core.dot_general`` (inside ``shard_map``: the mesh axes each amax is
      max-reduced over).
    kernel_all_gather: passed to ``core.dot_general`` (FSDP: the kernel's sharding, gathered as
      FP8).
    config: passed to ``core.dot_general``: a ``core.GemmConfig``, or None for the default.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import linen as ta_linen
    >>> layer = ta_linen.Dense(16, recipe=ta.DelayedScaling(amax_history_len=8))
    >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 32)))
    >>> sorted(variables)
    ['_overwrite_with_gradient', 'params']
  """

  recipe: Any = kit.DEFAULT_RECIPE
  threshold: Any = kit.DEFAULT_THRESHOLD
  amax_axes: Any = None
  kernel_all_gather: Any = None
  config: Any = None

  def __post_init__(self):
    _with_recipe_dot_general(self)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs):
    """``nn.Dense``'s call, its GEMM quantized by the recipe.

    Args:
      inputs: the input, features last.

    Returns:
      The transformed input.
    """
    if self.recipe is None:  # nn.Dense's GEMM: refuses recipe state it would ignore
      _refuse_ignored_state(self, None)
    return super().__call__(inputs)


class DenseGeneral(nn.DenseGeneral):
  """``flax.linen.DenseGeneral`` with a ``recipe`` and TE's low-rank adaptation.

  Same fields and parameters as ``nn.DenseGeneral``, plus ``recipe``, ``threshold``,
  ``amax_axes``, ``kernel_all_gather`` and ``config`` (as for ``Dense``), and TE's LoRA fields:
  with ``enable_low_rank_adaptation=True`` the layer adds
  ``core.low_rank_adaptation(x, lora_a_kernel, lora_b_kernel, alpha=low_rank_adaptation_alpha)``
  to its output. ``lora_a_kernel`` (``(*contracted, *features[:-1], r)``, the kernel's
  initialiser) and ``lora_b_kernel`` (``(*features[:-1], r, features[-1])``, zeros) are TE's
  parameters; ``r = low_rank_adaptation_dim`` (default 32, at most ``min(K, features[-1])``).
  The LoRA GEMMs run in high precision; the base ``kernel``'s GEMM is quantized by the recipe.
  To train the adapters alone, leave ``kernel`` out of the optimizer (``optax.masked`` or
  ``optax.multi_transform`` on the parameter names).

  TE's sharding fields, so that a TE-style model runs unchanged: ``kernel_axes`` and
  ``bias_axes`` name the logical axes of ``kernel`` (one name per dimension of its full shape)
  and ``bias`` (``nn.LogicallyPartitioned`` parameters, as ``nn.with_logical_partitioning``
  gives); ``input_axes`` constrains the input to those logical axes
  (``nn.with_logical_constraint``) before the GEMM. ``transpose_batch_sequence`` is accepted and
  has no effect, as in TE's ``DenseGeneral``. ``dtype`` keeps Flax's meaning (the computation's
  dtype; ``param_dtype`` is the parameters'), where TE's ``dtype`` is the parameters' dtype.

  Args:
    features: the output features (an int or a tuple); ``nn.DenseGeneral``'s other fields
      (``axis``, ``batch_dims``, ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init``,
      ``bias_init``, ``precision``) keep their meaning and defaults.
    recipe, threshold, amax_axes, kernel_all_gather, config: as for ``Dense``.
    enable_low_rank_adaptation: add TE's LoRA term (default False).
    low_rank_adaptation_dim: its rank ``r`` (default 32).
    low_rank_adaptation_alpha: the term is scaled by ``alpha / r``; None (default) scales by 1.
    kernel_axes, bias_axes: the logical axis names of ``kernel`` and ``bias`` (default none).
    input_axes: the logical axes the input is constrained to (default none).
    transpose_batch_sequence: accepted for TE's signature; no effect.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from te_adapters import linen as ta_linen
    >>> layer = ta_linen.DenseGeneral(16, enable_low_rank_adaptation=True,
    ...                               low_rank_adaptation_dim=4)
    >>> params = layer.init(jax.random.PRNGKey(0), jnp.ones((2, 32)))["params"]
    >>> {k: v.shape for k, v in sorted(params.items())}
    {'bias': (16,), 'kernel': (32, 16), 'lora_a_kernel': (32, 4), 'lora_b_kernel': (4, 16)}
  """

  recipe: Any = kit.DEFAULT_RECIPE
  threshold: Any = kit.DEFAULT_THRESHOLD
  amax_axes: Any = None
  kernel_all_gather: Any = None
  config: Any = None
  enable_low_rank_adaptation: bool = False
  low_rank_adaptation_dim: int = 32
  low_rank_adaptation_alpha: float | None = None
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  input_axes: tuple[str | None, ...] = ()
  transpose_batch_sequence: bool = False

  def __post_init__(self):
    _with_recipe_dot_general(self)
    for field, axes in (("kernel_init", self.kernel_axes), ("bias_init", self.bias_axes)):
      # A clone passes the annotated initialiser back in: annotate the bare one, once.
      init = _unnamed(getattr(self, field))
      object.__setattr__(self, field, _NamedAxesInit(init, tuple(axes)) if axes else init)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs):
    if self.recipe is None:  # nn.DenseGeneral's GEMM: refuses recipe state it would ignore
      _refuse_ignored_state(self, None)
    if self.input_axes:
      inputs = nn.with_logical_constraint(inputs, tuple(self.input_axes))
    if not self.enable_low_rank_adaptation:
      return super().__call__(inputs)
    if _as_tuple(self.batch_dims):
      raise ValueError("DenseGeneral: low-rank adaptation does not take batch_dims")
    features = _as_tuple(self.features)
    axis = tuple(a % inputs.ndim for a in _as_tuple(self.axis))
    in_shape = tuple(inputs.shape[a] for a in axis)
    rank = self.low_rank_adaptation_dim
    core.check_lora_rank(rank, in_shape, features, f"DenseGeneral({features})")
    y = super().__call__(inputs)
    a_shape, b_shape = core.lora_shapes(in_shape, features, rank)
    lora_a = self.param(
      "lora_a_kernel",
      _flat_init(_unnamed(self.kernel_init), len(in_shape)),
      a_shape,
      self.param_dtype,
    )
    lora_b = self.param("lora_b_kernel", nn.initializers.zeros_init(), b_shape, self.param_dtype)
    # The base GEMM's recipe state: its child's variables.
    state = self.variables.get(OVERWRITE_WITH_GRADIENT) if self.recipe is not None else None
    return kit.add_lora(
      y,
      inputs,
      lora_a,
      lora_b,
      state=state,
      kernel_shape=in_shape + features,
      axis=axis,
      threshold=self.threshold,
      alpha=self.low_rank_adaptation_alpha,
      promote=lambda *arrays: self.promote_dtype(*arrays, dtype=self.dtype),
      layer=layer_label(self),
      framework="linen",
    )


class _NamedAxesInit:
  """An initialiser whose parameter is annotated with logical axis names (TE's ``kernel_axes``,
  ``bias_axes``), as ``nn.with_logical_partitioning(init, axes)`` gives; a class, so that a
  module's clone recognises it and does not annotate twice."""

  def __init__(self, init, axes: tuple):
    self.init, self.axes = init, axes
    self._named = nn.with_logical_partitioning(init, axes)

  def __call__(self, key, shape, dtype=jnp.float32):
    return self._named(key, shape, dtype)

  def __eq__(self, other):
    return isinstance(other, _NamedAxesInit) and other.init == self.init and other.axes == self.axes

  def __hash__(self):
    return hash((self.init, self.axes))


def _unnamed(init):
  return init.init if isinstance(init, _NamedAxesInit) else init


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _flat_init(init, n_in: int):
  """``init`` on the matrix view ``(contracted, rest)`` of a shape, as ``nn.DenseGeneral``
  initialises its kernel (fan-in = the contracted size)."""

  def wrapped(key, shape, dtype=jnp.float32):
    flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
    return jnp.reshape(init(key, flat, dtype), shape)

  return wrapped
