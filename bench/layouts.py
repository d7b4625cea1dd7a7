"""Seed 000's Dense step under each internal GEMM formulation (the measurement-only fields of
``GemmConfig``: output mode x transpose), in one process, beside bf16 and Flax's fp8 op.
Usage: python bench/layouts.py [--small]"""

import os
import sys

import jax
import jax.numpy as jnp

import te_adapters as ta
import te_adapters.linen

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import speed as _bench  # noqa: E402

small = "--small" in sys.argv
batch, seq, hidden, out = (2, 64, 256, 512) if small else (8, 2048, 8192, 32768)
steps = 2 if small else 20
k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
dy = jax.random.normal(k_dy, (batch, seq, out)).astype(jnp.bfloat16)
rows = []


def run(name, apply_fn, variables):
  step = _bench._speedometer(apply_fn)
  ms, spread = _bench._timed(step, (variables, x, dy), steps, 3)
  rows.append(dict(case="seed000 dense", variant=name, ms=ms, spread_ms=spread,
                   cublas_fp8=_bench._count_cublas_fp8(step, (variables, x, dy))))
  print(f"  {name:<40}{ms:9.2f} ms (spread {spread:.2f}, compile+first step "
        f"{_bench._timed.last_compile_s:.0f} s) {rows[-1]['cublas_fp8']}", flush=True)


make = _bench._make_dense(out)
for name, cls in [("bf16", lambda: None), ("flax Fp8DirectDotGeneralOp",
                                            _bench.nn.Fp8DirectDotGeneralOp)]:
  model = make(cls)
  run(name, model.apply, model.init(k_init, x))
for output in ("f32", "direct", "mixed"):
  for transpose in ("cast", "fp8"):
    config = ta.GemmConfig(output=output, transpose=transpose)
    for label, recipe in [("current", ta.Float8CurrentScaling()),
                          ("delayed", ta.DelayedScaling())]:
      model = make(ta.linen.make_dot_general_cls(recipe, threshold=None, config=config))
      run(f"{label} out={output} t={transpose}", model.apply, model.init(k_init, x))
print(_bench.format_table(rows))
