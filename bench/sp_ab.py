"""Seed 001's layer with sequence parallelism (``bench/sp_layer.py``) from several source trees of
te_adapters, timed against each other in one call, interleaved.

Each tree runs in its own worker process with its root first on ``sys.path`` (its
``te_adapters/`` must hold the compiled extension); ``bench/sp_layer.py`` is this checkout's. A
worker compiles its plans and variants and reports each program's FP8/other GEMMs and
collectives (compiled HLO); one worker compiles at a time (``--parallel-compile``: all at
once, faster, but XLA's autotuning of one then times its candidates beside another's work on
the same GPUs). The parent then warms every
configuration and runs ``--repeats`` rounds, each running one trial (``--iters`` synchronised
steps) of every configuration of every tree, the trees' order rotating from round to round, and
prints per configuration the median and spread, FP8 against the same plan's bf16 and the
scaling efficiency against one GPU (both from the first tree that has that row). With
``--profile N`` each sharded configuration is then traced for N steps (``sp_layer.profile``:
GEMM/NCCL overlap, the kernels between the GEMMs, and what runs after each all-gather).

Usage (two GPUs; a tree spec is ``LABEL=ROOT;PLANS;VARIANTS``):
  python bench/sp_ab.py --devices 2 --tree "main=.;single,tp_sp;bf16,current,delayed" \\
      --tree "other=../other;tp_sp;current,delayed" --repeats 5 --profile 3 --json OUT.json
CPU dry run: add ``--cpu-devices 2 --batch 2 --seq 64 --hidden 128 --ffn 256 --heads 4``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_MARK = "@sp "  # the workers' protocol lines on their stdout
_LAYER_ARGS = ("devices", "batch", "seq", "hidden", "ffn", "heads", "iters", "warmup")


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tree", action="append", default=[], help="LABEL=ROOT;PLANS;VARIANTS")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--plans", default="single,tp_sp", help=argparse.SUPPRESS)
  p.add_argument("--variants", default="bf16,current,delayed", help=argparse.SUPPRESS)
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--ffn", type=int, default=16384)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--pipelined", action="store_true", help="as sp_layer.py's")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--profile", type=int, default=0)
  p.add_argument(
    "--profile-only", default=None, help="trace only these TREE/VARIANT (comma-separated)"
  )
  p.add_argument("--cpu-devices", type=int, default=None)
  p.add_argument("--parallel-compile", action="store_true")
  p.add_argument("--json", default=None, help="write every figure here")
  p.add_argument(
    "--hlo-out",
    default=None,
    help="write each tree's compiled HLO here (LABEL/PLAN_VARIANT.hlo.txt, as sp_layer.py's)",
  )
  return p.parse_args(argv)


def _tree_spec(spec):
  label, rest = spec.split("=", 1)
  root, plans, variants = rest.split(";")
  return label, os.path.abspath(root), plans, variants


# --- the worker ------------------------------------------------------------------------------


def _worker(args):
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # everything else a worker prints goes to stderr
  sys.stdout = sys.stderr
  sys.path.insert(0, args.worker)
  sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
  from _multidevice import use_cpu_devices

  use_cpu_devices(args.cpu_devices)
  import jax
  import sp_layer

  import te_adapters

  print(f"worker {args.worker}: te_adapters from {os.path.dirname(te_adapters.__file__)}")
  configs = sp_layer.compile_configs(args)

  def send(obj):
    proto.write(_MARK + json.dumps(obj) + "\n")

  send(
    [
      dict(
        plan=c["plan"],
        variant=c["variant"],
        n=c["n"],
        gemms=c["gemms"],
        ext=c["ext"],
        coll=c["collectives"],
      )
      for c in configs
    ]
  )
  for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "quit":
      break
    c = configs[cmd["i"]]
    if cmd["cmd"] == "warm":
      for _ in range(args.warmup):
        jax.block_until_ready(c["run"]())
      send(None)
    elif cmd["cmd"] == "time":
      send(sp_layer.time_trial(c, args.iters, args.pipelined))
    elif cmd["cmd"] == "profile":
      sp_layer.profile([c], args.profile)
      send({k: c.get(k) for k in ("overlap", "between_gemms", "after_gathers")})


# --- the parent ------------------------------------------------------------------------------


def _read(proc):
  for line in proc.stdout:
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK) :])
  raise RuntimeError(f"a worker exited with {proc.wait()}")


def _ask(proc, **cmd):
  proc.stdin.write(json.dumps(cmd) + "\n")
  proc.stdin.flush()
  return _read(proc)


def main(args):
  import numpy as np

  if args.worker:
    return _worker(args)
  trees = [_tree_spec(t) for t in args.tree]
  procs, reports = [], []
  for label, root, plans, variants in trees:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", root, "--plans", plans]
    cmd += ["--variants", variants]
    for name in _LAYER_ARGS:
      cmd += [f"--{name}", str(getattr(args, name))]
    cmd += ["--profile", str(args.profile)] + (["--pipelined"] if args.pipelined else [])
    if args.cpu_devices:
      cmd += ["--cpu-devices", str(args.cpu_devices)]
    if args.hlo_out:
      cmd += ["--hlo-out", os.path.join(os.path.abspath(args.hlo_out), label)]
    procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    if not args.parallel_compile:
      reports.append(_read(procs[-1]))
  if args.parallel_compile:
    reports = [_read(proc) for proc in procs]
  rows = []  # (tree index, config index, info)
  for t, report in enumerate(reports):
    for i, info in enumerate(report):
      rows.append((t, i, dict(info, tree=trees[t][0], times=[])))
  for t, i, _ in rows:
    _ask(procs[t], cmd="warm", i=i)
  for r in range(args.repeats):
    shift = r % len(procs)
    order = sorted(rows, key=lambda row: ((row[0] - shift) % len(procs), row[1]))
    for t, i, info in order:
      info["times"].append(_ask(procs[t], cmd="time", i=i))
    print(
      f"  round {r + 1}: "
      + ", ".join(f"{i['tree']}/{i['plan']}/{i['variant']} {i['times'][-1]:.2f}" for *_, i in rows),
      flush=True,
    )
  med = {}
  for *_, info in rows:
    info["median_ms"] = float(np.median(info["times"]))
    med.setdefault((info["plan"], info["variant"]), info["median_ms"])
  print(
    f"\n{'tree':<10}{'plan':<8}{'variant':<17}{'median ms':>10}{'min-max':>14}{'vs bf16':>9}"
    f"{'eff':>6}  FP8/other GEMMs; the extension's casts/GEMMs; collectives"
  )
  for *_, i in rows:
    t = i["median_ms"]
    bf16 = med.get((i["plan"], "bf16"), float("nan"))
    single = med.get(("single", i["variant"]))
    eff = "" if single is None or i["plan"] == "single" else f"{single / (i['n'] * t):.2f}"
    spread = f"{min(i['times']):.2f}-{max(i['times']):.2f}"
    print(
      f"{i['tree']:<10}{i['plan']:<8}{i['variant']:<17}{t:>10.2f}{spread:>14}{bf16 / t:>8.2f}x"
      f"{eff:>6}  {i['gemms']}; {i['ext']}; {i['coll']}"
    )
  if args.profile:
    for t, i, info in rows:
      only = args.profile_only and args.profile_only.split(",")
      if info["plan"] != "single" and (not only or f"{info['tree']}/{info['variant']}" in only):
        print(f"  profile of {info['tree']}:", flush=True)
        info["profile"] = _ask(procs[t], cmd="profile", i=i)
  for proc in procs:
    proc.stdin.write(json.dumps(dict(cmd="quit")) + "\n")
    proc.stdin.close()
    proc.wait()
  if args.json:
    with open(args.json, "w") as f:
      json.dump([info for *_, info in rows], f)


if __name__ == "__main__":
  main(_parse(sys.argv[1:]))
