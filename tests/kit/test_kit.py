"""The adapters' kit: the GEMM options, the rounding-key policy, recipe state by TE's names, TE's
LayerNormDenseGeneral forward and LoRA term, and the kit's independence from the frameworks."""

import ast
import dataclasses
import inspect
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import _kit as kit
from te_adapters import core

DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
NVFP4 = ta.NVFP4BlockScaling()


def _rand(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def _rel(actual, reference) -> float:
  a, r = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
  return float(np.linalg.norm(a - r) / np.linalg.norm(r))


# GemmOptions


def test_gemm_options_defaults_are_every_adapters():
  options = kit.GemmOptions()
  assert options.threshold is core.DEFAULT_THRESHOLD
  assert options.amax_axes is None and options.kernel_all_gather is None
  assert options.config == core.GemmConfig()  # None is kept as the default config


def test_gemm_options_refuse_a_bad_threshold_and_config():
  with pytest.raises(TypeError, match="threshold must be a te_adapters.core.SizeThreshold or None"):
    kit.GemmOptions(threshold=1024)
  with pytest.raises(TypeError, match="config must be a GemmConfig or None, got str"):
    kit.GemmOptions(config="cublas")
  config = core.GemmConfig(backend="jax")
  assert kit.GemmOptions(threshold=None, config=config).config is config


def test_gemm_options_are_frozen_and_hashable():
  options = kit.GemmOptions(threshold=None, amax_axes=("dp",))
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.threshold = core.DEFAULT_THRESHOLD
  # NNX keys its jit cache on static attributes: equal options hash equal.
  assert hash(options) == hash(kit.GemmOptions(threshold=None, amax_axes=("dp",)))
  assert options != kit.GemmOptions(threshold=None, amax_axes=("tp",))


def test_gemm_options_keywords_are_what_the_core_takes():
  config = core.GemmConfig(backend="jax")
  options = kit.GemmOptions(
    threshold=None, amax_axes="dp", kernel_all_gather=("fsdp",), config=config
  )
  assert options.keywords() == {
    "threshold": None,
    "amax_axes": "dp",
    "kernel_all_gather": ("fsdp",),
    "config": config,
  }
  dot_general = inspect.signature(core.dot_general).parameters
  assert set(options.keywords()) <= set(dot_general)
  fused = kit.GemmOptions(threshold=None, config=config).keywords(spmd=False)
  assert fused == {"threshold": None, "config": config}
  for f in (core.layernorm_dense, core.layernorm_mlp):
    assert set(fused) <= set(inspect.signature(f).parameters)
  with pytest.raises(ValueError, match="amax_axes and kernel_all_gather go to core.dot_general"):
    options.keywords(spmd=False)
  # The fused functions take kernel_all_gather (FSDP) too, not amax_axes.
  gathered = kit.GemmOptions(threshold=None, kernel_all_gather=("fsdp",), config=config)
  assert gathered.fused_keywords() == {
    "threshold": None,
    "kernel_all_gather": ("fsdp",),
    "config": config,
  }
  for f in (core.layernorm_dense, core.layernorm_mlp):
    assert set(gathered.fused_keywords()) <= set(inspect.signature(f).parameters)
  with pytest.raises(ValueError, match="amax_axes goes to core.dot_general only"):
    options.fused_keywords()


def test_option_attributes_read_the_options():
  class Layer(kit.GemmOptionAttributes):
    def __init__(self, **options):
      self.options = kit.GemmOptions(**options)

  config = core.GemmConfig(backend="jax")
  layer = Layer(threshold=None, amax_axes="dp", kernel_all_gather=("fsdp",), config=config)
  assert (layer.threshold, layer.amax_axes, layer.kernel_all_gather, layer.config) == (
    None,
    "dp",
    ("fsdp",),
    config,
  )
  assert Layer().threshold is core.DEFAULT_THRESHOLD and Layer().config == core.GemmConfig()
  with pytest.raises(AttributeError):
    layer.threshold = core.DEFAULT_THRESHOLD  # one place holds the options: read-only


def test_spmd_options_need_a_recipe():
  for given in ({"amax_axes": "dp"}, {"kernel_all_gather": ("fsdp",)}):
    with pytest.raises(ValueError, match="^Dense: amax_axes and kernel_all_gather need a recipe$"):
      kit.check_needs_recipe(None, "Dense", **given)
    kit.check_needs_recipe(CURRENT, "Dense", **given)
  kit.check_needs_recipe(None, "Dense")


# The rounding-key policy


class _Draws:
  def __init__(self, key):
    self.key, self.calls = key, 0

  def __call__(self):
    self.calls += 1
    return self.key


@pytest.mark.parametrize(
  "recipe", [None, CURRENT, DELAYED, ta.NVFP4BlockScaling(disable_stochastic_rounding=True)]
)
def test_a_recipe_that_does_not_round_stochastically_draws_nothing(recipe):
  draw = _Draws(jax.random.key(0))
  assert kit.rounding_key(recipe, draw, "how, ") is None
  assert draw.calls == 0  # drawing advances a framework's stream: never for nothing


def test_a_recipe_that_rounds_stochastically_draws_one_key_per_call():
  draw = _Draws(jax.random.key(7))
  assert kit.rounding_key(NVFP4, draw, "how, ") is draw.key
  assert kit.rounding_key(NVFP4, draw, "how, ") is draw.key
  assert draw.calls == 2


def test_no_key_to_draw_is_an_error_with_the_way_out():
  with pytest.raises(ValueError) as info:
    kit.rounding_key(
      NVFP4, lambda: None, " and needs a key from the stream 'x': pass one, ", where="layer: "
    )
  assert str(info.value) == (
    "layer: NVFP4BlockScaling rounds the gradient stochastically and needs a key from the "
    "stream 'x': pass one, or use disable_stochastic_rounding=True"
  )
  assert str(info.value) == kit.missing_key_message(
    NVFP4, " and needs a key from the stream 'x': pass one, ", "layer: "
  )
  assert kit.SR_RNG == "sr_rng"  # TE's stream name


# Recipe state by TE's names


def test_initial_state_is_the_cores():
  state = kit.initial_state(DELAYED)
  assert tuple(state) == core.state_names(DELAYED)
  for name, value in core.init_state(DELAYED).items():
    np.testing.assert_array_equal(state[name], value)
  grouped = kit.initial_state(DELAYED, n_groups=3)
  assert grouped["x_scale"].shape == (3, 1) and grouped["grad_amax_history"].shape == (3, 4)
  assert dict(kit.initial_state(None)) == {} and dict(kit.initial_state(CURRENT)) == {}
  # Stateless recipes have no grouped state, including those the grouped GEMM does not run.
  assert dict(kit.initial_state(ta.Float8BlockScaling(), n_groups=3)) == {}


def test_recipe_state_declares_each_entry_once_in_order():
  calls = []

  def variable(name, value):
    calls.append(name)
    return value + 1.0  # the framework's current value, not the initial one

  state = kit.recipe_state(DELAYED, variable)
  assert calls == list(core.state_names(DELAYED)) == list(state)
  np.testing.assert_array_equal(state["x_scale"], np.full((1,), 2.0, np.float32))
  assert kit.recipe_state(CURRENT, variable) is None and kit.recipe_state(None, variable) is None
  assert len(calls) == 6
  grouped = kit.recipe_state(DELAYED, lambda name, value: value, n_groups=2)
  assert grouped["kernel_amax_history"].shape == (2, 4)


# TE's LayerNormDenseGeneral


def _ln_ref(x, gamma, beta, eps=1e-6):
  x = np.float64(x)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * np.float64(gamma) + np.float64(beta)


X = _rand((8, 32), 0)
KERNEL = _rand((32, 2, 16), 1, 0.2)
BIAS = _rand((2, 16), 2)
GAMMA, BETA = 1.0 + _rand((32,), 3, 0.1), _rand((32,), 4, 0.1)


def test_without_the_norm_the_layer_is_a_dense_gemm():
  ref = np.einsum("mk,kbn->mbn", np.float64(X), np.float64(KERNEL)) + np.float64(BIAS)
  # recipe=None: a float32 GEMM, kept float32 on GPUs too (their default is TF32's products).
  with jax.default_matmul_precision("float32"):
    z, ln_out = kit.layernorm_dense_general(
      X, None, None, KERNEL, BIAS, enable_layernorm=False, depth_scaling=4.0, recipe=None
    )
  assert z.shape == (8, 2, 16) and z.dtype == X.dtype
  assert _rel(z, ref / 4.0) < 1e-6
  assert ln_out is X  # the GEMM's input, returned as TE's ln_out
  z, ln_out = kit.layernorm_dense_general(
    X,
    None,
    None,
    KERNEL,
    enable_layernorm=False,
    return_layernorm_output=False,
    recipe=CURRENT,
    threshold=None,
  )
  assert ln_out is None
  assert _rel(z, ref - np.float64(BIAS)) < 0.08  # FP8 (current scaling) against float64
  quantized = core.dot_general(
    X,
    KERNEL,
    (((1,), (0,)), ((), ())),
    recipe=CURRENT,
    threshold=None,
    preferred_element_type=X.dtype,
  )
  np.testing.assert_array_equal(z, quantized)


def test_with_the_norm_the_layer_is_the_cores_layernorm_dense():
  normed = _ln_ref(X, GAMMA, BETA)
  ref = np.einsum("mk,kbn->mbn", normed, np.float64(KERNEL)) + np.float64(BIAS)
  with jax.default_matmul_precision("float32"):  # as above: float32 products on GPUs too
    z, ln_out = kit.layernorm_dense_general(
      X, GAMMA, BETA, KERNEL, BIAS, depth_scaling=2.0, recipe=None
    )
  assert _rel(z, ref / 2.0) < 1e-5 and _rel(ln_out, normed) < 1e-5
  z, ln_out = kit.layernorm_dense_general(
    X,
    GAMMA,
    BETA,
    KERNEL,
    recipe=DELAYED,
    state=core.init_state(DELAYED),
    threshold=None,
    return_layernorm_output=False,
  )
  core_z, _ = core.layernorm_dense(
    X, GAMMA, BETA, KERNEL, recipe=DELAYED, state=core.init_state(DELAYED), threshold=None
  )
  assert ln_out is None
  np.testing.assert_array_equal(z, core_z)


def test_each_constraint_applies_where_te_applies_it():
  seen = []

  def tag(name):
    def constraint(x):
      seen.append((name, x.shape))
      return x

    return constraint

  common = dict(
    layernorm_input_constraint=tag("layernorm_input"),
    dot_input_constraint=tag("dot_input"),
    recipe=None,
  )
  kit.layernorm_dense_general(X, GAMMA, BETA, KERNEL, **common)
  assert [name for name, _ in seen] == ["layernorm_input", "dot_input"]
  seen.clear()
  # Without the norm the GEMM's input is the layer's: only its constraint applies.
  kit.layernorm_dense_general(X, None, None, KERNEL, enable_layernorm=False, **common)
  assert seen == [("dot_input", X.shape)]


# TE's LoRA term


def test_add_lora_against_float64():
  a, b, y = _rand((32, 4), 5, 0.2), _rand((4, 48), 6, 0.2), _rand((8, 48), 7).astype(jnp.bfloat16)
  out = kit.add_lora(y, X, a, b, state=None, kernel_shape=(32, 48), alpha=8.0)
  ref = np.float64(y) + np.float64(X) @ np.float64(a) @ np.float64(b) * (8.0 / 4)
  assert out.dtype == jnp.bfloat16
  assert _rel(out, ref) < 1e-2  # bfloat16 output
  promoted = []

  def promote(*arrays):
    promoted.append(len(arrays))
    return tuple(x.astype(jnp.bfloat16) for x in arrays)

  kit.add_lora(y, X, a, b, state=None, kernel_shape=(32, 48), promote=promote)
  assert promoted == [3]


def test_add_lora_watches_the_base_gemms_state():
  a, b = _rand((32, 4), 5, 0.2), _rand((4, 48), 6, 0.2)
  state = core.init_state(DELAYED)

  def loss(a, state, threshold):
    y = jnp.zeros((8, 48))
    return kit.add_lora(y, X, a, b, state=state, kernel_shape=(32, 48), threshold=threshold).sum()

  # The factor is differentiated and the state is not, with the base GEMM in FP8: told so.
  with pytest.warns(core.FrozenStateWarning):
    jax.grad(loss)(a, state, None)
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FrozenStateWarning)
    jax.grad(loss)(a, None, None)  # no recipe state: nothing to freeze
    jax.grad(loss, argnums=(0, 1))(a, state, None)


# Argument checks and signatures


def test_argument_checks():
  assert kit.check_recipe_or_none(None) is None
  assert kit.check_recipe_or_none(DELAYED) is DELAYED
  with pytest.raises(TypeError, match="write DelayedScaling()"):
    kit.check_recipe_or_none(ta.DelayedScaling)
  kit.check_layernorm_type("rmsnorm", "LayerNorm")
  with pytest.raises(ValueError, match=r"^LayerNormMLP: layernorm_type must be one of "):
    kit.check_layernorm_type("batchnorm", "LayerNormMLP")


def test_signature_with_keywords():
  def parent(self, features, *, use_bias=True, name=None):
    pass

  def own(self, *args, recipe=CURRENT, threshold=None, **kwargs):
    pass

  sig = kit.signature_with_keywords(parent, own)
  assert list(sig.parameters) == ["self", "features", "use_bias", "name", "recipe", "threshold"]
  assert sig.parameters["recipe"].default is CURRENT
  assert sig.parameters["threshold"].kind is inspect.Parameter.KEYWORD_ONLY


# The kit's place in the package


KIT = pathlib.Path(kit.__file__).parent


def test_the_kit_imports_no_framework_and_only_the_cores_public_names():
  for path in KIT.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
        if node.module == "te_adapters":
          names = [f"te_adapters.{alias.name}" for alias in node.names]
      else:
        continue
      for name in names:
        assert name.split(".")[0] not in ("flax", "haiku"), f"{path.name} imports {name}"
        if name.startswith("te_adapters."):
          assert name == "te_adapters.core" or name.startswith("te_adapters._kit"), (
            f"{path.name} imports {name}"
          )


def test_importing_the_kit_loads_no_framework():
  code = (
    "import sys, te_adapters._kit; print(sorted(m for m in ('flax', 'haiku') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
