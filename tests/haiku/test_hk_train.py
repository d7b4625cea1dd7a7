"""The Haiku step helper: recipe state from grads, other state from apply; scan, remat, vmap."""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from tests.conftest import FP8_GEMM_RTOL

DELAYED = ta.DelayedScaling(amax_history_len=4)


def _np_init(seed, stddev=0.2):
  """A weight initialiser drawing from numpy: no PRNG to compile, so init(None, ...) works."""
  rng = np.random.default_rng(seed)
  return lambda shape, dtype: jnp.asarray(stddev * rng.normal(size=shape), dtype)


def _normal(seed, shape, scale=1.0):
  return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


def _assert_trees_close(a, b, rtol=1e-6, atol=0.0):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _sum_loss(model):
  def loss_fn(params, state, x):
    y, state = model.apply(params, state, None, x)
    return jnp.sum(y * y), state

  return loss_fn


def test_split_and_merge_state():
  recipe_entries = core.init_state(DELAYED)
  state = {
    "mlp/~/linear_0": dict(recipe_entries),
    "batch_norm/~/mean_ema": {"counter": jnp.zeros((), jnp.int32), "hidden": jnp.zeros(3)},
    "mixed": {**recipe_entries, "steps": jnp.zeros(())},
  }
  recipe, other = ta_hk.split_state(state)
  assert set(recipe) == {"mlp/~/linear_0", "mixed"}
  assert all(set(v) == ta_hk.RECIPE_STATE_NAMES for v in recipe.values())
  assert set(other) == {"batch_norm/~/mean_ema", "mixed"} and set(other["mixed"]) == {"steps"}
  assert ta_hk.merge_state(recipe, other) == state
  with pytest.raises(ValueError, match=r"'odd'.*lacks"):
    ta_hk.split_state({"odd": {"x_scale": jnp.ones(1), "hidden": jnp.zeros(1)}})
  with pytest.raises(ValueError, match="both recipe and other"):
    ta_hk.merge_state({"m": {"x_scale": 1}}, {"m": {"x_scale": 2}})
  with pytest.raises(TypeError, match="Haiku state mapping"):
    ta_hk.split_state([1, 2])


def test_batch_norm_state_updates_beside_recipe_state():
  def forward(x):
    h = hk.BatchNorm(True, True, decay_rate=0.5)(x, is_training=True)
    return ta_hk.Linear(16, w_init=_np_init(0), threshold=None, recipe=DELAYED)(h), h

  def reference(x):  # the same normalisation, no quantized layer
    return hk.BatchNorm(True, True, decay_rate=0.5)(x, is_training=True)

  model = hk.transform_with_state(forward)
  ref = hk.transform_with_state(reference)
  xs = [_normal(i, (8, 32), scale=1.0 + i) + i for i in range(3)]
  (params, state), (_, ref_state) = jax.jit(lambda x: (model.init(None, x), ref.init(None, x)))(
    xs[0]
  )

  def loss_fn(params, state, x):
    (y, h), state = model.apply(params, state, None, x)
    return jnp.sum(y * y), (h, state)

  @jax.jit
  def run(params, state, ref_state, x):
    step = ta_hk.value_grad_and_state(loss_fn, has_aux=True)(params, state, x)
    plain_grads = jax.grad(lambda p: loss_fn(p, state, x)[0])(params)
    return step, ref.apply(params, ref_state, None, x)[1], plain_grads

  for t, x in enumerate(xs):
    (loss, h, grads, new_state), ref_state, plain_grads = run(params, state, ref_state, x)
    # Ordinary state: as apply returned it, the same as without the quantized layer.
    _assert_trees_close(ta_hk.split_state(new_state)[1], ref_state)
    assert int(new_state["batch_norm/~/mean_ema"]["counter"]) == t + 1
    # Recipe state: from the gradient.
    lin = new_state["linear"]
    np.testing.assert_allclose(lin["x_amax_history"][-1], np.max(np.abs(h)), rtol=1e-6)
    assert float(lin["grad_amax_history"][-1]) > 0 and float(lin["x_scale"][0]) != 1.0
    # The parameter grads are the ordinary grads of the same loss; no recipe state among them.
    _assert_trees_close(grads, plain_grads, rtol=1e-6)
    assert not any(set(v) & ta_hk.RECIPE_STATE_NAMES for v in grads.values())
    state = new_state


def test_unused_layer_keeps_its_state_and_errors():
  def forward(x):
    return (
      ta_hk.Linear(16, w_init=_np_init(1), threshold=None, recipe=DELAYED, name="used")(x),
      ta_hk.Linear(16, w_init=_np_init(2), threshold=None, recipe=DELAYED, name="unused")(x),
    )

  model = hk.transform_with_state(forward)
  x = _normal(0, (4, 16))
  params, state = jax.jit(model.init)(None, x)
  state["unused"] = {k: v + 3.0 for k, v in state["unused"].items()}  # distinguishable old state

  def loss_fn(params, state, x):
    (a, _), state = model.apply(params, state, None, x)
    return jnp.sum(a), state

  _, aux, _, new = jax.jit(ta_hk.value_grad_and_state(loss_fn))(params, state, x)
  assert aux is None
  _assert_trees_close(new["unused"], state["unused"])
  np.testing.assert_allclose(new["used"]["x_amax_history"][-1], np.max(np.abs(x)), rtol=1e-6)

  # State that apply would have to create is never updated: refused with a clear message (by
  # the layer, before the helper's own check of created state).
  with pytest.raises(ValueError, match="'used' keeps recipe state .*has none for it"):
    jax.eval_shape(ta_hk.value_grad_and_state(loss_fn), params, {}, x)
  with pytest.raises(TypeError, match=r"\(loss, new_state\)"):
    jax.eval_shape(
      ta_hk.value_grad_and_state(lambda p, s, x: loss_fn(p, s, x)[0]), params, state, x
    )
  with pytest.raises(TypeError, match=r"\(loss, \(aux, new_state\)\)"):
    jax.eval_shape(ta_hk.value_grad_and_state(loss_fn, has_aux=True), params, state, x)


def _block(x, name=None):
  return jax.nn.gelu(
    ta_hk.Linear(32, w_init=_np_init(4), threshold=None, recipe=DELAYED, name=name)(x)
  )


def test_layer_stack_and_remat_match_unrolled_layers():
  layers = 3
  x = _normal(1, (8, 32))

  def stacked(remat=None, **kwargs):
    return hk.transform_with_state(
      lambda x: hk.layer_stack(layers)(remat(_block, **kwargs) if remat else _block)(x)
    )

  remat = stacked(hk.remat)
  remat_saving_fp8 = stacked(hk.remat, policy=core.save_quantized_operands)
  unrolled = hk.transform_with_state(
    lambda x: functools.reduce(lambda h, i: _block(h, f"l{i}"), range(layers), x)
  )
  params, state = jax.jit(stacked().init)(None, x)
  (name,) = params
  assert state[name]["x_amax_history"].shape == (layers, 4)  # per-layer state
  # Different weights per layer, so a mix-up of layers would show.
  params = jax.tree.map(lambda a: _normal(a.size, a.shape, 0.3), params)

  def unstack(tree):
    return {f"l{i}": jax.tree.map(lambda a, i=i: a[i], tree[name]) for i in range(layers)}

  def restack(tree):
    return {name: jax.tree.map(lambda *a: jnp.stack(a), *(tree[f"l{i}"] for i in range(layers)))}

  @jax.jit
  def run_all(params, state, x):
    out = [
      ta_hk.value_grad_and_state(_sum_loss(m))(params, state, x) for m in (remat, remat_saving_fp8)
    ]
    loss, _, grads, new = ta_hk.value_grad_and_state(_sum_loss(unrolled))(
      unstack(params), unstack(state), x
    )
    return out, (loss, None, restack(grads), restack(new))

  for _ in range(2):  # the second step quantizes with the scales the first one stored
    out, ref = run_all(params, state, x)
    for result in out:
      _assert_trees_close(result, ref, rtol=2e-5, atol=1e-6)
    state = out[0][3]
  history = state[name]["x_amax_history"]
  assert len(set(np.asarray(history[:, -1]).tolist())) == layers  # each layer its own amax
  np.testing.assert_allclose(history[0, -2:], [np.max(np.abs(x))] * 2, rtol=1e-6)


def test_vmap_state_equals_unbatched_layer():
  x = _normal(2, (3, 5, 32)) * np.array([1.0, 4.0, 2.0], np.float32)[:, None, None]

  def per_example(xi):
    return ta_hk.Linear(16, w_init=_np_init(3), threshold=None, recipe=DELAYED)(xi)

  mapped = hk.transform_with_state(lambda x: hk.vmap(per_example, split_rng=False)(x))
  whole = hk.transform_with_state(per_example)
  params, state = jax.jit(whole.init)(None, x)

  @jax.jit
  def both(params, state, x):
    return [ta_hk.value_grad_and_state(_sum_loss(m))(params, state, x) for m in (mapped, whole)]

  for _ in range(2):
    got, ref = both(params, state, x)
    # Batched and unbatched FP8 GEMMs: the same quantized operands, summed by other kernels. On
    # the GPU (M = 5 and 15, XLA's FP8 GEMM rather than the extension's) 1% of the outputs
    # differed by up to 0.7% on an H100, the unbatched ones with fewer mantissa bits: not traced
    # to its source. A sum of amaxes or a wrong scale moves every output.
    rtol = FP8_GEMM_RTOL if jax.default_backend() == "cpu" else 1e-2
    _assert_trees_close(got, ref, rtol=rtol, atol=rtol)
    # The amax of the whole batch, not a sum over the examples.
    np.testing.assert_allclose(got[3]["linear"]["x_amax_history"][-1], np.max(np.abs(x)), rtol=1e-6)
    state = got[3]


def test_apply_without_the_recipe_state_is_an_error_naming_the_module():
  """Haiku would create the missing entries afresh under apply (scale 1, empty history) and the
  step would quantize with them unnoticed; Linen's apply raises for a missing collection too."""
  x = jnp.ones((8, 32))
  model = hk.transform_with_state(
    lambda x: ta_hk.Linear(16, recipe=ta.DelayedScaling(amax_history_len=4), threshold=None)(x)
  )
  params, state = model.init(jax.random.key(0), x)
  assert model.apply(params, state, None, x)[0].shape == (8, 16)
  with pytest.raises(ValueError, match=r"'linear' keeps recipe state .*pass the state that init"):
    model.apply(params, {}, None, x)
  # A stateless recipe needs none.
  current = hk.transform_with_state(
    lambda x: ta_hk.Linear(16, recipe=ta.Float8CurrentScaling(), threshold=None)(x)
  )
  params, _ = current.init(jax.random.key(0), x)
  assert current.apply(params, {}, None, x)[0].shape == (8, 16)
