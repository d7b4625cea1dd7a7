"""Grouped GEMM (MoE expert layer) speed: ours in bf16 and FP8 vs jax.lax.ragged_dot vs a loop.

Times one training step of the grouped GEMM, forward and backward with a given output gradient
(``jax.value_and_grad`` of ``vdot(y, dy)`` with respect to x, the expert kernels and the recipe
state), jitted, ``block_until_ready`` after every step, the median over ``--repeats`` runs of
``--iters`` steps each. Variants:

- ``lax_bf16``: ``jax.lax.ragged_dot`` in bf16 (its own VJP).
- ``ours_bf16``: ``te_adapters.core.ragged_dot(recipe=None)`` (XLA's ragged dot, or on Hopper with
  the extension built with CUTLASS the native bfloat16 grouped GEMM, as ``native_bf16``).
- ``native_bf16``: the native grouped GEMM with bfloat16 operands
  (``te_adapters.core.kernels.bf16_ragged_dot``; Hopper, extension built with
  CUTLASS).
- ``ours_current``, ``ours_delayed``: ``te_adapters.core.ragged_dot`` with FP8 current / delayed
  scaling (HYBRID).
- ``ours_mxfp8``: ``te_adapters.core.ragged_dot`` with ``MXFP8BlockScaling`` (E4M3; the GEMMs
  are emulated on dequantized bf16 values, so its "FP8 GEMM" column says no).
- ``ours_float8_block``: ``te_adapters.core.ragged_dot`` with ``Float8BlockScaling`` (1x128
  blocks of x and dy that never cross a group, 128x128 tiles per expert; on Hopper with the
  extension built with CUTLASS the FP8 grouped GEMM with blockwise scaling, elsewhere emulated
  GEMMs on the dequantized values, as MXFP8's).
- ``ours_rowwise``: ``te_adapters.core.ragged_dot`` with ``Float8RowwiseScaling`` (XLA's ragged
  dots of the FP8 data, the row and column factors on their float32 outputs).
- ``xla_current``, ``emulated_float8_block``: the grouped GEMM rule (``core.gemm.grouped_gemms``)
  with its route pinned: current scaling on XLA's ragged dot of the FP8 data, and
  ``Float8BlockScaling``'s emulated GEMMs, where the extension's grouped GEMMs are built (their
  baselines in the same call).
- ``loop_bf16``: a dense loop over experts, ``sum_g mask_g * (x @ W[g])`` in bf16 (G times the
  FLOPs; what one writes without a grouped GEMM).
- ``loop_current``: the same loop with ``te_adapters.core.dot_general`` FP8 current scaling.
- ``dense_current``: one dense ``te_adapters.core.dot_general`` (M, K) x (K, N) with FP8 current
  scaling, the same useful FLOPs as the grouped step: the speed a grouped GEMM aims at.

TFLOP/s counts the useful work, 6*M*K*N per step (the forward, dgrad and wgrad GEMMs), whatever
a variant really computes. Each G's header also gives the step's memory floor (``traffic_floor``):
the bytes that any fwd+bwd step of the layer must move through device memory, over
``--bandwidth`` (the H100's measured copy rate by default). A grouped layer holds G kernels of
(K, N), so at fixed M, K and N its weight traffic grows with G while its FLOPs do not; where the
floor exceeds the dense step's time, no grouped kernel reaches the dense GEMM's speed. The last
column gives each variant's floor (``variant_floor``) and what fraction of its step it is.

The table also counts the compiled step's FP8 GEMMs (XLA's ``__cublas$lt$matmul$f8`` calls, the
extension's cuBLASLt ``te_adapters_block_gemm``, grouped ``te_adapters_grouped_gemm`` and
``te_adapters_grouped_block_gemm`` calls on GPU, f8 ``dot``s elsewhere), and gives the relative
error of the forward output against ``lax_bf16``'s.

``--recipe NAME`` (``current``, ``delayed``, ``mxfp8``, ``float8_block``) is short for
``--variants lax_bf16 ours_bf16 ours_NAME``.

``--profile N`` also lists, after each variant's row, the GPU kernels of one step in the order
they ran, each with its time, from a JAX profiler trace of N steps (``bench/speed.py``'s
``gpu_trace_events``; XLA runs its command buffers op by op while tracing, so the kernels' sum can
exceed the step's time measured without the trace).

Usage (on the GPU):
  python bench/ragged.py --tokens 16384 --k 4096 --n 14336 --groups 8 64
  python bench/ragged.py --groups 8 --variants lax_bf16 ours_current
  python bench/ragged.py --groups 8 64 --recipe mxfp8
Quick check on CPU:
  python bench/ragged.py --tokens 512 --k 128 --n 128 --groups 4 --iters 1 --repeats 1
  python bench/ragged.py --tokens 200 --k 64 --n 64 --groups 3 --recipe mxfp8 --iters 1 \
    --repeats 1 --warmup 0
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_adapters as ta
from te_adapters import core
from te_adapters.core import kernels

VARIANTS = (
  "lax_bf16",
  "ours_bf16",
  "native_bf16",
  "ours_current",
  "ours_delayed",
  "ours_mxfp8",
  "ours_float8_block",
  "ours_rowwise",
  "xla_current",
  "emulated_float8_block",
  "loop_bf16",
  "loop_current",
  "dense_current",
)
RECIPES = {
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(),
  "mxfp8": ta.MXFP8BlockScaling(),
  "float8_block": ta.Float8BlockScaling(),
  "rowwise": ta.Float8RowwiseScaling(),
}


# Device-to-device copy rate of the H100 of this project's measurements, bytes read plus written
# per second (the device tool's machine notes: about 3.0 TB/s).
H100_COPY_TBS = 3.0


def traffic_floor(
  m: int,
  k: int,
  n: int,
  groups: int,
  *,
  amax_passes: bool,
  fp8_in_memory: bool = True,
  high_bytes: int = 2,
) -> int:
  """The fewest bytes one fwd+bwd step of a grouped layer moves through device memory.

  x (M, K), the kernels (G, K, N) and dy (M, N) are high precision (``high_bytes`` each); each
  GEMM reads its operands once and writes its output once (y, dx, the G kernel gradients). Two
  designs:

  - ``fp8_in_memory``: the GEMMs read FP8 operands that casts wrote (as CUTLASS's and cuBLASLt's
    grouped FP8 GEMMs do, and ours). Hopper's FP8 tensor cores take both operands
    K-major, so each of x, the kernels and dy is cast into two FP8 copies, one per GEMM that
    reads it: per element, read high (the cast), write two bytes, read two bytes (the GEMMs), and
    with ``amax_passes`` (current scaling: the scale before the cast) one more high read.
  - otherwise the GEMMs read the high-precision operands and convert them on chip (FP8 or bf16
    alike): each of x, the kernels and dy read by its two GEMMs, nothing else; ``amax_passes``
    still adds its read.

  Outputs: y (M, N), dx (M, K) and the kernel gradient (G, K, N), written once in high precision.
  """
  # x, dy and the kernels; their gradients dx, y and the kernel gradient have the same sizes.
  elements = m * k + m * n + groups * k * n
  per_element = (high_bytes + 2 + 2) if fp8_in_memory else 2 * high_bytes
  if amax_passes:
    per_element += high_bytes
  return elements * (per_element + high_bytes)


def floor_ms(floor_bytes: int, bandwidth_tbs: float) -> float:
  """The time (ms) of moving ``floor_bytes`` at ``bandwidth_tbs``."""
  return floor_bytes / (bandwidth_tbs * 1e12) * 1e3


def floor_line(m: int, k: int, n: int, groups: int, bandwidth_tbs: float) -> str:
  """The header line with the step's memory floors (GB and ms at ``bandwidth_tbs``)."""

  def show(**kw):
    b = traffic_floor(m, k, n, groups, **kw)
    return f"{b / 1e9:.1f} GB = {floor_ms(b, bandwidth_tbs):.2f} ms"

  return (
    f"memory floor of the step at {bandwidth_tbs:g} TB/s: FP8 operands in memory "
    f"{show(amax_passes=False)} (delayed), {show(amax_passes=True)} (current); converted "
    f"on chip {show(amax_passes=False, fp8_in_memory=False)} (delayed); "
    f"compute: {6 * m * k * n / 1e12:.2f} TFLOP"
  )


def variant_floor(variant: str, m: int, k: int, n: int, groups: int) -> int | None:
  """The memory floor (bytes) of a variant's step, or None where none is stated (the loops do G
  times the work; MXFP8's GEMMs are emulated on dequantized values)."""
  if variant in ("lax_bf16", "ours_bf16", "native_bf16"):  # bf16 operands read as they are
    return traffic_floor(m, k, n, groups, amax_passes=False, fp8_in_memory=False)
  if variant in ("ours_current", "ours_delayed"):
    return traffic_floor(m, k, n, groups, amax_passes=variant == "ours_current")
  if variant == "dense_current":
    return traffic_floor(m, k, n, 1, amax_passes=True)
  return None


def _loop_over_experts(x, w, group_sizes, recipe):
  """``sum_g mask_g * (x @ W[g])``: every expert multiplies every token."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(x.shape[0])[:, None]
  y = jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
  for g in range(w.shape[0]):
    mask = (rows >= starts[g]) & (rows < ends[g])
    if recipe is None:
      yg = x @ w[g]
    else:
      yg = core.dot_general(x, w[g], (((1,), (0,)), ((), ())), recipe=recipe)
    y = y + jnp.where(mask, yg, jnp.zeros((), yg.dtype)).astype(x.dtype)
  return y


def make_forward(variant: str, num_groups: int):
  """Returns ``(forward(x, w, group_sizes, state) -> y, initial state)``."""
  if variant == "lax_bf16":
    return (lambda x, w, gs, st: jax.lax.ragged_dot(x, w, gs)), {}
  if variant == "ours_bf16":
    return (lambda x, w, gs, st: core.ragged_dot(x, w, gs, recipe=None)), {}
  if variant == "native_bf16":

    def forward(x, w, gs, st):
      why = kernels.bf16_refusal(x, w, x.dtype)
      if why is not None:
        raise RuntimeError(f"the native bfloat16 grouped GEMM cannot run: {why}")
      return kernels.bf16_ragged_dot(x, w, gs)

    return forward, {}
  if variant.startswith("ours_") and variant[5:] in RECIPES:
    recipe = RECIPES[variant[5:]]
    state = core.init_ragged_state(recipe, num_groups)

    def forward(x, w, gs, st):
      return core.ragged_dot(x, w, gs, recipe=recipe, state=st)

    return forward, state
  if variant in ("xla_current", "emulated_float8_block"):
    # The one grouped rule on a pinned route: XLA's ragged dot of the FP8 data (current), or
    # the GEMMs of the dequantized values (Float8BlockScaling), whatever the extension holds.
    recipe, route = (
      (RECIPES["current"], "xla") if variant == "xla_current" else (RECIPES["float8_block"], None)
    )
    state = core.init_ragged_state(recipe, num_groups)

    def forward(x, w, gs, st):
      dtypes = (np.dtype(x.dtype), np.dtype(w.dtype))
      spec = core.gemm.Grouped(recipe, None, np.dtype(x.dtype), dtypes, route)
      return core.gemm.grouped_gemms(x, w, gs.astype(jnp.int32), st, spec)

    return forward, state
  if variant == "loop_bf16":
    return (lambda x, w, gs, st: _loop_over_experts(x, w, gs, None)), {}
  if variant == "loop_current":
    recipe = ta.Float8CurrentScaling()
    return (lambda x, w, gs, st: _loop_over_experts(x, w, gs, recipe)), {}
  if variant == "dense_current":
    recipe = ta.Float8CurrentScaling()
    dims = (((1,), (0,)), ((), ()))
    # Called with the first expert's kernel only, (1, K, N).
    return (lambda x, w, gs, st: core.dot_general(x, w[0], dims, recipe=recipe)), {}
  raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def make_step(forward):
  def loss(x, w, state, gs, dy):
    return jnp.vdot(forward(x, w, gs, state).astype(jnp.float32), dy.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def fp8_gemms(hlo: str) -> str:
  """The FP8 GEMM calls of a compiled step, by kind ("no" when there are none)."""
  counts = {
    "xla": hlo.count('custom_call_target="__cublas$lt$matmul$f8'),
    "cublaslt": hlo.count('custom_call_target="te_adapters_block_gemm"'),
    "grouped": hlo.count('custom_call_target="te_adapters_grouped_gemm"'),
    "grouped block-scaled": hlo.count('custom_call_target="te_adapters_grouped_block_gemm"'),
    # Elsewhere (CPU, or a GPU that would run the FP8 dot in another way): dots of f8 operands.
    "dot": len(re.findall(r"= \w+\[[^\]]*\][^=]*\bdot\(f8e\w+", hlo)),
  }
  found = [f"{n} {kind}" for kind, n in counts.items() if n]
  return ", ".join(found) if found else "no"


def time_step(step, args, iters: int, repeats: int, warmup: int) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(step(*args))
  runs = []
  for _ in range(repeats):
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(step(*args))
      times.append(time.perf_counter() - t0)
    runs.append(statistics.median(times))
  return runs


def routed_group_sizes(key, tokens: int, num_groups: int, routing: str) -> jax.Array:
  if routing == "random":
    experts = jax.random.randint(key, (tokens,), 0, num_groups)
  elif routing == "balanced":
    experts = jnp.arange(tokens) % num_groups
  else:  # "skewed": expert j gets about 1/j^2 of the tokens
    p = 1.0 / jnp.arange(1, num_groups + 1) ** 2
    experts = jax.random.choice(key, num_groups, (tokens,), p=p / p.sum())
  return jnp.bincount(experts, length=num_groups).astype(jnp.int32)


def bench_groups(args, num_groups: int) -> None:
  m, k, n = args.tokens, args.k, args.n
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  dtype = jnp.dtype(args.dtype)
  x = jax.random.normal(keys[0], (m, k), dtype)
  w = (jax.random.normal(keys[1], (num_groups, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  dy = jax.random.normal(keys[2], (m, n), dtype)
  gs = routed_group_sizes(keys[3], m, num_groups, args.routing)
  sizes = np.asarray(gs)
  print(
    f"\n## G={num_groups}: M={m} K={k} N={n} {args.dtype}, {args.routing} routing, "
    f"group sizes min {sizes.min()} max {sizes.max()} (sum {sizes.sum()})"
  )
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(floor_line(m, k, n, num_groups, args.bandwidth))
  print(
    "| variant | ms/step (median) | runs (ms) | useful TFLOP/s | vs lax_bf16 | FP8 GEMM | "
    "fwd err vs lax_bf16 | memory floor / ms |"
  )
  print("|---|---|---|---|---|---|---|---|")
  flops = 6.0 * m * k * n
  reference = None
  base_ms = None
  for variant in args.variants:
    try:
      forward, state = make_forward(variant, num_groups)
      step = make_step(forward)
      wv = w[:1] if variant.startswith("dense_") else w
      call_args = (x, wv, state, gs, dy)
      hlo = step.lower(*call_args).compile().as_text()
      # The bfloat16 variant's grouped GEMM calls are not FP8 ones.
      fp8 = "no (bf16 grouped kernel)" if variant == "native_bf16" else fp8_gemms(hlo)
      y = jax.jit(forward)(x, wv, gs, state)
      if reference is None and variant == "lax_bf16":
        reference = np.asarray(y, np.float32)
      err = "-"
      if reference is not None and not variant.startswith("dense_"):
        yf = np.asarray(y, np.float32)
        err = f"{np.linalg.norm(yf - reference) / np.linalg.norm(reference):.4f}"
      runs = time_step(step, call_args, args.iters, args.repeats, args.warmup)
    except Exception as e:  # report and go on (an out-of-memory loop must not hide the rest)
      msg = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
      print(f"| {variant} | failed: {type(e).__name__}: {msg} | | | | | | |")
      continue
    ms = statistics.median(runs) * 1e3
    if variant == "lax_bf16":
      base_ms = ms
    speedup = f"{base_ms / ms:.2f}x" if base_ms else "-"
    runs_ms = ", ".join(f"{r * 1e3:.2f}" for r in runs)
    floor = variant_floor(variant, m, k, n, num_groups)
    floor_cell = "-"
    if floor is not None:
      fms = floor_ms(floor, args.bandwidth)
      floor_cell = f"{fms:.2f} ms = {fms / ms:.0%}"
    print(
      f"| {variant} | {ms:.2f} | {runs_ms} | {flops / (ms * 1e-3) / 1e12:.3g} | {speedup} | "
      f"{fp8} | {err} | {floor_cell} |"
    )
    if args.profile:
      print_step_kernels(variant, step, call_args, args.profile)
    sys.stdout.flush()


def short_kernel_name(name: str, width: int = 70) -> str:
  """A kernel's name cut to ``width``, with the words that tell CUTLASS's instantiations apart
  (schedule, scaling, tile) kept from past the cut."""
  keys = ("Blockwise", "Pingpong", "Cooperative", "FastAccum", "_64,", "_256,", "Setup", "Zero")
  found = [k.strip("_,") for k in keys if k in name[width:]]
  return name[:width] + (f" [{' '.join(found)}]" if found else "")


def print_step_kernels(variant: str, step, call_args, steps: int) -> None:
  """The kernels of one traced step of ``variant``, in the order they started, with their time
  (us), and their sum."""
  import os

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from bench import speed

  events = sorted(speed.gpu_trace_events(step, call_args, steps), key=lambda e: float(e["ts"]))
  if not events or len(events) % steps:
    print(f"  {variant}: {len(events)} GPU events in {steps} traced steps; no per-step listing")
    return
  one = events[-len(events) // steps :]
  total = sum(float(e["dur"]) for e in one)
  print(f"  {variant}: {len(one)} kernels in one traced step, {total:.1f} us of kernel time")
  for e in one:
    print(f"    {float(e['dur']):8.1f} us  {short_kernel_name(e['name'])}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=16384, help="M, rows routed to the experts")
  p.add_argument("--k", type=int, default=4096, help="K, input features")
  p.add_argument("--n", type=int, default=14336, help="N, output features per expert")
  p.add_argument("--groups", type=int, nargs="+", default=[8, 64], help="G values to run")
  p.add_argument("--dtype", default="bfloat16", help="dtype of x, kernels and dy")
  p.add_argument("--routing", choices=("random", "balanced", "skewed"), default="random")
  p.add_argument(
    "--variants", nargs="+", default=None, choices=VARIANTS, help="variants to time (default: all)"
  )
  p.add_argument(
    "--recipe", choices=tuple(RECIPES), help="short for --variants lax_bf16 ours_bf16 ours_RECIPE"
  )
  p.add_argument("--iters", type=int, default=10, help="timed steps per run")
  p.add_argument("--repeats", type=int, default=3, help="runs; the median is reported")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="list each variant's kernels of one step from a profiler trace of N steps (GPU)",
  )
  p.add_argument(
    "--bandwidth",
    type=float,
    default=H100_COPY_TBS,
    help="device memory rate for the floor line, TB/s (bytes read plus written)",
  )
  args = p.parse_args(argv)
  if args.recipe and args.variants:
    p.error("give --recipe or --variants, not both")
  if args.recipe:
    args.variants = ["lax_bf16", "ours_bf16", f"ours_{args.recipe}"]
  elif not args.variants:
    args.variants = list(VARIANTS)
  if "lax_bf16" in args.variants:  # the reference runs first
    args.variants = ["lax_bf16"] + [v for v in args.variants if v != "lax_bf16"]
  for g in args.groups:
    bench_groups(args, g)


if __name__ == "__main__":
  main()
