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

``--configs`` names what each sharded plan also runs with, ``+`` joining parts: ``base`` (the
defaults), ``m8``/``m16`` (FP8 only: ``GemmConfig(comm_sm_margin=8 or 16)``), ``no_one_shot``
(XLA's option ``xla_gpu_unsupported_use_all_reduce_one_shot_kernel=False``: NCCL for every
all-reduce instead of XLA's one-shot kernel), ``exchange`` (FP8 only:
``GemmConfig(device_sums="exchange")``, the partial products summed by ``ppermute`` exchanges)
and ``peer`` (XLA's option ``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY``: collective
permutes as device-to-device copies over the copy engines), e.g. ``exchange+peer``. XLA options
are given per compile
(``lower(...).compile(compiler_options=...)``), so that one process times them interleaved;
bf16 runs with each distinct set of XLA options.

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
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import (  # noqa: E402
  add_common_arguments,
  gemm_sm_margins,
  schedule,
  time_steps,
  use_cpu_devices,
  use_nccl_config,
)


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
  p.add_argument(
    "--configs",
    default="base",
    help=f"comma-separated, parts joined by '+': {', '.join(PARTS)}",
  )
  p.add_argument(
    "--pipelined",
    action="store_true",
    help="with --repeats: each round also times --iters steps back to back (one sync at the end)",
  )
  p.add_argument(
    "--schedule", action="store_true", help="print each program's GEMM/collective order"
  )
  p.add_argument("--json", default=None, help="write the rows here")
  add_common_arguments(p)
  return p.parse_args(argv)


# The parts of --configs: (GemmConfig fields, XLA options).
PARTS = {
  "base": ({}, {}),
  "m8": ({"comm_sm_margin": 8}, {}),
  "m16": ({"comm_sm_margin": 16}, {}),
  "no_one_shot": ({}, {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False}),
  # Partial products summed by ppermute exchanges, which XLA's peer-memory collective permutes
  # run as device-to-device copies (copy engines, no SMs): use together, "exchange+peer".
  "exchange": ({"device_sums": "exchange"}, {}),
  "peer": ({}, {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"}),
}


def config_parts(name):
  """``(GemmConfig fields, XLA options)`` of a --configs entry (parts joined by ``+``)."""
  fields, options = {}, {}
  for part in name.split("+"):
    if part not in PARTS:
      raise SystemExit(f"--configs: unknown {part!r} in {name!r} (known: {', '.join(PARTS)})")
    fields.update(PARTS[part][0])
    options.update(PARTS[part][1])
  return fields, options


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
use_cpu_devices(ARGS and ARGS.cpu_devices)
NCCL_ENV = use_nccl_config(ARGS.nccl) if ARGS is not None else {}

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


def make_step(variant, plan, mesh, config="base"):
  """The jitted fwd+bwd step ``(x, W, state, dy) -> (y, dx, dW, new state)``."""
  recipe = _recipe(variant)
  _, x_spec, w_spec, dy_spec = PLANS[plan]
  kw = {}
  if recipe is not None:
    kw["config"] = core.GemmConfig(**config_parts(config)[0])
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
  reduce-scatters, by op; dtype: bytes per step, a reduce-scatter's operand) of compiled HLO
  text, and the number of reductions by op."""
  fp8, other = inspect.count_fp8_gemms(text)
  gemms = f"{fp8}/{other}"
  itemsize = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4}
  gathers, reduces, n_reduces = {}, {}, {}
  for c in inspect.hlo_collectives(text):
    if c.op == "all-gather":
      dtype, shape = c.arrays[-1]  # the gathered result
      gathers[dtype] = gathers.get(dtype, 0) + itemsize.get(dtype, 0) * int(np.prod(shape))
    elif c.op in ("all-reduce", "reduce-scatter"):  # FSDP's gradient: a reduce-scatter
      n_reduces[c.op] = n_reduces.get(c.op, 0) + 1
      arrays = list(c.arrays)
      if "-start(" in c.line and len(arrays) > 1 and len(arrays) % 2 == 0:
        # An async start may list operands and results; a reduce-scatter's operand is the larger.
        half = len(arrays) // 2
        arrays = arrays[:half] if c.op == "reduce-scatter" else arrays[half:]
      sums = reduces.setdefault(c.op, {})
      for dtype, shape in arrays:
        sums[dtype] = sums.get(dtype, 0) + itemsize.get(dtype, 0) * int(np.prod(shape))
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
  rows, placed = [], {}
  for plan, variant, config in _configurations(args):
    axis, x_spec, w_spec, dy_spec = PLANS[plan]
    mesh = None
    if axis is not None:
      mesh = jax.make_mesh((n,), (axis,), devices=devices[:n], axis_types=(AxisType.Auto,))
    recipe = _recipe(variant)
    state = core.init_state(recipe) if recipe is not None else {}
    if mesh is None:
      put = lambda a, spec: jax.device_put(a, devices[0])
    else:
      put = lambda a, spec, mesh=mesh: jax.device_put(a, NamedSharding(mesh, spec))
    # One copy of the inputs per plan: every configuration of a plan takes the same arrays.
    if plan not in placed:
      placed[plan] = (put(x, x_spec), put(w, w_spec), put(dy, dy_spec))
    px, pw, pdy = placed[plan]
    call_args = (px, pw, put(state, P()), pdy)
    step = make_step(variant, plan, mesh, config)
    options = config_parts(config)[1]
    compile_options = options or None
    if mesh is None:
      compiled = step.lower(*call_args).compile(compile_options)
    else:
      with jax.set_mesh(mesh):
        compiled = step.lower(*call_args).compile(compile_options)
    run_once = functools.partial(compiled, *call_args)
    text = compiled.as_text()
    gemms, gathers, reduces, n_reduces = hlo_summary(text)
    row = dict(
      plan=plan,
      n=1 if mesh is None else n,
      variant=variant,
      config=config,
      options=",".join(f"{k}={v}" for k, v in sorted(options.items())),
      name=variant if config == "base" else f"{variant}+{config}",
      gemms=gemms,
      sm_margins=gemm_sm_margins(text),
      gathers=gathers,
      reduces=reduces,
      n_reduces=n_reduces,
      times=[],
      pipelined=[],
    )
    if args.schedule:
      print(f"  schedule {plan} {row['name']}: {' | '.join(schedule(text))}", flush=True)
    if args.repeats:
      row["run"] = run_once
      print(f"  compiled {plan} {row['name']}: FP8/other GEMMs {gemms}", flush=True)
    else:
      row["ms"] = time_steps(run_once, args.iters, args.warmup, args.trials)
      # As it goes, so that a run cut short still shows what it measured.
      print(f"  {plan} {row['name']}: {row['ms']:.3f} ms, FP8/other GEMMs {gemms}", flush=True)
    rows.append(row)
  if args.repeats:
    _interleaved(rows, args)
  for row in rows:
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12 / row["n"]
  return rows


def _configurations(args):
  """``(plan, variant, config)`` to run: one device the defaults; each sharded plan FP8 with
  every config, bf16 with each distinct set of XLA options among them."""
  configs = args.configs.split(",")
  for name in configs:
    config_parts(name)
  for plan in args.plans.split(","):
    for variant in args.variants.split(","):
      if variant.endswith("+fp8_gather") and plan != "fsdp":
        continue
      if plan == "single":
        yield plan, variant, "base"
        continue
      seen = []
      for config in configs:
        options = config_parts(config)[1]
        if variant == "bf16":
          if options in seen:
            continue
          seen.append(options)
          config = "+".join(p for p in config.split("+") if PARTS[p][1]) or "base"
        yield plan, variant, config


def _interleaved(rows, args):
  """Each row's ``ms``: the median over ``args.repeats`` rounds, each round one trial (the mean
  of ``args.iters`` synchronised steps) of every configuration in turn, after each one's
  warmup; ``times`` keeps the rounds' figures."""
  for row in rows:
    time_steps(row["run"], 0, args.warmup, 0)
  for r in range(args.repeats):
    for row in rows:
      row["times"].append(time_steps(row["run"], args.iters, 0, 1))
      if args.pipelined:
        row["pipelined"].append(time_steps(row["run"], args.iters, 0, 1, sync_each_step=False))
    print(
      f"  round {r + 1}: "
      + ", ".join(f"{row['plan']}/{row['name']} {row['times'][-1]:.2f}" for row in rows),
      flush=True,
    )
  for row in rows:
    row["ms"] = float(np.median(row["times"]))
    if row["pipelined"]:
      row["pipelined_ms"] = float(np.median(row["pipelined"]))
    del row["run"]


def efficiencies(rows):
  """Each sharded row's scaling efficiency ``t(single) / (n t)`` (``eff``, and with
  ``pipelined_ms`` ``eff_pipelined``), against one device's row of the same variant."""
  single = {r["variant"].split("+")[0]: r for r in rows if r["plan"] == "single"}
  for r in rows:
    base = single.get(r["variant"].split("+")[0])
    if base is None or r["plan"] == "single":
      continue
    r["eff"] = base["ms"] / (r["n"] * r["ms"])
    if "pipelined_ms" in r and "pipelined_ms" in base:
      r["eff_pipelined"] = base["pipelined_ms"] / (r["n"] * r["pipelined_ms"])
  return rows


def format_tables(rows):
  efficiencies(rows)
  bf16 = {(r["plan"], r["options"]): r["ms"] for r in rows if r["variant"] == "bf16"}
  head = (
    f"{'plan':<8}{'devices':>8}  {'variant':<40}{'step ms':>9}{'TFLOP/s/dev':>13}"
    f"{'vs bf16':>9}{'scaling eff':>13}{'rounds min-max':>16}{'pipelined (eff)':>18}"
  )
  lines = [head, "-" * len(head)]
  for r in rows:
    vs_bf16 = bf16.get((r["plan"], r["options"]), float("nan")) / r["ms"]
    eff = f"{r['eff']:.2f}" if "eff" in r else ""
    spread = f"{min(r['times']):.2f}-{max(r['times']):.2f}" if r["times"] else ""
    piped = ""
    if "pipelined_ms" in r:
      piped = f"{r['pipelined_ms']:.2f}" + (
        f" ({r['eff_pipelined']:.2f})" if "eff_pipelined" in r else ""
      )
    lines.append(
      f"{r['plan']:<8}{r['n']:>8}  {r['name']:<40}{r['ms']:>9.3f}"
      f"{r['tflops']:>13.1f}{vs_bf16:>8.2f}x{eff:>13}{spread:>16}{piped:>18}"
    )
  lines += [
    "",
    f"{'plan':<8}{'variant':<40}{'FP8/other GEMMs':>16}  all-gathers (dtype: MiB)"
    "; all-reduces / reduce-scatters: count (dtype: MiB)",
  ]
  mib = lambda d: ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in sorted(d.items()))
  for r in rows:
    sums = [
      f"{op} {r['n_reduces'].get(op, 0)} ({mib(r['reduces'].get(op, {})) or '-'})"
      for op in ("all-reduce", "reduce-scatter")
    ]
    margins = r.get("sm_margins") or []
    lines.append(
      f"{r['plan']:<8}{r['name']:<40}{r['gemms']:>16}  {mib(r['gathers']) or '-'}"
      f"; {'; '.join(sums)}"
      + (f"; GEMMs' sm_margin {','.join(map(str, margins))}" if any(margins) else "")
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
    f"float32 params in bf16; fwd + bwd; mean of {args.iters} steps, {timing}; "
    f"NCCL settings {args.nccl}: {NCCL_ENV or 'none'}\n"
  )
  rows = run(args)
  print(format_tables(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {"device": f"{dev.platform} {dev.device_kind}", "nccl": NCCL_ENV, "rows": rows}, f, indent=1
      )


if __name__ == "__main__":
  main()
