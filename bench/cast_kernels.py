"""GPU time of the MLP's fused cast kernels alone (csrc/act_cast_cuda.cu) at seed 001's sizes.

Usage (on a GPU, from the repository root):
  python bench/cast_kernels.py [--iters 20] [--m 8192] [--f 16384] [--k 4096]

Times the activation's cast (gelu, bf16 in, E4M3 both orientations), its gradient's cast (E5M2,
with the bias gradient), the norm's cast (layernorm, E4M3) and current scaling's amax passes of
the first two (the same kernels with no output but the amax), each from a profiler trace, and
prints each one's bytes moved per second against its traffic (one read of every input, one write
of both FP8 copies), and for the casts the fraction of their FP8 codes that differ from the
pure-JAX path's (``backend="jax"``) with the largest difference in FP8 steps. Small enough to run
under Nsight Compute (``--iters 1 --no-agree``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import speed  # noqa: E402
from te_adapters import core  # noqa: E402
from te_adapters.core import fused, ops  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--f", type=int, default=16384)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--no-agree", action="store_true", help="skip the comparison with pure JAX")
  args = p.parse_args()
  m, f, k = args.m, args.f, args.k
  config = core.GemmConfig(backend="ffi", fuse_activation_cast=True)
  pure = core.GemmConfig(backend="jax", fuse_activation_cast=True)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  h = (2.0 * jax.random.normal(keys[0], (m, f))).astype(jnp.bfloat16)
  dz = jax.random.normal(keys[1], (m, f)).astype(jnp.bfloat16)
  x = jax.random.normal(keys[2], (m, k)).astype(jnp.bfloat16)
  bias = 0.1 * jax.random.normal(keys[3], (1, f))
  gamma, beta = jnp.ones((k,)), jnp.zeros((k,))
  s4, s5 = jnp.asarray([20.0], jnp.float32), jnp.asarray([1000.0], jnp.float32)
  names = ("gelu",)

  def act(config):
    return jax.jit(lambda h, b: fused.act_cast(h, b, names, jnp.float8_e4m3fn, s4, True, config))

  def dact(config):
    return jax.jit(
      lambda dz, h, b: fused.dact_cast(dz, h, b, names, jnp.float8_e5m2, s5, True, config)
    )

  mean, rsigma = ops.norm_stats(x.astype(jnp.float32), "layernorm", 1e-6)

  def norm(config):
    return jax.jit(
      lambda x, mean, rsigma: fused.norm_cast(
        x, mean, rsigma, gamma, beta, False, jnp.float8_e4m3fn, s4, True, config
      )
    )

  def act_amax(config):
    return jax.jit(lambda h, b: fused.act_amax(h, b, names, config))

  def dact_amax(config):
    return jax.jit(lambda dz, h, b: fused.dact_amax(dz, h, b, names, config))

  # (name, jitted function of a GemmConfig, its arguments, bytes read and written, FP8 codes out)
  cases = [
    ("act_cast", act, (h, bias), m * f * (2 + 2), True),
    ("dact_cast", dact, (dz, h, bias), m * f * (2 + 2 + 2), True),
    ("norm_cast", norm, (x, mean, rsigma), m * k * (2 + 2), True),
    ("act_amax", act_amax, (h, bias), m * f * 2, False),
    ("dact_amax", dact_amax, (dz, h, bias), m * f * (2 + 2), False),
  ]
  for name, make, fn_args, nbytes, codes in cases:
    fn = make(config)
    per_kernel = speed.gpu_kernel_ms(fn, fn_args, args.iters)
    ours = {n: t for n, t in per_kernel.items() if "cast" in n or "column_sum" in n}
    total = sum(ours.values())
    rate = nbytes / (total * 1e-3) / 1e12 if total else float("nan")
    detail = ", ".join(f"{n.split('(')[0][-40:]} {t:.3f}" for n, t in sorted(ours.items()))
    print(f"{name}: {total:.3f} ms ({rate:.2f} TB/s of its traffic) [{detail}]")
    if not codes:
      ref = make(pure)(*fn_args)
      print(f"  amax {float(fn(*fn_args)[0]):.6g}, pure JAX's {float(ref[0]):.6g}")
    elif not args.no_agree:
      ours, ref = _steps(fn(*fn_args)[0]), _steps(make(pure)(*fn_args)[0])
      diff = np.abs(ours - ref)
      print(
        f"  codes differing from pure JAX: {np.mean(diff != 0):.2e} of {diff.size} "
        f"(largest {diff.max()} FP8 steps)"
      )


def _steps(q):
  """FP8 codes as signed steps from zero."""
  code = np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)).astype(np.int32)
  return np.where(code & 0x80, -(code & 0x7F), code & 0x7F)


if __name__ == "__main__":
  main()
