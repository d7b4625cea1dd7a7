"""GemmConfig: the kernels a quantized GEMM runs on, chosen in code (no environment variables)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from te_adapters.core import formats, kernels
from tests.conftest import FP8_GEMM_RTOL

DN = (((1,), (0,)), ((), ()))


def test_defaults_and_bad_values():
  config = ta.GemmConfig()
  assert (config.backend, config.fp8_gemm, config.block_gemm) == ("auto", "auto", "auto")
  assert hash(config) == hash(ta.GemmConfig())  # a static argument under jit
  for field, bad in [
    ("backend", "triton"),
    ("fp8_gemm", "cublas"),
    ("block_gemm", "emulated"),
    ("layout", "nt"),
    ("output", "bf16"),
    ("transpose", "none"),
    ("amax", "cuda"),
  ]:
    with pytest.raises(ValueError, match=f"GemmConfig.{field} must be one of"):
      ta.GemmConfig(**{field: bad})
  x = jnp.ones((16, 32))
  with pytest.raises(TypeError, match="config must be a GemmConfig or None"):
    core.dot_general(x, x.T, DN, recipe=ta.Float8CurrentScaling(), config={"backend": "jax"})


def _train(recipe, config, steps=3):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 64)) * 3, jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 48)) * 0.1, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)

  def loss(x, w, state):
    y = core.dot_general(x, w, DN, recipe=recipe, state=state, threshold=None, config=config)
    return jnp.vdot(y, dy), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  state = core.init_state(recipe) or None
  for i in range(steps):
    (_, y), (dx, dw, new) = step(x * (1 + i), w, state)
    state = None if state is None else core.updated_state(state, new)
  return (y, dx, dw), state, (x * steps, w, dy)


@pytest.mark.parametrize(
  "recipe",
  [ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)],
  ids=["current", "delayed"],
)
@pytest.mark.parametrize(
  "config",
  [
    ta.GemmConfig(backend="jax"),
    ta.GemmConfig(fp8_gemm="xla"),
  ],
  ids=["jax", "xla-gemm"],
)
def test_every_choice_computes_the_same_step(recipe, config, rel):
  """Every configuration quantizes to the same values: outputs, gradients and state agree with
  the default's after several steps, and with float64 to FP8's accuracy."""
  got, got_state, (x, w, dy) = _train(recipe, config)
  want, want_state, _ = _train(recipe, ta.GemmConfig())
  # The same quantized values; on a GPU the GEMMs differ (cuBLASLt rounds its float32 sums once,
  # XLA's GEMM writes bfloat16 that is then rescaled), so the outputs agree to FP8_GEMM_RTOL.
  for a, b in zip(got, want, strict=True):
    assert rel(a, b) < FP8_GEMM_RTOL
  if want_state is not None:
    for name in want_state:
      np.testing.assert_array_equal(np.asarray(got_state[name]), np.asarray(want_state[name]))
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  # E4M3 forward (2**-4 relative per operand), E5M2 gradient under HYBRID only; the default
  # format is E4M3 everywhere: a wrong scale is off by O(1).
  assert rel(got[0], x64 @ w64) < 0.1
  assert rel(got[2], x64.T @ dy64) < 0.1


def test_native_gemm_is_refused_where_it_cannot_run():
  if kernels.cublas_gemm_available():
    pytest.skip("the extension's cuBLASLt GEMM runs here")
  x = jnp.ones((32, 64))
  w = jnp.ones((64, 32))
  with pytest.raises(RuntimeError, match="fp8_gemm='native', but"):
    core.dot_general(
      x,
      w,
      DN,
      recipe=ta.Float8CurrentScaling(),
      threshold=None,
      config=ta.GemmConfig(fp8_gemm="native"),
    )


@pytest.mark.parametrize(
  "recipe", [ta.MXFP8BlockScaling(), ta.Float8BlockScaling()], ids=["mxfp8", "float8_block"]
)
def test_native_block_gemm_is_refused_where_it_cannot_run(recipe):
  if isinstance(recipe, ta.MXFP8BlockScaling):
    if formats.native_gemm_available("mxfp8"):
      pytest.skip("jax.nn.scaled_matmul runs MXFP8 here")
  elif kernels.cublas_gemm_available():
    pytest.skip("cuBLASLt's block-scaled GEMM runs here")
  x = jnp.ones((128, 128))
  with pytest.raises(RuntimeError, match="block_gemm='native', but"):
    core.dot_general(
      x, x, DN, recipe=recipe, threshold=None, config=ta.GemmConfig(block_gemm="native")
    )


@pytest.mark.parametrize(
  "field, value",
  [
    ("layout", "xla"),
    ("output", "f32"),
    ("transpose", "fp8"),
    ("amax", "ffi"),
  ],
)
def test_measurement_only_fields_are_deprecated_and_change_nothing(field, value, rel):
  """The measurement-only choices of earlier releases still construct, with a DeprecationWarning
  naming the field, and the step they configure is the default's, bit for bit."""
  with pytest.warns(DeprecationWarning, match=f"GemmConfig.{field} is deprecated"):
    config = ta.GemmConfig(**{field: value})
  recipe = ta.DelayedScaling(amax_history_len=4)
  got, got_state, _ = _train(recipe, config)
  want, want_state, _ = _train(recipe, ta.GemmConfig())
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name in want_state:
    np.testing.assert_array_equal(np.asarray(got_state[name]), np.asarray(want_state[name]))


@pytest.mark.parametrize(
  ("field", "value"),
  [
    ("comm_sm_margin", -1),
    ("comm_sm_margin", 8.0),
    ("comm_sm_margin", True),
    ("comm_sm_margin", "8"),
    ("sum_chunks", 0),
    ("sum_chunks", 2.0),
    ("sum_chunks", False),
    ("fold_amax", 1),
    ("fold_amax", None),
    ("device_sums", "ring"),
    ("device_sums", None),
  ],
)
def test_mesh_levers_refuse_bad_values(field, value):
  default = core.GemmConfig()
  assert (default.comm_sm_margin, default.sum_chunks, default.fold_amax) == (None, 1, False)
  assert default.device_sums == "collective"
  with pytest.raises(ValueError, match=f"GemmConfig.{field} must be"):
    core.GemmConfig(**{field: value})
  config = core.GemmConfig(comm_sm_margin=16, sum_chunks=4)  # hashable, a static argument
  assert hash(config) == hash(core.GemmConfig(comm_sm_margin=16, sum_chunks=4))
