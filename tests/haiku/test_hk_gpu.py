"""On a GPU with FP8 GEMMs: the Haiku layers' steps compile to cuBLAS FP8 GEMMs (with remat too)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU with FP8 GEMMs")
@pytest.mark.parametrize("remat_policy", [None, core.save_quantized_operands])
@pytest.mark.parametrize("recipe", [ta.Float8CurrentScaling(), ta.DelayedScaling()])
def test_step_runs_fp8_gemms(recipe, remat_policy):
  def block(x):
    return ta_hk.Linear(256, recipe=recipe, threshold=None)(x)

  def forward(x):
    layer = hk.remat(block, policy=remat_policy) if remat_policy else block
    return layer(x)

  model = hk.transform_with_state(forward)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(128, 256)), jnp.bfloat16)
  params, state = model.init(jax.random.key(0), x)

  def loss_fn(params, state, x):
    y, state = model.apply(params, state, None, x)
    return jnp.sum(y.astype(jnp.float32) ** 2), state

  step = jax.jit(ta_hk.value_grad_and_state(loss_fn))
  hlo = step.lower(params, state, x).compile().as_text()
  # Forward and wgrad (the input's gradient is not asked for, so XLA drops dgrad), all FP8.
  fp8, other = ta.inspect.count_fp8_gemms(hlo)
  assert fp8 >= 2 and other == 0, ta.inspect.hlo_dot_operand_types(hlo)
  loss, _, grads, _ = step(params, state, x)
  assert np.isfinite(float(loss))
  assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in jax.tree.leaves(grads))
