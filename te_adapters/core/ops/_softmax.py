"""The attention softmax with TE's scale factor, masks and softmax types, in float32."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SOFTMAX_TYPES", "SoftmaxFusionType", "SoftmaxType", "softmax"]

# What a masked logit becomes (TE's value): its weight underflows to 0, and a row with every
# logit masked gets equal weights.
MASKED_LOGIT = -1e10


class SoftmaxFusionType(enum.Enum):
  """Which mask the softmax applies (TE's names).

  ``SCALED``: ``mask`` if one is given, else none. ``SCALED_MASKED``: ``mask``, which is
  required. ``SCALED_UPPER_TRIANG_MASKED``: causal, key position > query position is masked
  (plus ``mask`` if given). ``softmax`` also takes the values' names (``"scaled_masked"``).

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> mask = jnp.array([[0, 1]])  # nonzero: masked out
    >>> p = ta.core.softmax(jnp.zeros((1, 1, 1, 2)), mask,
    ...                     softmax_fusion_type=ta.core.SoftmaxFusionType.SCALED_MASKED)
    >>> p.ravel().tolist()
    [1.0, 0.0]
    >>> ta.core.SoftmaxFusionType("scaled_masked").name
    'SCALED_MASKED'
  """

  SCALED = "scaled"
  SCALED_MASKED = "scaled_masked"
  SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang_masked"


# TE's older name for the same enum.
SoftmaxType = SoftmaxFusionType

# ``vanilla``: the usual softmax. ``off_by_one``: one more logit fixed at 0 in every row (the
# weights sum to less than 1). ``learnable``: that extra logit is ``softmax_offset``, per head.
SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")


def _fusion_type(value) -> SoftmaxFusionType:
  if isinstance(value, SoftmaxFusionType):
    return value
  names = {t.value: t for t in SoftmaxFusionType} | {t.name: t for t in SoftmaxFusionType}
  if isinstance(value, str) and value in names:
    return names[value]
  raise ValueError(
    f"softmax_fusion_type must be a SoftmaxFusionType or one of {sorted(names)}, got {value!r}"
  )


def softmax(
  logits: jax.Array,
  mask: jax.Array | None = None,
  bias: jax.Array | None = None,
  softmax_offset: jax.Array | None = None,
  *,
  scale_factor: float = 1.0,
  softmax_fusion_type: SoftmaxFusionType | str = SoftmaxFusionType.SCALED,
  softmax_type: str = "vanilla",
) -> jax.Array:
  """``softmax((logits + bias) * scale_factor)`` over the last axis, with masked logits removed.

  As TE's ``Softmax``: ``logits`` are ``[batch, heads, q, k]`` (any leading axes work), ``mask``
  broadcasts against them and masks where it is nonzero (``> 0``), ``bias`` is added before the
  scaling. Computed in float32 (the gradient too, by autodiff) and returned in ``logits``'s
  dtype. A row whose every logit is masked gets equal weights, as TE's.

  Args:
    logits: the attention scores, ``[..., q, k]``.
    mask: nonzero where a score is masked out; broadcastable to ``logits``.
    bias: added to the logits before the scaling; broadcastable to ``logits``.
    softmax_offset: for ``softmax_type="learnable"``: the extra logit of each row,
      broadcastable to ``logits.shape[:-1] + (1,)`` (TE's per-head ``(1, heads, 1, 1)``).
    scale_factor: multiplies the logits.
    softmax_fusion_type: a ``SoftmaxFusionType`` (or its name): which mask applies.
    softmax_type: ``"vanilla"``, ``"off_by_one"`` or ``"learnable"`` (``SOFTMAX_TYPES``).

  Returns:
    The probabilities, of ``logits``'s shape and dtype.

  Raises:
    ValueError: an unknown ``softmax_type`` or ``softmax_fusion_type``; logits that are not
      floating point or have fewer than 2 axes; ``SCALED_MASKED`` without a mask;
      ``softmax_offset`` given with a type other than ``"learnable"`` (or missing with it); a
      mask or bias that does not broadcast to the logits.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> causal = ta.core.SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED
    >>> p = ta.core.softmax(jnp.zeros((1, 1, 2, 2)), softmax_fusion_type=causal)
    >>> p[0, 0].tolist()
    [[1.0, 0.0], [0.5, 0.5]]
  """
  logits = jnp.asarray(logits)
  fusion = _fusion_type(softmax_fusion_type)
  if softmax_type not in SOFTMAX_TYPES:
    raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
  if not jnp.issubdtype(logits.dtype, jnp.floating) or logits.ndim < 2:
    raise ValueError(
      f"softmax: logits must be a floating-point array [..., q, k], got {logits.dtype} of "
      f"shape {tuple(logits.shape)}"
    )
  if fusion is SoftmaxFusionType.SCALED_MASKED and mask is None:
    raise ValueError("softmax: SoftmaxFusionType.SCALED_MASKED needs a mask")
  if (softmax_offset is None) != (softmax_type != "learnable"):
    raise ValueError(
      "softmax: softmax_offset is the extra logit of softmax_type='learnable' and is given "
      f"exactly then (softmax_type={softmax_type!r}, softmax_offset "
      f"{'given' if softmax_offset is not None else 'missing'})"
    )
  for name, a in (("mask", mask), ("bias", bias)):
    if a is not None:
      try:
        np.broadcast_shapes(np.shape(a), logits.shape)
      except ValueError:
        raise ValueError(
          f"softmax: {name} of shape {np.shape(a)} does not broadcast to the logits' shape "
          f"{tuple(logits.shape)}"
        ) from None
  z = logits.astype(jnp.float32)
  if bias is not None:
    z = z + jnp.asarray(bias).astype(jnp.float32)
  z = z * jnp.float32(scale_factor)
  masked = None if mask is None else jnp.asarray(mask) > 0
  if fusion is SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED:
    q, k = logits.shape[-2:]
    causal = jnp.arange(k)[None, :] > jnp.arange(q)[:, None]
    masked = causal if masked is None else masked | causal
  if masked is not None:
    z = jnp.where(masked, jnp.float32(MASKED_LOGIT), z)
  if softmax_type == "vanilla":
    return jax.nn.softmax(z, axis=-1).astype(logits.dtype)
  extra = jnp.zeros(z.shape[:-1] + (1,), jnp.float32)
  if softmax_type == "learnable":
    extra = extra + jnp.asarray(softmax_offset).astype(jnp.float32)
  full = jax.nn.softmax(jnp.concatenate([z, extra], axis=-1), axis=-1)
  return full[..., :-1].astype(logits.dtype)
