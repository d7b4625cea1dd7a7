"""Where one seed-000 Dense step on the 2x2 mesh spends its time, per GPU (a JAX profiler trace).

The step is bench/mesh2x2.py's (same layer, shardings and state feedback), through Linen, for
the variants asked (default bf16, current, delayed). Per variant and GPU: the step's wall time,
GPU time in GEMMs, casts and other fusions, and each NCCL kernel (its collective, reduction and
dtype from the kernel name; its HLO op, bytes and what it carries from the compiled HLO where
the trace names the op), how much of each collective ran while a GEMM ran on another stream, and
the GPU's idle time within the traced steps. Also the compiled program's order of GEMMs and
collectives (the schedule XLA chose), and ``--events`` a gzipped JSON of the GPU events.

Usage (4 GPUs): python bench/profile_mesh.py [--variants bf16,current,delayed] [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import mesh2x2  # noqa: E402  (bench/, on sys.path above)
from _multidevice import time_steps  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _kind(name: str) -> str:
  n = name.lower()
  # NCCL's kernels, and the device-to-device copies between GPUs that XLA's peer-memory
  # collective permutes run on the copy engines (GemmConfig.device_sums="exchange").
  if "nccl" in n or ("memcpy" in n and any(k in n for k in ("p2p", "ptop", "peer"))):
    return "collective"
  if any(k in n for k in ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "wgmma")):
    return "gemm"
  if "te_adapters" in n or "cast" in n or "convert" in n or "amax" in n:
    return "cast"
  return "other"


def trace(step_once, steps: int):
  """All Chrome-trace events of ``steps`` calls of ``step_once`` (after one warm-up call)."""
  jax.block_until_ready(step_once())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        out = step_once()
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      return []
    with gzip.open(paths[0]) as f:
      data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def gpu_events(events):
  """``{device name: [(start us, end us, kernel name, stream, args)]}`` of the GPU tracks."""
  pname = {
    e["pid"]: str(e.get("args", {}).get("name", ""))
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  tname = {
    (e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  out: dict[str, list] = {}
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    dev = pname.get(e.get("pid"), "")
    if "/device:GPU" not in dev:
      continue
    start = float(e["ts"])
    stream = tname.get((e["pid"], e.get("tid")), str(e.get("tid")))
    out.setdefault(dev, []).append(
      (start, start + float(e["dur"]), e["name"], stream, e.get("args", {}))
    )
  return out


def _union(spans):
  total, end = 0.0, None
  for s, t in sorted(spans):
    if end is None or s > end:
      total += t - s
      end = t
    elif t > end:
      total += t - end
      end = t
  return total


def _overlap(span, others):
  s, t = span
  return _union([(max(s, a), min(t, b)) for a, b in others if b > s and a < t])


def summarize(evs, steps: int, hlo_ops: dict):
  """One GPU's events: time by kind, each collective kernel, overlap and idle (per step)."""
  if not evs:
    return {}
  # Only kernels count for busy time; some tracks hold memcpy or annotation events too.
  by_kind: dict[str, float] = {}
  per_kernel: dict[str, float] = {}
  for s, t, name, _, _ in evs:
    by_kind[_kind(name)] = by_kind.get(_kind(name), 0.0) + (t - s)
    per_kernel[name] = per_kernel.get(name, 0.0) + (t - s)
  span = max(t for _, t, *_ in evs) - min(s for s, *_ in evs)
  busy = _union([(s, t) for s, t, *_ in evs])
  gemm_spans = [(s, t) for s, t, name, _, _ in evs if _kind(name) == "gemm"]
  compute_spans = [(s, t) for s, t, name, _, _ in evs if _kind(name) != "collective"]
  colls: dict[str, dict] = {}
  for s, t, name, stream, args in evs:
    if _kind(name) != "collective":
      continue
    op = str(args.get("hlo_op", args.get("long_name", "")))
    key = f"{name} | {op}" if op else name
    c = colls.setdefault(
      key,
      dict(
        kernel=name,
        hlo_op=op,
        stream=stream,
        us=0.0,
        count=0,
        with_gemm_us=0.0,
        with_compute_us=0.0,
        hlo=hlo_ops.get(op),
      ),
    )
    c["us"] += t - s
    c["count"] += 1
    c["with_gemm_us"] += _overlap((s, t), gemm_spans)
    c["with_compute_us"] += _overlap((s, t), compute_spans)
  for c in colls.values():
    for k in ("us", "with_gemm_us", "with_compute_us"):
      c[k] /= steps
    c["count"] /= steps
  top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
  sample_args = next((args for *_, args in evs if args), {})
  return dict(
    span_ms=span / steps / 1e3,
    busy_ms=busy / steps / 1e3,
    idle_ms=(span - busy) / steps / 1e3,
    by_kind_ms={k: v / steps / 1e3 for k, v in by_kind.items()},
    collectives=sorted(colls.values(), key=lambda c: -c["us"]),
    top_kernels_ms=[(k, v / steps / 1e3) for k, v in top],
    streams=sorted({e[3] for e in evs}),
    arg_keys=sorted(sample_args),
  )


def schedule(text: str):
  """The entry computation's GEMMs, casts and collectives in program order (XLA's schedule)."""
  lines = text.splitlines()
  try:
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  except StopIteration:
    return []
  out = []
  for line in lines[start + 1 :]:
    if line.startswith("}"):
      break
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(", line)
    if not m:
      continue
    name, shape, op = m.groups()
    target = re.search(r'custom_call_target="([^"]+)"', line)
    what = target.group(1) if target else op
    if (
      op in ("custom-call", "fusion")
      or "all-" in op
      or "reduce-scatter" in op
      or "collective" in op
      or op.endswith("-done")
      or op == "dot"
    ):
      calls = re.search(r"calls=%?([\w.\-]+)", line)
      out.append(
        f"{name} = {op}:{what} {shape[:60]}" + (f" calls {calls.group(1)}" if calls else "")
      )
  return out


def hlo_op_table(text: str):
  """HLO instruction name -> its collective details (bench/mesh2x2.collective_details)."""
  return {c["name"].lstrip("%"): c for c in mesh2x2.collective_details(text)}


def run_variant(model, mesh, x, dy, steps: int):
  """``(ms a step, trace events of ``steps`` steps, the compiled step)`` on ``mesh``."""
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec), may_alias=False)
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a: put(a, mesh2x2._param_spec(a)), model.params)
    state = jax.tree.map(lambda a: put(a, P()), model.state)
    xs, dys = put(x, mesh2x2.X_SPEC), put(dy, mesh2x2.DY_SPEC)
    stateful = bool(jax.tree.leaves(model.state))
    step = mesh2x2.make_step(model, mesh, donate_state=stateful)
    compiled = step.lower(params, state, xs, dys).compile()
    current = [state]

    def step_once():
      out = compiled(params, current[0], xs, dys)
      current[0] = out[1][1]  # the recipe state's gradient is the next step's state
      return out

    for _ in range(3):
      jax.block_until_ready(step_once())
    ms = time_steps(step_once, 10, 2, 3)
    events = trace(step_once, steps)
  return ms, events, compiled


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--variants", default="bf16,current,delayed")
  p.add_argument("--framework", default="linen")
  p.add_argument(
    "--config",
    default="base",
    help="the FP8 layers' GemmConfig levers, as bench/mesh2x2.py's --configs takes "
    "one (base, m<SMs>, c<n>, m<SMs>c<n>)",
  )
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out", default=".")
  p.add_argument("--events", action="store_true", help="also write the GPU events (gzipped)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=8192)
  p.add_argument("--features", type=int, default=32768)
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  devices = jax.devices()
  mesh = jax.make_mesh(
    mesh2x2.MESH_SHAPE, mesh2x2.MESH_AXES, devices=devices[:4], axis_types=(AxisType.Auto,) * 2
  )
  b, s, h, f = args.batch, args.seq, args.hidden, args.features
  kx, kd = jax.random.split(jax.random.PRNGKey(0), 2)
  x = jax.random.normal(kx, (b, s, h), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (b, s, f), jnp.float32).astype(jnp.bfloat16)
  report = dict(
    device=f"{devices[0].platform} {devices[0].device_kind} x {len(devices)}",
    config=args.config,
    jax=jax.__version__,
    shape=[b, s, h, f],
    steps=args.steps,
    variants={},
  )
  for variant in args.variants.split(","):
    start = time.perf_counter()
    mesh2x2.LEVERS = {} if variant == "bf16" else mesh2x2.parse_config(args.config)
    model = mesh2x2.BUILDERS[args.framework](variant, h, f, x[:1, :16])
    ms, events, compiled = run_variant(model, mesh, x, dy, args.steps)
    text = compiled.as_text()
    tag = f"{args.framework}_{variant}_{args.config}"
    with open(os.path.join(args.out, f"hlo_{tag}.txt"), "w") as fh:
      fh.write(text)
    per_dev = gpu_events(events)
    ops = hlo_op_table(text)
    summary = {dev: summarize(evs, args.steps, ops) for dev, evs in sorted(per_dev.items())}
    report["variants"][variant] = dict(
      wall_ms=ms,
      gpus=summary,
      schedule=schedule(text),
      collectives=mesh2x2.collective_details(text),
    )
    if args.events:
      with gzip.open(os.path.join(args.out, f"events_{tag}.json.gz"), "wt") as fh:
        json.dump(
          {d: [(s_, t_, n, st, a) for s_, t_, n, st, a in evs] for d, evs in per_dev.items()}, fh
        )
    print(
      f"\n== {args.framework} {variant} {args.config}: wall {ms:.3f} ms a step "
      f"({time.perf_counter() - start:.1f} s)"
    )
    for dev, sm in summary.items():
      if not sm:
        continue
      kinds = ", ".join(f"{k} {v:.3f}" for k, v in sorted(sm["by_kind_ms"].items()))
      print(
        f"  {dev}: span {sm['span_ms']:.3f} ms, busy {sm['busy_ms']:.3f}, idle "
        f"{sm['idle_ms']:.3f}; by kind (ms, streams summed): {kinds}"
      )
      for c in sm["collectives"]:
        hlo = c["hlo"] or {}
        arrs = " ".join(f"{d}[{','.join(map(str, s_))}]" for d, s_ in hlo.get("arrays", []))
        print(
          f"    {c['us']:8.1f} us x{c['count']:.0f}  with GEMM {c['with_gemm_us']:7.1f} us, "
          f"with any compute {c['with_compute_us']:7.1f} us  {c['kernel'][:60]}  "
          f"{c['hlo_op']} {'+'.join(hlo.get('carries', []))} {arrs}"
        )
      break  # the first GPU in the printout; all are in the JSON
  with open(os.path.join(args.out, f"profile_{args.framework}_{args.config}.json"), "w") as fh:
    json.dump(report, fh, indent=1, default=str)


if __name__ == "__main__":
  main()
