"""core.layernorm and core.layernorm_dense against float64, their state, residuals and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core

DELAYED = ta.DelayedScaling(amax_history_len=4)
RECIPES = [ta.Float8CurrentScaling(), DELAYED, ta.Float8BlockScaling()]


def _data(shapes, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def _inputs(rows=(4, 32), k=128, seed=0):
  x, g, b, dy = _data([(*rows, k), (k,), (k,), (*rows, k)], seed)
  # Rows with a mean and a spread of their own, so a wrong mean or variance term shows.
  x = 3.0 * x + jnp.linspace(-2.0, 2.0, rows[-1])[:, None] + 1.5
  return x, 1.0 + 0.5 * g, 0.3 * b, dy


def _norm64(x, g, b, layernorm_type, zero_centered_gamma, eps):
  """The plain formula, float64, differentiated by JAX's own autodiff."""
  gamma = g + 1.0 if zero_centered_gamma else g
  if layernorm_type == "layernorm":
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + b
  return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * gamma


def _reference(x, g, b, dy, layernorm_type, zero_centered_gamma, eps, kernel=None, dz=None):
  """Forward and (dx, dgamma, dbeta[, dkernel]) in float64 for loss sum(out * cotangent)."""
  with jax.enable_x64(True):
    args = [np.asarray(a, np.float64) for a in (x, g, b)]
    cot = np.asarray(dy if kernel is None else dz, np.float64)

    def f(x, g, b, *kernel_arg):
      y = _norm64(x, g, b, layernorm_type, zero_centered_gamma, eps)
      return y if not kernel_arg else y @ kernel_arg[0]

    extra = () if kernel is None else (np.asarray(kernel, np.float64),)
    out, vjp = jax.vjp(f, *args, *extra)
    grads = vjp(jnp.asarray(cot))
    return np.asarray(out), [np.asarray(gr) for gr in grads]


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_layernorm_against_float64(layernorm_type, zero_centered_gamma, dtype, tol, rel):
  x, g, b, dy = _inputs()
  if zero_centered_gamma:
    g = g - 1.0
  b = b if layernorm_type == "layernorm" else None
  x, dy = x.astype(dtype), dy.astype(dtype)

  def loss(x, g, b):
    y = core.layernorm(
      x, g, b, layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma, epsilon=1e-5
    )
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, g, b)
  ref, ref_grads = _reference(
    x, g, jnp.zeros_like(g) if b is None else b, dy, layernorm_type, zero_centered_gamma, 1e-5
  )
  assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == jnp.float32
  errs = [rel(y, ref)] + [rel(a, r) for a, r in zip(grads[:2], ref_grads[:2], strict=True)]
  if b is not None:
    errs.append(rel(grads[2], ref_grads[2]))
    assert grads[2].shape == b.shape
  else:
    assert grads[2] is None
  assert max(errs) < tol, errs


def test_layernorm_bf16_params_and_float32_compute(rel):
  # bf16 x with float32 gamma/beta: the statistics are float32 (a bf16 mean of rows with a large
  # offset would lose the spread), the output bf16.
  x = (100.0 + _data([(8, 256)])[0]).astype(jnp.bfloat16)
  y = core.layernorm(x, jnp.ones(256), jnp.zeros(256))
  ref, _ = _reference(x, jnp.ones(256), jnp.zeros(256), x, "layernorm", False, 1e-6)
  assert y.dtype == jnp.bfloat16 and rel(y, ref) < 1e-2


@pytest.mark.parametrize(
  "kwargs, bias, scale_shape, match",
  [
    ({"layernorm_type": "batchnorm"}, True, (32,), "layernorm_type must be one of"),
    ({"layernorm_type": "rmsnorm"}, True, (32,), "rmsnorm has no bias"),
    ({}, False, (32,), "needs a bias"),
    ({}, True, (16,), r"scale must have shape \(32,\)"),
    ({}, "short", (32,), r"bias must have shape \(32,\)"),
  ],
)
def test_layernorm_bad_input(kwargs, bias, scale_shape, match):
  x = jnp.ones((4, 32))
  b = {True: jnp.zeros(32), False: None, "short": jnp.zeros(8)}[bias]
  with pytest.raises(ValueError, match=match):
    core.layernorm(x, jnp.ones(scale_shape), b, **kwargs)


def _train_ln_dense(recipe, x, g, b, w, dz, steps, layernorm_type="layernorm"):
  state = core.init_state(recipe)

  @jax.jit
  def step(x, g, b, w, state):
    def loss(x, g, b, w, state):
      z, _ = core.layernorm_dense(
        x,
        g,
        b,
        w,
        layernorm_type=layernorm_type,
        recipe=recipe,
        state=state or None,
        threshold=None,
      )
      return jnp.sum(z.astype(jnp.float32) * dz), z

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, g, b, w, state)

  for _ in range(steps):
    (_, z), (dx, dg, db, dw, state) = step(x, g, b, w, state)
  return z, (dx, dg, db, dw), state


@pytest.mark.parametrize(
  "recipe, layernorm_type",
  [(r, "layernorm") for r in [*RECIPES, ta.MXFP8BlockScaling()]] + [(RECIPES[0], "rmsnorm")],
  ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_layernorm_dense_against_float64(recipe, layernorm_type, rel):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  b = b if layernorm_type == "layernorm" else None
  z, grads, _ = _train_ln_dense(recipe, x, g, b, w, dz, steps=3, layernorm_type=layernorm_type)
  ref, ref_grads = _reference(
    x, g, jnp.zeros_like(g) if b is None else b, None, layernorm_type, False, 1e-6, kernel=w, dz=dz
  )
  errs = {
    "z": rel(z, ref),
    "dx": rel(grads[0], ref_grads[0]),
    "dgamma": rel(grads[1], ref_grads[1]),
    "dkernel": rel(grads[3], ref_grads[3]),
  }
  if b is not None:
    errs["dbeta"] = rel(grads[2], ref_grads[2])
  # FP8 with E4M3 forward and E5M2 gradients: about 0.04 forward and 0.06 backward on this
  # data; a wrong scale, layout or norm gradient gives O(1).
  assert errs["z"] < 0.05 and max(errs.values()) < 0.08, errs
  # ... and clearly more than float32 would give: the GEMMs really ran in FP8.
  assert errs["z"] > 0.005 and errs["dkernel"] > 0.005, errs


def test_layernorm_dense_high_precision_matches_norm_then_dot(rel):
  x, g, b, _ = _inputs()
  w = _data([(128, 64)], seed=1)[0]
  z, ln = core.layernorm_dense(x, g, b, w, recipe=None, return_layernorm_output=True)
  ref, _ = _reference(x, g, b, None, "layernorm", False, 1e-6, kernel=w, dz=np.zeros((4, 32, 64)))
  np.testing.assert_array_equal(ln, core.layernorm(x, g, b))
  # float32 GEMM: to float32 rounding on CPU; GPUs may run it with TF32 inputs.
  assert rel(z, ref) < (1e-5 if jax.default_backend() == "cpu" else 5e-3)


def test_delayed_state_moves_with_the_norm_output():
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  _, _, state = _train_ln_dense(DELAYED, x, g, b, w, dz, steps=3)
  amax_y = float(jnp.max(jnp.abs(core.layernorm(x, g, b))))
  amax_w = float(jnp.max(jnp.abs(w)))
  # Three steps of the same amaxes: history [0, a, a, a] (length 4), scale 448 / a.
  np.testing.assert_allclose(state["x_amax_history"], [0, amax_y, amax_y, amax_y], rtol=1e-6)
  np.testing.assert_allclose(state["kernel_amax_history"], [0, amax_w, amax_w, amax_w])
  np.testing.assert_allclose(state["x_scale"], [448.0 / amax_y], rtol=1e-6)
  assert float(state["grad_amax_history"][-1]) > 0


@pytest.mark.parametrize("return_layernorm_output", [False, True])
def test_return_layernorm_output(return_layernorm_output):
  x, g, b, _ = _inputs()
  x = x.astype(jnp.bfloat16)
  w = _data([(128, 64)], seed=1)[0]
  z, ln = core.layernorm_dense(
    x,
    g,
    b,
    w,
    recipe=ta.Float8CurrentScaling(),
    threshold=None,
    return_layernorm_output=return_layernorm_output,
  )
  assert z.dtype == jnp.bfloat16 and z.shape == (4, 32, 64)  # x's dtype, as TE's
  if return_layernorm_output:
    np.testing.assert_array_equal(ln, core.layernorm(x, g, b))
  else:
    assert ln is None


def _saved(f, *args):
  """The residuals the backward pass keeps: (shape, dtype) pairs."""
  out = []
  _, vjp = jax.vjp(f, *args)
  for leaf in jax.tree_util.tree_leaves(vjp):
    if hasattr(leaf, "shape") and leaf.size:
      out.append((tuple(leaf.shape), jnp.dtype(leaf.dtype)))
  return out


@pytest.mark.parametrize(
  "recipe", [ta.Float8CurrentScaling(), ta.Float8BlockScaling()], ids=lambda r: type(r).__name__
)
def test_no_high_precision_norm_output_is_saved(recipe):
  # The backward keeps x, gamma, the row statistics and the FP8 copies, not the normalized
  # tensor in high precision (TE's fused layernorm_dense keeps the same).
  x, g, b, _ = _inputs()
  x = x.astype(jnp.bfloat16)
  w = _data([(128, 256)], seed=1)[0]

  def f(x, g, b, w):
    return core.layernorm_dense(x, g, b, w, recipe=recipe, threshold=None)[0]

  saved = _saved(f, x, g, b, w)
  big = [(s, d) for s, d in saved if int(np.prod(s)) >= x.size]
  high = [(s, d) for s, d in big if d.itemsize > 1]
  # The only high-precision residual of x's size is x itself, as (M, K) on the fused path (the
  # kernel is kept in FP8 too).
  assert [(int(np.prod(s)), d) for s, d in high] == [(x.size, jnp.dtype(jnp.bfloat16))], saved
  assert any(d.itemsize == 1 and int(np.prod(s)) == x.size for s, d in big), saved


@pytest.mark.parametrize(
  "kwargs, kernel_shape, match",
  [
    ({"axis": 0}, (128, 64), "axis must be -1"),
    ({"axis": (-2, -1)}, (128, 64), "axis must be -1"),
    ({}, (64, 128), "axis 0 must have size 128"),
    ({"layernorm_type": "groupnorm"}, (128, 64), "layernorm_type must be one of"),
  ],
)
def test_layernorm_dense_bad_input(kwargs, kernel_shape, match):
  x, g, b, _ = _inputs()
  with pytest.raises(ValueError, match=match):
    core.layernorm_dense(
      x, g, b, jnp.ones(kernel_shape), recipe=ta.Float8CurrentScaling(), **kwargs
    )


def test_remat_gives_the_same_grads_and_state():
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  state = core.init_state(DELAYED)

  def loss(x, g, b, w, state):
    z, _ = core.layernorm_dense(x, g, b, w, recipe=DELAYED, state=state, threshold=None)
    return jnp.sum(z * dz)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  remat = jax.jit(
    jax.grad(jax.checkpoint(loss, policy=core.save_quantized_operands), argnums=(0, 1, 2, 3, 4))
  )
  plain, again = grads(x, g, b, w, state), remat(x, g, b, w, state)
  for a, r in zip(jax.tree.leaves(plain), jax.tree.leaves(again), strict=True):
    if jax.default_backend() == "cpu":
      np.testing.assert_array_equal(a, r)
    else:
      # The GPU recomputes the norm in another fusion: its output may move by an ulp, and an
      # FP8 value on a rounding boundary with it (seen on an H100 with the pure-JAX casts).
      np.testing.assert_allclose(a, r, rtol=1e-2, atol=1e-2 * float(np.max(np.abs(a))))
  assert float(plain[4]["x_amax_history"][-1]) > 0


def _one_fused_rule(jaxpr) -> bool:
  """Whether a traced program runs its norm (and activation) inside the quantized GEMM rule:
  the rule's custom VJP is there and the norm's and the activation's own ones are not."""
  text = str(jaxpr)
  return (
    "name=_quantized_gemms" in text and "name=_norm" not in text and "name=_activation" not in text
  )


def _takes_fused(**kw):
  x, g, b, _ = _inputs()
  w = _data([(128, 256)], seed=1)[0]
  jaxpr = jax.make_jaxpr(lambda x, w: core.layernorm_dense(x, g, b, w, **kw)[0])(x, w)
  return _one_fused_rule(jaxpr)


def test_layernorm_dense_fuses_the_norm_into_the_cast_where_it_applies():
  current = ta.Float8CurrentScaling()
  assert _takes_fused(recipe=current, threshold=None)
  assert _takes_fused(recipe=DELAYED, state=core.init_state(DELAYED), threshold=None)
  # Block scaling too, where its blocks tile the GEMM (tests/core/test_fused_every_recipe.py).
  assert _takes_fused(recipe=ta.Float8BlockScaling(), threshold=None)
  # A sharding constraint on the norm's output goes on its input (tests/core/test_fused_sharding),
  # for per-tensor recipes; block scaling composes under it.
  assert _takes_fused(recipe=current, threshold=None, dot_input_constraint=lambda y: y)
  assert not _takes_fused(
    recipe=ta.Float8BlockScaling(), threshold=None, dot_input_constraint=lambda y: y
  )
  # Composed: high precision, the norm's output returned, the switch off, a GEMM the default
  # size threshold keeps in bf16.
  assert not _takes_fused(recipe=None)
  assert not _takes_fused(recipe=current, threshold=None, return_layernorm_output=True)
  assert not _takes_fused(
    recipe=current, threshold=None, config=core.GemmConfig(fuse_activation_cast=False)
  )
  with pytest.warns(core.HighPrecisionGemmWarning):
    assert not _takes_fused(recipe=current)


@pytest.mark.parametrize("layernorm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("recipe", [ta.Float8CurrentScaling(), DELAYED], ids=["current", "delayed"])
def test_fused_layernorm_dense_equals_the_composed_path(recipe, layernorm_type):
  """float32 x (the composed norm's output is not rounded to bf16 first): the same FP8 operands,
  so the fused custom VJP gives the composed path's output, gradients and state over 3 steps."""
  x, g, b, _ = _inputs()
  w, dz, c = _data([(128, 2, 128), (4, 32, 2, 128), (2, 128)], seed=1)
  b = b if layernorm_type == "layernorm" else None
  state = core.init_state(recipe) or None

  def step(fuse):
    config = core.GemmConfig(fuse_activation_cast=fuse)

    def loss(x, g, b, w, c, state):
      z, _ = core.layernorm_dense(
        x,
        g,
        b,
        w,
        layernorm_type=layernorm_type,
        recipe=recipe,
        state=state,
        threshold=None,
        config=config,
        dense_bias=c,
      )
      return jnp.sum(z * dz), z

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))

  out = {}
  for fuse in (True, False):
    s, f = state, step(fuse)
    for _ in range(3):
      (_, z), grads = f(x, g, b, w, c, s)
      s = grads[5]
    out[fuse] = (z, grads)
  assert z.shape == (4, 32, 2, 128)
  for a, r in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False]), strict=True):
    np.testing.assert_allclose(a, r, rtol=2e-6, atol=2e-6 * float(np.max(np.abs(r))))
  # The dense bias's gradient: dz's sums over the rows.
  np.testing.assert_allclose(
    out[True][1][4], np.sum(np.asarray(dz, np.float64), axis=(0, 1)), rtol=1e-5, atol=1e-5
  )


def test_layernorm_dense_refuses_a_dense_bias_of_another_shape():
  x, g, b, _ = _inputs()
  for config in (None, core.GemmConfig(fuse_activation_cast=False)):
    with pytest.raises(ValueError, match=r"dense_bias must have the kernel's feature shape"):
      core.layernorm_dense(
        x,
        g,
        b,
        jnp.ones((128, 256)),
        recipe=ta.Float8CurrentScaling(),
        threshold=None,
        config=config,
        dense_bias=jnp.ones((128,)),
      )


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py sets 8 on CPU)")
@pytest.mark.parametrize("recipe", [ta.Float8CurrentScaling(), DELAYED], ids=["current", "delayed"])
def test_fused_layernorm_dense_with_rows_sharded_equals_one_device(recipe):
  """The fused path under jit with x and dz sharded by rows on a 4-device mesh: the same
  output gradients, parameter gradients and next state as on one device (float32 sums of the
  shards in another order).

  The casts are pure JAX here (as on CPU); the CUDA norm cast runs per shard through its
  partitioning rule (tests/core/test_fused_sharding.py).
  """
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from tests import spmd_checks

  x, g, b, _ = _inputs(rows=(8, 32))
  w, dz, c = _data([(128, 256), (8, 32, 256), (256,)], seed=1)
  state = core.init_state(recipe) or None
  config = core.GemmConfig(backend="jax")

  def grads(x, dz):
    def loss(x, g, b, w, c, state):
      z, _ = core.layernorm_dense(
        x, g, b, w, recipe=recipe, state=state, threshold=None, dense_bias=c, config=config
      )
      return jnp.sum(z * dz)

    assert _one_fused_rule(jax.make_jaxpr(loss)(x, g, b, w, c, state))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(x, g, b, w, c, state)

  one = grads(x, dz)
  rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("dp",)), PartitionSpec("dp"))
  many = grads(jax.device_put(x, rows), jax.device_put(dz, rows))
  if spmd_checks.ON_GPU:  # the shards' FP8 GEMMs sum in another order (spmd_checks)
    spmd_checks.assert_trees_match_one_device(many, one)
    return
  for a, r in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
    np.testing.assert_allclose(r, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))


def test_fused_paths_warn_when_delayed_state_is_left_out_of_the_gradient():
  """layernorm_dense's and layernorm_mlp's fused paths, differentiated with respect to the
  inputs and weights only (plain jax.grad that leaves DelayedScaling's state out), warn as
  dot_general does instead of freezing the state silently; with the state differentiated,
  no warning."""
  import warnings

  x, g, b, _ = _inputs()
  w = _data([(128, 256)], seed=1)[0]
  wi, wo = _data([(128, 1, 256), (256, 128)], seed=2)

  def dense(x, w, state):
    return jnp.sum(core.layernorm_dense(x, g, b, w, recipe=DELAYED, state=state, threshold=None)[0])

  def mlp(x, w, state):
    return jnp.sum(
      core.layernorm_mlp(x, g, b, wi, wo, recipe=DELAYED, states=state, threshold=None)[0]
    )

  cases = [
    (dense, core.init_state(DELAYED)),
    (mlp, (core.init_state(DELAYED), core.init_state(DELAYED))),
  ]
  for f, state in cases:
    assert _one_fused_rule(jax.make_jaxpr(f)(x, w, state))
    with pytest.warns(core.FrozenStateWarning):
      jax.grad(f, argnums=(0, 1))(x, w, state)
    with warnings.catch_warnings():
      warnings.simplefilter("error", core.FrozenStateWarning)
      jax.grad(f, argnums=(0, 1, 2))(x, w, state)
