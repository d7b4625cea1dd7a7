"""Float32 leaves whose cotangents combine by max or min instead of sum.

The new recipe state leaves a training step as the gradient with respect to the state. When one
state feeds several GEMMs in a step (a layer called twice, ``scan`` over broadcast state, several
micro-batches), JAX adds the cotangents of the uses, which would add up scales and amaxes. Casting
the state to these dtypes *before* it fans out makes autodiff combine the uses by max (amax
histories) or min (scales, since the scale falls as the amax grows): the result is the state that
one use seeing the largest amax would have produced.

This relies on JAX's extended dtypes (``jax._src.dtypes.ExtendedDType``), the mechanism behind
typed PRNG keys; it is private API, so everything that touches it lives in this module.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes

__all__ = [
  "MAX_F32",
  "SCALE_F32",
  "cast_like",
  "encode_scale",
  "to_accumulating",
  "to_accumulating_shared",
  "to_float32",
  "is_accumulating",
]


class _AccumulatingRules:
  allow_conversion = True

  @staticmethod
  def physical_element_aval(dtype):
    del dtype
    return jax_core.ShapedArray((), np.dtype(np.float32))

  @staticmethod
  def add(dtype, x, y):
    # Some JAX versions pass an unrelated object as `dtype`; the operands carry the real one.
    del dtype
    dt = x.dtype
    xf = lax.convert_element_type(x, np.float32)
    yf = lax.convert_element_type(y, np.float32)
    if dt.combine == "max":
      combined = lax.max(xf, yf)
    else:
      # Scales: a use that updated its scale contributes it (> 0); a use that kept the old scale
      # contributes -old_scale. Updated scales combine by min (the largest amax wins) and beat
      # kept ones; kept ones are all the same -old_scale.
      both_updated = (xf > 0) & (yf > 0)
      combined = lax.select(both_updated, lax.min(xf, yf), lax.max(xf, yf))
    return lax.convert_element_type(combined, dt)

  @staticmethod
  def zero(dtype):
    # Loses against every contribution, so a use that contributes nothing changes nothing.
    return lax.convert_element_type(np.array(-np.inf, np.float32), dtype)

  @staticmethod
  def tangent_dtype(dtype):
    return dtype

  @staticmethod
  def full(shape, fill_value, dtype):
    fill = lax.convert_element_type(fill_value, np.float32)
    return lax.convert_element_type(lax.full(shape, fill, np.float32), dtype)

  @staticmethod
  def global_sharded_result_handler(aval, out_sharding, committed):
    from jax._src import earray
    from jax._src.interpreters import pxla

    physical = jax_core.physical_aval(aval)
    handler = pxla.global_result_handlers[jax_core.ShapedArray](physical, out_sharding, committed)
    return lambda buffers: earray.EArray(aval, handler(buffers))


class accumulating_float32(jax_dtypes.extended):
  """Scalar type of the accumulating dtypes (for ``jnp.issubdtype``)."""


@dataclasses.dataclass(frozen=True)
class AccumulatingFloat32(jax_dtypes.ExtendedDType):
  """A float32 whose autodiff accumulation is ``combine`` ("max" or "min")."""

  combine: str
  _rules: type = _AccumulatingRules
  type: type = accumulating_float32

  @property
  def name(self) -> str:
    return f"float32_{self.combine}_grad"

  def __repr__(self) -> str:
    return self.name


MAX_F32 = AccumulatingFloat32("max")
SCALE_F32 = AccumulatingFloat32("scale")


def _register_eager_adder():
  # Outside jit, autodiff adds concrete extended-dtype arrays through this table.
  try:
    from jax._src import ad_util, earray
  except ImportError:  # pragma: no cover - layout of a future JAX
    return
  adders = getattr(ad_util, "raw_jaxval_adders", None)
  if adders is not None:
    adders.setdefault(earray.EArray, lambda x, y: x.dtype._rules.add(x.dtype, x, y))


_register_eager_adder()


def is_accumulating(x) -> bool:
  return isinstance(getattr(x, "dtype", None), AccumulatingFloat32)


def to_accumulating(x, combine: str):
  """Casts a float32 array to the dtype whose cotangents combine by ``combine``.

  ``combine`` is ``"max"`` (amax histories) or ``"scale"`` (scales, see ``encode_scale``). The
  gradient that flows back to the float32 input is decoded: kept scales become positive again,
  and a leaf no use contributed to gets zeros (as without this cast).
  """
  if is_accumulating(x):
    return x
  x = jax.numpy.asarray(x)
  if x.dtype != np.float32:
    raise TypeError(f"recipe state must be float32, got an array of dtype {x.dtype}")
  return _cast_in(x, MAX_F32 if combine == "max" else SCALE_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cast_in(x, dtype):
  return lax.convert_element_type(x, dtype)


def _cast_in_fwd(x, dtype):
  return _cast_in(x, dtype), x


def _cast_in_bwd(dtype, x, ct):
  ct = lax.convert_element_type(ct, np.float32)
  kept = jnp.isneginf(ct)  # the combine rule's zero: every use kept the state as it was
  if dtype.combine == "scale":
    ct = jnp.abs(ct)  # a kept scale arrives as -old_scale
  return (jnp.where(kept, x, ct),)


_cast_in.defvjp(_cast_in_fwd, _cast_in_bwd)


# id(float32 tracer) -> (weak reference to it, its accumulating cast); see to_accumulating_shared.
_SHARED: dict[int, tuple] = {}
_SHARED_LIMIT = 1 << 14


def to_accumulating_shared(x, combine: str):
  """``to_accumulating(x, combine)``, cast once per traced array and shared by every use.

  Under a plain ``jax.grad`` (or a framework's transform built on it) the cotangents of several
  uses of one state leaf are summed where the leaf fans out. Casting each *use* would leave that
  fan-out before the casts, so the uses would still sum; casting the leaf once, in the trace it
  lives in, and handing every use the same cast array puts the fan-out after the cast, where
  autodiff combines by max. A leaf closed over by a ``scan`` or ``remat`` body is cast outside
  it, so the iterations combine by max too. Concrete arrays (nothing differentiates them) and
  arrays already accumulating come back as they are.
  """
  if is_accumulating(x) or not isinstance(x, jax_core.Tracer):
    return x
  key = id(x)
  entry = _SHARED.get(key)
  if entry is not None and entry[0]() is x:
    return entry[1]
  with jax_core.set_current_trace(x._trace):
    cast = to_accumulating(x, combine)
  if len(_SHARED) >= _SHARED_LIMIT:
    _SHARED.clear()

  def forget(ref, key=key, shared=_SHARED):  # bound here: it may run at interpreter exit
    current = shared.get(key)
    if current is not None and current[0] is ref:
      shared.pop(key, None)

  _SHARED[key] = (weakref.ref(x, forget), cast)
  return cast


def encode_scale(new_scale, updated, old_scale, reference):
  """The cotangent a use returns for a scale leaf shaped like ``reference``.

  Plain float32: the new scale. Accumulating: the new scale where it was updated, else
  ``-old_scale``, so that combining uses lets updated scales win (see ``_AccumulatingRules.add``).
  """
  if is_accumulating(reference):
    value = jnp.where(updated, new_scale, -jnp.abs(old_scale))
    return lax.convert_element_type(value, reference.dtype)
  return new_scale


def to_float32(x):
  """The float32 value of an array, accumulating or not."""
  if is_accumulating(x):
    return lax.convert_element_type(x, np.float32)
  return x


def cast_like(value, reference):
  """Casts float32 ``value`` to the dtype of ``reference`` (accumulating or float32)."""
  if is_accumulating(reference):
    return lax.convert_element_type(value, reference.dtype)
  return value
