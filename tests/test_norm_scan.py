"""LayerNormDenseGeneral stacked and scanned in each framework (nn.scan, nnx.scan over an
nnx.vmap stack, hk.layer_stack), with and without the framework's remat around the scanned
block: one recipe state per layer, the same gradients and new state as the layers applied one by
one."""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx
from te_adapters.linen import OVERWRITE_WITH_GRADIENT

OWG = OVERWRITE_WITH_GRADIENT
RECIPE = ta.DelayedScaling(amax_history_len=4)
LAYERS, K = 2, 128
X = jax.random.normal(jax.random.key(0), (16, K)) * 2.0 + 0.5
FIELDS = {"recipe": RECIPE, "threshold": None, "return_layernorm_output": False}


def _stacked_params(seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  return {
    "scale": 1.0 + 0.1 * jax.random.normal(keys[0], (LAYERS, K)),
    "ln_bias": 0.1 * jax.random.normal(keys[1], (LAYERS, K)),
    "kernel": jax.random.normal(keys[2], (LAYERS, K, K)) / np.sqrt(K),
  }


def _assert_close(a, b):
  """Leaf by leaf, normwise (the scan and the unrolled layers are different programs)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y), (x, y)


def _check(scanned, unrolled):
  """(loss, param grads, new state) of the scan against the layers one by one."""
  _assert_close(scanned, unrolled)
  state = scanned[2]
  history = np.asarray(state["x_amax_history"])
  assert history.shape == (LAYERS, 4)
  assert np.all(history[:, -1] > 0) and len(set(history[:, -1].tolist())) == LAYERS


@pytest.mark.parametrize("remat", [False, True])
def test_linen_scan(remat):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      z, _ = ta_linen.LayerNormDenseGeneral(K, **FIELDS)(h)
      return jnp.tanh(z), None

  stack = nn.scan(
    nn.remat(Block) if remat else Block,
    variable_axes={"params": 0, OWG: 0},
    split_rngs={"params": True},
    length=LAYERS,
  )
  variables = stack().init(jax.random.key(0), X, None)
  params = {"LayerNormDenseGeneral_0": _stacked_params()}
  state = variables[OWG]

  def scan_loss(params, state):
    h, _ = stack().apply({"params": params, OWG: state}, X, None)
    return jnp.sum(h**2)

  def unrolled_loss(params, state):
    h = X
    for i in range(LAYERS):
      one = jax.tree.map(lambda a, i=i: a[i], (params, state))
      h, _ = Block().apply({"params": one[0], OWG: one[1]}, h, None)
    return jnp.sum(h**2)

  results = []
  for loss in (scan_loss, unrolled_loss):
    value, (g, s) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, state)
    results.append((value, g, s["LayerNormDenseGeneral_0"]))
  _check(*results)
  assert ("remat" in str(jax.make_jaxpr(scan_loss)(params, state))) == remat


@pytest.mark.parametrize("remat", [False, True])
def test_nnx_scan(remat):
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return ta_nnx.LayerNormDenseGeneral(K, K, rngs=rngs, **FIELDS)

  stack = make(nnx.Rngs(0))
  for name, value in _stacked_params().items():
    getattr(stack, name).set_value(value)

  def scan_loss(stack):
    def block(layer, h):
      return jnp.tanh(layer(h)[0])

    body = nnx.scan(
      nnx.remat(block) if remat else block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry
    )
    return jnp.sum(body(stack, X) ** 2)

  diff = nnx.DiffState(0, nnx.Any(nnx.Param, ta_nnx.RecipeState))
  value, grads = nnx.jit(nnx.value_and_grad(scan_loss, argnums=diff))(stack)
  params, state = nnx.split_state(grads, nnx.Param, ta_nnx.RecipeState)
  scanned = (value, nnx.to_pure_dict(params), nnx.to_pure_dict(state)["dot_general"]["state"])

  graphdef, p0, s0 = nnx.split(stack, nnx.Param, ta_nnx.RecipeState)

  def unrolled_loss(p, s):
    h = X
    for i in range(LAYERS):
      one = nnx.merge(
        graphdef, jax.tree.map(lambda a, i=i: a[i], p), jax.tree.map(lambda a, i=i: a[i], s)
      )
      h = jnp.tanh(one(h)[0])
    return jnp.sum(h**2)

  value, (gp, gs) = jax.jit(jax.value_and_grad(unrolled_loss, argnums=(0, 1)))(p0, s0)
  unrolled = (value, nnx.to_pure_dict(gp), nnx.to_pure_dict(gs)["dot_general"]["state"])
  _check(scanned, unrolled)
  jaxpr = jax.make_jaxpr(lambda p, s: scan_loss(nnx.merge(graphdef, p, s)))(p0, s0)
  assert ("remat" in str(jaxpr)) == remat


@pytest.mark.parametrize("remat", [False, True])
def test_haiku_layer_stack(remat):
  def block(h):
    z, _ = ta_hk.LayerNormDenseGeneral(K, name="block", **FIELDS)(h)
    return jnp.tanh(z)

  stacked = hk.transform_with_state(
    lambda x: jnp.sum(hk.layer_stack(LAYERS)(hk.remat(block) if remat else block)(x) ** 2)
  )
  one = hk.transform_with_state(block)
  _, state = stacked.init(jax.random.key(0), X)
  (path,) = state
  params = {path: _stacked_params()}

  def scan_loss(params, state):
    return stacked.apply(params, state, None, X)[0]

  def unrolled_loss(params, state):
    h = X
    for i in range(LAYERS):
      p, s = jax.tree.map(lambda a, i=i: a[i], (params[path], state[path]))
      h, _ = one.apply({"block": p}, {"block": s}, None, h)
    return jnp.sum(h**2)

  results = []
  for loss in (scan_loss, unrolled_loss):
    value, (g, s) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, state)
    results.append((value, g[path], s[path]))
  _check(*results)
  assert ("remat" in str(jax.make_jaxpr(scan_loss)(params, state))) == remat
