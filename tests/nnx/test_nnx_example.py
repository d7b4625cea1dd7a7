"""The NNX example trains in CI at a tiny size."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_train_nnx_example_runs_tiny():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  # A tiny run is mostly XLA compilation; on CPU these flags cut its time about threefold (a
  # GPU jaxlib stops at the CPU-only flag).
  if jax.default_backend() == "cpu":
    env["XLA_FLAGS"] = " ".join(
      filter(
        None,
        [
          env.get("XLA_FLAGS"),
          "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true",
          "--xla_cpu_use_fusion_emitters=false",
        ],
      )
    )
  result = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "train_nnx.py"), "--tiny", "--steps", "3"],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].split() == ["step", "bf16", "fp8-current", "fp8-delayed"]
  rows = np.array([[float(v) for v in line.split()] for line in lines[1:4]])
  np.testing.assert_array_equal(rows[:, 0], [0, 1, 2])
  losses = rows[:, 1:]
  assert np.all(np.isfinite(losses))
  # Untrained, the loss is about log(vocab = 32) = 3.47 (plus the init's noise), and it drops.
  assert np.all(np.abs(losses[0] - np.log(32)) < 1.0), losses[0]
  assert np.all(losses[-1] < losses[0]), losses
  # FP8 tracks bf16.
  np.testing.assert_allclose(losses[:, 1], losses[:, 0], atol=0.05)
  np.testing.assert_allclose(losses[:, 2], losses[:, 0], atol=0.05)
  # Progress while training, on stderr: a line per step here (--steps 3), with the step's loss
  # (the table's) and the time per step since the last line.
  progress = re.findall(
    r"^(\S+): step (\d+)/3 loss (\d+\.\d{4}) (\d+\.\d) ms/step(.*)$", result.stderr, re.M
  )
  assert [(name, int(step)) for name, step, *_ in progress] == [
    (name, step) for name in ("bf16", "fp8-current", "fp8-delayed") for step in (1, 2, 3)
  ], result.stderr[-3000:]
  logged = np.array([float(loss) for _, _, loss, _, _ in progress]).reshape(3, 3).T
  np.testing.assert_allclose(logged, losses, atol=1e-4)
  assert all(float(ms) > 0 for *_, ms, _ in progress)
  assert [note for *_, note in progress][::3] == [" (the first step compiles)"] * 3
  assert "fp8-delayed: mean of the last" in result.stdout
  # Every GEMM of the Linear layers runs in FP8 (3 per layer: forward, dgrad, wgrad); attention's
  # own products stay in bf16.
  counts = re.findall(
    r"^(\S+): (\d+) of (\d+) GEMMs per step with FP8 operands", result.stdout, re.M
  )
  assert [(name, int(fp8)) for name, fp8, _ in counts] == [
    ("bf16", 0),
    ("fp8-current", 15),
    ("fp8-delayed", 15),
  ], result.stdout
