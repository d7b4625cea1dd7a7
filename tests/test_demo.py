import subprocess
import sys

import jax
import pytest

import te_adapters as ta
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
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "te_adapters",
      "demo",
      "--m",
      "32",
      "--k",
      "64",
      "--n",
      "32",
      "--repeats",
      "1",
    ],
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  below = "The FP8 rows ran in high precision" in out.stdout
  # What is installed, and whether FP8 is emulated here, comes before the table.
  assert f"te_adapters {ta.__version__}" in out.stdout and "C++ kernels: " in out.stdout
  emulated = "FP8 is emulated here" in out.stdout
  assert emulated == (ta.build_info().fp8_gemms == "emulated"), out.stdout
  # In a fresh process the shipped default applies on GPUs only.
  assert below == (jax.default_backend() == "gpu"), out.stdout
  forced = subprocess.run(
    [
      sys.executable,
      "-m",
      "te_adapters",
      "demo",
      "--m",
      "32",
      "--k",
      "64",
      "--n",
      "32",
      "--repeats",
      "1",
      "--force-fp8",
    ],
    capture_output=True,
    text=True,
  )
  assert forced.returncode == 0 and "3/3 in jaxpr" in forced.stdout, forced.stdout
  assert "ran in high precision" not in forced.stdout


def test_command_line_usage_error():
  out = subprocess.run([sys.executable, "-m", "te_adapters"], capture_output=True, text=True)
  assert out.returncode == 2 and "usage" in out.stderr
  out = subprocess.run(
    [sys.executable, "-m", "te_adapters", "demos"], capture_output=True, text=True
  )
  assert out.returncode == 2 and "unknown subcommand 'demos'" in out.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_command_line_help_lists_the_subcommands(flag):
  out = subprocess.run([sys.executable, "-m", "te_adapters", flag], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  listed = [
    line.split()[0]
    for line in out.stdout.split("subcommands:")[1].splitlines()
    if line.startswith("  ") and not line.strip().startswith("-")
  ]
  assert listed == ["demo", "bench"], out.stdout
  assert "FP8 against bf16" in out.stdout and out.stderr == ""
