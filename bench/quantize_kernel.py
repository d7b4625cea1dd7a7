"""The FFI quantize kernel on a GPU: bit identity with the pure-JAX path, bandwidth, Dense step.

    python bench/quantize_kernel.py [--sizes-mb 256,1024] [--iters 50] [--skip-dense]

Three parts, each case caught and reported on its own (a failing case prints ERROR and the run
goes on):

1. Bit identity: FP8 data, transposed data and amax from the FFI kernel against the pure-JAX path,
   for bfloat16/float16/float32 inputs, 1-D to 4-D shapes (sizes that are not multiples of the
   64x64 tile included), NaN and +-inf planted, both FP8 dtypes.
2. Bandwidth of one cast (FP8 copy + transposed copy [+ amax]) of a bfloat16 matrix of 256 MB
   and 1 GB: the FFI kernel, XLA's fusion of the pure-JAX path, and an XLA elementwise
   ``x * s`` of the same input (reads and writes every byte once: the device-to-device copy
   bandwidth it can reach). Bytes counted: input read + both FP8 copies written.
3. Seed 000's Dense fwd+bwd step (x 8x2048x8192 bf16, kernel 8192x32768) through the core,
   current and delayed scaling, with ``GemmConfig(backend="jax")`` and ``backend="ffi"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from te_adapters.core import formats, kernels  # noqa: E402


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _case(name, fn, results):
  try:
    msg = fn()
    results.append((name, "ok" if msg is None else msg))
  except Exception as e:  # report and go on
    results.append((name, f"ERROR {type(e).__name__}: {e}".splitlines()[0][:160]))
    traceback.print_exc(limit=3)
  print(f"  {name:<58} {results[-1][1]}", flush=True)


def identity_checks():
  print("\n== bit identity: FFI kernel vs pure-JAX path ==", flush=True)
  results = []
  rng = np.random.default_rng(0)
  shapes = [(1000,), (64, 64), (33, 65), (128, 4096), (3, 100, 37), (2, 3, 64, 130), (4096, 2048)]
  for dtype in (jnp.bfloat16, np.float16, np.float32):
    for q_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      for shape in shapes:
        for specials in (False, True):
          x = rng.standard_normal(shape) * rng.choice([1e-4, 1.0, 300.0], shape)
          if specials:
            flat = x.reshape(-1)
            flat[[0, 5, 7, flat.size - 1]] = [np.inf, -np.inf, np.nan, -np.nan]
          x = jnp.asarray(x.astype(dtype))
          name = f"{np.dtype(dtype).name:>8} {np.dtype(q_dtype).name:>13} {str(shape):>16}" + (
            " nan/inf" if specials else ""
          )

          def check(x=x, q_dtype=q_dtype, shape=shape, specials=specials):
            s = jnp.array([2.5], jnp.float32)
            col = len(shape) >= 2
            kw = dict(colwise=col, with_amax=True)
            f = jax.jit(lambda x, s: formats.cast_transpose(x, s, q_dtype, backend="ffi", **kw))
            g = jax.jit(lambda x, s: formats.cast_transpose(x, s, q_dtype, backend="jax", **kw))
            assert "te_adapters_cast_transpose" in f.lower(x, s).as_text(), "FFI call missing"
            got, want = f(x, s), g(x, s)
            bad = []
            for n, a, b in zip(("q", "q_t"), got[:2], want[:2], strict=False):
              if a is not None and not np.array_equal(_bits(a), _bits(b)):
                d = int(np.sum(_bits(a) != _bits(b)))
                i = np.argwhere(_bits(a) != _bits(b))[0]
                bad.append(
                  f"{n}: {d} differ, first {tuple(i)} ffi={_bits(a)[tuple(i)]:#x} "
                  f"jax={_bits(b)[tuple(i)]:#x}"
                )
            a, b = np.asarray(got[2]), np.asarray(want[2])
            if not (np.array_equal(_bits(a), _bits(b)) or (np.isnan(a[0]) and np.isnan(b[0]))):
              bad.append(f"amax ffi={a[0]!r} jax={b[0]!r}")
            if specials and not np.isposinf(a[0]):
              bad.append(f"amax {a[0]!r} is not inf (a NaN or inf input gives amax inf)")
            am = np.asarray(formats.amax(x, backend="ffi"))
            if not (np.array_equal(_bits(am), _bits(b)) or (np.isnan(am[0]) and np.isnan(b[0]))):
              bad.append(f"amax kernel ffi={am[0]!r} jax={b[0]!r}")
            return "; ".join(bad) if bad else None

          _case(name, check, results)
  n_bad = sum(r[1] != "ok" for r in results)
  print(f"identity: {len(results) - n_bad}/{len(results)} cases identical", flush=True)
  return results


def _time(fn, args, iters):
  jax.block_until_ready(fn(*args))  # compile
  jax.block_until_ready(fn(*args))
  best = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)  # dispatches queue up; the device runs them back to back
    jax.block_until_ready(out)
    best.append((time.perf_counter() - start) / iters)
  return float(np.median(best))


def bandwidth(sizes_mb, iters):
  print("\n== bandwidth: bf16 (R, C) -> FP8 copy + transposed FP8 copy ==", flush=True)
  rows = []
  for mb in sizes_mb:
    elems = mb * 2**20 // 2
    c = 16384 if elems >= 16384 * 4096 else 4096
    shape = (elems // c, c)
    try:
      x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.bfloat16)
      s = jnp.array([4.0], jnp.float32)
      n = x.size
      copy = jax.jit(lambda x, s: x * s.astype(x.dtype)[0])
      t_copy = _time(copy, (x, s), iters)
      copy_bw = 2 * 2 * n / t_copy
      rows.append((f"{mb} MB {shape}", "XLA x*s (copy)", t_copy, copy_bw, 1.0))
      for label, kw in (("q+q_t", {}), ("q+q_t+amax", dict(with_amax=True))):
        for be in ("ffi", "jax"):

          def run(x, s, be=be, kw=kw):
            return formats.cast_transpose(x, s, jnp.float8_e5m2, backend=be, **kw)

          try:
            t = _time(jax.jit(run), (x, s), iters)
            bw = (2 * n + 2 * n) / t
            rows.append((f"{mb} MB {shape}", f"{be} {label}", t, bw, bw / copy_bw))
          except Exception as e:
            rows.append(
              (
                f"{mb} MB {shape}",
                f"{be} {label} ERROR {type(e).__name__}: {e}"[:90],
                float("nan"),
                float("nan"),
                float("nan"),
              )
            )
      for be in ("ffi", "jax"):
        t = _time(jax.jit(lambda x, be=be: formats.amax(x, backend=be)), (x,), iters)
        rows.append((f"{mb} MB {shape}", f"{be} amax only", t, 2 * n / t, 2 * n / t / copy_bw))
      del x
    except Exception as e:
      rows.append(
        (
          f"{mb} MB",
          f"ERROR {type(e).__name__}: {e}"[:90],
          float("nan"),
          float("nan"),
          float("nan"),
        )
      )
      traceback.print_exc(limit=3)
  print(f"{'input':<28}{'variant':<26}{'ms':>9}{'GB/s':>9}{'vs copy':>9}")
  for r in rows:
    print(f"{r[0]:<28}{r[1]:<26}{r[2] * 1e3:>9.3f}{r[3] / 1e9:>9.0f}{r[4]:>8.0%}")
  return rows


def dense_step(iters):
  print("\n== seed 000 Dense fwd+bwd step through the core ==", flush=True)
  import te_adapters as ta
  from bench import speed as _bench

  k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k_x, (8, 2048, 8192)).astype(jnp.bfloat16)
  dy = jax.random.normal(k_dy, (8, 2048, 32768)).astype(jnp.bfloat16)
  rows = []
  for label, recipe in (
    ("current", ta.Float8CurrentScaling()),
    ("delayed", ta.DelayedScaling(amax_history_len=1024)),
  ):
    for be in ("jax", "ffi"):
      try:
        config = ta.GemmConfig(backend=be)
        apply_fn, init = _bench._core_variant(recipe, (8192, 32768), config=config)
        step = _bench._speedometer(apply_fn)
        variables = init(k_init)
        hlo = step.lower(variables, x, dy).compile().as_text()
        n_ffi = hlo.count("te_adapters_cast_transpose")
        ms, spread = _bench._timed(step, (variables, x, dy), iters, 3)
        fp8 = _bench._count_cublas_fp8(step, (variables, x, dy))
        rows.append((label, be, ms, spread, fp8, n_ffi))
      except Exception as e:
        rows.append(
          (label, f"{be} ERROR {type(e).__name__}: {e}"[:80], float("nan"), float("nan"), None, 0)
        )
        traceback.print_exc(limit=3)
      print(f"  {rows[-1]}", flush=True)
  print(
    f"{'recipe':<10}{'backend':<12}{'ms':>9}{'spread':>9}{'FP8/other GEMMs':>17}"
    f"{'FFI casts in HLO':>18}"
  )
  for r in rows:
    print(f"{r[0]:<10}{r[1]:<12}{r[2]:>9.2f}{r[3]:>9.2f}{str(r[4]):>17}{r[5]:>18}")
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--sizes-mb", default="256,1024")
  p.add_argument("--iters", type=int, default=50)
  p.add_argument("--skip-dense", action="store_true")
  p.add_argument("--skip-identity", action="store_true")
  args = p.parse_args(argv)
  dev = jax.devices()[0]
  print(
    f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; "
    f"FFI built for gpu: {kernels.ffi_available('gpu')}, cpu: {kernels.ffi_available('cpu')}; "
    f"date {time.strftime('%Y-%m-%d')}",
    flush=True,
  )
  platform = "gpu" if dev.platform == "gpu" else dev.platform
  if not kernels.ffi_available(platform):
    print(f"the FFI extension is not built for {platform}: nothing to measure")
    return 1
  bad = 0
  if not args.skip_identity:
    bad = sum(r[1] != "ok" for r in identity_checks())
  bandwidth([int(s) for s in args.sizes_mb.split(",")], args.iters)
  if not args.skip_dense:
    dense_step(max(5, args.iters // 5))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
