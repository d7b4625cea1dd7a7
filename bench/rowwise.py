"""Seed 000's Dense under Float8RowwiseScaling beside bf16 and current scaling, one call.

The model and step are ``python -m bench``'s seed 000 Dense through Linen (``bench.speed``): a
training step (forward, dx, dW) of ``nn.Dense`` with the recipe's ``dot_general``, bfloat16
activations and a float32 kernel, on the trained recipe state. Rowwise runs as the library runs
it (on Hopper the extension's cuBLASLt GEMM with unit scales, the row and column factors
multiplied into its bfloat16 output in a pass after it, the operands cast by the extension's two
CUDA passes), with its weight gradient in high precision, with ``GemmConfig(fp8_gemm="xla")``
(XLA's FP8 dot in place of the extension's, the same pass after it) and with
``GemmConfig(backend="jax")`` (the casts in XLA's fusions). The variants are timed in
turns, one repeat of ``--steps`` steps each, for ``--repeats`` rounds; the table gives the median
(and spread) per variant, its speed against bf16 and against current scaling, and the compiled
program's FP8 GEMMs / other GEMMs. ``--casts`` also times the quantization alone (both copies of
seed 000's x, kernel and gradient) with the extension's passes and with XLA's fusions.

Usage (on the GPU, the extension built):
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m bench.rowwise --repeats 5
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_adapters as ta
from bench import speed
from te_adapters import core, inspect
from te_adapters import linen as ta_linen


def variants(full_size: bool):
  batch, seq, hidden, features = (8, 2048, 8192, 32768) if full_size else (2, 64, 256, 512)
  k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(k_dy, (batch, seq, features)).astype(jnp.bfloat16)
  recipes = [
    ("current", ta.Float8CurrentScaling()),
    ("rowwise", ta.Float8RowwiseScaling()),
    ("rowwise, wgrad high precision", ta.Float8RowwiseScaling(weight_grad_high_precision=True)),
  ]
  make = speed._make_dense(features)
  models = speed._linen_variants(make, recipes, False)
  for label, config in (
    ("linen rowwise, XLA's FP8 dot", core.GemmConfig(fp8_gemm="xla")),
    ("linen rowwise, XLA's casts", core.GemmConfig(backend="jax")),
  ):
    cls = ta_linen.make_dot_general_cls(ta.Float8RowwiseScaling(), threshold=None, config=config)
    models.append((label, make(cls)))
  out = []
  for name, model in models:
    step = speed._speedometer(model.apply)
    state = speed.trained_state(step, model.init(k_init, x), x, dy)
    out.append((name, step, (state, x, dy)))
  return out


def time_casts(full_size: bool, repeats: int, steps: int):
  """ms per quantization of both copies of each operand, the extension's passes vs XLA's."""
  t, h, f = (16384, 8192, 32768) if full_size else (128, 256, 512)
  recipe = ta.Float8RowwiseScaling()
  fmt = core.format_of(recipe)
  operands = [("x", (t, h), "x"), ("kernel^T", (f, h), "kernel"), ("dy", (t, f), "grad")]
  print(f"{'rowwise cast (both copies)':30} {'extension ms':>12} {'XLA ms':>8}")
  for name, shape, role in operands:
    x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.bfloat16)
    ms = []
    for backend in ("auto", "jax"):
      config = core.GemmConfig(backend=backend)
      fn = jax.jit(
        lambda x, role=role, config=config: fmt.quantize(
          core.QuantizeRequest(x, role, recipe, config=config)
        )
      )
      jax.block_until_ready(fn(x))
      runs = []
      for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
          out = fn(x)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / steps * 1e3)
      ms.append(float(np.median(runs)))
    print(f"{name + ' ' + str(shape):30} {ms[0]:12.3f} {ms[1]:8.3f}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--small", action="store_true", help="small sizes (a dry run off the GPU)")
  p.add_argument("--json", default=None)
  p.add_argument("--casts", action="store_true", help="also time the casts alone")
  args = p.parse_args(argv)
  if args.casts:
    time_casts(not args.small, args.repeats, args.steps)
  rows = []
  runs = variants(not args.small)
  for name, step, call in runs:
    jax.block_until_ready(step(*call))
    fp8, other = inspect.count_fp8_gemms(step.lower(*call).compile().as_text())
    rows.append(dict(variant=name, fp8_gemms=fp8, other_gemms=other, ms=[]))
  for _ in range(args.repeats):
    for row, (_, step, call) in zip(rows, runs, strict=True):
      start = time.perf_counter()
      for _ in range(args.steps):
        out = step(*call)
      jax.block_until_ready(out)
      row["ms"].append((time.perf_counter() - start) / args.steps * 1e3)
  base = next(np.median(r["ms"]) for r in rows if r["variant"] == "bf16")
  current = next(np.median(r["ms"]) for r in rows if r["variant"] == "linen current")
  print(f"device: {jax.devices()[0].device_kind}; {args.repeats} rounds of {args.steps} steps")
  print(
    f"{'variant':38} {'ms':>8} {'spread':>7} {'vs bf16':>8} {'/ current':>9}  FP8 GEMMs / other"
  )
  for r in rows:
    ms = np.median(r["ms"])
    r["median_ms"] = float(ms)
    print(
      f"{r['variant']:38} {ms:8.2f} {np.ptp(r['ms']):7.2f} {base / ms:8.3f}x "
      f"{ms / current:9.3f}  {r['fp8_gemms']} / {r['other_gemms']}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
