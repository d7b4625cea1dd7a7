"""The benchmark's code (``bench/``, outside the package) at tiny sizes, and its command lines:
``python -m bench`` from a checkout, and ``python -m te_adapters bench``, a pointer to it."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import speed
from bench.qwix_variants import qwix_variants
from te_adapters import core, inspect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_sweep_rows_and_table():
  recipes = [("current", core.Float8CurrentScaling())]
  rows = speed.bench_sweep([(32, 64, 32)], steps=1, repeats=1, recipes=recipes, log=lambda r: None)
  assert [r["variant"] for r in rows] == [
    "core bf16",
    "core current",
    "core current (default threshold)",
  ]
  assert all(r["ms"] > 0 and r["case"] == "gemm 32x64x32" for r in rows)
  table = speed.format_table(rows)
  assert "core current" in table and "x" in table.splitlines()[3]


def test_bench_table_flags_points_slower_than_bf16():
  case = "gemm 1024x1024x1024"
  rows = [
    dict(case=case, variant=v, ms=ms, spread_ms=0.0, cublas_fp8=None)
    for v, ms in [
      ("core bf16", 1.0),
      ("core current", 1.5),
      ("core current (default threshold)", 1.02),
      ("core delayed", 0.9),
      ("core delayed (default threshold)", 1.2),
    ]
  ]
  lines = speed.format_table(rows).splitlines()
  assert lines[0].endswith(">3% slower")
  assert [line.endswith("SLOWER") for line in lines[1:6]] == [False, True, False, False, True]
  summary = lines[lines.index("") + 1 :]
  assert summary[0] == (
    f"default threshold, >3% slower than bf16: {case} core delayed (default threshold)"
  )
  assert summary[1] == (
    f"default threshold, >3% slower than forced FP8: {case} core delayed (default threshold)"
  )


def test_bench_qwix_variants_quantize_what_their_names_say():
  pytest.importorskip("qwix")

  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 64)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 128)).astype(jnp.bfloat16)
  variants = dict(qwix_variants(speed._make_dense(128)))
  assert set(variants) == {"qwix fp8 (fwd GEMM only)", "qwix fp8 (fwd+dgrad+wgrad GEMMs)"}
  fp8 = ("float8_e4m3fn", "float8_e5m2")
  expected = {"qwix fp8 (fwd GEMM only)": 1, "qwix fp8 (fwd+dgrad+wgrad GEMMs)": 3}
  for name, model in variants.items():
    variables = model.init(jax.random.PRNGKey(2), x)
    step = speed._speedometer(model.apply)
    pairs = inspect.dot_general_operand_dtypes(step, variables, x, dy)
    assert sum(a in fp8 and b in fp8 for a, b in pairs) == expected[name], (name, pairs)
    loss, (grads, dx) = step(variables, x, dy)
    leaves = [loss, dx, *jax.tree_util.tree_leaves(grads)]
    assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in leaves)


def test_bench_command_runs_from_a_checkout():
  # One sweep point, one step, written as JSON.
  import json
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.json")
    done = subprocess.run(
      [
        sys.executable,
        "-m",
        "bench",
        "--cases",
        "sweep",
        "--shapes",
        "32x64x32",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--no-full-size",
        "--json",
        out,
      ],
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
      rows = json.load(f)["rows"]
  assert {r["case"] for r in rows} == {"gemm 32x64x32"}
  assert "core bf16" in {r["variant"] for r in rows}


def test_te_adapters_bench_points_to_the_checkouts_benchmark():
  # From a checkout (this one: an editable install), the old command runs the same code.
  done = subprocess.run(
    [sys.executable, "-m", "te_adapters", "bench", "--help"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("usage: python -m bench") and "--cases" in done.stdout


def test_te_adapters_bench_outside_a_checkout_says_where_the_benchmark_is(monkeypatch, capsys):
  from te_adapters import __main__ as cli

  monkeypatch.setattr(cli, "_checkout_root", lambda: None)  # an installed wheel: no bench/
  assert cli.main(["bench", "--cases", "dense"]) == 2
  err = capsys.readouterr().err
  assert "python -m bench" in err and "source checkout" in err


def test_bench_is_not_in_the_package():
  import te_adapters

  package = os.path.dirname(te_adapters.__file__)
  names = set(os.listdir(package))
  assert not names & {"_bench.py", "_bench_qwix.py", "_seed_layer.py"}, names


def test_seed_layer_from_the_modules_runs_its_gemms_in_fp8():
  """The bench's seed 001 layer rebuilt from LayerNormDenseGeneral, DenseGeneral and
  LayerNormMLP: every projection GEMM (QKV, output, the MLP's two) in FP8 in forward, dgrad and
  wgrad, and the same output shape as the Flax layer."""
  import te_adapters as ta
  from bench.seed_layer import ModulesTransformerLayer

  layer = ModulesTransformerLayer(
    hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, recipe=ta.Float8CurrentScaling()
  )
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 128)).astype(jnp.bfloat16)
  variables = layer.init(jax.random.PRNGKey(1), x)
  loss = lambda v, x: jnp.sum(layer.apply(v, x).astype(jnp.float32) ** 2)
  fp8, total = inspect.count_fp8_dot_generals(
    jax.value_and_grad(loss, argnums=(0, 1)), variables, x
  )
  assert fp8 == 12, (fp8, total)
  y = layer.apply(variables, x)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y).all())


def test_seed_layer_attention_choice_computes_the_same_layer():
  """The layer case's ``--attention``: jax.nn.dot_product_attention (xla here) gives the seed's
  nn.dot_product_attention result, in the Flax layer and in the layer from the modules, and what
  it cannot do is refused."""
  from bench.seed_layer import FlaxTransformerLayer, ModulesTransformerLayer

  x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 64))
  for cls, kw in ((FlaxTransformerLayer, {}), (ModulesTransformerLayer, {"recipe": None})):
    make = lambda attention, cls=cls, kw=kw: cls(
      hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, attention=attention, **kw
    )
    variables = make("flax").init(jax.random.PRNGKey(1), x, deterministic=True)
    seed = make("flax").apply(variables, x, deterministic=True)
    fused = make("xla").apply(variables, x, deterministic=True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(seed), rtol=2e-5, atol=2e-5)
    # A changed attention shows: one query attends to a key past it (not causal) or not at all.
    assert (
      float(
        jnp.max(
          jnp.abs(
            seed[:, :-1]
            - make("flax").apply(variables, x.at[:, -1].add(1.0), deterministic=True)[:, :-1]
          )
        )
      )
      == 0.0
    )
  layer = FlaxTransformerLayer(
    hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, attention="xla"
  )
  with pytest.raises(ValueError, match="no dropout"):
    layer.init(
      {"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}, x, deterministic=False
    )
  with pytest.raises(ValueError, match="causal mask only"):
    layer.init(
      jax.random.PRNGKey(1), x, attention_mask=jnp.ones((2, 1, 32, 32), bool), deterministic=True
    )
  with pytest.raises(ValueError, match="attention must be one of"):
    FlaxTransformerLayer(
      hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, attention="flash"
    ).init(jax.random.PRNGKey(1), x, deterministic=True)


def test_gpu_idle_counts_time_no_stream_runs_and_names_the_gaps():
  # Two steps on two streams: the second stream's kernel covers part of the first's gap.
  events = [
    dict(name="gemm", ts=0.0, dur=100.0),
    dict(name="copy", ts=90.0, dur=30.0),  # overlaps gemm, ends at 120
    dict(name="cast", ts=150.0, dur=50.0),  # 30 us idle before it
    dict(name="gemm", ts=1200.0, dur=100.0),  # 1000 us idle before it (the next step)
    dict(name="tiny", ts=1310.0, dur=5.0),  # 10 us idle before it
  ]
  idle_ms, gaps = speed.gpu_idle(events, steps=2, top=2)
  assert idle_ms == pytest.approx((30 + 1000 + 10) / 2 / 1e3)
  assert gaps == [(1000.0, "cast", "gemm"), (30.0, "copy", "cast")]
  assert speed.gpu_idle(events, steps=2, top=None)[1] == gaps + [(10.0, "gemm", "tiny")]
  assert speed.kernel_ms(events, steps=2) == pytest.approx(
    {"gemm": 0.1, "copy": 0.015, "cast": 0.025, "tiny": 0.0025}
  )
  assert speed.gpu_idle([], steps=1) == (0.0, [])


def test_ragged_memory_floor_counts_every_array_of_the_step():
  """bench/ragged.py's floor against a tally by array: M=3, K=5, N=7, G=2, bf16."""
  from bench import ragged

  m, k, n, g = 3, 5, 7, 2
  x, dy, w = m * k, m * n, g * k * n
  outputs = 2 * (m * n + m * k + g * k * n)  # y, dx and the kernel gradients in bf16
  # FP8 copies in memory: each input read in bf16 by its cast, two FP8 copies written, each read
  # by one GEMM; current scaling reads each input once more for its amax.
  fp8_delayed = sum(2 * a + 2 * a + 2 * a for a in (x, dy, w)) + outputs
  assert ragged.traffic_floor(m, k, n, g, amax_passes=False) == fp8_delayed
  assert ragged.traffic_floor(m, k, n, g, amax_passes=True) == fp8_delayed + 2 * (x + dy + w)
  # Converted on chip: each input read in bf16 by its two GEMMs.
  on_chip = sum(2 * 2 * a for a in (x, dy, w)) + outputs
  assert ragged.traffic_floor(m, k, n, g, amax_passes=False, fp8_in_memory=False) == on_chip
  # The issue's shape at G=64: 32.5 GB, 10.83 ms at the H100's 3.0 TB/s with FP8 copies.
  line = ragged.floor_line(16384, 4096, 14336, 64, 3.0)
  assert "32.5 GB = 10.83 ms (delayed)" in line and "40.6 GB = 13.53 ms (current)" in line
  assert "24.4 GB = 8.12 ms" in line


@pytest.mark.filterwarnings("ignore::te_adapters.core.HighPrecisionGemmWarning")  # tiny GEMMs
def test_ragged_bench_runs_and_prints_its_floor(capsys):
  from bench import ragged

  ragged.main(
    [
      "--tokens",
      "64",
      "--k",
      "32",
      "--n",
      "32",
      "--groups",
      "2",
      "--iters",
      "1",
      "--repeats",
      "1",
      "--warmup",
      "0",
      "--variants",
      "ours_bf16",
      "dense_current",
    ]
  )
  out = capsys.readouterr().out
  assert "memory floor of the step at 3 TB/s" in out
  rows = [
    line
    for line in out.splitlines()
    if line.startswith("| ours_bf16") or line.startswith("| dense_current")
  ]
  assert len(rows) == 2 and not any("failed" in r for r in rows), out
  assert all(r.rstrip(" |").endswith("%") and " ms = " in r.split("|")[-2] for r in rows), rows
  # Each variant's floor: bf16 operands read as they are, FP8 copies with current's amax passes.
  assert ragged.variant_floor("ours_bf16", 64, 32, 32, 2) == ragged.traffic_floor(
    64, 32, 32, 2, amax_passes=False, fp8_in_memory=False
  )
  assert ragged.variant_floor("dense_current", 64, 32, 32, 2) == ragged.traffic_floor(
    64, 32, 32, 1, amax_passes=True
  )
  assert ragged.variant_floor("loop_current", 64, 32, 32, 2) is None


def test_trained_state_gives_every_delayed_variant_the_scale_training_reaches():
  """The Dense case times DelayedScaling on the state of a few training steps, not on the initial
  scale of 1: in every variant (Linen, Flax's op, the core, NNX, Haiku) the kernel's scale is
  then E4M3's 448 over the bf16 kernel's amax (Flax's op: its inverse), as the state rule gives
  after a step."""
  import te_adapters as ta

  batch, seq, hidden, out = 2, 8, 64, 32
  kx, kd = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.normal(kx, (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (batch, seq, out)).astype(jnp.bfloat16)
  recipes = [("delayed", ta.DelayedScaling(amax_history_len=4))]
  key = jax.random.PRNGKey(0)
  variants = [
    (n, m.apply, m.init(key, x))
    for n, m in speed._linen_variants(speed._make_dense(out), recipes)
    if "delayed" in n or "Fp8Direct" in n
  ]
  apply_fn, init = speed._core_variant(recipes[0][1], (hidden, out))
  variants.append(("core delayed", apply_fn, init(key)))
  variants += speed._adapter_variants(hidden, out, recipes, key, x)
  assert len(variants) >= 3
  seen = []
  for name, apply_fn, variables in variants:
    step = speed._speedometer(apply_fn)
    trained = speed.trained_state(step, variables, x, dy)
    before = dict(_leaves_named(variables, "kernel_scale"))
    after = dict(_leaves_named(trained, "kernel_scale"))
    assert after and before.keys() == after.keys(), name
    weights = [
      np.asarray(v, np.float32)
      for p, v in _leaves_named(trained, "")
      if p.endswith(("kernel", "w")) and np.ndim(v) == 2
    ]
    assert len(weights) == 1, (name, [p for p, _ in _leaves_named(trained, "")])
    amax = np.max(np.abs(np.asarray(jnp.asarray(weights[0]).astype(jnp.bfloat16), np.float32)))
    for path, scale in after.items():
      np.testing.assert_array_equal(np.asarray(before[path]), 1.0, err_msg=name)
      # Flax's fp8 op stores the dequantizing factor (amax / 448), TE and we the quantizing one.
      want = amax / 448.0 if "Fp8Direct" in name else 448.0 / amax
      np.testing.assert_allclose(np.asarray(scale), want, rtol=1e-5, err_msg=name)
    seen.append(name)
  assert any(n.startswith("nnx") for n in seen) == _imports("flax.nnx")
  assert any(n.startswith("haiku") for n in seen) == _imports("haiku")


def _leaves_named(tree, suffix):
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    name = name.removesuffix("/value")  # an NNX variable's array
    if name.endswith(suffix):
      out.append((name, leaf))
  return out


def _imports(module):
  try:
    __import__(module)
  except ImportError:
    return False
  return True
