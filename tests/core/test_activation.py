"""TE's MLP activations by name against float64, gated products, and bad names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_adapters import core

_C = np.sqrt(2.0 / np.pi)


def _gelu(x):
  return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x**3)))


def _dgelu(x):
  t = np.tanh(_C * (x + 0.044715 * x**3))
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * _C * (1.0 + 3 * 0.044715 * x**2)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


# name -> (f, f') in float64 numpy, written from the formulas.
REFERENCE = {
  "gelu": (_gelu, _dgelu),
  "relu": (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64)),
  "silu": (lambda x: x * _sigmoid(x), lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x)))),
  "swish": (lambda x: x * _sigmoid(x), lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x)))),
  "quick_gelu": (
    lambda x: x * _sigmoid(1.702 * x),
    lambda x: _sigmoid(1.702 * x) * (1 + 1.702 * x * (1 - _sigmoid(1.702 * x))),
  ),
  "squared_relu": (lambda x: np.maximum(x, 0.0) ** 2, lambda x: 2 * np.maximum(x, 0.0)),
  "linear": (lambda x: x, np.ones_like),
}

CASES = [(n,) for n in REFERENCE] + [
  ("gelu", "linear"),
  ("silu", "linear"),
  ("relu", "linear"),
  ("quick_gelu", "linear"),
  ("squared_relu", "linear"),
]


def _reference(h, names):
  """Forward and d/dh of sum(out * g) in float64."""
  h = np.asarray(h, np.float64)
  terms = [REFERENCE[n][0](h[..., i, :]) for i, n in enumerate(names)]
  out = np.prod(terms, axis=0)
  return out, terms


@pytest.mark.parametrize("names", CASES, ids="-".join)
def test_forward_and_gradient_against_float64(names):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(8, len(names), 32)) * 2, jnp.float32)
  g = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  out, vjp = jax.vjp(lambda a: core.activation(a, names), h)
  (dh,) = vjp(g)
  ref, terms = _reference(h, names)
  h64, g64 = np.asarray(h, np.float64), np.asarray(g, np.float64)
  dref = np.stack(
    [
      g64
      * REFERENCE[n][1](h64[..., i, :])
      * np.prod([t for j, t in enumerate(terms) if j != i], axis=0)
      for i, n in enumerate(names)
    ],
    axis=-2,
  )
  assert out.shape == (8, 32) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dh, dref, rtol=1e-5, atol=1e-5)


def test_bf16_in_bf16_out_computed_in_float32(rel):
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(64, 2, 128)), jnp.bfloat16)
  out, vjp = jax.vjp(lambda a: core.activation(a, ("gelu", "linear")), h)
  (dh,) = vjp(jnp.ones_like(out))
  assert out.dtype == dh.dtype == jnp.bfloat16
  ref, _ = _reference(h, ("gelu", "linear"))
  assert rel(out, ref) < 4e-3  # one bf16 rounding of the float32 result


def test_names_are_normalized_as_te():
  assert core.normalize_activations("GELU") == ("gelu",)
  assert core.normalize_activations(("linear", "silu")) == ("silu", "linear")
  h = jnp.asarray(np.random.default_rng(2).normal(size=(4, 2, 16)), jnp.float32)
  np.testing.assert_array_equal(
    core.activation(h, ("linear", "silu")), core.activation(h, ("silu", "linear"))
  )


def test_a_callable_is_applied_to_its_slice():
  h = jnp.asarray(np.random.default_rng(3).normal(size=(4, 2, 16)), jnp.float32)
  out = core.activation(h, (jnp.tanh, "linear"))
  np.testing.assert_allclose(out, np.tanh(h[:, 0]) * h[:, 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "activations, match",
  [
    (("geglu",), "unknown activation 'geglu'; known: gelu, linear"),
    (("gelu", "tanh"), "unknown activation 'tanh'"),
    ((), "non-empty sequence"),
    ((3,), "a name or a callable"),
  ],
)
def test_bad_activation_is_a_clear_error(activations, match):
  with pytest.raises(ValueError, match=match):
    core.activation(jnp.ones((4, max(len(activations), 1), 16)), activations)


def test_wrong_number_of_slices_is_a_clear_error():
  with pytest.raises(ValueError, match=r"shape \(\.\.\., n_act=2, F\).*got \(4, 16\)"):
    core.activation(jnp.ones((4, 16)), ("gelu", "linear"))


def test_backward_keeps_only_the_input():
  """The custom VJP's residual is the pre-activation alone (one array, the input's dtype)."""
  h = jnp.ones((16, 2, 64), jnp.bfloat16)
  res = jax.vjp(lambda a: core.activation(a, ("gelu", "linear")), h)[1]
  leaves = [x for x in jax.tree_util.tree_leaves(res) if hasattr(x, "shape") and x.size > 1]
  assert [(x.shape, x.dtype) for x in leaves] == [((16, 2, 64), jnp.bfloat16)]
