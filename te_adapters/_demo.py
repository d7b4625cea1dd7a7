"""``python -m te_adapters demo``: FP8 against bf16 on one Dense-like GEMM, fwd + bwd."""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters import core, inspect
from te_adapters._build_info import BuildInfo, build_info

_DN = (((1,), (0,)), ((), ()))


def _rel(actual, reference) -> float:
  a = np.asarray(actual, np.float64)
  return float(np.linalg.norm(a - reference) / np.linalg.norm(reference))


def _time(fn, args, repeats: int) -> float:
  out = fn(*args)
  jax.block_until_ready(out)  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def run(
  m: int,
  k: int,
  n: int,
  repeats: int = 5,
  warmup_steps: int = 3,
  threshold: core.SizeThreshold | None = core.DEFAULT_SIZE_THRESHOLD,
) -> list[dict]:
  """Times fwd+bwd of ``x @ w`` for bf16 and each FP8 recipe; errors are against float64.

  ``threshold`` is passed to ``core.dot_general``: with the default, a GEMM too small for FP8
  to pay on a GPU runs in high precision there, and its row says so (``fp8_dots`` 0/3).
  """
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  refs = (x64 @ w64, dy64 @ w64.T, x64.T @ dy64)

  rows = []
  recipes = [
    ("bf16", None),
    ("Float8CurrentScaling", core.Float8CurrentScaling()),
    ("DelayedScaling", core.DelayedScaling(amax_history_len=16)),
  ]
  for label, recipe in recipes:
    state: Any = core.init_state(recipe) if recipe is not None else {}

    def step(x, w, dy, state, recipe=recipe):
      def f(x, w, state):
        y = core.dot_general(x, w, _DN, recipe=recipe, state=state or None, threshold=threshold)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

      (_, y), (dx, dw, new_state) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        x, w, state
      )
      return y, dx, dw, new_state

    step_jit = jax.jit(step)
    for _ in range(warmup_steps):  # delayed scaling needs a few steps to fill its history
      *_, new_state = step_jit(x, w, dy, state)
      state = core.updated_state(state, new_state) if state else state
    y, dx, dw, _ = step_jit(x, w, dy, state)
    fp8_dots, dots = inspect.count_fp8_dot_generals(step, x, w, dy, state)
    cublas = None
    if jax.default_backend() == "gpu":
      hlo = step_jit.lower(x, w, dy, state).compile().as_text() or ""
      cublas = "{}/{}".format(*inspect.count_fp8_gemms(hlo))
    rows.append(
      dict(
        recipe=label,
        ms=_time(step_jit, (x, w, dy, state), repeats),
        err_y=_rel(y, refs[0]),
        err_dx=_rel(dx, refs[1]),
        err_dw=_rel(dw, refs[2]),
        fp8_dots=f"{fp8_dots}/{dots}",
        cublas_fp8=cublas,
      )
    )
  return rows


def format_table(rows: list[dict]) -> str:
  head = f"{'recipe':<22}{'step ms':>9}{'err y':>9}{'err dx':>9}{'err dW':>9}  FP8 GEMMs"
  lines = [head, "-" * len(head)]
  for r in rows:
    fp8 = f"{r['fp8_dots']} in jaxpr"
    if r["cublas_fp8"] is not None:
      fp8 += f", FP8/other in compiled HLO {r['cublas_fp8']}"
    lines.append(
      f"{r['recipe']:<22}{r['ms']:>9.3f}{r['err_y']:>9.4f}{r['err_dx']:>9.4f}"
      f"{r['err_dw']:>9.4f}  {fp8}"
    )
  return "\n".join(lines)


def emulation_note(info: BuildInfo) -> str:
  """One sentence on what the FP8 rows below measure on this machine."""
  if info.fp8_gemms == "emulated":
    return (
      "FP8 is emulated here (no GPU with FP8 GEMMs): XLA computes the same FP8 arithmetic in "
      "higher precision, so the errors below are FP8's and the step times are not."
    )
  if not info.gpu_kernels_run:
    return (
      "FP8 GEMMs are native here; the casts to FP8 run in pure JAX (te_adapters's CUDA kernels "
      "are not installed or do not run on this GPU; see the notes above)."
    )
  return "FP8 GEMMs are native here, and the casts to FP8 run te_adapters's CUDA kernels."


def main(argv=None) -> None:
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(prog="python -m te_adapters demo", description=__doc__)
  p.add_argument("--m", type=int, default=8192 if on_gpu else 256, help="rows of x (tokens)")
  p.add_argument("--k", type=int, default=8192 if on_gpu else 512, help="contracting size")
  p.add_argument("--n", type=int, default=8192 if on_gpu else 512, help="output features")
  p.add_argument("--repeats", type=int, default=10 if on_gpu else 3)
  p.add_argument(
    "--force-fp8",
    action="store_true",
    help="quantize whatever the size (threshold=None); by default a GEMM too small "
    "for FP8 to pay on a GPU runs in high precision there",
  )
  args = p.parse_args(argv)
  threshold = None if args.force_fp8 else core.DEFAULT_SIZE_THRESHOLD
  device = jax.devices()[0]
  print(f"device: {device.platform} {device.device_kind}; jax {jax.__version__}")
  info = build_info()
  print(str(info))
  print(emulation_note(info))
  print()
  print(f"x ({args.m}, {args.k}) @ w ({args.k}, {args.n}), bf16 inputs, fwd + bwd;")
  print("errors: normwise relative error against float64 of the same bf16 inputs\n")
  with warnings.catch_warnings():  # the table and the note below say which rows stayed in bf16
    warnings.simplefilter("ignore", core.HighPrecisionGemmWarning)
    rows = run(args.m, args.k, args.n, args.repeats, threshold=threshold)
  print(format_table(rows))
  if any(r["recipe"] != "bf16" and r["fp8_dots"].startswith("0/") for r in rows):
    print(
      f"\nThe FP8 rows ran in high precision: this GEMM is below the size threshold "
      f"({core.DEFAULT_SIZE_THRESHOLD.rule()}). --force-fp8 quantizes it anyway."
    )
