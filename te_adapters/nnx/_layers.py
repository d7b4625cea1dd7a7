"""Drop-in quantized versions of ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``.

Each class subclasses its NNX counterpart and takes every one of its arguments, plus
``recipe=``. Parameters (``kernel``, ``bias``) are created by the NNX parent exactly as there, so
they load from and into the NNX layer; the quantized GEMM is the parent's ``dot_general`` /
``einsum_op`` slot, filled with a ``DotGeneral`` / ``EinsumOp`` submodule that owns the recipe
state. With ``recipe=None`` the layer is its NNX parent, unchanged.
"""

from __future__ import annotations

import math
import typing as tp
from types import MappingProxyType

import jax.numpy as jnp
from flax import nnx
from flax.core.frozen_dict import FrozenDict
from flax.nnx.nn import dtypes
from flax.nnx.nn import linear as nnx_linear
from flax.typing import Dtype, Initializer, PrecisionLike, PromoteDtypeFn, Shape
from jax import lax

from te_adapters import core
from te_adapters.nnx._ops import DotGeneral, EinsumOp, _RecipeOp, call_rngs, check_gemm_dims

__all__ = ["Linear", "LinearGeneral", "Einsum"]

_DEFAULT_RECIPE = core.DEFAULT_RECIPE


def _quantized_op(op_cls, recipe, given, default, arg_name: str, layer: str, **options):
  if recipe is None:
    if options.get("amax_axes") is not None or options.get("kernel_all_gather") is not None:
      raise ValueError(f"{layer}: amax_axes and kernel_all_gather need a recipe")
    return given
  if given is not default:
    raise ValueError(
        f"{layer}: pass either recipe= or a custom {arg_name}=, not both (recipe={recipe!r} "
        f"replaces the {arg_name})"
    )
  # The rounding stream is forked after the parameters are drawn (see _attach_rngs).
  return op_cls(recipe, **options)


def _attach_rngs(op, rngs) -> None:
  # After the NNX parent drew the parameters, so they equal those of the NNX layer.
  if isinstance(op, _RecipeOp):
    op.set_rngs(rngs)


class Linear(nnx.Linear):
  """``nnx.Linear`` with a quantized GEMM.

  Takes every argument of ``flax.nnx.Linear`` with the same defaults, and creates the same
  parameters (``kernel`` (in, out), ``bias`` (out,)) with the same initialisers, so weights load
  from and into an ``nnx.Linear``. The recipe state lives in ``RecipeState`` variables of the
  ``dot_general`` submodule (``layer.dot_general.x_scale``, ...), which
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
    amax_axes, kernel_all_gather: passed to ``core.dot_general`` (SPMD: the mesh axes amaxes are
      reduced over inside ``shard_map``; FSDP's FP8 kernel all-gather).
    **others: as for ``flax.nnx.Linear``. ``dot_general`` cannot be combined with a recipe.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.Linear(32, 16, recipe=ta.DelayedScaling(amax_history_len=16),
    ...                       rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape
    (4, 16)
    >>> layer.dot_general.x_amax_history.shape
    (16,)
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      precision: PrecisionLike = None,
      kernel_init: Initializer = nnx_linear.default_kernel_init,
      bias_init: Initializer = nnx_linear.default_bias_init,
      dot_general: tp.Callable[..., tp.Any] = lax.dot_general,
      promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      preferred_element_type: Dtype | None = None,
      rngs: nnx.Rngs,
      kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      recipe: core.Recipe | None = _DEFAULT_RECIPE,
      threshold: core.SizeThreshold | None = core.DEFAULT_THRESHOLD,
      amax_axes: tp.Any = None,
      kernel_all_gather: tp.Any = None,
  ):
    if recipe is not None:
      check_gemm_dims(in_features, out_features, f"Linear({in_features}, {out_features})")
    dot_general = _quantized_op(
        DotGeneral, recipe, dot_general, lax.dot_general, "dot_general", "Linear",
        threshold=threshold, amax_axes=amax_axes, kernel_all_gather=kernel_all_gather,
    )
    super().__init__(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=kernel_init,
        bias_init=bias_init,
        dot_general=dot_general,
        promote_dtype=promote_dtype,
        preferred_element_type=preferred_element_type,
        rngs=rngs,
        kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata,
    )
    self.recipe = recipe
    self.threshold = threshold
    _attach_rngs(self.dot_general, rngs)

  def __call__(self, inputs, out_sharding=None, *, rngs=None):
    """As ``nnx.Linear.__call__``; ``rngs`` overrides the layer's rounding stream for this call."""
    with call_rngs(rngs):
      return super().__call__(inputs, out_sharding=out_sharding)


class LinearGeneral(nnx.LinearGeneral):
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
    threshold, amax_axes, kernel_all_gather: as for ``Linear``.
    **others: as for ``flax.nnx.LinearGeneral``. ``dot_general`` and ``dot_general_cls`` cannot be
      combined with a recipe.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.LinearGeneral(32, (2, 16), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 32))).shape
    (4, 2, 16)
  """

  def __init__(
      self,
      in_features: int | tp.Sequence[int],
      out_features: int | tp.Sequence[int],
      *,
      axis: int | tp.Sequence[int] = -1,
      batch_axis: tp.Mapping[int, int] = FrozenDict({}),
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer = nnx_linear.default_kernel_init,
      bias_init: Initializer = nnx_linear.default_bias_init,
      precision: PrecisionLike = None,
      promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      dot_general: tp.Callable[..., tp.Any] | None = None,
      dot_general_cls: tp.Any = None,
      preferred_element_type: Dtype | None = None,
      rngs: nnx.Rngs,
      kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      recipe: core.Recipe | None = _DEFAULT_RECIPE,
      threshold: core.SizeThreshold | None = core.DEFAULT_THRESHOLD,
      amax_axes: tp.Any = None,
      kernel_all_gather: tp.Any = None,
  ):
    if recipe is not None:
      if dot_general_cls is not None:
        raise ValueError("LinearGeneral: pass either recipe= or dot_general_cls=, not both")
      k = math.prod(nnx_linear._canonicalize_tuple(in_features))
      n = math.prod(nnx_linear._canonicalize_tuple(out_features))
      check_gemm_dims(k, n, f"LinearGeneral({in_features}, {out_features})")
    dot_general = _quantized_op(
        DotGeneral, recipe, dot_general, None, "dot_general", "LinearGeneral",
        threshold=threshold, amax_axes=amax_axes, kernel_all_gather=kernel_all_gather,
    )
    super().__init__(
        in_features,
        out_features,
        axis=axis,
        batch_axis=batch_axis,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=kernel_init,
        bias_init=bias_init,
        precision=precision,
        promote_dtype=promote_dtype,
        dot_general=dot_general,
        dot_general_cls=dot_general_cls,
        preferred_element_type=preferred_element_type,
        rngs=rngs,
        kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata,
    )
    self.recipe = recipe
    self.threshold = threshold
    _attach_rngs(self.dot_general, rngs)

  def __call__(self, inputs, out_sharding=None, *, rngs=None):
    """As ``nnx.LinearGeneral.__call__``; ``rngs`` overrides the rounding stream for this call."""
    with call_rngs(rngs):
      return super().__call__(inputs, out_sharding=out_sharding)


def einsum_gemm_dims(einsum_str: str, kernel_shape: Shape) -> tuple[int, int] | None:
  """``(K, N)`` of the GEMM of an Einsum layer, from its equation and kernel shape.

  K multiplies the kernel dims summed with the input, N the kernel dims kept in the output
  and absent from the input. ``None`` if the equation is not one GEMM of input and kernel (not
  two operands, an ellipsis in the kernel, a repeated label, a label summed over one operand).
  """
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    return None
  operands, out_labels = einsum_str.split("->")
  in_labels, k_labels = operands.split(",")
  in_labels, out_labels = in_labels.replace(".", ""), out_labels.replace(".", "")
  if "." in k_labels or len(k_labels) != len(kernel_shape):
    return None
  if len(set(k_labels)) != len(k_labels) or len(set(in_labels)) != len(in_labels):
    return None
  if any(c not in k_labels and c not in out_labels for c in in_labels) or any(
      c not in in_labels and c not in out_labels for c in k_labels
  ):
    return None
  sizes = dict(zip(k_labels, kernel_shape, strict=True))
  k = math.prod(s for c, s in sizes.items() if c in in_labels and c not in out_labels)
  n = math.prod(s for c, s in sizes.items() if c in out_labels and c not in in_labels)
  return k, n


class Einsum(nnx.Einsum):
  """``nnx.Einsum`` with a quantized GEMM, through ``jnp.einsum(..., _dot_general=...)``.

  Takes every argument of ``flax.nnx.Einsum`` with the same defaults and creates the same
  parameters. The recipe state (and the rounding stream, as for ``Linear``) lives in the
  ``einsum_op`` submodule (``layer.einsum_op.x_scale``, ...). The equation must contract the
  input with the kernel in one GEMM: no label repeated in an operand, and every summed label
  present in both operands.

  Args:
    einsum_str: the equation, input first and kernel second (``None`` to give it at call time).
    kernel_shape: the kernel shape; the contracted and output-feature sizes are multiples of 16
      when quantized.
    bias_shape: the bias shape, or ``None`` for no bias.
    recipe: a te_adapters recipe (default ``Float8CurrentScaling()``); ``None`` gives a plain
      ``nnx.Einsum``.
    threshold, amax_axes, kernel_all_gather: as for ``Linear``.
    **others: as for ``flax.nnx.Einsum``. ``einsum_op`` cannot be combined with a recipe.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> from flax import nnx
    >>> from te_adapters import nnx as ta_nnx
    >>> layer = ta_nnx.Einsum("btd,dhk->bthk", (32, 2, 16), (2, 16), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 4, 32))).shape
    (2, 4, 2, 16)
  """

  def __init__(
      self,
      einsum_str: str,
      kernel_shape: Shape,
      bias_shape: Shape | None = None,
      *,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      precision: PrecisionLike = None,
      kernel_init: Initializer = nnx_linear.default_kernel_init,
      bias_init: Initializer = nnx_linear.default_bias_init,
      promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
      einsum_op: tp.Callable[..., tp.Any] = jnp.einsum,
      preferred_element_type: Dtype | None = None,
      rngs: nnx.Rngs,
      kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      recipe: core.Recipe | None = _DEFAULT_RECIPE,
      threshold: core.SizeThreshold | None = core.DEFAULT_THRESHOLD,
      amax_axes: tp.Any = None,
      kernel_all_gather: tp.Any = None,
  ):
    if recipe is not None and einsum_str is not None:
      dims = einsum_gemm_dims(einsum_str, kernel_shape)
      if dims is not None:
        check_gemm_dims(*dims, f"Einsum({einsum_str!r}, kernel_shape={tuple(kernel_shape)})")
    einsum_op = _quantized_op(
        EinsumOp, recipe, einsum_op, jnp.einsum, "einsum_op", "Einsum",
        threshold=threshold, amax_axes=amax_axes, kernel_all_gather=kernel_all_gather,
    )
    super().__init__(
        einsum_str,
        kernel_shape,
        bias_shape,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=kernel_init,
        bias_init=bias_init,
        promote_dtype=promote_dtype,
        einsum_op=einsum_op,
        preferred_element_type=preferred_element_type,
        rngs=rngs,
        kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata,
    )
    self.recipe = recipe
    self.threshold = threshold
    _attach_rngs(self.einsum_op, rngs)

  def __call__(self, inputs, einsum_str=None, out_sharding=None, *, rngs=None):
    """As ``nnx.Einsum.__call__``; ``rngs`` overrides the layer's rounding stream for this call."""
    with call_rngs(rngs):
      return super().__call__(inputs, einsum_str, out_sharding=out_sharding)
