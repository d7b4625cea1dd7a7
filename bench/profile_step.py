"""Per-kernel GPU time of one seed-000 Dense fwd+bwd step, from a JAX profiler (perfetto) trace.

Usage: python bench/profile_step.py OUT_DIR [variant ...]; variants: bf16, flax, qwix, current,
delayed, current-fast, delayed-fast (the last two with fast sums in every GEMM,
``speed.fast_sums``).
Prints, per variant, the wall time per step, the kernels sorted by time per step, the GPU's idle
time within the traced steps with its longest gaps, and writes the compiled HLO. The recipe state
is the one after three training steps (``speed.trained_state``); ``PROFILE_INITIAL_STATE=1`` keeps
the initial state instead (DelayedScaling's scale of 1), to show what that changes.
"""

import os
import sys

import jax
import jax.numpy as jnp

import te_adapters as ta
import te_adapters.linen

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import speed as _bench  # noqa: E402
from bench.qwix_variants import qwix_variants  # noqa: E402

out_dir = sys.argv[1]
variants = sys.argv[2:] or ["bf16", "delayed"]
small = os.environ.get("PROFILE_SMALL") == "1"
batch, seq, hidden, out = (2, 64, 256, 512) if small else (8, 2048, 8192, 32768)
k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
dy = jax.random.normal(k_dy, (batch, seq, out)).astype(jnp.bfloat16)


def _ours(recipe):
  return ta.linen.make_dot_general_cls(recipe, threshold=None)


classes = {
  "bf16": lambda: None,
  "flax": _bench.nn.Fp8DirectDotGeneralOp,
  "current": _ours(ta.Float8CurrentScaling()),
  "delayed": _ours(ta.DelayedScaling()),
  "current-fast": _ours(_bench.fast_sums(ta.Float8CurrentScaling())),
  "delayed-fast": _ours(_bench.fast_sums(ta.DelayedScaling())),
}
make = _bench._make_dense(out)
steps = 3
for name in variants:
  if name == "qwix":
    found = [m for n, m in qwix_variants(make) if "dgrad" in n]
    if not found:
      print("qwix does not import here")
      continue
    model = found[0]
  else:
    model = make(classes[name])
  variables = model.init(k_init, x)
  step = _bench._speedometer(model.apply)
  if not os.environ.get("PROFILE_INITIAL_STATE"):
    variables = _bench.trained_state(step, variables, x, dy)
  compiled = step.lower(variables, x, dy).compile()
  with open(os.path.join(out_dir, f"hlo_{name}.txt"), "w") as f:
    f.write(compiled.as_text())
  wall_ms, spread = _bench._timed(step, (variables, x, dy), 10, 3)
  events = _bench.gpu_trace_events(step, (variables, x, dy), steps)
  per_kernel = _bench.kernel_ms(events, steps)
  idle, gaps = _bench.gpu_idle(events, steps)
  total = sum(per_kernel.values())
  fp8 = _bench._count_cublas_fp8(step, (variables, x, dy))
  if not per_kernel:
    print("no GPU kernel events in the profiler trace")
  print(
    f"\n== {name}: wall {wall_ms:.2f} ms (spread {spread:.2f}), {total:.2f} ms of GPU kernels"
    f" per step (device tracks, may double count), GPU idle {idle:.3f} ms per step,"
    f" FP8/other GEMMs {fp8}"
  )
  for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:14]:
    print(f"  {v:8.3f} ms  {k[:110]}")
  for gap, before, after in gaps:
    print(f"  gap {gap:8.1f} us  after {before[:50]}  before {after[:50]}")
