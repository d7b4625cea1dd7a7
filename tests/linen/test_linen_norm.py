"""Linen LayerNorm, LayerNormDenseGeneral and Softmax: TE's names and shapes, numerics against
float64, recipe state in an ordinary Linen training loop, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters import linen as ta_linen
from te_adapters.linen import OVERWRITE_WITH_GRADIENT
from tests.core.test_norm import _data, _inputs, _reference

DELAYED = ta.DelayedScaling(amax_history_len=4)
# Current scaling runs through every adapter in tests/test_norm_adapters_agree.py.
RECIPES = [DELAYED, ta.Float8BlockScaling()]


@pytest.mark.parametrize(
  "layernorm_type, zero_centered_gamma, names",
  [("layernorm", False, ["ln_bias", "scale"]), ("rmsnorm", True, ["scale"])],
)
def test_layer_norm_params_and_values(layernorm_type, zero_centered_gamma, names):
  x, g, b, _ = _inputs()
  layer = ta_linen.LayerNorm(
    layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma, epsilon=1e-5
  )
  variables = layer.init(jax.random.key(0), x)
  assert sorted(variables["params"]) == names
  init = 0.0 if zero_centered_gamma else 1.0
  np.testing.assert_array_equal(variables["params"]["scale"], np.full(128, init, np.float32))
  params = {"scale": g} | ({"ln_bias": b} if "ln_bias" in names else {})
  y = layer.apply({"params": params}, x)
  ref, _ = _reference(
    x,
    g,
    b if "ln_bias" in names else jnp.zeros_like(b),
    x,
    layernorm_type,
    zero_centered_gamma,
    1e-5,
  )
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_layer_norm_unknown_type():
  with pytest.raises(ValueError, match="layernorm_type must be one of"):
    ta_linen.LayerNorm(layernorm_type="batchnorm").init(jax.random.key(0), jnp.ones((2, 16)))


def test_layer_norm_dense_general_te_parameters():
  layer = ta_linen.LayerNormDenseGeneral((2, 16), use_bias=True, recipe=DELAYED, threshold=None)
  x = jnp.ones((4, 8, 32), jnp.bfloat16)
  variables = layer.init(jax.random.key(0), x)
  shapes = jax.tree_util.tree_map(jnp.shape, variables["params"])
  assert shapes == {"scale": (32,), "ln_bias": (32,), "kernel": (32, 2, 16), "bias": (2, 16)}
  state = variables[OVERWRITE_WITH_GRADIENT]
  assert sorted(state) == sorted(core.state_names(DELAYED))
  assert state["x_amax_history"].shape == (4,) and state["x_scale"].shape == (1,)
  z, ln_out = layer.apply(variables, x)
  assert z.shape == (4, 8, 2, 16) and z.dtype == jnp.bfloat16
  assert ln_out.shape == x.shape  # TE's default: return_layernorm_output=True


def _loop(recipe, x, dz, params, steps, lr=0.0, **fields):
  """An ordinary Linen loop: grads of the whole variable dict, params by SGD, the state
  collection replaced by its gradient."""
  layer = ta_linen.LayerNormDenseGeneral(
    256, recipe=recipe, threshold=None, return_layernorm_output=False, **fields
  )
  variables = layer.init(jax.random.key(0), x)
  variables = {**variables, "params": params}

  @jax.jit
  def step(variables):
    def loss(variables):
      z, ln_out = layer.apply(variables, x)
      assert ln_out is None
      return jnp.sum(z.astype(jnp.float32) * dz), z

    (_, z), grads = jax.value_and_grad(loss, has_aux=True)(variables)
    new = {
      "params": jax.tree_util.tree_map(
        lambda p, g: p - lr * g, variables["params"], grads["params"]
      )
    }
    if OVERWRITE_WITH_GRADIENT in grads:
      new[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
    return new, z, grads["params"]

  history = []
  for _ in range(steps):
    history.append(variables)
    variables, z, grads = step(variables)
  return variables, z, grads, history


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_layer_norm_dense_general_against_float64(recipe, rel):
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  params = {"scale": g, "ln_bias": b, "kernel": w}
  _, z, grads, _ = _loop(recipe, x, dz, params, steps=3)
  ref, (dx, dg, db, dw) = _reference(x, g, b, None, "layernorm", False, 1e-6, kernel=w, dz=dz)
  del dx
  errs = {
    "z": rel(z, ref),
    "dgamma": rel(grads["scale"], dg),
    "dbeta": rel(grads["ln_bias"], db),
    "dkernel": rel(grads["kernel"], dw),
  }
  assert errs["z"] < 0.05 and max(errs.values()) < 0.08, errs
  assert errs["z"] > 0.005 and errs["dkernel"] > 0.005, errs  # FP8, not float32


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_layer_norm_dense_general_with_bias_against_float64(recipe, rel):
  """use_bias=True (TE's ``bias``): the layer takes the fused path under every recipe, whose
  bias gradient is dz's float32 column sums from the pass that casts dz to FP8."""
  x, g, b, _ = _inputs()
  w, dz, c = _data([(128, 256), (4, 32, 256), (256,)], seed=1)
  params = {"scale": g, "ln_bias": b, "kernel": w, "bias": c}
  _, z, grads, _ = _loop(recipe, x, dz, params, steps=3, use_bias=True)
  ref, (_, dg, db, dw) = _reference(x, g, b, None, "layernorm", False, 1e-6, kernel=w, dz=dz)
  ref = ref + np.asarray(c, np.float64)
  errs = {
    "z": rel(z, ref),
    "dgamma": rel(grads["scale"], dg),
    "dbeta": rel(grads["ln_bias"], db),
    "dkernel": rel(grads["kernel"], dw),
  }
  assert errs["z"] < 0.05 and max(errs.values()) < 0.08, errs
  assert rel(grads["bias"], np.sum(np.asarray(dz, np.float64), axis=(0, 1))) < 1e-6
  layer = ta_linen.LayerNormDenseGeneral(
    256, recipe=recipe, threshold=None, use_bias=True, return_layernorm_output=False
  )
  variables = layer.init(jax.random.key(0), x)
  text = str(jax.make_jaxpr(lambda v: layer.apply(v, x)[0])(variables))
  # Fused: the norm runs inside the quantized GEMM rule, not as its own custom VJP.
  fused = "name=_quantized_gemms" in text and "name=_norm" not in text
  assert fused


def test_delayed_state_follows_training():
  # Three SGD steps: each step's x amax is the amax of the norm's output under that step's
  # parameters, and the history rolls them in.
  x, g, b, _ = _inputs()
  w, dz = _data([(128, 256), (4, 32, 256)], seed=1)
  params = {"scale": g, "ln_bias": b, "kernel": w}
  final, _, _, history = _loop(DELAYED, x, dz, params, steps=3, lr=1e-3)
  amaxes = [
    float(jnp.max(jnp.abs(core.layernorm(x, v["params"]["scale"], v["params"]["ln_bias"]))))
    for v in history
  ]
  assert len(set(amaxes)) == 3  # the parameters moved, and the amax with them
  state = final[OVERWRITE_WITH_GRADIENT]
  np.testing.assert_allclose(state["x_amax_history"], [0.0, *amaxes], rtol=1e-6)
  np.testing.assert_allclose(state["x_scale"], [448.0 / max(amaxes)], rtol=1e-6)
  assert np.all(np.asarray(state["grad_amax_history"][1:]) > 0)


def test_return_layernorm_output_and_bias_and_depth_scaling():
  x, g, b, _ = _inputs()
  x = x.astype(jnp.bfloat16)
  layer = ta_linen.LayerNormDenseGeneral(
    64, use_bias=True, depth_scaling=2.0, recipe=None, bias_init=jax.nn.initializers.ones
  )
  variables = layer.init(jax.random.key(0), x)
  z, ln_out = layer.apply(variables, x)
  p = variables["params"]
  np.testing.assert_array_equal(ln_out, core.layernorm(x, p["scale"], p["ln_bias"]))
  ref = (np.asarray(ln_out, np.float64) @ np.asarray(p["kernel"], np.float64) + 1.0) / 2.0
  np.testing.assert_allclose(np.asarray(z, np.float64), ref, rtol=2e-2, atol=2e-2)
  layer = layer.clone(return_layernorm_output=False)
  assert layer.apply(variables, x)[1] is None


def test_enable_layernorm_false_is_a_quantized_dense(rel):
  x, w = _data([(64, 128), (128, 64)])
  layer = ta_linen.LayerNormDenseGeneral(64, enable_layernorm=False, threshold=None)
  variables = layer.init(jax.random.key(0), x)
  assert sorted(variables["params"]) == ["kernel"]
  z, ln_out = layer.apply({"params": {"kernel": w}}, x)
  ref = np.float64(x) @ np.float64(w)
  assert 0.005 < rel(z, ref) < 0.05 and ln_out is x


@pytest.mark.parametrize(
  "fields, match",
  [
    ({"axis": 0}, "axis must be -1"),
    ({"layernorm_type": "groupnorm"}, "layernorm_type must be one of"),
    ({"features": 24}, "multiples of 16"),
  ],
)
def test_layer_norm_dense_general_bad_input(fields, match):
  layer = ta_linen.LayerNormDenseGeneral(**({"features": 32} | fields))
  with pytest.raises(ValueError, match=match):
    layer.init(jax.random.key(0), jnp.ones((4, 32)))


def test_softmax_module_is_the_core_softmax():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8, 8), jnp.bfloat16)
  mask = jnp.triu(jnp.ones((8, 8), jnp.uint8), 1)[None, None]
  sm = ta_linen.Softmax(scale_factor=0.25, softmax_fusion_type=core.SoftmaxFusionType.SCALED_MASKED)
  np.testing.assert_array_equal(
    sm.apply({}, x, mask),
    core.softmax(x, mask, scale_factor=0.25, softmax_fusion_type="scaled_masked"),
  )
  causal = ta_linen.Softmax(scale_factor=0.25, softmax_fusion_type="scaled_upper_triang_masked")
  np.testing.assert_array_equal(causal.apply({}, x), sm.apply({}, x, mask))


def test_te_axes_fields_annotate_the_parameters():
  # A TE-style model names logical axes; the parameters carry them (nn.LogicallyPartitioned)
  # and the output is the same as without them.
  import flax.linen as nn

  fields = {
    "scale_axes": ("embed",),
    "ln_bias_axes": ("embed",),
    "kernel_axes": ("embed", "mlp"),
    "bias_axes": ("mlp",),
    "layernorm_input_axes": ("batch", "length", "embed"),
    "dot_input_axes": ("batch", "length", "embed"),
    "transpose_batch_sequence": False,
  }
  x = _inputs()[0]
  plain = ta_linen.LayerNormDenseGeneral(64, use_bias=True, recipe=None)
  named = ta_linen.LayerNormDenseGeneral(64, use_bias=True, recipe=None, **fields)
  variables = named.init(jax.random.key(0), x)
  specs = nn.get_partition_spec(variables)["params"]
  P = jax.sharding.PartitionSpec
  assert specs == {
    "scale": P("embed"),
    "ln_bias": P("embed"),
    "kernel": P("embed", "mlp"),
    "bias": P("mlp"),
  }
  unboxed = nn.unbox(variables)
  z, ln_out = named.apply(variables, x)
  z_plain, ln_plain = plain.apply(unboxed, x)
  np.testing.assert_array_equal(z, z_plain)
  np.testing.assert_array_equal(ln_out, ln_plain)
  norm = ta_linen.LayerNorm(scale_axes=("embed",), bias_axes=("embed",))
  assert nn.get_partition_spec(norm.init(jax.random.key(0), x))["params"] == {
    "scale": P("embed"),
    "ln_bias": P("embed"),
  }


@pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts",
)
def test_dot_input_axes_constrain_the_norm_output_on_a_mesh():
  import flax.linen as nn

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((8, 4, 32))
  rules = (("batch", "data"), ("embed", None))
  specs = []
  for axes in (None, ("batch", None, "embed")):
    layer = ta_linen.LayerNormDenseGeneral(64, recipe=None, dot_input_axes=axes)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      variables = layer.init(jax.random.key(0), x)
      _, ln_out = jax.jit(layer.apply)(variables, x)
    specs.append(tuple(ln_out.sharding.spec))
  assert specs[0] in ((), (None, None, None)) and specs[1][0] == "data", specs


def test_stochastic_rounding_draws_from_sr_rng():
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  layer = ta_linen.LayerNormDenseGeneral(64, recipe=ta.NVFP4BlockScaling(), threshold=None)
  variables = jax.eval_shape(layer.init, jax.random.key(0), x)

  def loss(variables, **kwargs):
    return jnp.sum(layer.apply(variables, x, **kwargs)[0].astype(jnp.float32))

  # Traced, not compiled (NVFP4 compiles slowly on CPU): the key is drawn where it is given.
  grads = jax.eval_shape(lambda v: jax.grad(loss)(v, rngs={"sr_rng": jax.random.key(1)}), variables)
  assert grads["params"]["kernel"].shape == (64, 64)
  with pytest.raises(ValueError, match="sr_rng"):
    jax.eval_shape(jax.grad(loss), variables)
