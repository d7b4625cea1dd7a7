"""bench/llama (the Llama-style decoder's benchmark) at its CPU configuration: each conversion puts
every projection GEMM of the model in FP8 (the head and attention stay bf16), and training through
the conversion lowers the loss as bf16 training does, step for step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.llama import model as model_lib
from bench.llama import train
from te_adapters import inspect

CFG = model_lib.CONFIGS["cpu"]
FP8 = {"float8_e4m3fn", "float8_e5m2"}


@pytest.fixture(scope="module")
def tokens():
  return train.token_data(CFG)[0]


@pytest.mark.parametrize(
  "variant,remat",
  [
    ("nnx-current", None),
    ("linen-delayed", "gemm_outputs"),
    ("haiku-current", "gemm_outputs"),
    ("nnx-modules-current", "gemm_outputs"),
  ],
)
def test_converted_model_gemms_are_fp8(variant, remat, tokens):
  # With the benchmark's rematerialisation policy too: it recomputes no GEMM, so the counts hold.
  cfg = dataclasses.replace(CFG, remat=remat)
  sample = jnp.asarray(train.batch(tokens, cfg, 0, 0))
  trainer = train.make_trainer(cfg, variant, 0, sample)
  pairs = inspect.dot_general_operand_dtypes(trainer.step, trainer.carry, sample)
  fp8 = [p for p in pairs if set(p) <= FP8]
  rest = [p for p in pairs if p not in fp8]
  # The scanned layer's four projections (QKV, attention out, gate-and-up, down), forward, dgrad
  # and wgrad; the head's three GEMMs and attention's batched ones (forward 2, backward 4) not:
  # bf16, but for the two gradients of XLA's attention scores (computed in float32). On a GPU the
  # attention is cuDNN's, a custom call with no GEMM in the jaxpr: the head's three remain.
  assert len(fp8) == 12, pairs
  if jax.default_backend() == "gpu":
    assert sorted(rest) == [("bfloat16", "bfloat16")] * 3, rest
  else:
    assert sorted(rest) == [("bfloat16", "bfloat16")] * 7 + [("float32", "bfloat16")] * 2, rest
  # The converted modules, each a stack of the scanned layers.
  assert trainer.quantized == (3 if variant.startswith("nnx-modules") else 4)


def test_fp8_training_lowers_the_loss_as_bf16_does(tokens):
  cfg = dataclasses.replace(CFG, layers=1)
  runs = {
    v: train.run_variant(cfg, v, tokens, warmup=1, windows=1, window_steps=4)
    for v in ("nnx-bf16", "nnx-current")
  }
  bf16, fp8 = np.array(runs["nnx-bf16"]["losses"]), np.array(runs["nnx-current"]["losses"])
  assert runs["nnx-current"]["fp8_gemms"] == 12 and runs["nnx-bf16"]["fp8_gemms"] == 0
  # From ln(512) = 6.24 nats; no learning would stay there.
  assert bf16[0] > 6.0 and bf16[-1] < bf16[0] - 1.0, bf16
  # Same parameters and batches: FP8's losses follow bf16's within 1%, at every step.
  np.testing.assert_allclose(fp8, bf16, rtol=1e-2)
