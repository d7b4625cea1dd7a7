"""The README's usage blocks for plain JAX, Flax Linen, Flax NNX and Haiku run as written.

Each block is taken from README.md by a line it holds and executed with the names it leaves to
the reader (a model, its loss, a batch) defined the ordinary way for that framework, at sizes
under the FP8 size threshold (the README's code keeps the default threshold; the FP8 numerics
are the other tests' subject). What is checked is that the documented calls exist, take the
documented arguments and return the documented structures, so the README cannot drift from
the API unnoticed.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.filterwarnings("ignore::te_adapters.core.HighPrecisionGemmWarning")


def _block(marker: str) -> str:
  blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in b]
  assert len(blocks) == 1, f"README.md: {len(blocks)} python blocks hold {marker!r}"
  return blocks[0]


def _batch():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((8, 32)), jnp.float32),
          jnp.asarray(rng.standard_normal((8, 16)), jnp.float32))


def test_plain_jax_block():
  ns = {"w": jnp.ones((32, 16)) / 8, "x": _batch()[0]}
  exec(_block("state = ta.core.with_max_grad(state)"), ns)
  assert isinstance(ns["state"], core.DelayedScalingState)
  assert ns["g_w"].shape == (32, 16) and np.isfinite(float(ns["loss"]))


def test_linen_block():
  import optax
  from flax import linen as nn

  from te_adapters import linen as ta_linen

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      cls = ta_linen.make_dot_general_cls(ta.DelayedScaling(amax_history_len=4))
      return nn.Dense(16, dot_general=cls())(nn.relu(nn.Dense(32, dot_general=cls())(x)))

  model, batch = Model(), _batch()
  variables = model.init(jax.random.PRNGKey(0), batch[0])

  def loss_fn(variables, batch):
    x, y = batch
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  ns = {"ta": ta, "features": 32, "model": model, "variables": variables, "loss_fn": loss_fn,
        "batch": batch, "optax": optax}
  exec(_block("ta_linen.TrainState.create"), ns)
  state = ns["state"]
  assert isinstance(state, ta_linen.TrainState) and int(state.step) == 1
  assert np.isfinite(float(ns["loss"]))
  assert "_overwrite_with_gradient" in ns["layer"].init(jax.random.PRNGKey(1), batch[0])


def test_nnx_block():
  import optax
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(32, 64, rngs=rngs)
      self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
      return self.down(nnx.relu(self.up(x)))

  model, batch = Model(nnx.Rngs(0)), _batch()

  def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  before = np.asarray(model.up.kernel[...]).copy()
  ns = {"ta": ta, "model": model, "loss_fn": loss_fn, "batch": batch, "optimizer": optimizer}
  exec(_block("ta_nnx.update_recipe_state(model, state_grads)"), ns)
  report = ns["report"]
  assert sorted(report.quantized) == ["down", "up"], report
  # Below the size threshold: the report says these will run in high precision here.
  assert sorted(report.high_precision) == ["down", "up"], report
  assert np.isfinite(float(ns["loss"]))
  assert not np.array_equal(np.asarray(model.up.kernel[...]), before)  # the optimizer stepped


def test_haiku_block():
  hk = pytest.importorskip("haiku")

  def forward(x):
    return hk.Linear(16)(jax.nn.relu(hk.Linear(64)(x)))

  batch = _batch()

  def loss_fn(params, state, batch):
    x, y = batch
    out, state = ns["model"].apply(params, state, None, x)
    return jnp.mean((out - y) ** 2), state

  ns = {"ta": ta, "forward": forward, "rng": jax.random.PRNGKey(0), "x": batch[0],
        "loss_fn": loss_fn, "batch": batch}
  exec(_block("ta_hk.value_grad_and_state(loss_fn)"), ns)
  assert np.isfinite(float(ns["loss"])) and ns["aux"] is None
  assert jax.tree.structure(ns["param_grads"]) == jax.tree.structure(ns["params"])


def test_scale_out_block_on_four_devices():
  """The FSDP + tensor-parallel example on a 2x2 mesh of this process's devices (the suite runs
  with 8 CPU devices): its weight gradient equals the one-device computation's."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
  ns = {"x": x, "w": w}
  exec(_block('kernel_all_gather=P("fsdp", None)'), ns)
  want = jax.grad(lambda w: jnp.sum(core.dot_general(
      x, w, (((2,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling())), argnums=0)(w)
  got = ns["grads"]
  assert got.shape == w.shape and len(got.sharding.device_set) == 4
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_formats_block_registers_a_format_that_runs():
  x, _ = _batch()
  ns = {"ta": ta, "jnp": jnp, "x": x, "w": jnp.ones((32, 16)) / 8}
  try:
    exec(_block("ta.core.register_format("), ns)
    recipe = ns["PowerOfTwoScaling"]()
    assert core.format_of(recipe).recipe_type is ns["PowerOfTwoScaling"]
    y = core.dot_general(x, ns["w"], (((1,), (0,)), ((), ())), recipe=recipe, threshold=None)
    want = np.asarray(x, np.float64) @ np.asarray(ns["w"], np.float64)
    assert np.linalg.norm(np.asarray(y) - want) / np.linalg.norm(want) < 0.1
    assert ns["y"].shape == (8, 16)
  finally:
    core.unregister_format(ns["PowerOfTwoScaling"])
