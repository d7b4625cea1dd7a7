"""Why sharded FP8 programs differ from one device on GPUs: the GEMMs' own arithmetic, and FSDP.

Two parts, one JSON (``--json``):

1. ``gemm``: the extension's cuBLASLt FP8 GEMM and XLA's FP8 GEMM on the same random FP8 operands
   against the exact product (float64 on the host), for the shapes of the sharding tests, fast
   and promoted sums, bfloat16 and float32 outputs; and the GEMM of half the rows against the
   same rows of the whole GEMM (a shard against one device), in ulps of the output dtype.
2. ``fsdp``: ``tests/core/test_sharding_gpu.py``'s FSDP program (x (8, 128, 256) bf16, kernel
   (256, 512), Float8CurrentScaling, 2 devices) against one device, with one thing changed at a
   time: no FP8 gather, the kernel replicated (DP), XLA's GEMM, the pure-JAX cast, a kernel whose
   two shards have the same amax, DelayedScaling. Per output: normwise error against one device,
   the largest error in ulps, the share of elements that differ, the component along the
   one-device output (a scale error shows there; a summation order does not), and each run's
   error against the unquantized float64 product.

Usage (GPU): python bench/sharding_diag.py --json diag.json [--hlo-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters.core import kernels

DN = (((2,), (0,)), ((), ()))
X_SHAPE, W_SHAPE = (8, 128, 256), (256, 512)


def _ulp(values, dtype):
  finfo = ml_dtypes.finfo(dtype)
  mag = np.maximum(np.abs(values), float(finfo.tiny))
  _, exp = np.frexp(mag)
  return float(finfo.eps) * np.ldexp(1.0, exp - 1)


def figures(got, want, dtype=None):
  dtype = np.dtype(dtype or want.dtype)
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  d = g - w
  norm = float(np.linalg.norm(w))
  return dict(
    rel=float(np.linalg.norm(d) / norm),
    max_over_max=float(np.abs(d).max() / np.abs(w).max()),
    max_ulps=float(np.max(np.abs(d) / _ulp(w, dtype))),  # large where w is near 0
    differ=float(np.mean(d != 0)),
    along=float(np.vdot(d, w) / norm**2),  # d's component along w: a scale error
  )


# --------------------------------------------------------------------------- 1. the GEMMs


def _fp8(shape, seed, dtype=jnp.float8_e4m3fn):
  v = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 64.0
  return jnp.asarray(v).astype(dtype)


def gemm_part(log):
  rows = []
  if not kernels.cublas_gemm_available():
    log("the extension's cuBLASLt GEMM is not available here: part 1 skipped")
    return rows
  sa, sb = jnp.full((1,), 0.0123, jnp.float32), jnp.full((1,), 0.0371, jnp.float32)
  shapes = [  # (M, N, K, what)
    (1024, 512, 256, "fsdp test y, one device"),
    (1024, 256, 512, "fsdp test dx, one device"),
    (32, 32, 64, "exact-data tests y, one device"),
    (2048, 2048, 4096, "large K"),
  ]
  for m, n, k, what in shapes:
    a, b = _fp8((m, k), m + k), _fp8((n, k), n + k + 1)
    exact = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * float(sa[0]) * float(sb[0])
    for dtype in (jnp.bfloat16, jnp.float32):
      for fast in (True, False):
        ext = jax.jit(
          lambda a, b, dtype=dtype, fast=fast: kernels.gemm_call(
            a, b, sa, sb, dtype, lhs_mode=0, rhs_mode=0, fast_accum=fast
          )
        )
        xla = jax.jit(
          lambda a, b, dtype=dtype, fast=fast: kernels.tensor_fallback(fast, a, b, sa, sb, dtype)
        )
        y_ext, y_xla = np.asarray(ext(a, b)), np.asarray(xla(a, b))
        half = m // 2
        y_half = np.asarray(ext(a[:half], b))  # a shard of the rows
        y_khalf = np.asarray(
          ext(a[:, : k // 2], b[:, : k // 2]).astype(np.float32), np.float64
        ) + np.asarray(ext(a[:, k // 2 :], b[:, k // 2 :]).astype(np.float32), np.float64)
        row = dict(
          m=m,
          n=n,
          k=k,
          what=what,
          dtype=np.dtype(dtype).name,
          fast=fast,
          ext_vs_exact=figures(y_ext, exact, dtype),
          xla_vs_exact=figures(y_xla, exact, dtype),
          ext_vs_xla=figures(y_ext, y_xla),
          half_rows_vs_whole=figures(y_half, y_ext[:half]),
          two_k_halves_vs_exact=figures(y_khalf, exact, dtype),
          ext_deterministic=bool(np.array_equal(np.asarray(ext(a, b)), y_ext)),
        )
        rows.append(row)
        ex, xl = row["ext_vs_exact"], row["xla_vs_exact"]
        ev, hv = row["ext_vs_xla"], row["half_rows_vs_whole"]
        log(
          f"  gemm M={m:5d} N={n:5d} K={k:5d} {row['dtype']:9s} fast={int(fast)}: vs exact "
          f"(normwise, max err / max) ext {ex['rel']:.2e} {ex['max_over_max']:.2e}"
          f", xla {xl['rel']:.2e} {xl['max_over_max']:.2e}; ext vs xla {ev['max_ulps']:.0f} ulps"
          f" ({ev['differ']:.3f} differ); half rows vs whole {hv['max_ulps']:.0f} ulps "
          f"({hv['differ']:.3f} differ)"
        )
  return rows


# --------------------------------------------------------------------------- 2. FSDP


def _data(equal_shard_amax=False):
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, X_SHAPE, jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, W_SHAPE, jnp.float32)
  dy = jax.random.normal(kd, X_SHAPE[:2] + W_SHAPE[1:], jnp.float32).astype(jnp.bfloat16)
  if equal_shard_amax:  # both halves of the kernel's rows hold the tensor's amax
    top = float(jnp.max(jnp.abs(w))) * 1.25
    w = w.at[0, 0].set(top).at[W_SHAPE[0] // 2, 0].set(top)
  return x, w, dy


def _step(recipe, config, **kw):
  def step(x, w, state, dy):
    def layer(x, w, state):
      return core.dot_general(
        x,
        w.astype(jnp.bfloat16),
        DN,
        recipe=recipe,
        state=state or None,
        threshold=None,
        config=config,
        **kw,
      )

    y, vjp = jax.vjp(layer, x, w, state)
    return (y, *vjp(dy))

  return jax.jit(step)


def fsdp_part(log, hlo_dir=None):
  rows = []
  if jax.device_count() < 2:
    log("fewer than 2 devices: part 2 skipped")
    return rows
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  gather = P("fsdp", None)
  current, delayed = ta.Float8CurrentScaling(), ta.DelayedScaling(amax_history_len=4)
  default, xla, jaxcast = None, core.GemmConfig(fp8_gemm="xla"), core.GemmConfig(backend="jax")
  cases = [  # name, recipe, config, kernel spec, kernel_all_gather, equal shard amax
    ("fsdp_fp8_gather (the test)", current, default, gather, gather, False),
    ("fsdp_fp8_gather, XLA's GEMM", current, xla, gather, gather, False),
    ("fsdp_fp8_gather, pure-JAX cast", current, jaxcast, gather, gather, False),
    ("fsdp_fp8_gather, equal shard amaxes", current, default, gather, gather, True),
    ("fsdp, no FP8 gather", current, default, gather, None, False),
    ("dp (kernel replicated)", current, default, P(), None, False),
    ("fsdp_fp8_gather, DelayedScaling", delayed, default, gather, gather, False),
  ]
  for name, recipe, config, w_spec, kag, equal in cases:
    start = time.perf_counter()
    x, w, dy = _data(equal)
    state = core.init_state(recipe)
    ref = _step(recipe, config)(x, w, state, dy)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (put(x, P("fsdp")), put(w, w_spec), put(state, P()), put(dy, P("fsdp")))
    kw = {"kernel_all_gather": kag} if kag is not None else {}
    with jax.set_mesh(mesh):
      compiled = _step(recipe, config, **kw).lower(*args).compile()
    got = compiled(*args)
    text = compiled.as_text()
    if hlo_dir:
      slug = name.split(" (")[0].replace(", ", "_").replace(" ", "_").replace("'", "")
      with open(os.path.join(hlo_dir, f"fsdp_{slug}.txt"), "w") as f:
        f.write(text)
    # The unquantized product in float64, against which both runs are FP8 approximations.
    x64, w64, dy64 = (np.asarray(t, np.float64) for t in (x, w.astype(jnp.bfloat16), dy))
    exact = dict(y=x64 @ w64, dx=dy64 @ w64.T, dW=np.einsum("bsk,bsn->kn", x64, dy64))
    row = dict(
      case=name,
      fp8_gemms=inspect.count_fp8_gemms(text),
      collectives=[(c.op, c.arrays) for c in inspect.hlo_collectives(text)],
    )
    for key, a, b in zip(("y", "dx", "dW"), got[:3], ref[:3], strict=True):
      row[key] = figures(a, b)
      row[key]["mesh_vs_unquantized"] = float(
        np.linalg.norm(np.asarray(a, np.float64) - exact[key]) / np.linalg.norm(exact[key])
      )
      row[key]["one_vs_unquantized"] = float(
        np.linalg.norm(np.asarray(b, np.float64) - exact[key]) / np.linalg.norm(exact[key])
      )
    if jax.tree.leaves(ref[3]):
      row["state_equal"] = {
        k: bool(np.array_equal(np.asarray(got[3][k]), np.asarray(ref[3][k]))) for k in ref[3]
      }
      row["state_mesh"] = {k: np.asarray(got[3][k]).tolist()[-2:] for k in ref[3]}
      row["state_one"] = {k: np.asarray(ref[3][k]).tolist()[-2:] for k in ref[3]}
    rows.append(row)
    log(
      f"  {name:<40s} "
      + "  ".join(
        f"{k} rel {row[k]['rel']:.2e} ({row[k]['max_ulps']:.0f} ulps, {row[k]['differ']:.3f} "
        f"differ, along {row[k]['along']:+.1e})"
        for k in ("y", "dx", "dW")
      )
      + f"  ({time.perf_counter() - start:.1f} s)"
    )
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--json", default=None)
  p.add_argument("--hlo-dir", default=None)
  p.add_argument("--parts", default="gemm,fsdp")
  args = p.parse_args()
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  dev = jax.devices()[0]
  print(f"{dev.platform} {dev.device_kind} x {jax.device_count()}, jax {jax.__version__}")
  out = dict(device=f"{dev.platform} {dev.device_kind}", device_count=jax.device_count())
  if "gemm" in args.parts:
    out["gemm"] = gemm_part(print)
  if "fsdp" in args.parts:
    out["fsdp"] = fsdp_part(print, args.hlo_dir)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
  main()
