"""Core recipe state under vmap (unmapped state) and FP8 residuals saved by remat policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from tests.conftest import assert_scales_equal

DN = (((1,), (0,)), ((), ()))
RECIPE = ta.DelayedScaling(amax_history_len=2)


@pytest.mark.parametrize("max_grad", [False, True])
def test_vmap_with_unmapped_state_records_the_batch_amax(max_grad):
  # Examples with amax 1..6 in a (2, 3) grid of examples; a sum over them would give 21.
  x = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3, 1, 1) * np.ones((2, 3, 4, 16), np.float32)
  w = np.full((16, 16), 0.5, np.float32)

  def loss(state, x):
    if max_grad:
      state = core.with_max_grad(state)
    f = lambda xi: core.dot_general(xi, w, DN, threshold=None, recipe=RECIPE, state=state)
    return jnp.sum(jax.vmap(jax.vmap(f))(x)), jnp.sum(jax.vmap(f)(x[1]))

  grads = jax.jit(jax.grad(lambda s, x: loss(s, x)[0]))(core.init_state(RECIPE), x)
  one_level = jax.jit(jax.grad(lambda s, x: loss(s, x)[1]))(core.init_state(RECIPE), x)
  np.testing.assert_allclose(grads["x_amax_history"], [0.0, 6.0])
  np.testing.assert_allclose(grads["x_scale"], [448.0 / 6.0], rtol=1e-6)
  np.testing.assert_allclose(grads["kernel_amax_history"], [0.0, 0.5])
  np.testing.assert_allclose(grads["grad_amax_history"], [0.0, 1.0])  # d(sum)/dy = 1
  np.testing.assert_allclose(one_level["x_amax_history"], [0.0, 6.0])


def test_vmap_with_an_all_zero_example_takes_the_other_examples_scale():
  # Example 0 is all zeros (alone it would keep the old scale 1); example 1 has amax 3.
  x = np.stack([np.zeros((4, 16), np.float32), np.full((4, 16), 3.0, np.float32)])
  w = np.full((16, 16), 0.5, np.float32)
  for max_grad in (False, True):

    def loss(state, max_grad=max_grad):
      if max_grad:
        state = core.with_max_grad(state)
      f = lambda xi: core.dot_general(xi, w, DN, threshold=None, recipe=RECIPE, state=state)
      return jnp.sum(jax.vmap(f)(x))

    grads = jax.grad(loss)(core.init_state(RECIPE))
    np.testing.assert_array_equal(grads["x_amax_history"], [0.0, 3.0])
    assert_scales_equal(grads["x_scale"], [np.float32(448.0) / np.float32(3.0)])


def test_remat_policy_saving_fp8_operands_matches_no_remat():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 32)).astype(np.float32)
  w = rng.normal(size=(32, 16)).astype(np.float32)

  def block(x, w, state):
    return core.dot_general(x, w, DN, threshold=None, recipe=RECIPE, state=state)

  def loss(block, w, state):
    return jnp.sum(block(x, w, state) ** 2)

  @jax.jit
  def both(w, state):
    grad = jax.value_and_grad(loss, argnums=(1, 2))
    saved = jax.checkpoint(block, policy=core.save_quantized_gemms)
    return grad(block, w, state), grad(saved, w, state)

  state = core.init_state(RECIPE)
  for _ in range(2):
    ref, got = both(w, state)
    # The max element quantizes to 448; saving it must not turn it into inf (NaN loss).
    assert np.isfinite(got[0])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
      np.testing.assert_array_equal(a, b)
    state = ref[1][1]


@pytest.mark.parametrize(
  "policy,hopper,gemms",
  [
    # XLA's FP8 dot: JAX's dot policy saves its output.
    (jax.checkpoint_policies.checkpoint_dots, False, 3),
    # The extension's GEMM (Hopper GPUs) is an FFI call, which JAX's dot policies do not see:
    # the forward GEMM runs again in the backward pass.
    (jax.checkpoint_policies.checkpoint_dots, True, 4),
    # The library's policies save it by its checkpoint name on either path.
    (core.checkpoint_dots_and_quantized_gemms, False, 3),
    (core.checkpoint_dots_and_quantized_gemms, True, 3),
    (core.save_quantized_gemms, True, 3),
  ],
)
def test_remat_policies_and_the_hopper_gemm(monkeypatch, policy, hopper, gemms):
  from te_adapters import inspect
  from te_adapters.core import kernels

  # The branch is chosen, not the platform's: XLA's FP8 dot or the extension's GEMM (only traced:
  # the CPU extension has no GEMM).
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: hopper)
  x = jnp.ones((16, 32), jnp.bfloat16)
  w = jnp.ones((32, 16), jnp.float32)
  recipe = ta.Float8CurrentScaling()

  def block(x, w):  # sin's derivative needs the GEMM's output: saved or computed again
    return jnp.sin(core.dot_general(x, w, DN, threshold=None, recipe=recipe))

  def loss(w):
    return jnp.sum(jax.checkpoint(block, policy=policy)(x, w).astype(jnp.float32))

  closed = jax.make_jaxpr(jax.grad(loss))(w)
  found = [e for e in inspect.equations(closed) if inspect._is_gemm(e)]
  # Forward, dgrad and wgrad, and the forward again where the policy did not save it; FP8 all.
  assert len(found) == gemms
  assert sum(e.primitive.name == "ffi_call" for e in found) == (gemms if hopper else 0)
  assert inspect.count_fp8_dot_generals(jax.grad(loss), w) == (gemms, gemms)


@pytest.mark.parametrize("fuse", [True, False])
def test_library_policy_saves_both_gemm_outputs_of_layernorm_mlp_on_hopper(monkeypatch, fuse):
  # The fused path names GEMM 1's output by ffn1_ckpt_name too: the library's policy, which
  # saves GEMM_OUTPUT, keeps it, so neither forward GEMM runs again in the backward pass.
  from te_adapters import inspect
  from te_adapters.core import kernels

  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)  # only traced
  x = jnp.ones((16, 32), jnp.bfloat16)
  params = (jnp.ones((32,)), jnp.ones((32, 2, 64)), jnp.ones((64, 32)))
  config = ta.GemmConfig(fuse_activation_cast=fuse)

  def block(x, params):
    scale, wi, wo = params
    out, _ = core.layernorm_mlp(
      x,
      scale,
      None,
      wi,
      wo,
      activations=("silu", "linear"),
      layernorm_type="rmsnorm",
      recipe=ta.Float8CurrentScaling(),
      threshold=None,
      config=config,
    )
    return jnp.sin(out)  # sin's derivative needs the output: saved or computed again

  def loss(params):
    saved = jax.checkpoint(block, policy=core.checkpoint_dots_and_quantized_gemms)
    return jnp.sum(saved(x, params).astype(jnp.float32))

  closed = jax.make_jaxpr(jax.grad(loss))(params)
  found = [e for e in inspect.equations(closed) if inspect._is_gemm(e)]
  # Each GEMM's forward, dgrad and wgrad, the extension's all.
  assert [e.primitive.name for e in found] == ["ffi_call"] * 6
