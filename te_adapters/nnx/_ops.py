"""Quantized GEMM operations as NNX modules that own their recipe state.

An NNX layer that takes ``dot_general=`` (``nnx.Linear``, ``nnx.LinearGeneral``) or
``einsum_op=`` (``nnx.Einsum``) calls these modules in place of ``lax.dot_general`` /
``jnp.einsum``. Because the operation is a submodule, its recipe state (``op.state``: the
format's typed state, a ``RecipeState`` variable at each entry) follows the layer through
``nnx.split``/``nnx.merge``, ``nnx.jit``, ``nnx.scan``, ``nnx.vmap`` and ``nnx.remat`` like any
other variable.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import opt_einsum
from flax import nnx
from flax.core.frozen_dict import FrozenDict

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.nnx._scan_check import refuse_shared_scan_state
from te_adapters.nnx._variables import HoldsRecipeState, hold_state, state_value, te_name_aliases

__all__ = ["DotGeneral", "EinsumOp", "SR_RNG"]

# The RNG stream stochastic rounding draws its keys from (TE's name; "default" when absent).
SR_RNG = kit.SR_RNG
# How an NNX layer gets its rounding keys, said when it has none.
_HOW_TO_GIVE_KEYS = (
  f" and needs a key per call from the {SR_RNG!r} stream: build the layer with "
  f"rngs=nnx.Rngs({SR_RNG}=...) (a 'default' stream works too), or call it with rngs=...; "
)
# rngs= given to a quantized layer's __call__, for its GEMM op (the NNX parent calls the op).
_CALL_RNGS: contextvars.ContextVar = contextvars.ContextVar("te_adapters_nnx_rngs", default=None)


def source_stream(rngs) -> nnx.RngStream | None:
  """The stream of ``rngs`` stochastic rounding draws from: an ``nnx.Rngs``'s ``"sr_rng"``
  stream (else its ``"default"`` one, else None), an ``nnx.RngStream`` itself, or None."""
  if rngs is None:
    return None
  if isinstance(rngs, nnx.Rngs):
    try:
      return rngs[SR_RNG]
    except KeyError:
      return None
  if not isinstance(rngs, nnx.RngStream):
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None, got {type(rngs)}")
  return rngs


def sr_stream(rngs, stack_shape: tuple[int, ...] = ()) -> nnx.RngStream | None:
  """A stream of its own for one GEMM's stochastic rounding, from ``source_stream(rngs)``.

  Forked (or split to ``stack_shape`` for layers stacked by ``nnx.vmap``) as ``nnx.Dropout``
  does, so layers built from one ``Rngs`` draw different keys.
  """
  stream = source_stream(rngs)
  if stream is None:
    return None
  return stream.split(stack_shape) if stack_shape else stream.fork()


def _hashable(value):
  """``value`` with dicts frozen and lists made tuples (amax_axes by role, spec lists)."""
  if isinstance(value, Mapping):
    return FrozenDict({k: _hashable(v) for k, v in value.items()})
  if isinstance(value, list):
    return tuple(_hashable(v) for v in value)
  return value


def kernel_annotation(kernel, stacked: int):
  """The kernel's sharding annotation (``nnx.with_partitioning``), one entry per dim of the
  kernel a layer's call sees (less ``stacked`` leading dims), or None."""
  meta = kernel.get_metadata()
  spec = next(
    (meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k)), None
  )
  if not isinstance(spec, (tuple, list, jax.sharding.PartitionSpec)):
    return None
  spec = tuple(spec)
  if len(spec) == kernel.get_value().ndim:
    spec = spec[stacked:]
  return tuple(tuple(e) if isinstance(e, list) else e for e in spec) or None


@contextlib.contextmanager
def call_rngs(rngs):
  """Within it, the quantized op called next draws its rounding key from ``rngs``."""
  token = _CALL_RNGS.set(rngs)
  try:
    yield
  finally:
    _CALL_RNGS.reset(token)


def _permuted_sharding(out_sharding, perm: list[int]):
  """``out_sharding`` (a ``NamedSharding`` or ``PartitionSpec``) for an output whose dimension
  ``i`` is dimension ``perm[i]`` of the one it was written for."""
  if out_sharding is None:
    return None
  spec = getattr(out_sharding, "spec", out_sharding)
  if not isinstance(spec, jax.sharding.PartitionSpec):
    raise TypeError(
      f"EinsumOp: out_sharding must be a NamedSharding or a PartitionSpec, got {out_sharding!r}"
    )
  entries = tuple(spec) + (None,) * (len(perm) - len(spec))
  permuted = jax.sharding.PartitionSpec(*(entries[p] for p in perm))
  if isinstance(out_sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(out_sharding.mesh, permuted)
  return permuted


@te_name_aliases
class _RecipeOp(HoldsRecipeState, kit.GemmOptionAttributes, nnx.Module):
  """Holds a recipe and its GEMM's typed recipe state, ``self.state`` (``core.init_state``'s
  type, a ``RecipeState`` variable at each entry, TE's names: ``self.state.x_scale``, ...).

  A recipe that rounds stochastically (``recipe.uses_rng``) also gets an RNG stream of its own
  (``self.rngs``, see ``sr_stream``); each call draws one key from it. The GEMM options are
  ``self.options``, a ``GemmOptions`` (also read as ``threshold``, ``amax_axes``,
  ``kernel_all_gather`` and ``config``).
  """

  def __init__(
    self,
    recipe: core.Recipe,
    *,
    threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    amax_axes: Any = None,
    kernel_all_gather: Any = None,
    config: core.GemmConfig | None = None,
  ):
    self.recipe = core.check_recipe(recipe)
    # A static attribute of the graph: hashable, so nnx.jit can key its cache on it.
    self.options = kit.GemmOptions(
      threshold, _hashable(amax_axes), _hashable(kernel_all_gather), config
    )
    # Only where the recipe keeps state (HoldsRecipeState: else `state` reads as EmptyState).
    if initial := kit.initial_state(self.recipe):
      self.state = hold_state(initial)
    self.rngs: nnx.RngStream | None = nnx.data(None)
    self.set_rngs(rngs)
    # The layer's path in its model, where a conversion knows it (named in sharding messages),
    # and its kernel's sharding annotation (orders the GEMM's layout under Auto mesh axes).
    self.layer_path: str | None = None
    self.kernel_sharding = None
    # The layer that holds the op, (class name, its kernel and shape), where it says
    # (``_set_owner``): how errors about the op's state name it, NNX modules knowing no path.
    self.owner: tuple[str, str] | None = None

  def _set_owner(self, layer, kernel_shape: tuple[int, ...], kernel: str = "kernel") -> None:
    """Records the layer that holds this op (its class) and its kernel (name and shape)."""
    self.owner = (type(layer).__name__, f"{kernel} {tuple(kernel_shape)}")

  def _state_owner(self) -> str:
    """How the refusal of another recipe's state names the layer: as every message does."""
    return self._layer_name()

  def set_rngs(self, rngs, stack_shape: tuple[int, ...] = ()) -> None:
    """Gives the op its rounding stream from ``rngs`` (``sr_stream``), if the recipe uses one."""
    if self.recipe.uses_rng:
      stream = sr_stream(rngs, stack_shape)
      self.rngs = nnx.data(None) if stream is None else stream

  def _rounding_key(self, rngs):
    """The key for this call's stochastic rounding (None when the recipe does not use one):
    from the call's ``rngs``, else the layer call's, else the op's own stream."""

    def draw():
      source = rngs if rngs is not None else _CALL_RNGS.get()
      if source is None:
        source = self.rngs
      if isinstance(source, nnx.Rngs):
        return source[SR_RNG]()
      if isinstance(source, nnx.RngStream):
        return source()
      return source  # a key, or None

    return kit.rounding_key(self.recipe, draw, _HOW_TO_GIVE_KEYS)

  def gemm_arguments(self, rngs=None) -> dict[str, Any]:
    """This op's keywords for a core function that runs its GEMM (``core.layernorm_dense``):
    ``recipe``, ``state``, ``rng``, ``threshold``, ``kernel_all_gather`` and ``config``."""
    return {
      "recipe": self.recipe,
      "state": refuse_shared_scan_state(self, self.recipe_state()) or None,
      "rng": self._rounding_key(rngs),
      **self.options.fused_keywords(),
    }

  def recipe_state(self):
    """The current recipe state, typed: a ``core.DelayedScalingState`` of arrays, or an
    ``EmptyState`` for stateless recipes (both read as mappings of TE's names)."""
    return state_value(self.state)

  def _layer_name(self, what: str | None = None) -> str:
    """How messages about this GEMM name its layer: by its path in the model where a conversion
    gave it (``layer 'blocks/0/up'``, as Linen's and Haiku's messages name theirs), else (NNX
    gives a layer no path) by the holding layer's class and kernel shape (``Linear layer (kernel
    (64, 32))``); an op in no layer of ours by ``what`` (the einsum equation) or its class."""
    if self.layer_path is not None:
      return f"layer {self.layer_path!r}"
    if self.owner is not None:
      return f"{self.owner[0]} layer ({self.owner[1]})"
    return what or f"{type(self).__name__} op"

  def _dot(
    self,
    lhs,
    rhs,
    dimension_numbers,
    precision,
    preferred_element_type,
    rngs=None,
    out_sharding=None,
    layer=None,
  ):
    name = self._layer_name(layer)
    kit.check_input_dtype(self.recipe, lhs.dtype, name)
    kit.check_kernel_gemm_dims(self.recipe, rhs.shape, dimension_numbers, name)
    return core.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision,
      preferred_element_type,
      recipe=self.recipe,
      state=refuse_shared_scan_state(self, self.recipe_state()),
      rng=self._rounding_key(rngs),
      out_sharding=out_sharding,
      **self.options.keywords(),
      layer=name,
      kernel_sharding=self.kernel_sharding,
      framework="nnx",
    )


class DotGeneral(_RecipeOp):
  """A quantized ``dot_general`` for any NNX layer that takes ``dot_general=``.

  The first operand is the activation ``x`` and the second the ``kernel``, as in
  ``nnx.Linear`` and ``nnx.LinearGeneral``. The recipe state lives in ``RecipeState`` variables
  of this module (``x_scale``, ``x_amax_history``, ...; none for stateless recipes).

  Args:
    recipe: a te_adapters recipe.
    threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in high
      precision (default ``core.DEFAULT_SIZE_THRESHOLD``); ``None`` quantizes every GEMM.
    rngs: for a recipe that rounds stochastically (``NVFP4BlockScaling``): the op keeps a stream
      of its own from ``rngs``'s ``"sr_rng"`` (or ``"default"``) stream, and draws one key per
      call; a call may pass ``rngs=`` (an ``nnx.Rngs``, ``nnx.RngStream`` or key) instead.
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` (SPMD).
    config: passed to ``core.dot_general``: a ``core.GemmConfig``, or ``None`` for the default.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = nnx.Linear(32, 16, dot_general=ta_nnx.DotGeneral(ta.Float8CurrentScaling()),
    ...                    rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape
    (4, 16)
  """

  def __call__(
    self,
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    rngs=None,
  ) -> jax.Array:
    """``lax.dot_general(lhs, rhs, ...)`` with FP8 operands; ``out_sharding`` as for it (with
    Explicit mesh axes, e.g. row-parallel layers whose contracting dimension is sharded).

    Args:
      lhs: the activation.
      rhs: the kernel.
      dimension_numbers: as for ``lax.dot_general``.
      precision: as for ``lax.dot_general`` (see ``core.dot_general``).
      preferred_element_type: the output dtype; default as ``lax.dot_general`` gives.
      out_sharding: as for ``lax.dot_general``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      The product, as ``lax.dot_general`` gives it.
    """
    return self._dot(
      lhs, rhs, dimension_numbers, precision, preferred_element_type, rngs, out_sharding
    )


def _einsum_labels(einsum_str: str, inputs, kernel) -> tuple[str, str, str]:
  operands, output, _ = opt_einsum.parser.parse_einsum_input((einsum_str, inputs, kernel))
  in_labels, kernel_labels = operands.split(",")
  return in_labels, kernel_labels, output


def _check_einsum(einsum_str, in_labels, kernel_labels, out_labels, inputs, kernel) -> None:
  """Refuses equations that ``jnp.einsum`` would reduce before its GEMM (with a clear message)."""
  for what, labels, array in (("input", in_labels, inputs), ("kernel", kernel_labels, kernel)):
    if len(labels) != array.ndim:
      raise ValueError(
        f"Einsum {einsum_str!r}: the {what} has rank {array.ndim} (shape {array.shape}) but "
        f"the equation gives it {len(labels)} labels ({labels!r})"
      )
  for what, labels in (("input", in_labels), ("kernel", kernel_labels)):
    if len(set(labels)) != len(labels):
      raise ValueError(
        f"Einsum {einsum_str!r}: a label repeats in the {what} ({labels}); a quantized "
        "einsum needs one GEMM without diagonals"
      )
  lonely = [c for c in in_labels if c not in kernel_labels and c not in out_labels]
  lonely += [c for c in kernel_labels if c not in in_labels and c not in out_labels]
  if lonely:
    raise ValueError(
      f"Einsum {einsum_str!r}: label(s) {lonely} are summed over one operand only; a quantized "
      "einsum needs every summed label in both the input and the kernel"
    )
  for c in set(in_labels) & set(kernel_labels):
    a, b = inputs.shape[in_labels.index(c)], kernel.shape[kernel_labels.index(c)]
    if a != b:
      raise ValueError(
        f"Einsum {einsum_str!r}: label {c!r} has size {a} in the input but {b} in the kernel"
      )


class EinsumOp(_RecipeOp):
  """A quantized ``jnp.einsum`` for ``nnx.Einsum(einsum_op=...)``: the GEMM goes through
  ``jnp.einsum(..., _dot_general=...)``.

  The first operand is the input ``x`` and the second the ``kernel``. ``jnp.einsum`` may hand
  the kernel to its ``dot_general`` first; the roles are matched by labels and shapes, so the
  ``x_*`` state always belongs to the input.

  Args:
    recipe: a te_adapters recipe.
    threshold, rngs, amax_axes, kernel_all_gather, config: as for ``DotGeneral``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = nnx.Einsum("btd,dhk->bthk", (32, 2, 16),
    ...                    einsum_op=ta_nnx.EinsumOp(ta.Float8CurrentScaling()), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4, 32))).shape
    (2, 4, 2, 16)
  """

  def __call__(
    self,
    einsum_str: str,
    inputs: jax.Array,
    kernel: jax.Array,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    rngs=None,
  ) -> jax.Array:
    """``jnp.einsum(einsum_str, inputs, kernel, ...)`` with one FP8 GEMM; ``out_sharding`` as
    for ``jnp.einsum`` (a model's own sharding annotations).

    Args:
      einsum_str: the equation, input first and kernel second (one GEMM of the two).
      inputs: the input.
      kernel: the kernel.
      precision: as for ``jnp.einsum``.
      preferred_element_type: the output dtype; default as ``jnp.einsum`` gives.
      out_sharding: as for ``jnp.einsum``.
      rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or key for this call's stochastic rounding, in
        place of the layer's own stream; None: the layer's.

    Returns:
      The result of the equation.
    """
    inputs, kernel = jnp.asarray(inputs), jnp.asarray(kernel)
    in_labels, k_labels, out_labels = _einsum_labels(einsum_str, inputs, kernel)
    _check_einsum(einsum_str, in_labels, k_labels, out_labels, inputs, kernel)

    def matches(a, b, dims, a_labels, b_labels, a_shape, b_shape) -> bool:
      (ac, bc), (ab, bb) = dims
      return (
        tuple(a.shape) == tuple(a_shape)
        and tuple(b.shape) == tuple(b_shape)
        and all(a_labels[i] == b_labels[j] for i, j in zip((*ac, *ab), (*bc, *bb), strict=True))
      )

    def dot_general(a, b, dims, precision=None, preferred_element_type=None, **kwargs: Any):
      out_sharding = kwargs.pop("out_sharding", None)
      (ac, bc), (ab, bb) = dims
      x_first = matches(a, b, dims, in_labels, k_labels, inputs.shape, kernel.shape)
      kernel_first = matches(a, b, dims, k_labels, in_labels, kernel.shape, inputs.shape)
      if x_first == kernel_first:
        raise ValueError(
          f"Einsum {einsum_str!r}: cannot tell the input from the kernel in the GEMM that "
          "jnp.einsum formed; use distinct labels or shapes for the two operands"
        )
      layer = f"Einsum {einsum_str!r}"
      if x_first:
        return self._dot(a, b, dims, precision, preferred_element_type, rngs, out_sharding, layer)
      # jnp.einsum put the kernel first: compute with x first, then restore its output layout
      # (batch, kernel free, x free); out_sharding, given for that layout, is permuted to ours.
      n_batch = len(ab)
      n_x_free = b.ndim - len(bc) - n_batch
      n_k_free = a.ndim - len(ac) - n_batch
      batch = list(range(n_batch))
      # Our output (batch, x free, k free) in terms of einsum's (batch, k free, x free).
      ours = batch + [n_batch + n_k_free + i for i in range(n_x_free)]
      ours += [n_batch + i for i in range(n_k_free)]
      out = self._dot(
        b,
        a,
        ((bc, ac), (bb, ab)),
        precision,
        preferred_element_type,
        rngs,
        _permuted_sharding(out_sharding, ours),
        layer,
      )
      x_free = list(range(n_batch, n_batch + n_x_free))
      k_free = list(range(n_batch + n_x_free, n_batch + n_x_free + n_k_free))
      return jnp.transpose(out, batch + k_free + x_free)

    return jnp.einsum(
      einsum_str,
      inputs,
      kernel,
      precision=precision,
      preferred_element_type=preferred_element_type,
      _dot_general=dot_general,
      out_sharding=out_sharding,
    )
