"""What bench/spmd.py and bench/mesh2x2.py share: the CPU dry run's virtual devices and the
named NCCL settings (both set before JAX is imported), the timing of synchronised steps, and the
order of GEMMs and collectives in a compiled program."""

from __future__ import annotations

import os
import re
import time

# --nccl: NCCL settings the user gives a job through its environment, by name. NCCL reads them
# when a communicator is created, so one process runs with one of them. NCCL_MAX_CTAS caps the
# blocks (one SM each) a collective takes (NCCL 2.28 took 24 for the two-GPU all-reduces of
# bench/mesh2x2.py on H100s), so that it fits in the SMs a GEMM beside it leaves free
# (GemmConfig.comm_sm_margin).
NCCL_CONFIGS = {
  "default": {},
  "ctas8": {"NCCL_MAX_CTAS": "8"},
  "ctas16": {"NCCL_MAX_CTAS": "16"},
}


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
    "--nccl",
    choices=sorted(NCCL_CONFIGS),
    default="default",
    help="named NCCL settings, set in the environment before JAX starts: "
    + "; ".join(f"{k}: {v or 'none'}" for k, v in NCCL_CONFIGS.items()),
  )
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


def use_nccl_config(name: str) -> dict:
  """Sets the NCCL environment variables of ``NCCL_CONFIGS[name]``; call before importing JAX.
  Returns them (recorded beside the figures)."""
  env = NCCL_CONFIGS[name]
  os.environ.update(env)
  return dict(env)


def schedule(text: str) -> list[str]:
  """The entry computation's GEMMs and collectives of compiled HLO, in program order (the order
  XLA's scheduler chose): ``gemm``/``fp8 gemm`` and the collectives' op names."""
  from te_adapters import inspect

  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
  if start is None:
    return []
  out = []
  for line in lines[start + 1 :]:
    if line.startswith("}"):
      break
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
    if not m:
      continue
    op = m.group(1)
    if op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute") or op.endswith(
      ("-start", "-done")
    ):
      out.append(op)
    elif "gemm" in line.lower() and op in ("custom-call", "fusion"):
      fp8, _ = inspect.count_fp8_gemms(line)
      out.append("fp8 gemm" if fp8 else "gemm")
  return out


def gemm_sm_margins(text: str) -> list[int]:
  """The ``sm_margin`` of each of the extension's GEMM calls in compiled GPU HLO, sorted (SMs
  the GEMM left free; 0: every SM)."""
  calls = [
    line for line in text.splitlines() if 'custom_call_target="te_adapters_block_gemm"' in line
  ]
  return sorted(int(m) for line in calls for m in re.findall(r"sm_margin\s*=\s*(\d+)", line))


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
