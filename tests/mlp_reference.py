"""What the LayerNormMLP tests of every adapter compare against: TE-shaped parameters, the block
in float64, and the core function run block after block (the unrolled stack)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters import core
from tests.core.test_mlp import _reference_grads

K, F = 128, 128
GATED = ("gelu", "linear")
# Two compiled programs of one block (scanned and unrolled, two adapters) agree to float32
# rounding on CPU; on an H100 the FP8 GEMMs of differently laid-out programs have differed by up
# to 0.7% (tests/haiku/test_hk_train.py), so there the bound is 1%. A sum of amaxes, a wrong
# scale or a mixed-up layer moves everything by far more.
CROSS_RTOL = 1e-5 if jax.default_backend() == "cpu" else 1e-2
STATE_RTOL = 1e-6 if jax.default_backend() == "cpu" else 1e-2


def block_params(seed=0, n_act=2, bias=True):
  """TE's parameter names and shapes for K=128, F=128."""
  rng = np.random.default_rng(seed)

  def r(*shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  p = {
    "scale": 1.0 + r(K, scale=0.1),
    "ln_bias": r(K, scale=0.1),
    "wi_kernel": r(K, n_act, F, scale=K**-0.5),
    "wo_kernel": r(F, K, scale=F**-0.5),
  }
  if bias:
    p.update(wi_bias=r(n_act, F, scale=0.1), wo_bias=r(K, scale=0.1))
  return p


def inputs(seed=10, shape=(2, 64, K)):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.normal(size=shape), jnp.float32),
    jnp.asarray(rng.normal(size=shape), jnp.float32),
  )


def float64_reference(x, params, dy, activations=GATED):
  """``(out, dx, {name: grad})`` of ``sum(out * dy)`` in float64."""
  return _reference_grads(x, params, dy, activations)


def unrolled(x, stacked_params, stacked_states, dy, recipe, activations=GATED):
  """Blocks run one after the other with ``core.layernorm_mlp`` (slice ``i`` of every stacked
  parameter and state): ``(out, param_grads, new_states)``, stacked like the inputs."""
  n = jax.tree.leaves(stacked_params)[0].shape[0]
  return _unrolled_step(recipe, tuple(activations), n)(x, stacked_params, stacked_states, dy)


@functools.cache
def _unrolled_step(recipe, activations, n):
  """The jitted step of ``unrolled``, compiled once per recipe, activations and depth."""

  def loss(params, states, x, dy):
    h = x
    for i in range(n):
      p = jax.tree.map(lambda a, i=i: a[i], params)
      s = None if states is None else jax.tree.map(lambda a, i=i: a[i], states)
      h, _ = core.layernorm_mlp(
        h,
        p["scale"],
        p["ln_bias"],
        p["wi_kernel"],
        p["wo_kernel"],
        p.get("wi_bias"),
        p.get("wo_bias"),
        activations=activations,
        recipe=recipe,
        states=s,
        threshold=None,
      )
    return jnp.sum(h * dy), h

  @jax.jit
  def step(x, params, states, dy):
    (_, out), (g, s) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, states, x, dy)
    return out, g, s

  return step


def gemm_states(recipe, n=None):
  """Two GEMMs' initial states (stacked ``n`` deep when given), or None if stateless."""
  if recipe is None or not core.init_state(recipe):
    return None
  pair = (core.init_state(recipe), core.init_state(recipe))
  if n is None:
    return pair
  return jax.tree.map(lambda a: jnp.stack([a] * n), pair)


def postfixed(states):
  """``(state_0, state_1)`` as TE's Linen variables: ``x_0_scale``, ``kernel_1_amax_history``."""
  out = {}
  for i, state in enumerate(states):
    for name, value in state.items():
      role, rest = name.split("_", 1)
      out[f"{role}_{i}_{rest}"] = value
  return out
