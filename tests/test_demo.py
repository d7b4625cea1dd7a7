import subprocess
import sys

import jax
import pytest

from te_adapters import _demo, core


def test_demo_rows_at_tiny_size():
  rows = _demo.run(32, 64, 32, repeats=1, warmup_steps=2, threshold=None)
  by_recipe = {r["recipe"]: r for r in rows}
  assert set(by_recipe) == {"bf16", "Float8CurrentScaling", "DelayedScaling"}
  assert by_recipe["bf16"]["fp8_dots"] == "0/3"
  for name in ("Float8CurrentScaling", "DelayedScaling"):
    r = by_recipe[name]
    assert r["fp8_dots"] == "3/3"
    assert 0.01 < r["err_y"] < 0.05 and 0.01 < r["err_dx"] < 0.08 and 0.01 < r["err_dw"] < 0.08
  assert by_recipe["bf16"]["err_y"] < 0.005
  table = _demo.format_table(rows)
  assert "DelayedScaling" in table and "in jaxpr" in table


def test_demo_says_when_the_gemm_stays_in_high_precision():
  # The suite's default threshold applies on every platform (tests/conftest.py).
  with pytest.warns(core.HighPrecisionGemmWarning):
    rows = _demo.run(32, 64, 32, repeats=1, warmup_steps=1)
  assert [r["fp8_dots"] for r in rows] == ["0/3", "0/3", "0/3"]
  assert all(r["err_y"] < 0.005 for r in rows)  # bf16 numerics in every row
  out = subprocess.run([sys.executable, "-m", "te_adapters", "demo", "--m", "32", "--k", "64",
                        "--n", "32", "--repeats", "1"], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  below = "The FP8 rows ran in high precision" in out.stdout
  # In a fresh process the shipped default applies on GPUs only.
  assert below == (jax.default_backend() == "gpu"), out.stdout
  forced = subprocess.run([sys.executable, "-m", "te_adapters", "demo", "--m", "32", "--k", "64",
                           "--n", "32", "--repeats", "1", "--force-fp8"],
                          capture_output=True, text=True)
  assert forced.returncode == 0 and "3/3 in jaxpr" in forced.stdout, forced.stdout
  assert "ran in high precision" not in forced.stdout


def test_command_line_usage_error():
  out = subprocess.run([sys.executable, "-m", "te_adapters"], capture_output=True, text=True)
  assert out.returncode == 2 and "usage" in out.stderr


def test_bench_sweep_rows_and_table():
  from te_adapters import _bench, core

  recipes = [("current", core.Float8CurrentScaling())]
  rows = _bench.bench_sweep([(32, 64, 32)], steps=1, repeats=1, recipes=recipes, log=lambda r: None)
  assert [r["variant"] for r in rows] == [
      "core bf16", "core current", "core current (default threshold)"]
  assert all(r["ms"] > 0 and r["case"] == "gemm 32x64x32" for r in rows)
  table = _bench.format_table(rows)
  assert "core current" in table and "x" in table.splitlines()[3]


def test_bench_table_flags_points_slower_than_bf16():
  from te_adapters import _bench

  case = "gemm 1024x1024x1024"
  rows = [dict(case=case, variant=v, ms=ms, spread_ms=0.0, cublas_fp8=None) for v, ms in [
      ("core bf16", 1.0), ("core current", 1.5), ("core current (default threshold)", 1.02),
      ("core delayed", 0.9), ("core delayed (default threshold)", 1.2)]]
  lines = _bench.format_table(rows).splitlines()
  assert lines[0].endswith(">3% slower")
  assert [line.endswith("SLOWER") for line in lines[1:6]] == [False, True, False, False, True]
  summary = lines[lines.index("") + 1:]
  assert summary[0] == (f"default threshold, >3% slower than bf16: {case} core delayed "
                        "(default threshold)")
  assert summary[1] == (f"default threshold, >3% slower than forced FP8: {case} core delayed "
                        "(default threshold)")


def test_bench_qwix_variants_quantize_what_their_names_say():
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pytest

  pytest.importorskip("qwix")
  from te_adapters import _bench, core
  from te_adapters._bench_qwix import qwix_variants

  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 64)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 128)).astype(jnp.bfloat16)
  variants = dict(qwix_variants(_bench._make_dense(128)))
  assert set(variants) == {"qwix fp8 (fwd GEMM only)", "qwix fp8 (fwd+dgrad+wgrad GEMMs)"}
  fp8 = ("float8_e4m3fn", "float8_e5m2")
  expected = {"qwix fp8 (fwd GEMM only)": 1, "qwix fp8 (fwd+dgrad+wgrad GEMMs)": 3}
  for name, model in variants.items():
    variables = model.init(jax.random.PRNGKey(2), x)
    step = _bench._speedometer(model.apply)
    pairs = core.dot_general_operand_dtypes(step, variables, x, dy)
    assert sum(a in fp8 and b in fp8 for a, b in pairs) == expected[name], (name, pairs)
    loss, (grads, dx) = step(variables, x, dy)
    leaves = [loss, dx, *jax.tree_util.tree_leaves(grads)]
    assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in leaves)
