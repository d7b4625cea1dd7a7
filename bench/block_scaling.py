"""Times a Dense layer's forward and backward pass under the block-scaled recipes against bf16.

Run on a GPU from the repository root:

  python bench/block_scaling.py                      # seed 000's shape: x 8x2048x8192, W 8192x32768
  python bench/block_scaling.py --tokens 4096 --hidden 4096 --features 4096

Each step is ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` with
``loss = vdot(dense(x, W), dy)`` (bf16 activations, float32 kernel computed in bf16), timed with
``block_until_ready`` after every call; the table gives the median of several repeats. It also
counts the FP8 cuBLASLt GEMMs in the compiled program, so an FP8 path that silently fell back to
a bf16 GEMM shows up. On Hopper, MXFP8 and NVFP4 run emulated (bf16 GEMMs of the dequantized
values) and ``Float8BlockScaling`` runs cuBLASLt's block-scaled FP8 GEMM when the extension has it
(``GemmConfig(block_gemm="xla")``: one FP8 GEMM per 128-wide K slice instead).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_adapters as ta

VARIANTS = {
  "bf16": None,
  "Float8CurrentScaling": ta.Float8CurrentScaling(),
  "Float8BlockScaling": ta.Float8BlockScaling(),
  "MXFP8BlockScaling": ta.MXFP8BlockScaling(),
  "NVFP4BlockScaling": ta.NVFP4BlockScaling(),
}


def make_step(recipe, dn):
  def loss(kernel, x, dy, key):
    k = kernel.astype(jnp.bfloat16)
    if recipe is None:
      y = jax.lax.dot_general(x, k, dn)
    else:
      rng = key if recipe.uses_rng else None
      y = ta.core.dot_general(x, k, dn, recipe=recipe, rng=rng, threshold=None)
    return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_step(step, args, iters: int, repeats: int) -> float:
  jax.block_until_ready(step(*args))
  medians = []
  for _ in range(repeats):
    times = []
    for _ in range(iters):
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      times.append(time.perf_counter() - start)
    medians.append(statistics.median(times))
  return 1e3 * statistics.median(medians)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--hidden", type=int, default=8192)
  parser.add_argument("--features", type=int, default=32768)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  b, s, h, f = args.batch, args.tokens, args.hidden, args.features
  x = jnp.asarray(rng.standard_normal((b, s, h), np.float32), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((b, s, f), np.float32), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((h, f), np.float32) / np.sqrt(h))
  dn = (((2,), (0,)), ((), ()))
  key = jax.random.key(0)

  device = jax.devices()[0]
  print(f"device: {device.device_kind}; jax {jax.__version__}; {datetime.date.today()}")
  print(f"x {b}x{s}x{h} bf16, kernel {h}x{f} float32 (computed in bf16), fwd + bwd\n")
  print("| variant | ms | vs bf16 | FP8 GEMMs (cuBLASLt + block kernel) |")
  print("|---|---|---|---|")
  base = None
  for name in args.variants:
    step = make_step(VARIANTS[name], dn)
    step_args = (kernel, x, dy, key)
    hlo = step.lower(*step_args).compile().as_text()
    fp8_gemms = hlo.count("__cublas$lt$matmul$f8") + hlo.count(
      'custom_call_target="te_adapters_block_gemm"'
    )
    ms = time_step(step, step_args, args.iters, args.repeats)
    base = ms if name == "bf16" else base
    ratio = f"{base / ms:.2f}x" if base else "-"
    print(f"| {name} | {ms:.1f} | {ratio} | {fp8_gemms} |")


if __name__ == "__main__":
  main()
