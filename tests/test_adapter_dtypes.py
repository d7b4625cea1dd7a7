"""One input-dtype rule for every adapter (``core.check_input_dtype``), and Haiku's ``Linear``
with ``hk.Linear``'s own constructor."""

import inspect

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

CURRENT = ta.Float8CurrentScaling()
RULE = r"needs real floating-point inputs \(input dtype int32 is not real floating point\)"


def test_refusal_of_each_dtype():
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
    assert core.input_dtype_refusal(dtype) is None
  for dtype in (jnp.int32, jnp.bool_, jnp.complex64):
    want = f"input dtype {np.dtype(dtype)} is not real floating point"
    assert core.input_dtype_refusal(dtype) == want
  core.check_input_dtype(None, jnp.int32, "layer")  # no recipe: no rule
  with pytest.raises(TypeError, match="layer: a quantized layer " + RULE):
    core.check_input_dtype(CURRENT, jnp.int32, "layer")


def test_every_adapter_refuses_complex_inputs_with_the_same_error():
  # Flax promotes the inputs with the float32 parameters (complex stays complex; Flax itself
  # refuses integer layer dtypes); Haiku creates its parameters in the inputs' dtype, so it
  # refuses before creating them.
  x = jnp.ones((4, 32), jnp.complex64)
  rule = RULE.replace("int32", "complex64")
  layer = ta_linen.Dense(16, recipe=CURRENT)
  with pytest.raises(TypeError, match=rule):
    layer.init(jax.random.key(0), x)
  nnx_layer = ta_nnx.Linear(32, 16, recipe=CURRENT, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=rule):
    nnx_layer(x)
  f = hk.transform_with_state(lambda x: ta_hk.Linear(16, recipe=CURRENT)(x))
  with pytest.raises(TypeError, match="linear: a quantized layer " + rule):
    f.init(jax.random.key(0), x)
  f_int = hk.transform_with_state(lambda x: ta_hk.Linear(16, recipe=CURRENT)(x))
  with pytest.raises(TypeError, match="linear: a quantized layer " + RULE):
    f_int.init(jax.random.key(0), x.real.astype(jnp.int32))
  # Without a recipe there is no rule: the frameworks' own layers run complex inputs.
  plain = ta_linen.Dense(16, recipe=None)
  assert plain.apply(plain.init(jax.random.key(0), x), x).dtype == jnp.complex64


def test_haiku_conversion_skips_integer_inputs_with_the_rule_as_its_reason():
  q = ta_hk.quantize(CURRENT)

  def model(x):
    # The second layer gets integer inputs: it stays hk.Linear (integer parameters).
    integer = hk.Linear(16, w_init=hk.initializers.Constant(1))(x)
    return hk.Linear(16)(x.astype(jnp.float32)) + integer

  f = hk.transform(q(model))
  with pytest.warns(UserWarning, match="input dtype int32 is not real floating point"):
    params = f.init(jax.random.key(0), jnp.ones((4, 32), jnp.int32))
  assert params["linear"]["w"].dtype == jnp.int32
  assert q.report.quantized == ["linear_1"]
  assert q.report.skipped == {"linear": "input dtype int32 is not real floating point"}


def test_haiku_linear_takes_hk_linear_constructor_unchanged():
  ours = list(inspect.signature(ta_hk.Linear).parameters)
  theirs = list(inspect.signature(hk.Linear).parameters)
  assert ours[: len(theirs)] == theirs
  assert ours[len(theirs) :] == [
    "recipe",
    "threshold",
    "amax_axes",
    "kernel_all_gather",
    "config",
    "enable_low_rank_adaptation",
    "low_rank_adaptation_dim",
    "low_rank_adaptation_alpha",
  ]

  def make(cls, **kw):
    # Positional with_bias=False and a named initializer, as hk.Linear takes them.
    return cls(16, False, w_init=hk.initializers.Constant(0.5), name="proj", **kw)

  x = jnp.arange(4 * 32, dtype=jnp.float32).reshape(4, 32) / 100
  ref = hk.transform(lambda x: make(hk.Linear)(x))
  got = hk.transform_with_state(lambda x: make(ta_hk.Linear, recipe=None)(x))
  p_ref = ref.init(jax.random.key(0), x)
  p_got, state = got.init(jax.random.key(0), x)
  assert jax.tree.map(np.asarray, p_ref).keys() == p_got.keys() == {"proj"}
  assert set(p_got["proj"]) == {"w"} and state == {}
  np.testing.assert_array_equal(p_got["proj"]["w"], p_ref["proj"]["w"])
  np.testing.assert_array_equal(got.apply(p_got, state, None, x)[0], ref.apply(p_ref, None, x))
  with pytest.raises(TypeError, match="recipx"):
    ta_hk.Linear(16, recipx=None)
