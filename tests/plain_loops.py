"""A float64 reference for DelayedScaling state under reuse, the data the plain-loop tests use,
and Linen's plain loop of one layer.

One layer (kernel ``w``) is used twice per step, on ``X1`` (amax 3) and ``X2`` (amax 5), with
output gradients ``DY1`` (amax 0.5) and ``DY2`` (amax 2): loss ``sum(y1 * DY1) + sum(y2 * DY2)``.
The reference state is what one use seeing the largest amaxes gives (TE's rule); a sum of the
uses would put 8 and 2.5 in the histories.
"""

import jax
import jax.numpy as jnp
import numpy as np

HISTORY = 4
LR = 1e-3
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _probe(amax, shape, seed):
  t = np.random.default_rng(seed).uniform(-0.5, 0.5, shape) * amax
  t.flat[0] = amax
  return t.astype(np.float32)


X1, X2 = _probe(3.0, (16, 32), 1), _probe(5.0, (16, 32), 2)
DY1, DY2 = _probe(0.5, (16, 32), 3), _probe(2.0, (16, 32), 4)
W0 = _probe(0.25, (32, 32), 5)


def reference_states(kernels):
  """The state after each step, given the kernel each step used (float64, TE's rule)."""
  state = {
    f"{r}_{k}": (np.ones(1) if k == "scale" else np.zeros(HISTORY))
    for r in ("x", "kernel", "grad")
    for k in ("scale", "amax_history")
  }
  out = []
  for w in kernels:
    amaxes = {
      "x": max(np.abs(X1).max(), np.abs(X2).max()),
      "kernel": np.abs(w).max(),
      "grad": max(np.abs(DY1).max(), np.abs(DY2).max()),
    }
    new = {}
    for role, amax in amaxes.items():
      history = np.roll(state[f"{role}_amax_history"], -1)
      history[-1] = amax
      limit = E5M2_MAX if role == "grad" else E4M3_MAX
      new[f"{role}_amax_history"] = history
      new[f"{role}_scale"] = np.array([limit / history.max()])
    state = new
    out.append(state)
  return out


def assert_state(got, want, what=""):
  for name, value in want.items():
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64), value, rtol=1e-6, err_msg=f"{what}{name}"
    )


def linen_loop(layer, x, dy, steps, key=None):
  """``steps`` steps of Linen's plain loop of ``layer`` on ``x``: ``jax.value_and_grad`` of
  ``sum(y * dy)`` over the whole variables and ``x``, the recipe state collection replaced by its
  gradient (the parameters kept). Returns ``(y, dx, grads, variables)`` of the last step, with
  the variables it ran on."""
  from te_adapters.linen import OVERWRITE_WITH_GRADIENT  # the core's tests need no Flax

  variables = layer.init(jax.random.key(0) if key is None else key, x)

  @jax.jit
  def step(variables, x):
    def loss(v, x):
      y = layer.apply(v, x)
      return jnp.sum(y * dy), y

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)

  for _ in range(steps):
    (_, y), (grads, dx) = step(variables, x)
    if OVERWRITE_WITH_GRADIENT in grads:
      variables = {**variables, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
  return y, dx, grads, variables
