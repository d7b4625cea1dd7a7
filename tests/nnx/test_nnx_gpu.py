"""On a GPU with FP8 GEMMs, a te_adapters.nnx training step compiles to cuBLAS FP8 GEMMs."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize(
  "recipe",
  [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=16)],
  ids=["current", "delayed"],
)
def test_training_step_runs_fp8_gemms(recipe, remat):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  model = ta_nnx.Linear(
    256, 512, recipe=recipe, threshold=None, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
  )
  x = jnp.ones((64, 256), jnp.bfloat16)

  def loss(m, x):
    apply = lambda m, x: m(x)
    if remat:
      apply = nnx.remat(apply, policy=ta.core.save_quantized_operands)
    return jnp.sum(apply(m, x).astype(jnp.float32) ** 2)

  graphdef, state = nnx.split(model)

  def step(state, x):
    m = nnx.merge(graphdef, state)
    _, (grads, state_grads) = ta_nnx.value_and_grad(loss)(m, x)
    ta_nnx.update_recipe_state(m, state_grads)
    return grads, nnx.state(m)

  hlo = jax.jit(step).lower(state, x).compile().as_text()
  # Forward and wgrad (the input's gradient is not asked for, so XLA drops dgrad), all FP8.
  fp8, other = ta.inspect.count_fp8_gemms(hlo)
  assert fp8 >= 2 and other == 0, ta.inspect.hlo_dot_operand_types(hlo)
