"""LoRA in the dense layers of Linen, NNX and Haiku: TE's parameters, the LoRA GEMMs in high
precision beside the quantized base kernel, training the adapters alone in each framework's
ordinary way, the rank rule, and the three adapters agreeing."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

CURRENT = ta.Float8CurrentScaling()
K, N, R, ALPHA = 32, 48, 4, 8.0
LORA = dict(
  enable_low_rank_adaptation=True, low_rank_adaptation_dim=R, low_rank_adaptation_alpha=ALPHA
)


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
  layer = ta_nnx.Linear(
    K, N, recipe=recipe, threshold=None, rngs=nnx.Rngs(0), **(LORA if lora else {}), **kw
  )
  graphdef, state = nnx.split(layer)
  pure = nnx.to_pure_dict(state)

  def apply(p, x):
    new = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(new, {**pure, **p})
    return nnx.merge(graphdef, new)(x)

  params = {
    k: v for k, v in pure.items() if k in {"kernel", "bias", "lora_a_kernel", "lora_b_kernel"}
  }
  return apply, params


def _haiku(lora, recipe=CURRENT, **kw):
  f = hk.transform(
    lambda x: ta_hk.Linear(N, recipe=recipe, threshold=None, **(LORA if lora else {}), **kw)(x)
  )
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
  np.testing.assert_allclose(
    np.float64(y) - np.float64(y_base), _lora_ref(X, A, B), rtol=HP_TOL, atol=HP_TOL
  )
  # The base GEMM is FP8: its error against float64 is an FP8 one.
  w = np.float64(params[KERNEL[fw]])
  assert 0.01 < rel(y_base - np.float64(params.get("bias", params.get("b"))), np.float64(X) @ w)
  assert inspect.count_fp8_dot_generals(apply, params, X) == (1, 3)


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
    lambda module, name, value: name.startswith("lora_"), params
  )
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


@pytest.mark.parametrize(
  "train, kernel",
  [
    (_train_linen_masked, "kernel"),
    (_train_nnx_wrt_lora, "kernel"),
    (_train_haiku_partitioned, "w"),
  ],
  ids=["linen-optax-mask", "nnx-wrt-LoRAParam", "haiku-partition"],
)
def test_frozen_base_kernel_left_out_of_the_optimizer(train, kernel):
  start, end, losses = train()
  np.testing.assert_array_equal(end[kernel], start[kernel])
  assert np.any(end["lora_b_kernel"] != 0)  # the adapters trained
  assert np.any(end["lora_a_kernel"] != start["lora_a_kernel"])
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("rank", [33, 0])
def test_rank_larger_than_the_dims_is_a_clear_error(fw, rank):
  with pytest.raises(
    ValueError,
    match=r"low_rank_adaptation_dim must be an int from 1 to "
    r"min\(K, N\) = 32 \(K=32 contracted, N=48",
  ):
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


def _hp_close(actual, reference, rel):
  """float32 LoRA GEMMs against float64: elementwise on CPU; normwise elsewhere, where XLA's
  float32 GEMMs may run in TF32 (entries near zero then miss an elementwise tolerance)."""
  if jax.default_backend() == "cpu":
    np.testing.assert_allclose(actual, reference, rtol=HP_TOL, atol=HP_TOL)
  else:
    assert rel(actual, reference) < HP_TOL


DY = _rand((16, N), 8)  # the output's cotangent: the loss is sum(y * DY)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_lora_factor_and_input_gradients_against_float64(fw, rel):
  apply, params = FRAMEWORKS[fw](True)
  base_apply, base_params = FRAMEWORKS[fw](False)
  base = {k: params[k] for k in base_params}

  def loss(a, b, x):
    return jnp.sum(apply({**params, "lora_a_kernel": a, "lora_b_kernel": b}, x) * DY)

  da, db, dx = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(A, B, X)
  dx_base = jax.jit(jax.grad(lambda x: jnp.sum(base_apply(base, x) * DY)))(X)
  x, a, b, dy = (np.float64(v) for v in (X, A, B, DY))
  s = ALPHA / R
  # The factors' gradients take only the float32 LoRA GEMMs and dy, never the FP8 GEMM: they are
  # float64's to float32 rounding (normwise 1e-7 seen on CPU).
  _hp_close(da, s * x.T @ dy @ b.T, rel)
  _hp_close(db, s * (x @ a).T @ dy, rel)
  # dx: the LoRA part (dx less the base layer's, the same FP8 GEMM) is high precision too...
  lora_dx = s * dy @ b.T @ a.T
  _hp_close(np.float64(dx) - np.float64(dx_base), lora_dx, rel)
  # ... and the whole dx an FP8 one: dy in E5M2 by the E4M3 kernel (0.04 seen on CPU, where the
  # LoRA part is two thirds of dx's norm).
  err = rel(dx, dy @ np.float64(params[KERNEL[fw]]).T + lora_dx)
  assert 0.005 < err < 0.1, err


DELAYED = ta.DelayedScaling(amax_history_len=4)
OWG = ta_linen.OVERWRITE_WITH_GRADIENT
LR = 1e-3  # small: the trained LoRA term stays near the base's size

# Each loop below: 3 steps of SGD on the LoRA factors alone (from A and B), the base kernel
# frozen the framework's way, the DelayedScaling state carried the framework's way. Returns
# (y of the last step, the parameters that step used, the parameters after it, the recipe state
# after it), parameters as {"kernel", "bias", "lora_a_kernel", "lora_b_kernel"}.


def _delayed_linen(steps=3):
  layer = ta_linen.DenseGeneral(N, recipe=DELAYED, threshold=None, **LORA)
  variables = layer.init(jax.random.key(0), X)
  params = {**variables["params"], "lora_a_kernel": A, "lora_b_kernel": B}
  variables = {"params": params, OWG: variables[OWG]}
  labels = {k: "train" if k.startswith("lora_") else "freeze" for k in params}
  tx = optax.multi_transform({"train": optax.sgd(LR), "freeze": optax.set_to_zero()}, labels)
  opt_state = tx.init(params)

  @jax.jit
  def step(variables, opt_state):
    def loss(v):
      y = layer.apply(v, X)
      return jnp.sum(y * DY), y

    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    params = variables["params"]
    updates, opt_state = tx.update(grads["params"], opt_state, params)
    # The state collection is replaced by its gradient, the new state.
    return {"params": optax.apply_updates(params, updates), OWG: grads[OWG]}, opt_state, y

  for _ in range(steps):
    used = variables["params"]
    variables, opt_state, y = step(variables, opt_state)
  (state,) = variables[OWG].values()
  return y, dict(used), dict(variables["params"]), dict(state)


def _delayed_nnx(steps=3, grads="DiffState"):
  """grads: "DiffState" (nnx.value_and_grad over LoRAParam and RecipeState, the state written
  back with nnx.update), "helper" (ta_nnx.value_and_grad(wrt=nnx.LoRAParam)) or "LoRAParam"
  (nnx.value_and_grad over LoRAParam alone: the recipe state left out)."""
  layer = ta_nnx.Linear(K, N, recipe=DELAYED, threshold=None, rngs=nnx.Rngs(0), **LORA)
  layer.lora_a_kernel.set_value(A)
  layer.lora_b_kernel.set_value(B)
  optimizer = nnx.Optimizer(layer, optax.sgd(LR), wrt=nnx.LoRAParam)

  def loss(m):
    y = m(X)
    return jnp.sum(y * DY), y

  @nnx.jit
  def step(layer, optimizer):
    if grads == "helper":
      (_, y), (g, state) = ta_nnx.value_and_grad(loss, has_aux=True, wrt=nnx.LoRAParam)(layer)
      ta_nnx.update_recipe_state(layer, state)
    elif grads == "DiffState":
      diff = nnx.DiffState(0, nnx.Any(nnx.LoRAParam, ta_nnx.RecipeState))
      (_, y), g = nnx.value_and_grad(loss, argnums=diff, has_aux=True)(layer)
      g, state = nnx.split_state(g, nnx.LoRAParam, ta_nnx.RecipeState)
      nnx.update(layer, state)
    else:
      diff = nnx.DiffState(0, nnx.LoRAParam)
      (_, y), g = nnx.value_and_grad(loss, argnums=diff, has_aux=True)(layer)
    optimizer.update(layer, g)
    return y

  def params():
    return {k: getattr(layer, k)[...] for k in ("kernel", "bias", "lora_a_kernel", "lora_b_kernel")}

  for _ in range(steps):
    used = params()
    y = step(layer, optimizer)
  return y, used, params(), layer.dot_general.recipe_state()


def _delayed_haiku(steps=3):
  f = hk.transform_with_state(lambda x: ta_hk.Linear(N, recipe=DELAYED, threshold=None, **LORA)(x))
  params, state = f.init(jax.random.key(0), X)
  params = {"linear": {**params["linear"], "lora_a_kernel": A, "lora_b_kernel": B}}
  trainable, frozen = hk.data_structures.partition(
    lambda module, name, value: name.startswith("lora_"), params
  )
  tx = optax.sgd(LR)
  opt_state = tx.init(trainable)

  @jax.jit
  def step(trainable, state, opt_state):
    def loss(t, s):
      y, _ = f.apply(hk.data_structures.merge(t, frozen), s, None, X)
      return jnp.sum(y * DY), y

    # The state's gradient is the new state.
    (_, y), (grads, state) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      trainable, state
    )
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), state, opt_state, y

  def named(t):
    p = hk.data_structures.merge(t, frozen)["linear"]
    return {
      "kernel": p["w"],
      "bias": p["b"],
      "lora_a_kernel": p["lora_a_kernel"],
      "lora_b_kernel": p["lora_b_kernel"],
    }

  for _ in range(steps):
    used = named(trainable)
    trainable, state, opt_state, y = step(trainable, state, opt_state)
  return y, used, named(trainable), dict(state["linear"])


@pytest.mark.parametrize(
  "loop",
  [_delayed_linen, _delayed_nnx, lambda: _delayed_nnx(grads="helper"), _delayed_haiku],
  ids=[
    "linen-owg-collection",
    "nnx-DiffState-RecipeState",
    "nnx-ta_nnx.value_and_grad",
    "haiku-transform_with_state",
  ],
)
def test_delayed_scaling_state_advances_while_training_lora_alone(loop, rel):
  y, used, end, state = loop()
  np.testing.assert_array_equal(end["kernel"], used["kernel"])  # the base kernel frozen
  assert np.any(end["lora_a_kernel"] != used["lora_a_kernel"])  # the adapters trained
  assert np.any(end["lora_b_kernel"] != used["lora_b_kernel"])
  # After 3 steps, each role's history holds its amax from each step (x and the kernel are
  # fixed, and so is the gradient of sum(y * DY)), and its scale is fp8_max / amax.
  assert set(state) == set(core.state_names(DELAYED))
  for role, operand, fp8_max in [
    ("x", X, 448),
    ("kernel", used["kernel"], 448),
    ("grad", DY, 57344),
  ]:
    amax = float(jnp.max(jnp.abs(operand)))
    np.testing.assert_allclose(state[f"{role}_amax_history"], [0, amax, amax, amax], rtol=1e-6)
    np.testing.assert_allclose(state[f"{role}_scale"], [fp8_max / amax], rtol=1e-6)
  # The last step quantized with the scales the first two stored: an FP8 error, LoRA's exact.
  x, w, bias, a, b = (
    np.float64(v)
    for v in (X, *(used[k] for k in ("kernel", "bias", "lora_a_kernel", "lora_b_kernel")))
  )
  err = rel(y, x @ w + bias + _lora_ref(x, a, b))
  assert 0.005 < err < 0.06, err  # 0.03 seen on CPU


def test_nnx_lora_param_alone_in_the_diff_state_leaves_the_recipe_state_frozen():
  # nnx.DiffState(0, nnx.LoRAParam) differentiates neither operand of the base GEMM (x is an
  # input, the kernel is not differentiated) nor its state: the state keeps its initial values,
  # and a FrozenStateWarning says so. Put RecipeState in the DiffState.
  with pytest.warns(core.FrozenStateWarning, match="low-rank adaptation factors"):
    _, used, end, state = _delayed_nnx(grads="LoRAParam")
  assert np.any(end["lora_b_kernel"] != used["lora_b_kernel"])  # the adapters trained
  for name, value in state.items():
    np.testing.assert_array_equal(value, np.ones(1) if name.endswith("_scale") else np.zeros(4))


def _lora_alone(fw, with_state, threshold=None):
  """One gradient of the LoRA factors alone (the base kernel and x not differentiated), with or
  without DelayedScaling's state, in each framework's plain way."""
  if fw == "nnx":
    layer = ta_nnx.Linear(K, N, recipe=DELAYED, threshold=threshold, rngs=nnx.Rngs(0), **LORA)
    wrt = nnx.Any(nnx.LoRAParam, ta_nnx.RecipeState) if with_state else nnx.LoRAParam
    nnx.grad(lambda m: jnp.sum(m(X) * DY), argnums=nnx.DiffState(0, wrt))(layer)
  elif fw == "linen":
    layer = ta_linen.DenseGeneral(N, recipe=DELAYED, threshold=threshold, **LORA)
    v = layer.init(jax.random.key(0), X)
    lora = {k: v["params"][k] for k in ("lora_a_kernel", "lora_b_kernel")}

    def loss(lora, state):
      return jnp.sum(layer.apply({"params": {**v["params"], **lora}, OWG: state}, X) * DY)

    jax.grad(loss, argnums=(0, 1) if with_state else 0)(lora, v[OWG])
  else:
    f = hk.transform_with_state(
      lambda x: ta_hk.Linear(N, recipe=DELAYED, threshold=threshold, **LORA)(x)
    )
    params, state = f.init(jax.random.key(0), X)
    trainable, frozen = hk.data_structures.partition(
      lambda module, name, value: name.startswith("lora_"), params
    )

    def loss(t, s):
      return jnp.sum(f.apply(hk.data_structures.merge(t, frozen), s, None, X)[0] * DY)

    jax.grad(loss, argnums=(0, 1) if with_state else 0)(trainable, state)


@pytest.mark.parametrize("fw", ["linen", "nnx", "haiku"])
def test_training_lora_alone_without_the_state_warns(fw):
  # The base GEMM's operands are not differentiated, so only the LoRA term can see that the
  # layer trains while its DelayedScaling state would stay frozen.
  with pytest.warns(core.FrozenStateWarning, match="low-rank adaptation factors"):
    _lora_alone(fw, with_state=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    _lora_alone(fw, with_state=True)


@pytest.mark.parametrize("fw", ["linen", "nnx", "haiku"])
def test_training_lora_alone_below_the_threshold_does_not_warn(fw):
  # Below the size threshold the base GEMM runs in high precision and its state does not move
  # whatever is differentiated: nothing is frozen, so nothing to warn about.
  always_high = core.SizeThreshold(min_mkn=10**12, min_dim=1, platforms=("cpu", "gpu", "tpu"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    _lora_alone(fw, with_state=False, threshold=always_high)


def test_forward_mode_through_the_lora_factors_with_delayed_scaling(rel):
  # jax.jvp with respect to the factors alone (the base GEMM's operands fixed): the tangent is
  # the LoRA term's, s * (x @ (dA @ B + A @ dB)).
  layer = ta_linen.DenseGeneral(N, recipe=DELAYED, threshold=None, **LORA)
  v = layer.init(jax.random.key(0), X)

  def y(a, b):
    return layer.apply({**v, "params": {**v["params"], "lora_a_kernel": a, "lora_b_kernel": b}}, X)

  da, db = _rand((K, R), 11, 0.2), _rand((R, N), 12, 0.2)
  _, tangent = jax.jvp(y, (A, B), (da, db))
  x64, a64, b64, da64, db64 = (np.float64(t) for t in (X, A, B, da, db))
  _hp_close(tangent, x64 @ (da64 @ b64 + a64 @ db64) * (ALPHA / R), rel)


IN, OUT = (4, 8), (2, 16)  # LinearGeneral: K = 32 contracted, features (2, 16), N = 16


def _nnx_general(lora=True, **kw):
  return ta_nnx.LinearGeneral(
    IN,
    OUT,
    axis=(-2, -1),
    recipe=CURRENT,
    threshold=None,
    rngs=nnx.Rngs(0),
    **{**(LORA if lora else {}), **kw},
  )


def test_nnx_linear_general_lora_over_two_axes(rel):
  layer = _nnx_general()
  assert layer.lora_a_kernel.shape == (*IN, OUT[0], R)
  assert layer.lora_b_kernel.shape == (OUT[0], R, OUT[1])
  assert not np.any(layer.lora_b_kernel[...])
  x = _rand((16, *IN), 5)
  y_base = layer(x)  # lora_b = 0: the layer equals its base
  np.testing.assert_array_equal(y_base, _nnx_general(lora=False)(x))
  a, b = _rand(layer.lora_a_kernel.shape, 6, 0.2), _rand(layer.lora_b_kernel.shape, 7, 0.2)
  layer.lora_a_kernel.set_value(a)
  layer.lora_b_kernel.set_value(b)
  y = layer(x)
  assert y.shape == (16, *OUT)
  x64, a64, b64 = (np.float64(v) for v in (x, a, b))
  lora = np.einsum("pij,ijhs,hsn->phn", x64, a64, b64) * (ALPHA / R)
  _hp_close(np.float64(y) - np.float64(y_base), lora, rel)
  # The base GEMM over both axes is FP8.
  base = np.einsum("pij,ijkn->pkn", x64, np.float64(layer.kernel[...])) + np.float64(
    layer.bias[...]
  )
  assert 0.005 < rel(y_base, base) < 0.1
  assert inspect.count_fp8_dot_generals(lambda x: layer(x), x) == (1, 3)


@pytest.mark.parametrize("rank", [17, 0])
def test_nnx_linear_general_rank_is_bounded_by_the_last_feature(rank):
  # N is the last feature (16), not the product of the features (32): TE factors one K x N
  # matrix per leading feature.
  with pytest.raises(
    ValueError,
    match=r"LinearGeneral\(\(4, 8\), \(2, 16\)\): "
    r"low_rank_adaptation_dim must be an int from 1 to "
    r"min\(K, N\) = 16 \(K=32 contracted, N=16",
  ):
    _nnx_general(low_rank_adaptation_dim=rank)
  assert _nnx_general(low_rank_adaptation_dim=16).lora_b_kernel.shape == (2, 16, 16)


def test_nnx_linear_general_lora_refuses_batch_axis():
  with pytest.raises(
    ValueError, match="LinearGeneral: low-rank adaptation does not take batch_axis"
  ):
    ta_nnx.LinearGeneral(32, 32, batch_axis={0: 16}, recipe=None, rngs=nnx.Rngs(0), **LORA)
