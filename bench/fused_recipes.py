"""``core.layernorm_mlp``'s training step under each recipe, fused against composed.

    python bench/fused_recipes.py [--shape 8192x4096x16384] [--activations gelu]
                                  [--recipes float8_block,rowwise,current] [--steps 20]

For each recipe, times one jitted training step of the block (the output and the gradients of
x, both kernels, both biases, the norm's parameters and the states: ``jax.value_and_grad``) on x
(M, K) bfloat16 with float32 parameters, on the default ``GemmConfig``'s path, on the fused path
(``GemmConfig(fuse_activation_cast=True)``: the norm's and the activation's float32 outputs
quantized as they are computed) and on the composed one (``fuse_activation_cast=False``), and
fused with XLA's casts only (``backend="jax"``), interleaved, the median of ``--repeats`` runs
of ``--steps`` steps. Prints the FP8 GEMMs of each compiled step (``te_adapters.inspect``) and
whether the step took the fused path (one run of the quantized GEMM rule).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_adapters as ta  # noqa: E402
from te_adapters import core  # noqa: E402

RECIPES = {
  "float8_block": ta.Float8BlockScaling(),
  "rowwise": ta.Float8RowwiseScaling(),
  "mxfp8": ta.MXFP8BlockScaling(),
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(),
}
PATHS = {
  "default": core.GemmConfig(),
  "fused": core.GemmConfig(fuse_activation_cast=True),
  # The fused path with every cast XLA's fusion (no extension cast kernel reads a written value).
  "fused, jax casts": core.GemmConfig(fuse_activation_cast=True, backend="jax"),
  "composed": core.GemmConfig(fuse_activation_cast=False),
}


def _step(recipe, config, acts, g, b):
  def loss(x, wi, wo, bi, bo, g, b, states):
    out, _ = core.layernorm_mlp(
      x,
      g,
      b,
      wi,
      wo,
      bi,
      bo,
      activations=acts,
      recipe=recipe,
      states=states,
      threshold=None,
      config=config,
    )
    return jnp.sum(out.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8))))


def _fused(recipe, config, acts, args):
  def fwd(x, wi, wo, bi, bo, g, b, states):
    return core.layernorm_mlp(
      x,
      g,
      b,
      wi,
      wo,
      bi,
      bo,
      activations=acts,
      recipe=recipe,
      states=states,
      threshold=None,
      config=config,
    )[0]

  return str(jax.make_jaxpr(fwd)(*args)).count("name=_quantized_gemms") == 1


def _time(step, args, steps):
  start = time.perf_counter()
  for _ in range(steps):
    out = step(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps * 1e3


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", default="8192x4096x16384", help="MxKxF")
  parser.add_argument("--activations", default="gelu")
  parser.add_argument("--recipes", default="float8_block,rowwise,current")
  parser.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ", ".join(PATHS))
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  m, k, f = (int(s) for s in args.shape.split("x"))
  acts = tuple(args.activations.split(","))
  n_act = len(acts)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  wi = jax.random.normal(keys[1], (k, n_act, f), jnp.float32) / math.sqrt(k)
  wo = jax.random.normal(keys[2], (f, k), jnp.float32) / math.sqrt(f)
  bi, bo = jnp.zeros((n_act, f)), jnp.zeros((k,))
  g, b = jnp.ones(k), jnp.zeros(k)
  print(
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}, x {m}x{k} bf16, F {f}, "
    f"activations {acts}, {args.repeats} x {args.steps} steps"
  )
  print("| recipe | path | ms/step (median) | runs (ms) | FP8 GEMMs / other GEMMs | fused rule |")
  print("|---|---|---|---|---|---|")
  paths = {p: PATHS[p] for p in args.paths.split(",")}
  for name in args.recipes.split(","):
    recipe = RECIPES[name]
    states = None
    if core.init_state(recipe):
      states = (core.init_state(recipe), core.init_state(recipe))
    call = (x, wi, wo, bi, bo, g, b, states)
    steps, info = {}, {}
    for path, config in paths.items():
      steps[path] = _step(recipe, config, acts, g, b)
      hlo = steps[path].lower(*call).compile().as_text()
      fp8, other = ta.inspect.count_fp8_gemms(hlo)
      info[path] = (f"{fp8} / {other}", _fused(recipe, config, acts, call))
      jax.block_until_ready(steps[path](*call))  # compile and warm up
    runs = {path: [] for path in paths}
    for _ in range(args.repeats):  # interleaved
      for path in paths:
        runs[path].append(_time(steps[path], call, args.steps))
    med = {path: statistics.median(r) for path, r in runs.items()}
    for path in paths:
      shown = ", ".join(f"{t:.2f}" for t in runs[path])
      print(
        f"| {name} | {path} | {med[path]:.2f} | {shown} | {info[path][0]} | "
        f"{'yes' if info[path][1] else 'no'} |"
      )
    if "composed" in med and "fused" in med:
      print(f"| {name} | composed / fused | {med['composed'] / med['fused']:.3f} | | | |")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
