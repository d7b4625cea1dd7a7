"""Per-kernel GPU time of one seed-000 Dense fwd+bwd step, from a JAX profiler (perfetto) trace.

Usage: python bench/profile_step.py OUT_DIR [variant ...]; variants: bf16, flax, current, delayed.
Prints, per variant, the kernels sorted by time per step, and writes the compiled HLO.
"""

import os
import sys

import jax
import jax.numpy as jnp

import te_adapters as ta
import te_adapters.linen

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import speed as _bench  # noqa: E402

out_dir = sys.argv[1]
variants = sys.argv[2:] or ["bf16", "delayed"]
small = os.environ.get("PROFILE_SMALL") == "1"
batch, seq, hidden, out = (2, 64, 256, 512) if small else (8, 2048, 8192, 32768)
k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
dy = jax.random.normal(k_dy, (batch, seq, out)).astype(jnp.bfloat16)
classes = {"bf16": lambda: None, "flax": _bench.nn.Fp8DirectDotGeneralOp,
           "current": ta.linen.make_dot_general_cls(ta.Float8CurrentScaling(), threshold=None),
           "delayed": ta.linen.make_dot_general_cls(ta.DelayedScaling(), threshold=None)}
steps = 3
for name in variants:
  model = _bench._make_dense(out)(classes[name])
  variables = model.init(k_init, x)
  step = _bench._speedometer(model.apply)
  compiled = step.lower(variables, x, dy).compile()
  with open(os.path.join(out_dir, f"hlo_{name}.txt"), "w") as f:
    f.write(compiled.as_text())
  for _ in range(3):
    jax.block_until_ready(step(variables, x, dy))
  per_kernel = _bench.gpu_kernel_ms(step, (variables, x, dy), steps)
  total = sum(per_kernel.values())
  if not per_kernel:
    print("no GPU kernel events in the profiler trace")
  print(f"\n== {name}: {total:.2f} ms of GPU kernels per step (device tracks, may double count)")
  for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:18]:
    print(f"  {v:8.3f} ms  {k[:110]}")
