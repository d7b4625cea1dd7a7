"""Whether XLA fuses the norm of ``core.layernorm_dense`` into the FP8 cast of the GEMM's input.

    python bench/layernorm_fusion.py [--shape 8192x4096x12288] [--backend jax,auto] [--time]

For each recipe (current, delayed) and cast backend, compiles the forward pass of
``layernorm_dense`` as the training step runs it (``jax.vjp``: the output and the residuals, so
the amax is needed) on x (M, K) bfloat16 and a (K, N) float32 kernel, and lists every
instruction of the optimized program's entry computation that writes an activation-sized
(M x K elements) buffer that is not FP8. Fused, the list holds no bfloat16 (M, K) buffer: the
norm's output is computed inside the fusions that take the amax and write the FP8 copies. The
FFI cast kernel (``backend="auto"`` on a GPU where it is built) reads its input from memory, so
there the norm's output is written once in bfloat16 before it.

``--time`` also times a fwd+bwd step (median of 3 x 20 steps) of: the norm and the GEMM in one
jitted step (``layernorm_dense``), the same with the norm's output passed between two jitted
functions (so written out), and the bf16 step (``recipe=None``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_adapters as ta  # noqa: E402
from bench import speed  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\w[\w-]*)\(")


def _activation_buffers(hlo: str, elements: int):
  entry = hlo[hlo.index("\nENTRY") :]
  out = []
  for line in entry.splitlines()[1:]:
    m = _INSTR.match(line)
    if not m:
      continue
    name, dtype, dims, op = m.groups()
    size = math.prod(int(d) for d in dims.split(",")) if dims else 1
    if size == elements and not dtype.startswith("f8") and op not in ("parameter", "bitcast"):
      meta = re.search(r'op_name="([^"]+)"', line)
      out.append(f"{dtype}[{dims}] {op} %{name} ({meta.group(1) if meta else ''})")
  return out


def _time_steps(x, g, b, w, recipe, config):
  """Step times (ms): fused in one jit, the norm's output between two jits, and bf16."""
  state = ta.core.init_state(recipe) or None
  dz = jnp.ones((x.shape[0], w.shape[1]), x.dtype)

  def loss(x, g, b, w, state, recipe=recipe):
    z, _ = ta.core.layernorm_dense(
      x, g, b, w, recipe=recipe, state=state, threshold=None, config=config
    )
    return jnp.sum(z.astype(jnp.float32) * dz)

  fused = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  norm_vjp = jax.jit(lambda x, g, b: jax.vjp(ta.core.layernorm, x, g, b))

  def gemm_loss(y, w, state):
    z = ta.core.dot_general(
      y,
      w,
      (((1,), (0,)), ((), ())),
      preferred_element_type=y.dtype,
      recipe=recipe,
      state=state,
      threshold=None,
      config=config,
    )
    return jnp.sum(z.astype(jnp.float32) * dz)

  gemm_grad = jax.jit(jax.grad(gemm_loss, argnums=(0, 1, 2)))
  norm_bwd = jax.jit(lambda vjp, dy: vjp(dy))

  def split(x, g, b, w, state):
    y, vjp = norm_vjp(x, g, b)
    dy, dw, new_state = gemm_grad(y, w, state)
    return norm_bwd(vjp, dy), dw, new_state

  bf16 = jax.jit(
    jax.grad(lambda x, g, b, w: loss(x, g, b, w.astype(x.dtype), None, None), argnums=(0, 1, 2, 3))
  )
  return (
    _median_ms(fused, (x, g, b, w, state)),
    _median_ms(split, (x, g, b, w, state)),
    _median_ms(bf16, (x, g, b, w)),
  )


def _median_ms(step, args, steps=20, repeats=3):
  return speed._timed(step, args, steps, repeats)[0]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", default="8192x4096x12288", help="MxKxN")
  parser.add_argument("--backend", default="jax,auto")
  parser.add_argument("--time", action="store_true")
  args = parser.parse_args()
  m, k, n = (int(s) for s in args.shape.split("x"))
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / math.sqrt(k)
  g, b = jnp.ones(k), jnp.zeros(k)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, x {m}x{k} bf16, kernel {k}x{n}")
  for recipe in (ta.Float8CurrentScaling(), ta.DelayedScaling()):
    state = ta.core.init_state(recipe) or None
    for backend in args.backend.split(","):
      config = ta.core.GemmConfig(backend=backend)

      def fwd(x, g, b, w, state, recipe=recipe, config=config):
        def f(x, g, b, w, state):
          return ta.core.layernorm_dense(
            x, g, b, w, recipe=recipe, state=state, threshold=None, config=config
          )[0]

        return jax.vjp(f, x, g, b, w, state)

      hlo = jax.jit(fwd).lower(x, g, b, w, state).compile().as_text()
      found = _activation_buffers(hlo, m * k)
      print(f"\n{type(recipe).__name__}, backend={backend}: {len(found)} non-FP8 (M, K) buffers")
      for line in found:
        print("  ", line)
      if args.time:
        fused, split, bf16 = _time_steps(x, g, b, w, recipe, config)
        print(
          f"   fwd+bwd ms: one jit {fused:.3f}, norm output between jits {split:.3f}, "
          f"bf16 {bf16:.3f}"
        )


if __name__ == "__main__":
  main()
