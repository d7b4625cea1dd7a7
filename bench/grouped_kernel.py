"""The native grouped FP8 GEMM alone (``te_adapters/core/kernels/_grouped_kernel.py``), beside the
extension's dense cuBLASLt FP8 GEMM of the same total size, on FP8 operands made beforehand.

Times each GEMM of a grouped layer (forward, dgrad, wgrad; the wgrad with and without the
gather that lays out its operands) for both tile configurations and both accumulation modes, the
median of ``--iters`` jitted calls after a warm-up. TFLOP/s counts 2*M*K*N per GEMM. ``--block``
adds ``Float8BlockScaling``'s grouped GEMM with blockwise scaling (``block_rows_gemm``,
``block_wgrad_gemm``: float32 scales per 1x128 block of x and dy, per 128x128 tile of the
kernels), on operands already quantized and laid out (the wgrad's in the padded layout), so that
a step of ``bench/ragged.py`` splits into its GEMMs and the rest.

Usage (on a Hopper GPU, with the extension built with TE_ADAPTERS_CUTLASS_DIR):
  python bench/grouped_kernel.py --tokens 16384 --k 4096 --n 14336 --groups 8 64
  python bench/grouped_kernel.py --tokens 8192 --k 2048 --n 2048 --groups 8 --configs 1 --block
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from te_adapters.core import kernels


def _time(fn, *args, iters=10):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=14336)
  p.add_argument("--groups", type=int, nargs="+", default=[8, 64])
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--configs", type=int, nargs="+", default=[0, 1])
  p.add_argument("--block", action="store_true", help="also Float8BlockScaling's grouped GEMM")
  args = p.parse_args(argv)
  if not kernels.available():  # this also registers the extension's FFI targets
    raise SystemExit("needs a Hopper GPU and the extension built with TE_ADAPTERS_CUTLASS_DIR")
  m, k, n = args.tokens, args.k, args.n
  flops = 2.0 * m * k * n
  e4, e5, bf = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(keys[0], (m, k)).astype(e4)
  dy = jax.random.normal(keys[1], (m, n)).astype(e5)
  print(f"device: {jax.devices()[0].device_kind}, M={m} K={k} N={n}")
  print("| GEMM | G | config | sums | ms | TFLOP/s |")
  print("|---|---|---|---|---|---|")
  one = jnp.ones((1,), jnp.float32)
  w_nk = jax.random.normal(keys[2], (n, k)).astype(e4)
  w_kn = jax.random.normal(keys[3], (k, n)).astype(e4)
  x_t = x.T
  dy_t = dy.T
  for fast in (True, False):
    sums = "fast" if fast else "promoted"
    dense = jax.jit(
      lambda a, b, f=fast: kernels.gemm_call(
        a, b, one, one, bf, lhs_mode=0, rhs_mode=0, fast_accum=f
      )
    )
    for name, a, b in (("fwd", x, w_nk), ("dgrad", dy, w_kn), ("wgrad", x_t, dy_t)):
      ms = _time(dense, a, b, iters=args.iters)
      print(f"| dense {name} (cuBLASLt) | - | - | {sums} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
  del w_nk, w_kn, x_t, dy_t
  for g in args.groups:
    experts = jax.random.randint(jax.random.PRNGKey(g), (m,), 0, g)
    sizes = jnp.bincount(experts, length=g).astype(jnp.int32)
    alpha = jnp.ones((g,), jnp.float32)
    w_nk = jax.random.normal(keys[2], (g, n, k)).astype(e4)
    w_kn = jax.random.normal(keys[3], (g, k, n)).astype(e4)
    gather = jax.jit(lambda x, dy, s: (kernels.padded_columns(x, s), kernels.padded_columns(dy, s)))
    ms = _time(gather, x, dy, sizes, iters=args.iters)
    print(f"| wgrad operand gather | {g} | - | - | {ms:.3f} | - |")
    for cfg in args.configs:
      for fast in (True, False):
        sums = "fast" if fast else "promoted"
        rows = jax.jit(lambda a, b, s, al, f=fast, c=cfg: kernels.rows_gemm(a, b, s, al, bf, f, c))
        wgrad = jax.jit(
          lambda a, b, s, al, f=fast, c=cfg: kernels.wgrad_gemm(a, b, s, al, bf, f, c)
        )
        for name, fn, a, b in (
          ("fwd", rows, x, w_nk),
          ("dgrad", rows, dy, w_kn),
          ("wgrad (with gather)", wgrad, x, dy),
        ):
          ms = _time(fn, a, b, sizes, alpha, iters=args.iters)
          print(f"| {name} | {g} | {cfg} | {sums} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    if args.block:
      _time_block(x, dy, w_nk, w_kn, sizes, flops, args.iters)
    del w_nk, w_kn


def _time_block(x, dy, w_nk, w_kn, sizes, flops, iters):
  """Float8BlockScaling's grouped GEMMs on the operands of the per-tensor rows, with power-of-2
  scales drawn at random (1x128 blocks of x and dy, 128x128 tiles of the kernels)."""
  if not kernels.block_available():
    raise SystemExit("--block needs the extension's grouped GEMM with blockwise scaling")
  b = 128
  (m, k), n, g = x.shape, dy.shape[1], sizes.shape[0]
  keys = jax.random.split(jax.random.PRNGKey(1), 6)

  def scales(key, shape):
    return 2.0 ** jax.random.randint(key, shape, -4, 5).astype(jnp.float32)

  bf = jnp.bfloat16
  rows = jax.jit(lambda a, sa, w, sw, s: kernels.block_rows_gemm(a, sa, w, sw, s, bf))
  clamped = kernels.clamped_sizes(sizes, m)
  fwd = (x, scales(keys[0], (m, k // b)), w_nk, scales(keys[1], (g, n // b, k // b)))
  dgrad = (dy, scales(keys[2], (m, n // b)), w_kn, scales(keys[3], (g, k // b, n // b)))
  times = {}
  for name, args in (("fwd", fwd), ("dgrad", dgrad)):
    times[name] = _time(rows, *args, clamped, iters=iters)
  # The wgrad's operands as wide as the padded layout (each group from a multiple of 128
  # columns); the values do not matter to the time.
  width = b * ((m + (b - 1) * g) // b)
  x_t = jnp.zeros((k, width), x.dtype).at[:, :m].set(x.T)
  dy_t = jnp.zeros((n, width), dy.dtype).at[:, :m].set(dy.T)
  wgrad = jax.jit(lambda a, sa, d, sd, s: kernels.block_wgrad_gemm(a, sa, d, sd, s, bf))
  args = (x_t, scales(keys[4], (k, width // b)), dy_t, scales(keys[5], (n, width // b)))
  times["wgrad"] = _time(wgrad, *args, sizes, iters=iters)
  for name, ms in times.items():
    print(f"| {name} (block-scaled) | {g} | - | per block | {ms:.3f} | {flops / ms / 1e9:.0f} |")


if __name__ == "__main__":
  main()
