"""Two JAX processes on CPU (gloo), started by ``bench/multiprocess.py``: training across processes
equals one process driving the same two-device mesh, and the launcher fails loudly.

``bench/multiprocess_check.py`` does the checks (see its docstring); here it runs for each
adapter, recipe and plan, a Latin square of them (every adapter with both recipes, every recipe
with both plans) to keep the two runs near a minute on two cores. The GPU run, two processes x one
GPU, is in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = (
  "linen/delayed/dp,linen/current/fsdp,nnx/delayed/fsdp,nnx/current/dp,"
  "haiku/delayed/dp,haiku/current/fsdp"
)


def _gloo_missing() -> str | None:
  if not hasattr(jax, "distributed") or not hasattr(jax.distributed, "initialize"):
    return "this JAX has no jax.distributed"
  try:
    _ = jax.config.jax_cpu_collectives_implementation
  except (AttributeError, KeyError):
    return "this JAX has no CPU collectives option (gloo)"
  return None


pytestmark = pytest.mark.skipif(_gloo_missing() is not None, reason=str(_gloo_missing()))


def _env():
  """This environment without the suite's 8 virtual devices (each run sets its own count)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _run(args, timeout=300):
  out = subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
  )
  return out.returncode, out.stdout + out.stderr


def _launch(processes, target, *options, timeout=300):
  return _run(
    [
      "-m",
      "bench.multiprocess",
      "--processes",
      str(processes),
      "--platform",
      "cpu",
      *options,
      "--",
      *target,
    ],
    timeout=timeout,
  )


@pytest.mark.slow  # two runs of the check: about a minute on two cores
def test_two_processes_train_bit_for_bit_like_one_process_on_the_same_mesh(tmp_path):
  check = ["-m", "bench.multiprocess_check", "--configs", CONFIGS]
  single, multi = tmp_path / "single", tmp_path / "multi"
  # The reference trains on the mesh only: the two processes' run also trains on one device
  # and saves, restores and trains again.
  rc, log = _run(
    [*check, "--cpu-devices", "2", "--out", str(single), "--no-one-device", "--no-checkpoint"]
  )
  assert rc == 0, log[-4000:]
  rc, log = _launch(2, [*check, "--out", str(multi), "--reference", str(single / "results.json")])
  assert rc == 0, log[-6000:]
  assert "all 2 processes succeeded" in log
  assert "6 of 6 bit for bit" in log, log[-3000:]

  ref = json.loads((single / "results.json").read_text())
  got = json.loads((multi / "results.json").read_text())
  assert (ref["processes"], ref["devices"]) == (1, 2)
  assert (got["processes"], got["devices"]) == (2, 2)
  assert sorted(got["results"]) == sorted(CONFIGS.split(","))
  for name, r in got["results"].items():
    assert r["loss_bits"] == ref["results"][name]["loss_bits"], name
    assert r["state_digest"] == ref["results"][name]["state_digest"], name
    assert r["checkpoint"], name  # saved halfway, restored, the same steps again
    assert r["max_rel_vs_one_device"] < 1e-4, (name, r["max_rel_vs_one_device"])
    assert r["losses"][-1] < r["losses"][0], name  # it trains
    if "/delayed/" in name:
      # The newest x amax is the global batch's, larger than process 0's own rows' (the largest
      # rows of the last step were process 1's): the amax was reduced across processes.
      assert r["x_amax"] > r["own_rows_amax"], (name, r)


def test_the_launcher_fails_when_a_process_fails_and_ends_the_ones_left_waiting(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text(
    "import sys, time, jax\n"
    "if jax.process_index() == 1:\n"
    "  print('process 1 fails', flush=True)\n"
    "  sys.exit(3)\n"
    "time.sleep(600)\n"
  )
  start = time.monotonic()
  rc, log = _launch(2, [str(script)], "--grace", "2", "--timeout", "120")
  assert rc == 1, log
  assert "[1] process 1 fails" in log
  # Process 0 is killed after the grace period, unless JAX's coordination service ended it first.
  assert re.search(r"process 0: (timeout|exit -?\d+), process 1: exit 3", log), log
  assert time.monotonic() - start < 60, log


def test_the_launcher_fails_when_the_job_outlasts_its_timeout(tmp_path):
  script = tmp_path / "hang.py"
  script.write_text("import time, jax\nprint(jax.process_count(), flush=True)\ntime.sleep(600)\n")
  rc, log = _launch(2, [str(script)], "--timeout", "8")
  assert rc == 1, log
  assert "[0] 2" in log and "[1] 2" in log  # both initialized: two processes
  assert "process 0: timeout, process 1: timeout" in log, log
