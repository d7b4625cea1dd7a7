"""Seed 000's Dense on several devices: DP, TP and FSDP, bf16 against FP8, against one device.

The layer is seed 000's ``FlaxDenseBlock`` written functionally: ``y = x @ bf16(W)`` with x
(batch, seq, hidden) in bf16 and W (hidden, features) float32 parameters computed in bf16, no bias.
One step is forward plus backward with a given output gradient (``jax.vjp``), as in TE's
speedometer; each step is synchronised (``block_until_ready``) and timed with ``perf_counter``.

Plans (n = --devices):
  single  one device
  dp      x, dy sharded on batch; W replicated                      (data parallel)
  tp      W column-parallel P(None, "tp"); x replicated; dy, y on features
  tp_row  W row-parallel P("tp", None); x sharded on hidden; y summed over tp
  fsdp    x, dy sharded on batch; W sharded on hidden P("fsdp", None) and gathered for the GEMM

Variants: bf16 (no quantization), current / delayed (FP8 recipes), and for fsdp
``current+fp8_gather`` (``kernel_all_gather``: the FP8 kernel shard is what is all-gathered).

Scaling efficiency is strong scaling: ``t(single) / (n * t(plan))`` for the same variant and the
same global shapes. The second table lists what the compiled HLO holds: FP8 GEMMs against other
GEMMs (te_adapters.inspect.count_fp8_gemms), the all-gathers (dtype and bytes per step) and the
all-reduces and reduce-scatters (how many, dtype and bytes per step).

Usage (two GPUs, seed 000's sizes):
  python bench/spmd.py --devices 2
Quick check on CPU (virtual devices, tiny sizes):
  python bench/spmd.py --cpu-devices 4 --devices 4 --batch 4 --seq 64 --hidden 256 \\
      --features 512 --iters 2 --trials 1
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import add_common_arguments, time_steps, use_cpu_devices  # noqa: E402


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--devices", type=int, default=None, help="devices per plan (default: all)")
  p.add_argument("--plans", default="single,dp,tp,tp_row,fsdp")
  p.add_argument("--variants", default="bf16,current,delayed,current+fp8_gather")
  p.add_argument(
    "--repeats",
    type=int,
    default=0,
    help="interleaved rounds: compile every configuration first, then run one "
    "trial of --iters steps of each in turn, --repeats times; report the "
    "median over rounds and the spread (0: --trials per configuration, "
    "one configuration after the other)",
  )
  add_common_arguments(p)
  return p.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
use_cpu_devices(ARGS and ARGS.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from te_adapters import core, inspect  # noqa: E402

DN = (((2,), (0,)), ((), ()))

# plan -> (mesh axis, x spec, W spec, dy spec)
PLANS = {
  "single": (None, P(), P(), P()),
  "dp": ("dp", P("dp"), P(), P("dp")),
  "tp": ("tp", P(), P(None, "tp"), P(None, None, "tp")),
  "tp_row": ("tp", P(None, None, "tp"), P("tp", None), P()),
  "fsdp": ("fsdp", P("fsdp"), P("fsdp", None), P("fsdp")),
}


def _recipe(variant):
  name = variant.split("+")[0]
  return {
    "bf16": None,
    "current": core.Float8CurrentScaling(),
    "delayed": core.DelayedScaling(amax_history_len=1024),
  }[name]


def make_step(variant, plan, mesh):
  """The jitted fwd+bwd step ``(x, W, state, dy) -> (y, dx, dW, new state)``."""
  recipe = _recipe(variant)
  _, x_spec, w_spec, dy_spec = PLANS[plan]
  kw = {}
  if variant.endswith("+fp8_gather"):
    kw["kernel_all_gather"] = NamedSharding(mesh, w_spec)

  def constrain(a, spec):
    return a if mesh is None else jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

  def step(x, w, state, dy):
    def layer(x, w, state):
      return core.dot_general(
        x, w.astype(jnp.bfloat16), DN, recipe=recipe, state=state or None, threshold=None, **kw
      )

    y, vjp = jax.vjp(layer, x, w, state)
    dx, dw, new_state = vjp(dy)
    # Outputs laid out like their inputs (FSDP keeps W's gradient sharded like W).
    return constrain(y, dy_spec), constrain(dx, x_spec), constrain(dw, w_spec), new_state

  return jax.jit(step)


def hlo_summary(text):
  """``"FP8 GEMMs/other GEMMs"``, the all-gathers and the reductions (all-reduces and
  reduce-scatters; dtype: bytes per step, a reduce-scatter's operand) of compiled HLO text, and
  the number of reductions."""
  fp8, other = inspect.count_fp8_gemms(text)
  gemms = f"{fp8}/{other}"
  itemsize = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4}
  gathers, reduces, n_reduces = {}, {}, 0
  for c in inspect.hlo_collectives(text):
    if c.op == "all-gather":
      dtype, shape = c.arrays[-1]  # the gathered result
      gathers[dtype] = gathers.get(dtype, 0) + itemsize.get(dtype, 0) * int(np.prod(shape))
    elif c.op in ("all-reduce", "reduce-scatter"):  # FSDP's gradient: a reduce-scatter
      n_reduces += 1
      arrays = list(c.arrays)
      if "-start(" in c.line and len(arrays) > 1 and len(arrays) % 2 == 0:
        # An async start may list operands and results; a reduce-scatter's operand is the larger.
        half = len(arrays) // 2
        arrays = arrays[:half] if c.op == "reduce-scatter" else arrays[half:]
      for dtype, shape in arrays:
        reduces[dtype] = reduces.get(dtype, 0) + itemsize.get(dtype, 0) * int(np.prod(shape))
  return gemms, gathers, reduces, n_reduces


def run(args):
  devices = jax.devices()
  n = args.devices or len(devices)
  if n > len(devices):
    raise SystemExit(f"--devices {n} but only {len(devices)} devices are present")
  b, s, h, f = args.batch, args.seq, args.hidden, args.features
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (b, s, h), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (h, f), jnp.float32) * (h**-0.5)
  dy = jax.random.normal(kd, (b, s, f), jnp.float32).astype(jnp.bfloat16)
  flops = 6.0 * b * s * h * f  # three GEMMs
  variants = args.variants.split(",")
  rows = []
  for plan in args.plans.split(","):
    axis, x_spec, w_spec, dy_spec = PLANS[plan]
    mesh = None
    if axis is not None:
      mesh = jax.make_mesh((n,), (axis,), devices=devices[:n], axis_types=(AxisType.Auto,))
    for variant in variants:
      if variant.endswith("+fp8_gather") and plan != "fsdp":
        continue
      recipe = _recipe(variant)
      state = core.init_state(recipe) if recipe is not None else {}
      if mesh is None:
        put = lambda a, spec: jax.device_put(a, devices[0])
      else:
        put = lambda a, spec, mesh=mesh: jax.device_put(a, NamedSharding(mesh, spec))
      call_args = (put(x, x_spec), put(w, w_spec), put(state, P()), put(dy, dy_spec))
      step = make_step(variant, plan, mesh)
      if mesh is None:
        compiled = step.lower(*call_args).compile()
      else:
        with jax.set_mesh(mesh):
          compiled = step.lower(*call_args).compile()
      run_once = functools.partial(compiled, *call_args)
      gemms, gathers, reduces, n_reduces = hlo_summary(compiled.as_text())
      row = dict(
        plan=plan,
        n=1 if mesh is None else n,
        variant=variant,
        gemms=gemms,
        gathers=gathers,
        reduces=reduces,
        n_reduces=n_reduces,
        times=[],
      )
      if args.repeats:
        row["run"] = run_once
        print(f"  compiled {plan} {variant}: FP8/other GEMMs {gemms}", flush=True)
      else:
        row["ms"] = time_steps(run_once, args.iters, args.warmup, args.trials)
        # As it goes, so that a run cut short still shows what it measured.
        print(f"  {plan} {variant}: {row['ms']:.3f} ms, FP8/other GEMMs {gemms}", flush=True)
      rows.append(row)
  if args.repeats:
    _interleaved(rows, args)
  for row in rows:
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12 / row["n"]
  return rows


def _interleaved(rows, args):
  """Each row's ``ms``: the median over ``args.repeats`` rounds, each round one trial (the mean
  of ``args.iters`` synchronised steps) of every configuration in turn, after each one's
  warmup; ``times`` keeps the rounds' figures."""
  for row in rows:
    time_steps(row["run"], 0, args.warmup, 0)
  for r in range(args.repeats):
    for row in rows:
      row["times"].append(time_steps(row["run"], args.iters, 0, 1))
    print(
      f"  round {r + 1}: "
      + ", ".join(f"{row['plan']}/{row['variant']} {row['times'][-1]:.2f}" for row in rows),
      flush=True,
    )
  for row in rows:
    row["ms"] = float(np.median(row["times"]))
    del row["run"]


def format_tables(rows):
  single = {r["variant"]: r["ms"] for r in rows if r["plan"] == "single"}
  bf16 = {r["plan"]: r["ms"] for r in rows if r["variant"] == "bf16"}
  head = (
    f"{'plan':<8}{'devices':>8}  {'variant':<20}{'step ms':>9}{'TFLOP/s/dev':>13}"
    f"{'vs bf16':>9}{'scaling eff':>13}{'rounds min-max':>16}"
  )
  lines = [head, "-" * len(head)]
  for r in rows:
    vs_bf16 = bf16.get(r["plan"], float("nan")) / r["ms"]
    base = single.get(r["variant"].split("+")[0])
    eff = "" if base is None or r["plan"] == "single" else f"{base / (r['n'] * r['ms']):.2f}"
    spread = f"{min(r['times']):.2f}-{max(r['times']):.2f}" if r["times"] else ""
    lines.append(
      f"{r['plan']:<8}{r['n']:>8}  {r['variant']:<20}{r['ms']:>9.3f}"
      f"{r['tflops']:>13.1f}{vs_bf16:>8.2f}x{eff:>13}{spread:>16}"
    )
  lines += [
    "",
    f"{'plan':<8}{'variant':<22}{'FP8/other GEMMs':>16}  all-gathers (dtype: MiB)"
    "; all-reduces and reduce-scatters: count (dtype: MiB)",
  ]
  mib = lambda d: ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in sorted(d.items()))
  for r in rows:
    lines.append(
      f"{r['plan']:<8}{r['variant']:<22}{r['gemms']:>16}  {mib(r['gathers']) or '-'}"
      f"; {r['n_reduces']} ({mib(r['reduces']) or '-'})"
    )
  return "\n".join(lines)


def main():
  args = ARGS
  dev = jax.devices()[0]
  print(
    f"date: {datetime.date.today()}; device: {dev.platform} {dev.device_kind} x "
    f"{args.devices or jax.device_count()}; jax {jax.__version__}"
  )
  timing = (
    f"median over {args.repeats} interleaved rounds"
    if args.repeats
    else f"median of {args.trials} trials"
  )
  print(
    f"x ({args.batch}, {args.seq}, {args.hidden}) bf16 @ W ({args.hidden}, {args.features}) "
    f"float32 params in bf16; fwd + bwd; mean of {args.iters} steps, {timing}\n"
  )
  print(format_tables(run(args)))


if __name__ == "__main__":
  main()
