"""core.softmax against a float64 softmax: scale factor, masks, bias, softmax types, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_adapters import core

SHAPE = (2, 3, 8, 16)  # [batch, heads, q, k]


def _data(seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=SHAPE) * 3.0
  mask = (rng.uniform(size=(2, 1, 8, 16)) < 0.3).astype(np.uint8)
  mask[0, 0, 1, :] = 1  # one row entirely masked
  bias = rng.normal(size=(1, 3, 8, 16))
  dy = rng.normal(size=SHAPE)
  return logits, mask, bias, dy


def _reference(logits, masked, bias, scale, extra=None):
  """float64 numpy: softmax over the kept logits (a fully masked row: equal weights)."""
  z = (logits + (0.0 if bias is None else bias)) * scale
  z = np.where(masked, -1e10, z)
  if extra is not None:
    z = np.concatenate([z, np.broadcast_to(extra, z.shape[:-1] + (1,))], axis=-1)
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  p = e / e.sum(axis=-1, keepdims=True)
  return p if extra is None else p[..., :-1]


def _reference_grad(logits, masked, bias, scale, dy, extra=None):
  """d sum(p * dy) / d logits in float64: scale * p * (dy - sum(p * dy)) on kept logits."""
  p = _reference(logits, masked, bias, scale, extra)
  g = scale * p * (dy - np.sum(p * dy, axis=-1, keepdims=True))
  return np.where(masked, 0.0, g)


CAUSAL = np.triu(np.ones((8, 16), bool), 1)


CASES = [(f, t, jnp.float32, 1e-5) for f in core.SoftmaxFusionType for t in core.SOFTMAX_TYPES]
CASES += [
  (core.SoftmaxFusionType.SCALED_MASKED, "vanilla", jnp.bfloat16, 1e-2),
  (core.SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED, "learnable", jnp.bfloat16, 1e-2),
]


@pytest.mark.parametrize(
  "fusion, softmax_type, dtype, tol", CASES, ids=lambda v: getattr(v, "name", None) or str(v)
)
def test_softmax_against_float64(fusion, softmax_type, dtype, tol, rel):
  logits, mask, bias, dy = _data()
  scale = 0.125
  use_mask = fusion is not core.SoftmaxFusionType.SCALED
  masked = np.zeros(SHAPE, bool) | (mask > 0 if use_mask else False)
  if fusion is core.SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED:
    masked = masked | CAUSAL
  offset = None
  extra = None
  if softmax_type == "off_by_one":
    extra = 0.0
  elif softmax_type == "learnable":
    offset = np.linspace(-1.0, 1.0, 3).reshape(1, 3, 1, 1)
    extra = offset
  x = jnp.asarray(logits, dtype)

  def loss(x):
    p = core.softmax(
      x,
      mask if use_mask else None,
      jnp.asarray(bias, dtype),
      offset,
      scale_factor=scale,
      softmax_fusion_type=fusion,
      softmax_type=softmax_type,
    )
    return jnp.sum(p.astype(jnp.float32) * jnp.asarray(dy, jnp.float32)), p

  (_, p), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
  x64 = np.asarray(x, np.float64)
  b64 = np.asarray(jnp.asarray(bias, dtype), np.float64)
  ref = _reference(x64, masked, b64, scale, extra)
  assert p.dtype == dtype and dx.dtype == dtype
  assert rel(p, ref) < tol
  assert rel(dx, _reference_grad(x64, masked, b64, scale, dy, extra)) < tol
  # Masked weights are exactly 0, except in fully masked rows (equal weights, as TE).
  full = masked.all(axis=-1, keepdims=True)
  assert np.all(np.asarray(p, np.float64)[masked & ~full] == 0)
  if softmax_type == "vanilla":
    np.testing.assert_allclose(np.sum(np.asarray(p, np.float64), -1), 1.0, atol=tol * 10)


def test_scaled_applies_a_given_mask():
  logits, mask, _, _ = _data()
  p = core.softmax(logits, mask, scale_factor=0.5)
  np.testing.assert_allclose(
    p, _reference(logits, np.broadcast_to(mask > 0, SHAPE), None, 0.5), rtol=1e-5, atol=1e-7
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"softmax_fusion_type": "scaled_masked"}, "needs a mask"),
    ({"softmax_fusion_type": "causal"}, "softmax_fusion_type must be"),
    ({"softmax_type": "sparsemax"}, "softmax_type must be one of"),
    ({"softmax_type": "learnable"}, "softmax_offset"),
    ({"softmax_offset": jnp.zeros((1, 3, 1, 1))}, "softmax_offset"),
    ({"mask": jnp.ones((3, 8, 8))}, "mask of shape"),
  ],
)
def test_softmax_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    core.softmax(jnp.zeros(SHAPE), **kwargs)
