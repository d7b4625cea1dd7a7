"""Whether XLA fuses the activation of ``core.layernorm_mlp`` into the FP8 cast of GEMM 2's input.

    python bench/mlp_fusion.py [--shape 8192x4096x16384] [--activations gelu | gelu,linear]
                               [--paths fused,unfused]

For each recipe (current, delayed) and path (the fused activation casts, and
``GemmConfig(fuse_activation_cast=False)``), compiles the forward pass of ``layernorm_mlp`` as
the training step runs it (``jax.vjp``: the output and the residuals) on x (M, K) bfloat16 with
float32 kernels, and lists every instruction of the optimized program's entry computation that
writes a buffer of GEMM 2's input size (M x F elements) or of GEMM 1's output (M x n_act x F)
that is not FP8. GEMM 1's output is written once in bfloat16 (the activation's backward needs
it); fused, no bfloat16 (M, F) buffer is listed: the activation's output is computed inside the
fusions that take GEMM 2's amax and write its FP8 copies.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_adapters as ta  # noqa: E402
from bench.layernorm_fusion import _activation_buffers  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", default="8192x4096x16384", help="MxKxF")
  parser.add_argument("--activations", default="gelu")
  parser.add_argument(
    "--paths",
    default="fused,unfused",
    help="comma list: fused (the default GemmConfig), unfused "
    "(GemmConfig(fuse_activation_cast=False))",
  )
  args = parser.parse_args()
  m, k, f = (int(s) for s in args.shape.split("x"))
  acts = tuple(args.activations.split(","))
  n_act = len(acts)
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  wi = jax.random.normal(jax.random.key(1), (k, n_act, f), jnp.float32) / math.sqrt(k)
  wo = jax.random.normal(jax.random.key(2), (f, k), jnp.float32) / math.sqrt(f)
  g, b = jnp.ones(k), jnp.zeros(k)
  print(
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}, x {m}x{k} bf16, F {f}, "
    f"activations {acts}"
  )
  configs = {"fused": None, "unfused": ta.core.GemmConfig(fuse_activation_cast=False)}
  for recipe, label in itertools.product(
    (ta.Float8CurrentScaling(), ta.DelayedScaling()), args.paths.split(",")
  ):
    states = None
    if ta.core.init_state(recipe):
      states = (ta.core.init_state(recipe), ta.core.init_state(recipe))

    def fwd(x, wi, wo, states, recipe=recipe, config=configs[label]):
      def f(x, wi, wo, states):
        return ta.core.layernorm_mlp(
          x,
          g,
          b,
          wi,
          wo,
          activations=acts,
          recipe=recipe,
          states=states,
          threshold=None,
          config=config,
        )[0]

      return jax.vjp(f, x, wi, wo, states)

    hlo = jax.jit(fwd).lower(x, wi, wo, states).compile().as_text()
    print(f"{type(recipe).__name__}, {label}:")
    for elements, what in ((m * f, "GEMM 2's input size"), (m * n_act * f, "GEMM 1's output")):
      found = _activation_buffers(hlo, elements)
      print(f"  {what} ({elements} elements), non-FP8 buffers: {len(found)}")
      for line in found:
        print(f"    {line}")


if __name__ == "__main__":
  main()
