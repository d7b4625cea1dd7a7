"""LoRA in the dense layers of Linen, NNX and Haiku: TE's parameters, the LoRA GEMMs in high
precision beside the quantized base kernel, training the adapters alone in each framework's
ordinary way, the rank rule, and the three adapters agreeing."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

CURRENT = ta.Float8CurrentScaling()
K, N, R, ALPHA = 32, 48, 4, 8.0
LORA = dict(enable_low_rank_adaptation=True, low_rank_adaptation_dim=R,
            low_rank_adaptation_alpha=ALPHA)


def _rand(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


X = _rand((16, K), 0)
TARGET = _rand((16, N), 1)
A, B = _rand((K, R), 2, 0.2), _rand((R, N), 3, 0.2)


# The LoRA GEMMs run in float32; off CPU, XLA's float32 GEMMs may run in TF32.
HP_TOL = 1e-4 if jax.default_backend() == "cpu" else 5e-3


def _lora_ref(x, a, b):
  return np.float64(x) @ np.float64(a) @ np.float64(b) * (ALPHA / R)


# Each framework: a function (lora: bool, recipe) -> (apply(params, x), params), with params a
# flat dict {name: array} using the framework's own names.


def _linen(lora, recipe=CURRENT, **kw):
  layer = ta_linen.DenseGeneral(N, recipe=recipe, threshold=None, **(LORA if lora else {}), **kw)
  params = layer.init(jax.random.key(0), X)["params"]
  return (lambda p, x: layer.apply({"params": p}, x)), dict(params)


def _nnx(lora, recipe=CURRENT, **kw):
  layer = ta_nnx.Linear(K, N, recipe=recipe, threshold=None, rngs=nnx.Rngs(0),
                        **(LORA if lora else {}), **kw)
  graphdef, state = nnx.split(layer)
  pure = nnx.to_pure_dict(state)

  def apply(p, x):
    new = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(new, {**pure, **p})
    return nnx.merge(graphdef, new)(x)

  params = {k: v for k, v in pure.items() if k in {
      "kernel", "bias", "lora_a_kernel", "lora_b_kernel"}}
  return apply, params


def _haiku(lora, recipe=CURRENT, **kw):
  f = hk.transform(lambda x: ta_hk.Linear(N, recipe=recipe, threshold=None,
                                          **(LORA if lora else {}), **kw)(x))
  params = f.init(jax.random.key(0), X)
  return (lambda p, x: f.apply({"linear": p}, None, x)), dict(params["linear"])


FRAMEWORKS = {"linen": _linen, "nnx": _nnx, "haiku": _haiku}
KERNEL = {"linen": "kernel", "nnx": "kernel", "haiku": "w"}


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_te_parameters_and_zero_init_b(fw):
  apply, params = FRAMEWORKS[fw](True)
  assert params["lora_a_kernel"].shape == (K, R)
  assert params["lora_b_kernel"].shape == (R, N)
  assert not np.any(params["lora_b_kernel"])
  assert np.std(params["lora_a_kernel"]) > 0.05  # the kernel's initialiser, not zeros
  base_apply, base_params = FRAMEWORKS[fw](False)
  base = {k: params[k] for k in base_params}
  # lora_b = 0: the layer starts equal to its base.
  np.testing.assert_array_equal(apply(params, X), base_apply(base, X))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_lora_term_is_high_precision_beside_the_fp8_kernel(fw, rel):
  apply, params = FRAMEWORKS[fw](True)
  base_apply, base_params = FRAMEWORKS[fw](False)
  params = {**params, "lora_a_kernel": A, "lora_b_kernel": B}
  base = {k: params[k] for k in base_params}
  y, y_base = apply(params, X), base_apply(base, X)
  # The LoRA GEMMs: float32 against float64, far tighter than any FP8 GEMM.
  np.testing.assert_allclose(np.float64(y) - np.float64(y_base), _lora_ref(X, A, B),
                             rtol=HP_TOL, atol=HP_TOL)
  # The base GEMM is FP8: its error against float64 is an FP8 one.
  w = np.float64(params[KERNEL[fw]])
  assert 0.01 < rel(y_base - np.float64(params.get("bias", params.get("b"))), np.float64(X) @ w)
  assert core.count_fp8_dot_generals(apply, params, X) == (1, 3)


def _loss(y):
  return jnp.mean(jnp.square(y - TARGET))


def _train_linen_masked(steps=3):
  apply, params = _linen(True)
  labels = {k: "train" if k.startswith("lora_") else "freeze" for k in params}
  tx = optax.multi_transform({"train": optax.adam(1e-2), "freeze": optax.set_to_zero()}, labels)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: _loss(apply(p, X)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  start = params
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return start, params, losses


def _train_nnx_wrt_lora(steps=3):
  layer = ta_nnx.Linear(K, N, recipe=CURRENT, threshold=None, rngs=nnx.Rngs(0), **LORA)
  start = dict(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(layer, optimizer):
    diff = nnx.DiffState(0, nnx.LoRAParam)
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(X)), argnums=diff)(layer)
    optimizer.update(layer, grads)
    return loss

  losses = [float(step(layer, optimizer)) for _ in range(steps)]
  end = dict(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  return start, end, losses


def _train_haiku_partitioned(steps=3):
  f = hk.transform(lambda x: ta_hk.Linear(N, recipe=CURRENT, threshold=None, **LORA)(x))
  params = f.init(jax.random.key(0), X)
  trainable, frozen = hk.data_structures.partition(
      lambda module, name, value: name.startswith("lora_"), params)
  tx = optax.adam(1e-2)
  opt_state = tx.init(trainable)

  @jax.jit
  def step(trainable, opt_state):
    def loss_fn(t):
      return _loss(f.apply(hk.data_structures.merge(t, frozen), None, X))
    loss, grads = jax.value_and_grad(loss_fn)(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    trainable, opt_state, loss = step(trainable, opt_state)
    losses.append(float(loss))
  start = dict(params["linear"])
  end = dict(hk.data_structures.merge(trainable, frozen)["linear"])
  return start, end, losses


@pytest.mark.parametrize("train, kernel", [(_train_linen_masked, "kernel"),
                                           (_train_nnx_wrt_lora, "kernel"),
                                           (_train_haiku_partitioned, "w")],
                         ids=["linen-optax-mask", "nnx-wrt-LoRAParam", "haiku-partition"])
def test_frozen_base_kernel_left_out_of_the_optimizer(train, kernel):
  start, end, losses = train()
  np.testing.assert_array_equal(end[kernel], start[kernel])
  assert np.any(end["lora_b_kernel"] != 0)  # the adapters trained
  assert np.any(end["lora_a_kernel"] != start["lora_a_kernel"])
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("rank", [33, 0])
def test_rank_larger_than_the_dims_is_a_clear_error(fw, rank):
  with pytest.raises(ValueError, match=r"low_rank_adaptation_dim must be an int from 1 to "
                                       r"min\(K, N\) = 32 \(K=32 contracted, N=48"):
    _build_with_rank(fw, rank)


def _build_with_rank(fw, rank):
  kw = {**LORA, "low_rank_adaptation_dim": rank}
  if fw == "linen":
    ta_linen.DenseGeneral(N, recipe=CURRENT, **kw).init(jax.random.key(0), X)
  elif fw == "nnx":
    ta_nnx.Linear(K, N, recipe=CURRENT, rngs=nnx.Rngs(0), **kw)
  else:
    hk.transform(lambda x: ta_hk.Linear(N, recipe=CURRENT, **kw)(x)).init(jax.random.key(0), X)


def test_the_three_adapters_agree():
  outs = []
  for fw in FRAMEWORKS:
    apply, params = FRAMEWORKS[fw](True)
    kernel = _rand((K, N), 4, 0.2)
    params = {**params, KERNEL[fw]: kernel, "lora_a_kernel": A, "lora_b_kernel": B}
    outs.append(np.asarray(apply(params, X)))
  tol = 1e-6 if jax.default_backend() == "cpu" else 1e-2  # two programs' FP8 GEMMs on GPU
  np.testing.assert_allclose(outs[1], outs[0], rtol=tol, atol=tol)
  np.testing.assert_allclose(outs[2], outs[0], rtol=tol, atol=tol)


def test_linen_dense_general_lora_over_two_axes(rel):
  layer = ta_linen.DenseGeneral((2, 16), axis=(-2, -1), recipe=None, **LORA)
  x = _rand((3, 4, 8), 5)
  params = layer.init(jax.random.key(0), x)["params"]
  assert params["lora_a_kernel"].shape == (4, 8, 2, R)
  assert params["lora_b_kernel"].shape == (2, R, 16)
  a, b = _rand((4, 8, 2, R), 6), _rand((2, R, 16), 7)
  y = layer.apply({"params": {**params, "lora_a_kernel": a, "lora_b_kernel": b}}, x)
  ref = np.einsum("pij,ijkn->pkn", np.float64(x), np.float64(params["kernel"]))
  ref += np.einsum("pij,ijhs,hsn->phn", *(np.float64(v) for v in (x, a, b))) * (ALPHA / R)
  if jax.default_backend() == "cpu":
    np.testing.assert_allclose(y, ref, rtol=HP_TOL, atol=HP_TOL)
  else:  # TF32 float32 GEMMs: entries near zero miss an elementwise tolerance (H100)
    assert rel(y, ref) < HP_TOL
