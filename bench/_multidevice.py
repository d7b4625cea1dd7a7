"""What bench/spmd.py and bench/mesh2x2.py share: the CPU dry run's virtual devices (set before
JAX is imported) and the timing of synchronised steps."""

from __future__ import annotations

import os
import time


def add_common_arguments(p) -> None:
  """Seed 000's shape, and the timing and dry-run flags of both scripts."""
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=8192)
  p.add_argument("--features", type=int, default=32768)
  p.add_argument("--iters", type=int, default=20, help="timed steps per trial")
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--trials", type=int, default=3, help="the median over trials is reported")
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=None,
    help="run on this many virtual CPU devices (sets XLA_FLAGS; for a dry run)",
  )


def use_cpu_devices(count: int | None) -> None:
  """With ``count``: run on that many virtual CPU devices. Call before importing JAX."""
  if count:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
      f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    ).strip()


def time_steps(
  step_once, iters: int, warmup: int, trials: int, sync_each_step: bool = True
) -> float:
  """ms per step: the median over ``trials`` of the mean of ``iters`` steps, each step ended by
  ``block_until_ready``, after ``warmup`` steps. ``sync_each_step=False``: the ``iters`` steps
  of a trial run back to back and only the last is waited for (the host dispatches the next
  step while the devices run this one, as in a training loop)."""
  import jax
  import numpy as np

  for _ in range(warmup):
    jax.block_until_ready(step_once())
  per_trial = []
  for _ in range(trials):
    if not sync_each_step:
      start = time.perf_counter()
      out = None
      for _ in range(iters):
        out = step_once()
      jax.block_until_ready(out)
      per_trial.append((time.perf_counter() - start) / iters)
      continue
    times = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(step_once())
      times.append(time.perf_counter() - start)
    per_trial.append(float(np.mean(times)))
  return float(np.median(per_trial)) * 1e3
