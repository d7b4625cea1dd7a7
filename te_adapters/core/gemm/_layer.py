"""What every adapter's quantized layer shares: the default recipe and threshold, the rules on
GEMM sizes and input dtypes, and the report of a conversion (``quantize`` in Linen and Haiku,
``quantize_model`` in NNX). The adapters apply these; they hold no rule of their own."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from te_adapters.core.gemm._threshold import DEFAULT_SIZE_THRESHOLD
from te_adapters.core.recipes import Float8CurrentScaling

if TYPE_CHECKING:
  from jax import lax
  from jax.typing import DTypeLike

  from te_adapters.core.recipes import Recipe

__all__ = [
  "check_last_axis",
  "DEFAULT_RECIPE",
  "DEFAULT_THRESHOLD",
  "GEMM_DIM_MULTIPLE",
  "QuantizeReport",
  "check_gemm_dims",
  "check_input_dtype",
  "check_kernel_gemm_dims",
  "einsum_gemm_dims",
  "gemm_dims_refusal",
  "input_dtype_refusal",
  "kernel_gemm_dims",
]

# The recipe of a quantized layer built without ``recipe=`` (NNX ``Linear``, Linen ``Dense``,
# Haiku ``Linear``): per-tensor current scaling, stateless, so the layer needs nothing beyond
# its parameters and trains with any loop. Recipes are frozen, so one instance is shared.
DEFAULT_RECIPE = Float8CurrentScaling()
# Every adapter's default ``threshold=``: GEMMs too small for FP8 to pay stay in high precision.
DEFAULT_THRESHOLD = DEFAULT_SIZE_THRESHOLD

# FP8 GEMMs need the contracting size K and the output-feature size N of a layer's kernel to be
# multiples of 16 (TE asserts the same; cuBLASLt's FP8 GEMMs need 16-byte aligned operands).
GEMM_DIM_MULTIPLE = 16


def gemm_dims_refusal(k: int, n: int) -> str | None:
  """Why a layer whose GEMM contracts ``k`` and writes ``n`` features cannot be quantized, or None.

  Args:
    k: the GEMM's contracting size K.
    n: its output-feature size N.

  Returns:
    A sentence saying why (K or N not a multiple of ``GEMM_DIM_MULTIPLE``), or None where the
    sizes can be quantized.

  Example:
    >>> from te_adapters import core
    >>> core.gemm_dims_refusal(32, 10)
    'GEMM size K=32, N=10 is not a multiple of 16'
    >>> core.gemm_dims_refusal(32, 16) is None
    True
  """
  if k % GEMM_DIM_MULTIPLE or n % GEMM_DIM_MULTIPLE:
    return f"GEMM size K={k}, N={n} is not a multiple of {GEMM_DIM_MULTIPLE}"
  return None


def check_gemm_dims(k: int, n: int, what: str) -> None:
  """Raises a ValueError naming ``what`` when ``gemm_dims_refusal(k, n)`` refuses the layer.

  A layer built or called with a recipe applies it (at every size: the size threshold does not
  hide it); a conversion skips such a layer and says why in its report.

  Args:
    k: the GEMM's contracting size K.
    n: its output-feature size N.
    what: the layer, as the error names it.

  Returns:
    None.

  Raises:
    ValueError: K or N is not a multiple of ``GEMM_DIM_MULTIPLE`` (16).

  Example:
    >>> from te_adapters import core
    >>> core.check_gemm_dims(64, 32, "Dense_0")
    >>> core.check_gemm_dims(64, 10, "Dense_0")
    Traceback (most recent call last):
      ...
    ValueError: Dense_0: FP8 GEMMs need ... to be multiples of 16, got N=10; keep this layer ...
  """
  if gemm_dims_refusal(k, n) is None:
    return
  bad = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % GEMM_DIM_MULTIPLE]
  raise ValueError(
    f"{what}: FP8 GEMMs need the contracting size K and the output-feature size N to be "
    f"multiples of {GEMM_DIM_MULTIPLE}, got {', '.join(bad)}; keep this layer unquantized "
    "(recipe=None)"
  )


def input_dtype_refusal(dtype: DTypeLike | None) -> str | None:
  """Why a layer whose GEMM takes inputs of ``dtype`` cannot be quantized, or None.

  FP8 GEMMs quantize real floating-point operands; integer, boolean and complex inputs are
  refused. Each adapter asks this of the inputs as its framework's layer would hand them to its
  GEMM (Flax promotes them with the parameters' dtype first; Haiku creates its parameters in
  the inputs' dtype, so it asks before creating them).

  Args:
    dtype: the inputs' dtype (anything ``np.dtype`` takes).

  Returns:
    A sentence saying why, or None for real floating-point inputs.

  Example:
    >>> import numpy as np
    >>> from te_adapters import core
    >>> core.input_dtype_refusal(np.int32)
    'input dtype int32 is not real floating point'
    >>> core.input_dtype_refusal(np.float32) is None
    True
  """
  try:
    dt = np.dtype(dtype)
  except TypeError:
    return f"input dtype {dtype} is not real floating point"
  if jnp.issubdtype(dt, jnp.floating):
    return None
  return f"input dtype {dt} is not real floating point"


def check_input_dtype(recipe: Recipe | None, dtype: DTypeLike, what: str) -> None:
  """Raises a TypeError naming ``what`` when ``recipe`` is not None and
  ``input_dtype_refusal(dtype)`` refuses the inputs (a conversion skips such a layer instead).

  Args:
    recipe: the layer's recipe; None (an unquantized layer) takes any inputs.
    dtype: the inputs' dtype.
    what: the layer, as the error names it.

  Returns:
    None.

  Raises:
    TypeError: a recipe and inputs that are not real floating point.

  Example:
    >>> import numpy as np, te_adapters as ta
    >>> ta.core.check_input_dtype(None, np.int32, "Embed_0")  # unquantized: any dtype
    >>> ta.core.check_input_dtype(ta.Float8CurrentScaling(), np.int32, "Dense_0")
    Traceback (most recent call last):
      ...
    TypeError: Dense_0: a quantized layer needs real floating-point inputs (input dtype int32 ...
  """
  if recipe is None or (why := input_dtype_refusal(dtype)) is None:
    return
  raise TypeError(
    f"{what}: a quantized layer needs real floating-point inputs ({why}); cast the "
    "inputs, or keep this layer unquantized (recipe=None)"
  )


def check_last_axis(axis: int | Iterable[int], ndim: int | None, what: str, te_layer: str) -> None:
  """Raises a ValueError unless ``axis`` names the last axis: TE's norm-then-GEMM layers
  (``te_layer``) normalize and contract it alone. ``axis`` is an int or a sequence of ints;
  with the input's rank ``ndim`` it may be ``ndim - 1``, without it (a layer checking its
  arguments before any input) it must be ``-1``.

  Args:
    axis: the layer's ``axis`` argument.
    ndim: the input's rank, or None.
    what: the layer, as the error names it.
    te_layer: the TE layer whose rule this is, as the error names it.

  Returns:
    None.

  Raises:
    ValueError: ``axis`` is not the last axis alone.

  Example:
    >>> from te_adapters import core
    >>> core.check_last_axis(2, 3, "f", "LayerNormMLP")  # the last of 3 axes
    >>> core.check_last_axis(0, 3, "f", "LayerNormMLP")
    Traceback (most recent call last):
    ...
    ValueError: f: axis must be -1 (the normalized last axis, as TE's LayerNormMLP requires), got 0
  """
  axes = tuple(axis) if isinstance(axis, Iterable) else (axis,)
  if ndim is None:
    ok = axes == (-1,)
  else:
    ok = ndim >= 1 and tuple(a % ndim for a in axes) == (ndim - 1,)
  if not ok:
    raise ValueError(
      f"{what}: axis must be -1 (the normalized last axis, as TE's {te_layer} requires), "
      f"got {axis!r}"
    )


def kernel_gemm_dims(
  kernel_shape: Sequence[int], dimension_numbers: lax.DotDimensionNumbers
) -> tuple[int, int]:
  """``(K, N)`` of a ``dot_general(x, kernel, dimension_numbers)``: the product of the kernel's
  contracting sizes and of its free (neither contracting nor batch) sizes.

  Args:
    kernel_shape: the kernel's shape.
    dimension_numbers: the GEMM's ``lax.dot_general`` dimension numbers (the kernel is the
      right-hand operand).

  Returns:
    ``(K, N)`` as ints.

  Example:
    >>> from te_adapters import core
    >>> core.kernel_gemm_dims((32, 2, 24), (((2,), (0,)), ((), ())))
    (32, 48)
  """
  (_, contracting), (_, batch) = dimension_numbers
  free = [d for d in range(len(kernel_shape)) if d not in (*contracting, *batch)]
  return math.prod(kernel_shape[d] for d in contracting), math.prod(kernel_shape[d] for d in free)


def check_kernel_gemm_dims(
  recipe: Recipe | None,
  kernel_shape: Sequence[int],
  dimension_numbers: lax.DotDimensionNumbers,
  what: str,
) -> None:
  """``check_gemm_dims`` on a GEMM given by its kernel's shape, when ``recipe`` is not None.

  Args:
    recipe: the layer's recipe; None checks nothing.
    kernel_shape: the kernel's shape.
    dimension_numbers: the GEMM's ``lax.dot_general`` dimension numbers (kernel on the right).
    what: the layer, as the error names it (with the kernel's shape added).

  Returns:
    None.

  Raises:
    ValueError: the kernel's K or N is not a multiple of ``GEMM_DIM_MULTIPLE``.

  Example:
    >>> import te_adapters as ta
    >>> dn = (((1,), (0,)), ((), ()))
    >>> ta.core.check_kernel_gemm_dims(ta.Float8CurrentScaling(), (64, 32), dn, "Dense_0")
    >>> ta.core.check_kernel_gemm_dims(ta.Float8CurrentScaling(), (64, 24), dn, "Dense_0")
    Traceback (most recent call last):
      ...
    ValueError: Dense_0 with kernel shape (64, 24): FP8 GEMMs need ... got N=24; ...
  """
  if recipe is not None:
    k, n = kernel_gemm_dims(tuple(kernel_shape), dimension_numbers)
    check_gemm_dims(k, n, f"{what} with kernel shape {tuple(kernel_shape)}")


def einsum_gemm_dims(einsum_str: str, kernel_shape: Sequence[int]) -> tuple[int, int] | None:
  """``(K, N)`` of the GEMM of an Einsum layer, from its equation and kernel shape.

  K multiplies the kernel dims summed with the input, N the kernel dims kept in the output
  and absent from the input. ``None`` if the equation is not one GEMM of input and kernel (not
  two operands, an ellipsis in the kernel, a repeated label, a label summed over one operand).

  Args:
    einsum_str: the layer's equation, input first and kernel second (``"bsd,dhk->bshk"``).
    kernel_shape: the kernel's shape.

  Returns:
    ``(K, N)`` as ints, or None.

  Example:
    >>> from te_adapters import core
    >>> core.einsum_gemm_dims("bsd,dhk->bshk", (64, 4, 16))
    (64, 64)
    >>> core.einsum_gemm_dims("bd,dd->bd", (64, 64)) is None  # a repeated label
    True
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


@dataclasses.dataclass
class QuantizeReport:
  """What a conversion did: ``te_adapters.linen.quantize``, ``te_adapters.haiku.quantize``
  (filled in while the model is traced) and ``te_adapters.nnx.quantize_model``.

  Paths are the names each framework gives its modules, joined by ``/`` (Linen
  ``"Encoder_0/Dense_1"``, Haiku ``"mlp/~/linear_0"``, NNX ``"blocks/0/mlp"``); the same model
  written in two frameworks with the same module names gets equal reports.

  Attributes:
    quantized: paths of the layers computed with a recipe, in the order met.
    skipped: path -> why the conversion could not quantize a layer a rule gave a recipe (sizes
      not multiples of 16, a ``dot_general`` of its own, a GEMM the conversion cannot reach such
      as a tied embedding's ``attend``). Each conversion warns once about the layers it skips.
    high_precision: path -> why a layer's GEMM runs in high precision by choice: a rule keeps it
      there (``recipe=None``), or no rule selects it; or, for a quantized layer, it is below the
      size threshold on this backend (``threshold=None`` quantizes it: Linen and Haiku record
      the GEMMs that ran so; NNX, converting before the model runs, the layers whose kernel
      alone keeps every GEMM below the threshold).
    recipes: path of each quantized layer -> its recipe.

  Example:
    >>> import te_adapters as ta
    >>> from te_adapters import core
    >>> report = core.QuantizeReport(
    ...     ["mlp/up"], {"head": "GEMM size K=32, N=10 is not a multiple of 16"},
    ...     {"attn/query": "rule 0 ('attn/.*') keeps it in high precision"},
    ...     {"mlp/up": ta.Float8CurrentScaling()})
    >>> print(report)
    quantized 1 layer(s), kept 1 in high precision, skipped 1
      quantized mlp/up: Float8CurrentScaling
      high precision attn/query: rule 0 ('attn/.*') keeps it in high precision
      skipped head: GEMM size K=32, N=10 is not a multiple of 16
  """

  quantized: list[str] = dataclasses.field(default_factory=list)
  skipped: dict[str, str] = dataclasses.field(default_factory=dict)
  high_precision: dict[str, str] = dataclasses.field(default_factory=dict)
  recipes: dict[str, object] = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    kept = [path for path in self.high_precision if path not in self.quantized]
    small = [path for path in self.high_precision if path in self.quantized]
    head = f"quantized {len(self.quantized)} layer(s)"
    if kept:
      head += f", kept {len(kept)} in high precision"
    head += f", skipped {len(self.skipped)}"
    if small:
      every = " (all of them)" if len(small) == len(self.quantized) else ""
      head += f"; {len(small)} of the quantized{every} run in high precision"
    lines = [head]
    for path in self.quantized:
      recipe = self.recipes.get(path)
      name = "" if recipe is None else f": {type(recipe).__name__}"
      lines.append(f"  quantized {path}{name}")
    lines += [f"  high precision {path}: {self.high_precision[path]}" for path in kept]
    lines += [f"  skipped {path}: {reason}" for path, reason in self.skipped.items()]
    lines += [f"  high precision {path}: {self.high_precision[path]}" for path in small]
    return "\n".join(lines)
