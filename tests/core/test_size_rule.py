"""The size rule and its one documented difference (docs/guide/adapters.md, "One size rule").

A quantized *layer* (and a conversion) refuses a GEMM whose contracting size K or output size N
is not a multiple of 16 (``core.gemm_dims_refusal``, as TE asserts), when it is built; so do the
core functions that take a layer's parameters (``layernorm_mlp``, ``ragged_dot``).
``core.dot_general`` is a drop-in ``lax.dot_general`` for any dimension numbers and quantizes any
K and N its format can tile (the per-tensor and rowwise formats: every size; XLA pads the FP8
GEMM, and on Hopper runs it where the extension's cuBLASLt GEMM, which needs multiples of 16,
cannot). Both are asserted here, so neither drifts unnoticed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core, inspect

DN = (((1,), (0,)), ((), ()))
RECIPES = [ta.DelayedScaling(), ta.Float8CurrentScaling(), ta.Float8RowwiseScaling()]
IDS = [type(r).__name__ for r in RECIPES]


def _fp8_model(x, w, recipe):
  """float64 product of the operands as the recipe quantizes them (E4M3, per tensor or row)."""
  qx = core.quantize(x, recipe=recipe, role="x")
  qw = core.quantize(jnp.swapaxes(w, 0, 1), recipe=recipe, role="kernel")
  dx = np.asarray(core.dequantize(qx, jnp.float32), np.float64)
  dw = np.asarray(core.dequantize(qw, jnp.float32), np.float64)
  return dx @ dw.T


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_dot_general_quantizes_sizes_the_layers_refuse(recipe):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((24, 50)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((50, 40)) / 7, jnp.float32)
  assert core.gemm_dims_refusal(50, 40) == "GEMM size K=50, N=40 is not a multiple of 16"
  state = core.init_state(recipe) or None

  def f(x, w):
    return core.dot_general(x, w, DN, recipe=recipe, state=state, threshold=None)

  assert inspect.count_fp8_dot_generals(f, x, w) == (1, 1)  # in FP8, not a silent fallback
  y = np.asarray(f(x, w), np.float64)
  want = _fp8_model(x, w, recipe) if state is None else None
  if want is not None:
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.08


def test_every_layer_refuses_them_with_one_message():
  from flax import nnx

  from te_adapters import linen as ta_linen
  from te_adapters import nnx as ta_nnx

  message = (
    r"FP8 GEMMs need the contracting size K and the output-feature size N to be "
    r"multiples of 16, got K=50, N=40"
  )
  with pytest.raises(ValueError, match=message):
    ta_nnx.Linear(50, 40, recipe=ta.Float8CurrentScaling(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    ta_linen.Dense(40, recipe=ta.Float8CurrentScaling()).init(
      jax.random.PRNGKey(0), jnp.ones((2, 50))
    )
  hk = pytest.importorskip("haiku")
  from te_adapters import haiku as ta_hk

  model = hk.transform(lambda x: ta_hk.Linear(40, recipe=ta.Float8CurrentScaling())(x))
  with pytest.raises(ValueError, match=message):
    model.init(jax.random.PRNGKey(0), jnp.ones((2, 50)))


def test_every_experts_layer_refuses_them_naming_the_layer():
  from flax import linen as nn
  from flax import nnx

  from te_adapters import linen as ta_linen
  from te_adapters import nnx as ta_nnx

  recipe, x, gs = ta.Float8CurrentScaling(), jnp.ones((4, 50)), jnp.array([2, 2], jnp.int32)
  rule = r"FP8 GEMMs need the contracting size K and the output-feature size N to be multiples"
  with pytest.raises(ValueError, match=rf"^GroupedLinear\(2, 50, 40\): {rule}"):
    ta_nnx.GroupedLinear(2, 50, 40, recipe=recipe, rngs=nnx.Rngs(0))

  class Experts(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("kernel", nn.initializers.zeros_init(), (2, 50, 40))
      return ta_linen.make_ragged_dot_cls(recipe)(name="experts")(x, w, gs)

  with pytest.raises(ValueError, match=rf"^layer 'experts' with rhs \(2, 50, 40\): {rule}"):
    Experts().init(jax.random.PRNGKey(0), x)
  hk = pytest.importorskip("haiku")
  from te_adapters import haiku as ta_hk

  model = hk.transform_with_state(lambda x: ta_hk.GroupedLinear(2, 40, recipe=recipe)(x, gs))
  with pytest.raises(ValueError, match=rf"^layer 'grouped_linear' with rhs \(2, 50, 40\): {rule}"):
    model.init(jax.random.PRNGKey(0), x)


GROUPED = [
  ta.DelayedScaling(),
  ta.Float8CurrentScaling(),
  ta.MXFP8BlockScaling(),
  ta.Float8RowwiseScaling(),
]


@pytest.mark.parametrize("recipe", GROUPED, ids=[type(r).__name__ for r in GROUPED])
def test_ragged_dot_applies_the_layer_rule_under_every_recipe(recipe):
  # MXFP8's and the rowwise format's grouped GEMMs could run N=40 forward; the layer rule
  # refuses it all the same, naming the layer where the caller says which.
  state = core.init_ragged_state(recipe, 2) or None
  x, w, gs = jnp.ones((32, 64)), jnp.ones((2, 64, 40)), jnp.array([16, 16], jnp.int32)
  with pytest.raises(ValueError, match=r"^layer 'moe/experts' with rhs \(2, 64, 40\): .*got N=40"):
    core.ragged_dot(x, w, gs, recipe=recipe, state=state, layer="layer 'moe/experts'")
  assert core.ragged_dot(x, w, gs, recipe=None).shape == (32, 40)  # high precision: any size


def test_core_functions_over_layer_parameters_apply_the_layer_rule():
  x = jnp.ones((32, 48))
  with pytest.raises(ValueError, match="multiples of 16"):
    core.ragged_dot(
      x, jnp.ones((2, 48, 40)), jnp.array([16, 16], jnp.int32), recipe=ta.Float8CurrentScaling()
    )
  with pytest.raises(ValueError, match="multiples of 16"):
    core.layernorm_mlp(
      x,
      jnp.ones(48),
      jnp.zeros(48),
      jnp.ones((48, 1, 40)),
      jnp.ones((40, 48)),
      recipe=ta.Float8CurrentScaling(),
      threshold=None,
    )
