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
from te_adapters.core import kernels

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
  # and wgrad; the head's three GEMMs and attention's batched ones not (see _unquantized_dots).
  assert len(fp8) == 12, pairs
  assert sorted(rest) == _unquantized_dots(), rest
  # The converted modules, each a stack of the scanned layers.
  assert trainer.quantized == (3 if variant.startswith("nnx-modules") else 4)


def _unquantized_dots() -> list[tuple[str, str]]:
  """The step's dots left in high precision: the head's three GEMMs (bf16), and where XLA runs
  the attention, its batched ones (forward 2, backward 4: bf16, but for the two gradients of the
  attention scores, computed in float32). On a GPU the attention is cuDNN's, a custom call with no
  GEMM in the jaxpr: the head's three remain."""
  if model_lib.attention_implementation() == "cudnn":
    return [("bfloat16", "bfloat16")] * 3
  return [("bfloat16", "bfloat16")] * 7 + [("float32", "bfloat16")] * 2


@pytest.fixture
def hopper_gemm(monkeypatch):
  """The GEMM's Hopper branch, traced here: the extension's cuBLASLt FP8 GEMM (an FFI call) where
  XLA's FP8 dot runs elsewhere. The tests only trace it (the CPU extension has no GEMM)."""
  monkeypatch.setattr(kernels, "cublas_gemm_available", lambda: True)


def _dots_and_custom_vjps(prim, *_, **__):
  # The benchmark's policy before it named the extension's GEMM.
  return prim.name == "dot_general" or prim.name.startswith("custom_vjp")


def _extension_gemms(fn, *args) -> int:
  closed = jax.make_jaxpr(fn)(*args)
  return sum(
    e.primitive.name == "ffi_call" for e in inspect.equations(closed) if inspect._is_gemm(e)
  )


@pytest.mark.parametrize(
  "variant,policy,expected",
  [
    ("linen-delayed", None, 12),
    ("haiku-current", None, 12),
    ("nnx-modules-current", None, 12),
    # A GPU's count before the fix (two H100s): JAX's remat policies see the extension's GEMM as
    # an ffi_call, not a dot_general, so three forward GEMMs (QKV, attention out, gate-and-up:
    # their outputs feed the recomputed layer; the down projection's only the carry) ran again in
    # the backward pass.
    ("linen-delayed", _dots_and_custom_vjps, 15),
  ],
)
def test_remat_policy_saves_the_extension_gemms_outputs(
  hopper_gemm, monkeypatch, tokens, variant, policy, expected
):
  if policy is not None:
    monkeypatch.setattr(model_lib, "save_gemm_outputs", policy)
  cfg = dataclasses.replace(CFG, remat="gemm_outputs")
  sample = jnp.asarray(train.batch(tokens, cfg, 0, 0))
  trainer = train.make_trainer(cfg, variant, 0, sample)
  pairs = inspect.dot_general_operand_dtypes(trainer.step, trainer.carry, sample)
  fp8 = [p for p in pairs if set(p) <= FP8]
  assert len(fp8) == expected, pairs
  # Every FP8 GEMM is the extension's; the unquantized dots as without the Hopper branch.
  assert _extension_gemms(trainer.step, trainer.carry, sample) == expected
  assert sorted(p for p in pairs if p not in fp8) == _unquantized_dots(), pairs


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")
@pytest.mark.parametrize("policy,expected", [(None, 12), (_dots_and_custom_vjps, 15)])
def test_remat_policy_saves_the_extension_gemms_outputs_under_fsdp(
  hopper_gemm, monkeypatch, tokens, policy, expected
):
  # Under FSDP (Auto mesh axes) the GEMM runs through its partitioning rule, inside calls that
  # remat saves or recomputes whole: the policy must look into them.
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  if policy is not None:
    monkeypatch.setattr(model_lib, "save_gemm_outputs", policy)
  cfg = dataclasses.replace(CFG, layers=1, batch=2 * CFG.batch, remat="gemm_outputs")
  mesh = train.fsdp_mesh(2)
  with jax.set_mesh(mesh):
    sample = jnp.asarray(train.batch(tokens, cfg, 0, 0))
    trainer = train.make_trainer(cfg, "nnx-modules-current", 0, sample, gather=P(train.FSDP, None))
    carry = jax.device_put(trainer.carry, train.fsdp_shardings(trainer.carry, mesh))
    sample = jax.device_put(sample, NamedSharding(mesh, P(train.FSDP)))
    pairs = inspect.dot_general_operand_dtypes(trainer.step, carry, sample)
    assert sum(set(p) <= FP8 for p in pairs) == expected, pairs
    assert _extension_gemms(trainer.step, carry, sample) == expected


def test_qwix_variant_quantizes_every_projection_but_the_head(tokens):
  pytest.importorskip("qwix")
  sample = jnp.asarray(train.batch(tokens, CFG, 0, 0))
  trainer = train.make_trainer(CFG, "linen-qwix", 0, sample)
  pairs = inspect.dot_general_operand_dtypes(trainer.step, trainer.carry, sample)
  # Qwix's forward GEMMs e4m3 x e4m3, its gradients' e5m2 x e4m3: the four projections' three
  # GEMMs each, as in our conversions; the head stays bf16.
  assert sum(set(p) <= FP8 for p in pairs) == 12, pairs
  assert ("float8_e5m2", "float8_e4m3fn") in pairs


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


# The projections' kernels in the carry: the converted plain model's, and the library's modules'
# (LayerNormDenseGeneral's QKV, Linear's output, LayerNormMLP's two kernels).
KERNEL_PATHS = {
  "nnx-current": ["['qkv']['kernel']", "['out']['kernel']", "['gate_up']['kernel']",
                  "['down']['kernel']"],
  "nnx-modules-current": ["['qkv']['kernel']", "['out']['kernel']", "['mlp']['wi_kernel']",
                          "['mlp']['wo_kernel']"],
}  # fmt: skip


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")
@pytest.mark.parametrize("variant", list(KERNEL_PATHS))
def test_fsdp_shards_the_parameters_and_gathers_fp8_kernels(tokens, variant):
  import warnings

  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from te_adapters import core

  cfg = dataclasses.replace(CFG, layers=1, batch=2 * CFG.batch)
  mesh = train.fsdp_mesh(2)
  with jax.set_mesh(mesh), warnings.catch_warnings():
    # The library's modules keep their fused norm and MLP paths under FSDP.
    warnings.simplefilter("error", core.FusedPathFallbackWarning)
    sample = jnp.asarray(train.batch(tokens, cfg, 0, 0))
    trainer = train.make_trainer(cfg, variant, 0, sample, gather=P(train.FSDP, None))
    carry = jax.device_put(trainer.carry, train.fsdp_shardings(trainer.carry, mesh))
    sample = jax.device_put(sample, NamedSharding(mesh, P(train.FSDP)))
    specs = {
      jax.tree_util.keystr(path): leaf.sharding.spec
      for path, leaf in jax.tree_util.tree_leaves_with_path(carry)
    }
    # The scanned stack's kernels on their input dim, the embedding on its rows, AdamW's moments
    # like their parameters; the norms' scales and the counters replicated.
    for name in KERNEL_PATHS[variant]:
      assert specs[f"[0]['blocks']{name}.value"] == P(None, train.FSDP), name
    assert specs["[0]['embed']['embedding'].value"] == P(train.FSDP)
    assert specs["[0]['head']['kernel'].value"] == P(train.FSDP)
    moments = [k for k in specs if k.endswith("['blocks']['qkv']['kernel'].value") and "[1]" in k]
    assert len(moments) == 2 and all(specs[k] == P(None, train.FSDP) for k in moments), moments
    norm = "attn_norm" if variant == "nnx-current" else "qkv"
    assert specs[f"[0]['blocks']['{norm}']['scale'].value"] == P()
    assert train.sharded_fraction(carry) > 0.95
    # The GEMMs of the one-device model, FP8 alike: the four projections' forward and gradients.
    pairs = inspect.dot_general_operand_dtypes(trainer.step, carry, sample)
    assert sum(set(p) <= FP8 for p in pairs) == 12, pairs
    # Each projection's kernel shard is quantized, and its FP8 bytes gathered over the mesh: a
    # uint8 sharding constraint from the shard to the whole kernel, one per projection (the
    # modules' MLP: one per kernel).
    jaxpr = jax.make_jaxpr(trainer.step)(carry, sample).jaxpr
    gathers = [
      e
      for e in inspect.equations(jaxpr)
      if e.primitive.name == "sharding_constraint"
      and e.invars[0].aval.dtype == jnp.uint8
      and train.FSDP not in jax.tree.leaves(tuple(e.params["sharding"].spec))
    ]
    shapes = sorted(tuple(e.invars[0].aval.shape) for e in gathers)
    d, f = cfg.d_model, cfg.ffn
    # The kernels as the GEMM takes them, (N, K).
    assert shapes == sorted(
      [(cfg.qkv_features, d), (d, cfg.heads * cfg.head_dim), (2 * f, d), (d, f)]
    )


def test_convergence_run_resumes_as_the_straight_run(tmp_path, monkeypatch):
  """bench/llama/converge.py's runs go through bench/convergence.py's ``run``: a delayed-scaling
  run stopped at step 2 (checkpoint: parameters, Adam moments, amax histories and scales), then
  resumed to its end, gives the straight run's losses and held-out losses bit for bit (on a GPU,
  to the order of its sums); a finished run leaves its record alone, which a later resume
  skips."""
  from bench import convergence
  from bench.llama import converge

  cfg = dataclasses.replace(CFG, layers=1, batch=2, seq_len=32, eval_every=2, eval_batches=1)
  work, data, cache = converge.workload(cfg), converge.corpus(cfg), {}

  def run(**kw):
    return convergence.run(
      converge.ADAPTER, "delayed", "cpu", 4, 1, corpus=data, cache=cache, workload=work, **kw
    )

  straight = run()
  first = run(save=tmp_path, stop_at=2)
  assert first["step"] == 2 and not first["completed"] and first["fp8_gemms"] == 12
  second = run(resume=tmp_path, save=tmp_path, save_completed_state=False)
  assert second["start_step"] == 2 and second["completed"]
  resumed, want_evals = (
    first["losses"] + second["losses"],
    {k: v for k, v in straight["evals"].items() if k > 2},
  )
  if jax.default_backend() == "cpu":
    assert resumed == straight["losses"]
    assert second["evals"] == want_evals
  else:
    # On a GPU the resumed run's step is compiled again, and its GEMMs may sum in another order:
    # seen on an H100, 6e-5 of the loss at the first resumed step.
    np.testing.assert_allclose(resumed, straight["losses"], rtol=5e-4)
    assert second["evals"].keys() == want_evals.keys()
    np.testing.assert_allclose(list(second["evals"].values()), list(want_evals.values()), rtol=5e-4)
  # Training moved the loss: the equality above compares real steps.
  assert straight["evals"][4] < straight["evals"][0] - 0.1, straight["evals"]
  with np.load(tmp_path / f"{converge.ADAPTER}_delayed.npz") as saved:
    assert saved.files == ["__meta__"]
  assert run(resume=tmp_path)["already_done"]
  # --save-every: a checkpoint with the state at every second step, the last one too.
  saved = []
  monkeypatch.setattr(
    convergence, "save_checkpoint", lambda path, carry, meta: saved.append((meta["step"], carry))
  )
  run(save=tmp_path / "every", save_every=2)
  assert [(step, carry is not None) for step, carry in saved] == [(2, True), (4, True)]
