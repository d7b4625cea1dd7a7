"""Per-kernel GPU time of seed 001's LayerNorm + MLP block (``python -m bench --cases mlp``).

Usage (on a GPU, from the repository root):
  python bench/profile_mlp.py [--variants bf16,current-fused,current-unfused] [--top 20]

Variants: ``bf16`` (plain Flax), ``flax-current``/``flax-delayed`` (Flax's modules with our
``dot_general``), ``current``/``delayed`` (``te_adapters.linen.LayerNormMLP`` with the default
``GemmConfig``), ``-fused``/``-unfused`` after either (``fuse_activation_cast=True``/``False``:
the fused casts, or the activation between two ``dot_general`` calls), ``-jax`` (the default path
with every cast in XLA's fusions instead of the extension's kernels: ``backend="jax"``). Prints, per
variant, the GPU time per fwd+bwd step grouped by kind (``bench/profile_convergence.py``'s
kinds), the FP8 GEMM count, the GPU's idle time between kernels with its longest gaps (where the
host did not keep the GPU busy) and the gaps' sizes, and the kernels that take the most time.

The wall-clock step time depends on how long the GPU has run: an H100 at its 700 W power limit
lowers its SM clock, so a step timed over 100 steps is slower than one timed over 5, and slower
than the kernel time of a short profile. ``--timed-steps 5,20,100 --clocks`` shows that: each
length timed, with the SM clock and power that nvidia-smi sampled meanwhile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import te_adapters as ta  # noqa: E402
from bench import speed  # noqa: E402
from bench.profile_convergence import kind  # noqa: E402


class _Clocks:
  """Samples the GPU's SM clock (MHz) and power draw (W) every 20 ms with nvidia-smi while
  active; ``summary()`` gives their medians and the lowest clock."""

  def __init__(self, active: bool):
    self.active, self.proc, self.lines = active, None, []

  def __enter__(self):
    if self.active:
      self.proc = subprocess.Popen(
        [
          "nvidia-smi",
          "--query-gpu=clocks.sm,power.draw",
          "--format=csv,noheader,nounits",
          "-lms",
          "20",
        ],
        stdout=subprocess.PIPE,
        text=True,
      )
    return self

  def __exit__(self, *exc):
    if self.proc is not None:
      self.proc.terminate()
      self.lines = self.proc.communicate()[0].splitlines()

  def summary(self) -> str:
    rows = []
    for line in self.lines:  # a "[N/A]" field or a line cut short by terminate() is skipped
      try:
        rows.append([float(v) for v in line.split(",")][:2])
      except ValueError:
        continue
    rows = [r for r in rows if len(r) == 2]
    if not rows:
      return ""
    clock = sorted(r[0] for r in rows)
    power = sorted(r[1] for r in rows)
    return (
      f" [SM clock median {clock[len(clock) // 2]:.0f} MHz, lowest {clock[0]:.0f}; "
      f"power median {power[len(power) // 2]:.0f} W; {len(rows)} samples]"
    )


def model_for(name, hidden, intermediate):
  recipes = {"current": ta.Float8CurrentScaling(), "delayed": ta.DelayedScaling()}
  if name == "bf16":
    return speed._FlaxLnMlp(hidden, intermediate)
  if name.startswith("flax-"):
    cls = speed.ta_linen.make_dot_general_cls(recipes[name[5:]], threshold=None)
    return speed._FlaxLnMlp(hidden, intermediate, cls)
  recipe, _, path = name.partition("-")
  config = {
    "": None,  # the default: fused
    "fused": ta.core.GemmConfig(fuse_activation_cast=True),
    "unfused": ta.core.GemmConfig(fuse_activation_cast=False),
    "jax": ta.core.GemmConfig(backend="jax"),
  }[path]
  return speed.te_layernorm_mlp(intermediate, recipes[recipe], config)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    "--variants", default="bf16,current-fused,current-unfused,delayed-fused,delayed-unfused"
  )
  p.add_argument("--size", default="4x2048x4096x16384", help="batch x seq x hidden x intermediate")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=20)
  p.add_argument(
    "--timed-steps",
    default="20",
    help="steps per timed repeat of the wall-clock step time (3 repeats; 0: none); "
    "a comma-separated list times each",
  )
  p.add_argument(
    "--clocks",
    action="store_true",
    help="sample the GPU's SM clock and power with nvidia-smi while steps are timed",
  )
  args = p.parse_args(argv)
  batch, seq, hidden, intermediate = (int(s) for s in args.size.split("x"))
  x = jax.random.normal(jax.random.PRNGKey(7), (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(8), (batch, seq, hidden)).astype(jnp.bfloat16)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, size {args.size}")
  for name in args.variants.split(","):
    model = model_for(name, hidden, intermediate)
    kw = {"deterministic": True} if isinstance(model, speed.ta_linen.LayerNormMLP) else {}
    variables = model.init(jax.random.PRNGKey(7), x, **kw)

    def apply_fn(v, x, model=model, kw=kw):
      y = model.apply(v, x, **kw)
      return y[0] if isinstance(y, tuple) else y

    step = speed._speedometer(apply_fn)
    variables = speed.trained_state(step, variables, x, dy)
    fp8 = speed._count_cublas_fp8(step, (variables, x, dy))
    events = speed.gpu_trace_events(step, (variables, x, dy), args.steps)
    per_kernel = speed.kernel_ms(events, args.steps)
    idle, gaps = speed.gpu_idle(events, args.steps)
    _, every_gap = speed.gpu_idle(events, args.steps, top=None)
    total = sum(per_kernel.values())
    groups: dict[str, float] = {}
    for k, v in per_kernel.items():
      groups[kind(k)] = groups.get(kind(k), 0.0) + v
    wall = ""
    for steps in (int(s) for s in args.timed_steps.split(",")):
      if not steps:
        continue
      with _Clocks(args.clocks) as clocks:
        ms, spread = speed._timed(step, (variables, x, dy), steps, 3)
      wall += f"; {steps} steps: {ms:.3f} ms wall a step (spread {spread:.3f}){clocks.summary()}"
    print(f"\n== {name}: {total:.3f} ms of GPU kernels per step{wall}; cuBLASLt FP8 GEMMs {fp8}")
    for label, v in sorted(groups.items(), key=lambda kv: -kv[1]):
      print(f"  {v:8.3f} ms  {label}")
    print(f"  {idle:8.3f} ms  GPU idle between kernels; the longest gaps (all steps):")
    for gap, before, after in gaps:
      print(f"    {gap / 1e3:7.3f} ms  after {before[:60]}  before {after[:60]}")
    for low, high in ((0, 5), (5, 20), (20, 100), (100, float("inf"))):
      sizes = [g for g, _, _ in every_gap if low <= g < high]
      print(
        f"    gaps of {low}-{high} us: {len(sizes) / args.steps:.1f} a step, "
        f"{sum(sizes) / args.steps / 1e3:.3f} ms a step"
      )
    print(f"    {len(events) / args.steps:.0f} GPU events a step")
    for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
      print(f"    {v:7.3f} ms  {k[:140]}")


if __name__ == "__main__":
  main()
