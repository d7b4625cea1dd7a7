"""examples/train_haiku.py at its tiny size: it trains, and FP8 tracks bf16."""

import math
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_example_trains_and_fp8_tracks_bf16():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  # Lower LLVM optimisation halves XLA's CPU compile time; the numerics do not depend on it.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
  proc = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "train_haiku.py"), "--tiny"],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert re.search(r"^bf16 +0 FP8 layers, skipped none, 0 of \d+ GEMMs", out, re.M), out
  # Every projection of the attention, the MLP and the logits layer went through FP8.
  # 7 layers, 3 FP8 GEMMs each (forward, dgrad, wgrad); attention's own products stay in bf16.
  for name in ("current", "delayed"):
    assert re.search(
      rf"^{name} +7 FP8 layers, skipped none, 21 of \d+ GEMMs per step with FP8", out, re.M
    ), out
  final = dict(
    (name, float(value))
    for name, value in re.findall(r"(\w+) (\d+\.\d+)", out.split("mean of the last steps:")[1])
  )
  assert set(final) == {"bf16", "current", "delayed"}
  assert final["bf16"] < math.log(32) - 1.0  # it learned (chance is log(vocab) = 3.47)
  for name in ("current", "delayed"):
    assert abs(final[name] - final["bf16"]) < 0.1, out
  # Progress while training, on stderr: after the first step (which compiles), then every
  # log_every = 20 steps of the 100, each with its loss and the time per step.
  progress = re.findall(
    r"^(\w+): step (\d+)/100 loss (\d+\.\d{4}) (\d+\.\d) ms/step", proc.stderr, re.M
  )
  steps = [1, 20, 40, 60, 80, 100]
  assert [(name, int(step)) for name, step, _, _ in progress] == [
    (name, step) for name in ("bf16", "current", "delayed") for step in steps
  ], proc.stderr[-3000:]
  last = {name: float(loss) for name, step, loss, _ in progress if step == "100"}
  assert last["bf16"] < math.log(32) - 1.0 and all(float(ms) > 0 for *_, ms in progress)
