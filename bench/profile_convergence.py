"""Per-kernel GPU time of one training step of bench/convergence.py's model, per recipe.

Usage (on a GPU, from the repository root):
  python bench/profile_convergence.py [--size gpu] [--adapter nnx] [--recipes bf16,current,block]

Prints, per recipe, the GPU time per step grouped by kind of kernel (GEMMs, the library's casts,
XLA's fusions, the rest) and the kernels that take the most time, from a JAX profiler trace of a
few steps after warm-up (``bench/speed.py``'s ``gpu_kernel_ms``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import convergence as conv  # noqa: E402
from bench import speed  # noqa: E402

# Substrings of kernel names, first match wins.
KINDS = (
  ("GEMM (cuBLAS/CUTLASS)", ("gemm", "xmma", "nvjet", "cutlass", "cublas")),
  ("library casts and amax (FFI)", ("te_adapters", "cast_transpose", "amax", "quantize")),
  ("XLA fusions", ("fusion", "loop_", "input_", "reduce", "transpose", "copy", "convert")),
)


def kind(name: str) -> str:
  lower = name.lower()
  for label, keys in KINDS:
    if any(k in lower for k in keys):
      return label
  return "other"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="gpu", choices=sorted(conv.SIZES))
  p.add_argument("--adapter", default="nnx", choices=sorted(conv.TRAINERS))
  p.add_argument("--recipes", default="bf16,current,block")
  p.add_argument("--steps", type=int, default=3, help="profiled steps")
  p.add_argument("--top", type=int, default=15)
  p.add_argument(
    "--hlo-dir",
    default=None,
    help="write each recipe's compiled step (HLO text) here, to read its fusions",
  )
  args = p.parse_args(argv)
  size = conv.SIZES[args.size]
  corpus = conv.stdlib_corpus()
  sample = jnp.asarray(conv.train_batch(corpus, size, 0, 0))
  threshold = None if size.fp8_everywhere else conv.core.DEFAULT_SIZE_THRESHOLD
  print(f"device: {jax.devices()[0].device_kind}, size {args.size}, adapter {args.adapter}")
  for name in args.recipes.split(","):
    recipe = conv.RECIPES[name]()
    trainer = conv.TRAINERS[args.adapter](
      size, recipe, threshold, 0, conv.optimizer(size, 100), sample
    )
    step = jax.jit(trainer.step)
    compiled = step.lower(trainer.carry, sample).compile()
    gemms = conv.count_gemms(trainer.step, trainer.carry, sample, compiled.as_text())
    if args.hlo_dir:
      os.makedirs(args.hlo_dir, exist_ok=True)
      with open(os.path.join(args.hlo_dir, f"step_{args.adapter}_{name}.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    per_kernel = speed.gpu_kernel_ms(step, (trainer.carry, sample), args.steps)
    total = sum(per_kernel.values())
    groups: dict[str, float] = {}
    for k, v in per_kernel.items():
      groups[kind(k)] = groups.get(kind(k), 0.0) + v
    print(
      f"\n== {name}: {total:.2f} ms of GPU kernels per step; FP8 GEMMs {gemms['fp8_gemms']} "
      f"of {gemms['gemms']}"
    )
    for label, v in sorted(groups.items(), key=lambda kv: -kv[1]):
      print(f"  {v:8.2f} ms  {label}")
    for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
      print(f"    {v:7.3f} ms  {k[:120]}")


if __name__ == "__main__":
  main()
