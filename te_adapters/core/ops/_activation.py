"""TE's MLP activations by name, and the gated product of several, with a lean custom VJP.

``activation(h, ("gelu", "linear"))`` takes the first GEMM's output ``h`` of shape
``(..., n_act, F)`` (one slice per name) and returns ``gelu(h[..., 0, :]) * h[..., 1, :]`` of
shape ``(..., F)``, in ``h``'s dtype. The arithmetic runs in float32 and, in
``core.layernorm_mlp``, sits in the same jitted computation as the second GEMM's amax and FP8
cast, which leaves XLA free to fuse it into them (``bench/mlp_fusion.py`` lists what the compiled
forward pass writes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "activation", "activation_product", "normalize_activations"]


def _quick_gelu(x):
  return x * jax.nn.sigmoid(1.702 * x)


def _squared_relu(x):
  return jnp.square(jax.nn.relu(x))


# TE's names. "gelu" is the tanh approximation, as in TE.
ACTIVATIONS: dict[str, Callable] = {
  "gelu": functools.partial(jax.nn.gelu, approximate=True),
  "relu": jax.nn.relu,
  "silu": jax.nn.silu,
  "swish": jax.nn.silu,
  "quick_gelu": _quick_gelu,
  "squared_relu": _squared_relu,
  "linear": lambda x: x,
}


# An activation by name (ACTIVATIONS) or as a function; several are a gated product.
Activation = str | Callable[[jax.Array], jax.Array]


def normalize_activations(activations: Activation | Sequence[Activation]) -> tuple[Activation, ...]:
  """``activations`` as TE orders them: a tuple of lower-case names (or callables).

  A single name is a one-element tuple; a gated pair written with ``"linear"`` first is
  reversed, as TE does, so ``("linear", "gelu")`` is ``("gelu", "linear")``. An unknown name,
  an empty sequence or an entry that is neither a name nor a callable is a ValueError.

  Args:
    activations: a name (``ACTIVATIONS``'s keys, any case), a callable, or a sequence of them
      (two for a gated MLP).

  Returns:
    A tuple of lower-case names and callables, in TE's order.

  Raises:
    ValueError: an unknown name, an empty sequence, or an entry of another kind.

  Example:
    >>> from te_adapters import core
    >>> core.normalize_activations(("Linear", "silu"))
    ('silu', 'linear')
  """
  if isinstance(activations, str) or callable(activations):
    activations = (activations,)
  if not isinstance(activations, Sequence) or not activations:
    raise ValueError(
      f"activations must be a non-empty sequence of names such as ('gelu',) or "
      f"('silu', 'linear'), got {activations!r}"
    )
  names: list[Activation] = []
  for act in activations:
    if isinstance(act, str):
      if act.lower() not in ACTIVATIONS:
        raise ValueError(
          f"unknown activation {act!r}; known: {', '.join(sorted(ACTIVATIONS))} (or a callable)"
        )
      names.append(act.lower())
    elif callable(act):
      names.append(act)
    else:
      raise ValueError(f"an activation is a name or a callable, got {act!r}")
  if len(names) > 1 and names[0] == "linear":
    names.reverse()
  return tuple(names)


def activation_product(h, names):
  """The float32 product of each name's activation of its slice along axis -2."""
  h = h.astype(jnp.float32)
  out = None
  for i, name in enumerate(names):
    fn = ACTIVATIONS[name] if isinstance(name, str) else name
    term = fn(h[..., i, :]).astype(jnp.float32)
    out = term if out is None else out * term
  return out


# Saves only the pre-activation h (in its own dtype) for the backward, which recomputes the
# derivative from it; autodiff of gelu/silu would keep float32 intermediates as well.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(h, names):
  return activation_product(h, names).astype(h.dtype)


def _activation_fwd(h, names):
  return _activation(h, names), h


def _activation_bwd(names, h, g):
  _, vjp = jax.vjp(lambda a: activation_product(a, names), h.astype(jnp.float32))
  (dh,) = vjp(g.astype(jnp.float32))
  return (dh.astype(h.dtype),)


_activation.defvjp(_activation_fwd, _activation_bwd)


def activation(
  h: jax.Array, activations: Activation | Sequence[Activation] = ("gelu",)
) -> jax.Array:
  """The MLP activation (or gated product) of ``h``, TE's ``activation(x, activation_type)``.

  Args:
    h: the first GEMM's output, shape ``(..., n_act, F)`` with ``n_act = len(activations)``.
    activations: names from ``ACTIVATIONS`` (``"gelu"``, ``"relu"``, ``"silu"``/``"swish"``,
      ``"quick_gelu"``, ``"squared_relu"``, ``"linear"``) or callables; several are multiplied,
      each applied to its own slice of axis -2 (``("gelu", "linear")`` is GeGLU,
      ``("silu", "linear")`` SwiGLU). See ``normalize_activations``.

  Returns:
    Shape ``(..., F)``, ``h``'s dtype, computed in float32.

  Raises:
    TypeError: ``h`` is not floating point.
    ValueError: an unknown activation, or ``h`` without an axis of one slice per activation.

  Example:
    >>> import jax.numpy as jnp
    >>> from te_adapters import core
    >>> h = jnp.array([[[1.0, -2.0], [3.0, 4.0]]])  # (1, n_act=2, F=2)
    >>> core.activation(h, ("relu", "linear")).tolist()
    [[3.0, 0.0]]
  """
  names = normalize_activations(activations)
  h = jnp.asarray(h)
  if not jnp.issubdtype(h.dtype, jnp.floating):
    raise TypeError(f"activation needs a floating-point input, got {h.dtype}")
  if h.ndim < 2 or h.shape[-2] != len(names):
    raise ValueError(
      f"activation: the input needs shape (..., n_act={len(names)}, F) for activations "
      f"{names}, got {h.shape}"
    )
  return _activation(h, names)
