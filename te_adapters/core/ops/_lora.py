"""Low-rank adaptation (LoRA) of a dense layer, as TE's ``DenseGeneral`` adds it.

``y = dense(x, kernel) + (x @ lora_a @ lora_b) * scaling`` with ``scaling = alpha / rank`` (1
when ``alpha`` is None). The two LoRA GEMMs run in the input's precision, never quantized: they
are small (rank ``r``), and quantizing them would cost more than it saves. The base kernel's
GEMM is the layer's own (quantized per its recipe).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["check_lora_rank", "lora_shapes", "low_rank_adaptation"]


def _as_tuple(value) -> tuple[int, ...]:
  return tuple(value) if isinstance(value, Sequence) else (value,)


def check_lora_rank(
  rank: int,
  in_shape: int | Sequence[int],
  features: int | Sequence[int],
  what: str = "low-rank adaptation",
) -> None:
  """A ValueError naming ``what`` unless ``1 <= rank <= min(K, N)``.

  ``K`` is the product of the contracted input sizes ``in_shape`` and ``N`` the last output
  feature (TE's LoRA factors one ``K x N`` matrix per leading feature); a larger rank adds
  parameters and no expressiveness.

  Args:
    rank: the LoRA rank (``low_rank_adaptation_dim``).
    in_shape: the contracted input sizes (an int or a sequence).
    features: the layer's output features (an int or a sequence; the last one is N).
    what: the layer, as the error names it.

  Returns:
    None.

  Raises:
    ValueError: ``rank`` is not an int from 1 to ``min(K, N)``.

  Example:
    >>> from te_adapters import core
    >>> core.check_lora_rank(8, 64, 32)
    >>> core.check_lora_rank(64, 64, 32, "Dense_0")
    Traceback (most recent call last):
      ...
    ValueError: Dense_0: low_rank_adaptation_dim must be an int from 1 to min(K, N) = 32 ...
  """
  in_shape, features = _as_tuple(in_shape), _as_tuple(features)
  k, n = math.prod(in_shape), features[-1]
  if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(k, n):
    raise ValueError(
      f"{what}: low_rank_adaptation_dim must be an int from 1 to min(K, N) = {min(k, n)} "
      f"(K={k} contracted, N={n} output features), got {rank!r}"
    )


def lora_shapes(
  in_shape: int | Sequence[int], features: int | Sequence[int], rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """TE's shapes of ``lora_a_kernel`` and ``lora_b_kernel``.

  ``lora_a_kernel``: ``(*in_shape, *features[:-1], rank)``; ``lora_b_kernel``:
  ``(*features[:-1], rank, features[-1])``.

  Args:
    in_shape: the contracted input sizes (an int or a sequence).
    features: the layer's output features (an int or a sequence).
    rank: the LoRA rank.

  Returns:
    ``(lora_a_shape, lora_b_shape)``, tuples of ints.

  Example:
    >>> from te_adapters import core
    >>> core.lora_shapes((64,), (4, 16), 8)
    ((64, 4, 8), (4, 8, 16))
  """
  in_shape, features = _as_tuple(in_shape), _as_tuple(features)
  return (*in_shape, *features[:-1], rank), (*features[:-1], rank, features[-1])


def low_rank_adaptation(
  x: jax.Array,
  lora_a: jax.Array,
  lora_b: jax.Array,
  *,
  axis: int | Sequence[int] = -1,
  alpha: float | None = None,
) -> jax.Array:
  """The LoRA term ``(x @ lora_a @ lora_b) * scaling`` of a dense layer, in high precision.

  Args:
    x: the layer's input; ``axis`` names its contracted dimensions.
    lora_a: shape ``(*contracted, *features[:-1], r)`` (see ``lora_shapes``).
    lora_b: shape ``(*features[:-1], r, features[-1])``.
    axis: the contracted axes of ``x`` (an int or a tuple), as for the dense layer.
    alpha: ``scaling = alpha / r``; ``None`` gives ``scaling = 1`` (TE's rule).

  Returns:
    Shape ``(*x's other dims, *features)``, the dtype of ``x``, ``lora_a`` and ``lora_b``
    promoted together.

  Raises:
    ValueError: factors whose shapes do not match ``x``'s contracted axes or each other.

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters import core
    >>> x, a, b = jnp.ones((2, 32)), jnp.ones((32, 4)), jnp.ones((4, 16))
    >>> float(core.low_rank_adaptation(x, a, b, alpha=2.0)[0, 0])  # 32 * 4 * (2 / 4)
    64.0
  """
  x, lora_a, lora_b = jnp.asarray(x), jnp.asarray(lora_a), jnp.asarray(lora_b)
  axis = tuple(a % x.ndim for a in _as_tuple(axis))
  n_in = len(axis)
  n_lead = lora_b.ndim - 2
  rank = lora_a.shape[-1]
  if lora_a.ndim != n_in + n_lead + 1 or lora_b.shape[-2] != rank:
    raise ValueError(
      f"low_rank_adaptation: lora_a {lora_a.shape} and lora_b {lora_b.shape} do not match "
      f"{n_in} contracted axes of x {x.shape} (see lora_shapes)"
    )
  contracted = tuple(x.shape[a] for a in axis)
  if lora_a.shape[:n_in] != contracted or lora_a.shape[n_in:-1] != lora_b.shape[:-2]:
    raise ValueError(
      f"low_rank_adaptation: lora_a {lora_a.shape} needs contracted sizes {contracted} and "
      f"the leading features {lora_b.shape[:-2]} of lora_b {lora_b.shape}"
    )
  dtype = jnp.result_type(x, lora_a, lora_b)
  x = jnp.moveaxis(x, axis, tuple(range(x.ndim - n_in, x.ndim))).astype(dtype)
  letters = iter(string.ascii_letters)
  ins = "".join(next(letters) for _ in range(n_in))
  lead = "".join(next(letters) for _ in range(n_lead))
  r, out = next(letters), next(letters)
  y = jnp.einsum(
    f"...{ins},{ins}{lead}{r},{lead}{r}{out}->...{lead}{out}",
    x,
    lora_a.astype(dtype),
    lora_b.astype(dtype),
  )
  scaling = 1.0 if alpha is None else alpha / rank
  return y * jnp.asarray(scaling, dtype)
