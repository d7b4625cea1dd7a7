"""bench/convergence.py's CPU-sized mode: the FP8 recipes' held-out loss tracks bf16's on the tiny
byte-level LM, and a run split by a checkpoint continues bit for bit.

One adapter per recipe keeps the time down (the full cross product is the GPU benchmark's job):
bf16 through NNX (the baseline), Float8CurrentScaling through Linen and DelayedScaling through
Haiku, each for the whole run; Float8BlockScaling through NNX for its first steps only (its GEMMs
are emulated one 128-wide slice at a time on CPU, 2.5 times slower than bf16 here). The three
models start from the same parameters and read the same batches, so one bf16 run is the baseline
of all (Linen's and NNX's bf16 runs agree bit for bit).
"""

import importlib.util
import math
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_bench():
  spec = importlib.util.spec_from_file_location("convergence", ROOT / "bench" / "convergence.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["convergence"] = module  # dataclasses look their module up while it loads
  spec.loader.exec_module(module)
  return module


conv = _load_bench()
# Compiled steps by run: the pieces of a run split by a checkpoint reuse the straight run's.
COMPILED = {}
SIZE = conv.SIZES["tiny"]
STEPS = 300
BLOCK_STEPS = 50
# The final held-out loss of an FP8 run may differ from bf16's by this fraction. Measured on this
# CPU (same parameters, same batches): after 300 steps bf16 2.432, current +0.60%, delayed
# +0.43%; after 400 steps current +0.19%, delayed +0.31%, and bf16 with seed 1 instead of 0
# +0.41% (+1% over seeds 0-2 after 100 steps). Broken quantization, after 300 of 400 steps:
# every FP8 scale forced to 1.0, +6.4%; the FP8 layers' kernel gradients dropped, +6.8% (after
# 400: +8.1% and +9.0%). So 2%.
RELATIVE_TOLERANCE = 0.02
# The comparison means something once the model has learned more than the statistics of byte
# pairs (the corpus's bigram entropy is about 2.41 nats), which the bf16 embedding and head reach
# alone (about 2.5): from there on the projections, the FP8 GEMMs, carry the model.
LEARNED = 2.47


@pytest.fixture(scope="module")
def runs():
  return {
    ("nnx", "bf16"): conv.run("nnx", "bf16", "tiny", STEPS),
    ("linen", "current"): conv.run("linen", "current", "tiny", STEPS),
    ("haiku", "delayed"): conv.run("haiku", "delayed", "tiny", STEPS, cache=COMPILED),
    ("nnx", "block"): conv.run("nnx", "block", "tiny", STEPS, stop_at=BLOCK_STEPS),
  }


def test_corpus_is_the_standard_library_with_a_fixed_split():
  corpus = conv.stdlib_corpus()
  assert corpus.info["files"] > 100 and 0 < corpus.info["heldout_files"] < corpus.info["files"]
  assert corpus.heldout.size > 10 * SIZE.seq_len * SIZE.batch
  batch = conv.train_batch(corpus, SIZE, 0, 3)
  assert batch.shape == (SIZE.batch, SIZE.seq_len + 1) and batch.dtype == "int32"
  assert (batch == conv.train_batch(corpus, SIZE, 0, 3)).all()
  assert not (batch == conv.train_batch(corpus, SIZE, 0, 4)).all()
  assert not (batch == conv.train_batch(corpus, SIZE, 1, 3)).all()
  assert conv.is_heldout("json/decoder.py") == conv.is_heldout("json/decoder.py")


@pytest.mark.slow  # the module's runs take about 100 s on 2 cores
def test_every_projection_gemm_runs_in_fp8(runs):
  expected = conv.expected_fp8_gemms(SIZE)  # fwd, dgrad, wgrad of QKV, out, MLP in and out
  for (adapter, recipe), result in runs.items():
    what = (adapter, recipe, result["fp8_gemms"], result["gemms"])
    if recipe == "bf16":
      assert result["fp8_gemms"] == 0 and not result["fp8"], what
      continue
    assert result["fp8_gemms"] == expected and result["fp8"], what
    assert result["quantized_layers"] == 4 * SIZE.layers and "head" in result["kept_layers"]


ON_GPU = jax.default_backend() == "gpu"
# On a GPU one run of the tiny model cannot decide a 2% question. Measured on an H100
# (2026-11-25, jax 0.11.2, NNX, 300 steps, seeds 0-5): bf16's final held-out loss spreads from
# 2.346 to 2.498 over seeds (sd 2.2%), FP8 minus bf16 on the same seed spreads from -1.5% to
# +4.3% (current) with a mean of +0.5% (delayed: -0.2%), and a repeated run of one seed differs
# by up to 1.5% (XLA's GPU reductions are not run-to-run deterministic). The CPU runs are
# deterministic; there the single-seed comparison holds. On GPU the means over seeds decide
# (test_fp8_tracks_bf16_over_seeds_on_gpu).
SINGLE_RUN_ON_CPU = pytest.mark.skipif(
  ON_GPU, reason="one GPU run is within run-to-run noise; the GPU test compares seed means"
)
GPU_SEEDS = (0, 1, 2, 3)
# Of the means over GPU_SEEDS: measured +1.3% (current), -0.5% (delayed); broken quantization
# costs 6% and more (CPU figures above).
GPU_MEAN_TOLERANCE = 0.03


@pytest.mark.slow  # the module's runs take about 100 s on 2 cores
@SINGLE_RUN_ON_CPU
def test_fp8_heldout_loss_tracks_bf16(runs):
  base = runs[("nnx", "bf16")]
  assert base["final_heldout_loss"] < LEARNED < math.log(256)
  for key in (("linen", "current"), ("haiku", "delayed")):
    loss = runs[key]["final_heldout_loss"]
    assert runs[key]["step"] == STEPS, key
    assert abs(loss / base["final_heldout_loss"] - 1) < RELATIVE_TOLERANCE, (key, loss, base)


@pytest.mark.slow  # the module's runs take about 100 s on 2 cores
@SINGLE_RUN_ON_CPU
def test_block_scaling_tracks_bf16_over_its_first_steps(runs):
  block = runs[("nnx", "block")]
  assert block["step"] == BLOCK_STEPS and block["final_step_evaluated"] == BLOCK_STEPS
  # bf16's loss at the same step, from its evaluation there (same schedule, same batches).
  base = runs[("nnx", "bf16")]["evals"][BLOCK_STEPS]
  assert abs(block["final_heldout_loss"] / base - 1) < RELATIVE_TOLERANCE, (block, base)


@pytest.mark.slow  # the module's runs take about 100 s on 2 cores
@pytest.mark.xfail(
  ON_GPU, strict=False, reason="XLA's GPU programs are not run-to-run deterministic by default"
)
def test_resume_continues_bit_for_bit(runs, tmp_path):
  """A checkpoint (parameters, Adam moments, amax histories and scales, the data position) at
  step 10, then 10 more steps: the losses of the straight run, bit for bit. (The pieces reuse
  the straight run's compiled step, to save two compiles; what is tested is the round trip of
  the state through the file.)"""
  straight = runs[("haiku", "delayed")]["losses"]
  first = conv.run("haiku", "delayed", "tiny", STEPS, save=tmp_path, stop_at=10, cache=COMPILED)
  assert first["step"] == 10 and not first["completed"]
  second = conv.run("haiku", "delayed", "tiny", STEPS, resume=tmp_path, stop_at=20, cache=COMPILED)
  assert second["start_step"] == 10 and second["step"] == 20
  assert first["losses"] + second["losses"] == straight[:20]
  assert conv.jax.tree.leaves(second["carry"][1])  # the recipe state was part of it
  # A checkpoint of another run (here: another schedule length) is refused, not half-used.
  with pytest.raises(ValueError, match="steps"):
    conv.run("haiku", "delayed", "tiny", STEPS + 1, resume=tmp_path)


def _load_plot():
  spec = importlib.util.spec_from_file_location(
    "convergence_plot", ROOT / "bench" / "convergence_plot.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules["convergence_plot"] = module
  spec.loader.exec_module(module)
  return module


def test_plot_table_from_json_lines(tmp_path):
  """The table's differences and speedups, from lines written in two pieces (a resumed run)."""
  import json

  def lines(recipe, losses, rate, **summary):
    tag = dict(adapter="linen", recipe=recipe, seed=0)
    out = [dict(tag, step=s, heldout_loss=x, tokens_per_s=rate, mfu=0.4) for s, x in losses]
    return out + [dict(tag, summary=True, steps=200, **summary)]

  first = lines(
    "bf16", [(0, 5.5), (100, 2.5)], 1000.0, fp8_gemms=0, gemms=60, fp8=False, fp8_gemms_expected=0
  )
  first += lines(
    "current",
    [(0, 5.5), (100, 2.6)],
    1500.0,
    fp8_gemms=48,
    gemms=60,
    fp8=True,
    fp8_gemms_expected=48,
  )
  second = lines(
    "bf16", [(200, 2.0)], 1000.0, fp8_gemms=0, gemms=60, fp8=False, fp8_gemms_expected=0
  )
  second += lines(
    "current", [(200, 2.02)], 1500.0, fp8_gemms=48, gemms=60, fp8=True, fp8_gemms_expected=48
  )
  second += lines(
    "delayed", [(200, 2.1)], 900.0, fp8_gemms=0, gemms=60, fp8=False, fp8_gemms_expected=48
  )
  for name, records in (("a.jsonl", first), ("b.jsonl", second)):
    (tmp_path / name).write_text("\n".join(json.dumps(r) for r in records) + "\n")
  plot = _load_plot()
  text = plot.main(
    [
      str(tmp_path / "a.jsonl"),
      str(tmp_path / "b.jsonl"),
      "--table-only",
      "--out-dir",
      str(tmp_path),
    ]
  )
  rows = {line.split("|")[2].strip(): line for line in text.splitlines()[2:]}
  assert list(rows) == ["bf16", "current", "delayed"]
  assert "| 2.0200 | +1.00% | 1,500 | 1.50x | 40.0% | 48 of 60 |" in rows["current"]
  assert "+5.00%" in rows["delayed"] and "0.90x" in rows["delayed"]
  assert "0 of 60 (expected 48) **not FP8**" in rows["delayed"]
  assert (tmp_path / "table.md").read_text() == text + "\n"
  other_seed = dict(first[0], seed=1)
  (tmp_path / "c.jsonl").write_text(json.dumps(other_seed) + "\n")
  with pytest.raises(SystemExit, match="--seed"):
    plot.main(
      [
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "c.jsonl"),
        "--table-only",
        "--out-dir",
        str(tmp_path),
      ]
    )


@pytest.mark.slow  # 12 runs: about 2 minutes on an H100
@pytest.mark.skipif(not ON_GPU, reason="GPU only: the CPU runs are deterministic (tests above)")
def test_fp8_tracks_bf16_over_seeds_on_gpu():
  finals = {}
  for recipe in ("bf16", "current", "delayed"):
    results = [conv.run("nnx", recipe, "tiny", STEPS, seed) for seed in GPU_SEEDS]
    assert all(r["fp8"] == (recipe != "bf16") for r in results), recipe
    finals[recipe] = sum(r["final_heldout_loss"] for r in results) / len(results)
  assert finals["bf16"] < LEARNED < math.log(256)
  for recipe in ("current", "delayed"):
    assert abs(finals[recipe] / finals["bf16"] - 1) < GPU_MEAN_TOLERANCE, finals


def test_plot_by_seed_compares_each_seed_with_its_own_bf16(tmp_path):
  """``--by-seed``: a row per adapter, seed and recipe, each FP8 run against bf16 of its own
  seed, and each recipe's spread over the seeds."""
  import json

  records = []
  for seed, finals in ((0, {"bf16": 3.0, "current": 3.03}), (1, {"bf16": 3.06, "current": 3.06})):
    for recipe, final in finals.items():
      tag = dict(adapter="llama-nnx", recipe=recipe, seed=seed)
      records += [
        dict(tag, step=s, heldout_loss=x, tokens_per_s=100.0) for s, x in ((0, 10.0), (200, final))
      ]
  (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
  plot = _load_plot()
  text = plot.main(
    [str(tmp_path / "a.jsonl"), "--by-seed", "--table-only", "--out-dir", str(tmp_path)]
  )
  rows = [line.split("|") for line in text.splitlines() if line.startswith("| llama-nnx")]
  diffs = {(r[1].strip(), r[2].strip()): r[5].strip() for r in rows if len(r) > 8}
  assert diffs == {
    ("llama-nnx seed 0", "bf16"): "-",
    ("llama-nnx seed 0", "current"): "+1.00%",
    ("llama-nnx seed 1", "bf16"): "-",
    ("llama-nnx seed 1", "current"): "+0.00%",
  }
  spread = {r[2].strip(): (r[3].strip(), r[5].strip()) for r in rows if len(r) == 7}
  assert spread == {
    "bf16": ("0: 3.0000, 1: 3.0600", "1.98%"),
    "current": ("0: 3.0300, 1: 3.0600", "0.99%"),
  }
  with pytest.raises(SystemExit):
    plot.main([str(tmp_path / "a.jsonl"), "--by-seed", "--seed", "0", "--table-only"])
