"""Seed 001's transformer layer with tensor + sequence parallelism, FP8 against bf16.

The layer (batch 4, seq 2048, hidden 4096, ffn 16384, 32 heads) written functionally,
sequence-first ``x (S, B, H)``: LayerNorm, the qkv projection (column-parallel), causal attention
on each device's heads, the output projection (row-parallel), residual, LayerNorm, the MLP's two
GEMMs (column- then row-parallel, tanh GELU), residual; biases as the seed's layer has them.

Plans (n = --devices):
  single   one device, every GEMM whole
  tp_sp    inside shard_map over "tp": x sharded on S; each column-parallel GEMM all-gathers its
           input's rows (FP8 with a recipe) and each row-parallel GEMM reduce-scatters its output
           (``dot_general(sequence_parallel=...)``)
  tp_ring  tp_sp with ``GemmConfig(collective_matmul=True)``: the all-gathers and
           reduce-scatters decomposed into ppermute ring steps beside the GEMMs' chunks

Variants: bf16, current, delayed; an FP8 variant with ``+saturate`` (``delayed+saturate``) runs
with ``GemmConfig(non_finite="saturate")``: no operand's inverse scale waits on its amax's
all-reduce (under delayed scaling the amaxes then feed only the next state). The rows are
gathered as ``GemmConfig.sequence_gather``'s default decides (bf16 rows here: unquantized, every
device casting them whole); ``+fp8`` (``current+fp8``, ``delayed+fp8+saturate``) gathers the
FP8 copies of each shard instead, ``+input`` the unquantized rows; ``+x`` moves the FP8 rows'
gathers and the partial sums' reduce-scatters by ``ppermute`` exchanges
(``GemmConfig(device_sums="exchange")``), and ``+peer`` (any variant, bf16 too) compiles with
XLA's ``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY`` (collective permutes as
device-to-device copies over the copy engines), e.g. ``current+fp8+x+peer``. One step is
forward plus backward (``jax.vjp``, a given output gradient). Timing: every configuration is
compiled first, then ``--repeats`` rounds run one trial of each configuration in turn
(interleaved), each trial the mean of ``--iters`` synchronised steps after ``--warmup``; the
median over rounds is reported with the spread. The second table lists the compiled HLO: FP8
against other GEMMs and the collectives.

With ``--profile N`` (GPUs), N steps of each sharded configuration are traced after the timing
(``jax.profiler``, steps back to back) and the trace's kernel timestamps give, per GPU and step,
the time in GEMM kernels, in NCCL kernels, and how much of the NCCL time ran while a GEMM kernel
ran on the same GPU (the collectives overlapped with the GEMMs), and the kernels between the
GEMMs by name and time, with the idle time; ``--out DIR`` also keeps the traced configurations'
GEMM and NCCL kernel spans and those figures (``kernels.json.gz``).

Usage (two GPUs):
  python bench/sp_layer.py --devices 2 [--profile 3 --out DIR] [--hlo-out DIR]
CPU dry run:
  python bench/sp_layer.py --cpu-devices 2 --devices 2 --batch 2 --seq 64 --hidden 128 \\
      --ffn 256 --heads 4 --iters 1 --warmup 0 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import use_cpu_devices  # noqa: E402


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--devices", type=int, default=None)
  p.add_argument("--plans", default="single,tp_sp,tp_ring")
  p.add_argument("--variants", default="bf16,current,delayed")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--ffn", type=int, default=16384)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument(
    "--pipelined",
    action="store_true",
    help="each trial: the steps back to back, one wait at the end (else a wait after each)",
  )
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--cpu-devices", type=int, default=None)
  p.add_argument("--profile", type=int, default=0, help="trace this many steps per sharded config")
  p.add_argument("--out", default=None, help="with --profile: write the traced kernels here")
  p.add_argument(
    "--hlo-out",
    default=None,
    help="write each configuration's compiled HLO here (PLAN_VARIANT.hlo.txt), where a trace's "
    "fusion names (input_convert_transpose_fusion_1, ...) are defined",
  )
  return p.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
use_cpu_devices(ARGS and ARGS.cpu_devices)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from te_adapters import core, inspect  # noqa: E402

DN = (((2,), (0,)), ((), ()))


def _recipe(variant):
  return {
    "bf16": None,
    "current": core.Float8CurrentScaling(),
    "delayed": core.DelayedScaling(amax_history_len=1024),
  }[variant.split("+")[0]]


PEER = {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"}


def _config(variant, plan):
  parts = set(variant.split("+")[1:]) - {"peer"}
  unknown = parts - {"saturate", "input", "fp8", "x"}
  if unknown or {"input", "fp8"} <= parts:
    raise SystemExit(f"--variants: {variant!r}: parts are saturate, x, peer and one of input, fp8")
  gather = "input" if "input" in parts else "fp8" if "fp8" in parts else "auto"
  return core.GemmConfig(
    collective_matmul=plan == "tp_ring",
    non_finite="saturate" if "saturate" in parts else "propagate",
    sequence_gather=gather,
    device_sums="exchange" if "x" in parts else "collective",
  )


def _compile_options(variant):
  """XLA options of a variant's compile: ``+peer``'s collective permutes over the copy engines."""
  return dict(PEER) if "peer" in variant.split("+")[1:] else None


def init_params(key, hidden, ffn):
  ks = jax.random.split(key, 4)

  def w(k, shape):
    return jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5

  return {
    "ln1": jnp.ones(hidden),
    "ln1_b": jnp.zeros(hidden),
    "qkv": w(ks[0], (hidden, 3 * hidden)),
    "qkv_b": jnp.zeros(3 * hidden),
    "out": w(ks[1], (hidden, hidden)),
    "out_b": jnp.zeros(hidden),
    "ln2": jnp.ones(hidden),
    "ln2_b": jnp.zeros(hidden),
    "fc1": w(ks[2], (hidden, ffn)),
    "fc1_b": jnp.zeros(ffn),
    "fc2": w(ks[3], (ffn, hidden)),
    "fc2_b": jnp.zeros(hidden),
  }


# Column-parallel kernels and biases split on their outputs, row-parallel kernels on their
# inputs; the row-parallel biases and the norms replicated.
PARAM_SPECS = {
  "ln1": P(),
  "ln1_b": P(),
  "qkv": P(None, "tp"),
  "qkv_b": P("tp"),
  "out": P("tp", None),
  "out_b": P(),
  "ln2": P(),
  "ln2_b": P(),
  "fc1": P(None, "tp"),
  "fc1_b": P("tp"),
  "fc2": P("tp", None),
  "fc2_b": P(),
}


def layer(x, p, states, *, recipe, heads, sequence, config, attention):
  """x (S, B, H) -> (S, B, H); ``heads``: this device's; ``sequence``: inside shard_map."""

  def gemm(a, w, state, mode):
    return core.dot_general(
      a,
      w.astype(jnp.bfloat16),
      DN,
      recipe=recipe,
      state=state,
      threshold=None,
      config=config,
      sequence_parallel=(mode, "tp") if sequence else None,
    )

  def norm(a, g, b):
    a32 = a.astype(jnp.float32)
    mean = jnp.mean(a32, -1, keepdims=True)
    var = jnp.mean(jnp.square(a32 - mean), -1, keepdims=True)
    return ((a32 - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(a.dtype)

  res = x
  qkv = gemm(norm(x, p["ln1"], p["ln1_b"]), p["qkv"], states[0], "all_gather")
  qkv = qkv + p["qkv_b"].astype(qkv.dtype)
  s, b, _ = qkv.shape
  q, k, v = jnp.split(qkv.reshape(s, b, heads, -1), 3, axis=3)
  bshd = lambda t: jnp.transpose(t, (1, 0, 2, 3))  # noqa: E731
  o = jax.nn.dot_product_attention(
    bshd(q), bshd(k), bshd(v), is_causal=True, implementation=attention
  )
  o = jnp.transpose(o, (1, 0, 2, 3)).reshape(s, b, -1)
  x = res + gemm(o, p["out"], states[1], "reduce_scatter") + p["out_b"].astype(x.dtype)
  res = x
  h = gemm(norm(x, p["ln2"], p["ln2_b"]), p["fc1"], states[2], "all_gather")
  h = jax.nn.gelu(h + p["fc1_b"].astype(h.dtype), approximate=True)
  return res + gemm(h, p["fc2"], states[3], "reduce_scatter") + p["fc2_b"].astype(x.dtype)


def make_step(variant, plan, mesh, heads, attention):
  recipe = _recipe(variant)
  config = _config(variant, plan)
  n = 1 if mesh is None else mesh.size
  fn = functools.partial(
    layer,
    recipe=recipe,
    heads=heads // n,
    sequence=mesh is not None,
    config=config,
    attention=attention,
  )
  if mesh is not None:
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(P("tp"), PARAM_SPECS, P()), out_specs=P("tp"))

  def step(x, p, states, dy):
    y, vjp = jax.vjp(fn, x, p, states)
    return y, vjp(dy)

  return jax.jit(step)


def run(args):
  configs = compile_configs(args)
  for c in configs:
    for _ in range(args.warmup):
      jax.block_until_ready(c["run"]())
  for r in range(args.repeats):  # interleaved: each round runs every configuration once
    for c in configs:
      c["times"].append(time_trial(c, args.iters, args.pipelined))
    print(
      f"  round {r + 1}: "
      + ", ".join(f"{c['plan']}/{c['variant']} {c['times'][-1]:.2f}" for c in configs),
      flush=True,
    )
  return configs


def time_trial(c, iters, pipelined=False):
  """The mean of ``iters`` synchronised steps of configuration ``c``, ms; ``pipelined``: of
  ``iters`` steps dispatched back to back and waited for once (the host's dispatch of a step
  then runs while the GPUs compute the one before, as in a training loop)."""
  if pipelined:
    start = time.perf_counter()
    for _ in range(iters):
      out = c["run"]()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(c["run"]())
    times.append(time.perf_counter() - start)
  return float(np.mean(times)) * 1e3


def compile_configs(args):
  """Every (plan, variant) of ``args`` compiled, with its FP8/other GEMM counts and collectives
  from the compiled HLO; ``run`` calls it with its arguments bound."""
  devices = jax.devices()
  n = args.devices or len(devices)
  attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  s, b, h, f = args.seq, args.batch, args.hidden, args.ffn
  kx, kp, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (s, b, h), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (s, b, h), jnp.float32).astype(jnp.bfloat16)
  params = init_params(kp, h, f)
  configs = []
  for plan in args.plans.split(","):
    mesh = None
    if plan != "single":
      mesh = jax.make_mesh((n,), ("tp",), devices=devices[:n], axis_types=(AxisType.Auto,))
    for variant in args.variants.split(","):
      if plan == "tp_ring" and "input" in variant.split("+"):
        print(f"  skipped tp_ring {variant}: the ring gathers FP8 chunks", flush=True)
        continue
      recipe = _recipe(variant)
      states = tuple(
        core.init_state(recipe) if recipe is not None and recipe.stateful else None
        for _ in range(4)
      )
      put = functools.partial(_put, mesh, devices[0])
      p = {k: put(v, PARAM_SPECS[k]) for k, v in params.items()}
      call_args = (
        put(x, P("tp")),
        p,
        jax.tree.map(lambda a, put=put: put(a, P()), states),
        put(dy, P("tp")),
      )
      step = make_step(variant, plan, mesh, args.heads, attention)
      try:
        options = _compile_options(variant)
        if mesh is None:
          compiled = step.lower(*call_args).compile(compiler_options=options)
        else:
          with jax.set_mesh(mesh):
            compiled = step.lower(*call_args).compile(compiler_options=options)
      except Exception as e:  # noqa: BLE001  (said, and the other configurations still run)
        print(f"  FAILED {plan} {variant}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        continue
      text = compiled.as_text()
      if getattr(args, "hlo_out", None):
        os.makedirs(args.hlo_out, exist_ok=True)
        with open(os.path.join(args.hlo_out, f"{plan}_{variant}.hlo.txt"), "w") as f:
          f.write(text)
      configs.append(
        dict(
          plan=plan,
          variant=variant,
          n=1 if mesh is None else n,
          run=functools.partial(compiled, *call_args),
          gemms="{}/{}".format(*inspect.count_fp8_gemms(text)),
          ext="{}/{}".format(*extension_calls(text)),
          collectives=_collectives(text),
          times=[],
        )
      )
      print(
        f"  compiled {plan} {variant}: FP8/other GEMMs {configs[-1]['gemms']}, the extension's "
        f"casts/GEMMs {configs[-1]['ext']}",
        flush=True,
      )
  return configs


def extension_calls(text):
  """``(casts, GEMMs)``: the extension's per-tensor cast and FP8 GEMM calls in a compiled
  program. ``inspect.count_fp8_gemms`` counts XLA's FP8 GEMMs and the extension's alike, so a tree
  whose extension did not load still shows its FP8 GEMMs; there its casts are XLA's fusions of
  the pure-JAX cast (``input_convert_transpose_fusion``: the FP8 copy and its transposed copy)."""
  from te_adapters.core import kernels

  def calls(target):
    return text.count(f'custom_call_target="{target}"')

  return calls(kernels.CAST_TRANSPOSE_TARGET), calls(kernels.GEMM_TARGET)


def _kernel_spans(events):
  """``{GPU: {"gemm": [(start, end)], "nccl": [...]}}`` (us) of a trace's GPU kernels."""
  import profile_mesh  # bench/, beside this script

  out = {}
  for dev, evs in profile_mesh.gpu_events(events).items():
    kinds = {"gemm": [], "nccl": []}
    for start, end, name, _, _ in evs:
      kind = profile_mesh._kind(name)
      if kind in ("gemm", "collective"):
        kinds["gemm" if kind == "gemm" else "nccl"].append((start, end))
    out[dev] = kinds
  return out


def overlap(spans, steps):
  """Per GPU and step (ms): GEMM kernels, NCCL kernels, and NCCL time while a GEMM kernel ran
  on the same GPU (the measure of the intersection of the two unions)."""
  import profile_mesh  # bench/, beside this script

  union = profile_mesh._union
  out = {}
  for dev, k in spans.items():
    gemm, nccl = union(k["gemm"]), union(k["nccl"])
    both = gemm + nccl - union(k["gemm"] + k["nccl"])
    out[dev] = dict(
      gemm_ms=gemm / steps / 1e3,
      nccl_ms=nccl / steps / 1e3,
      nccl_beside_gemm_ms=both / steps / 1e3,
      nccl_kernels=len(k["nccl"]) / steps,
    )
  return out


def between_gemms(events, steps, top=8):
  """Per GPU and step (ms): the trace's span and idle time (no kernel running), time by kernel
  kind, and the ``top`` kernels by time that are neither GEMMs nor NCCL's (the casts,
  transposes, norms and attention that run between the GEMMs), by name."""
  import profile_mesh  # bench/, beside this script

  out = {}
  for dev, evs in profile_mesh.gpu_events(events).items():
    s = profile_mesh.summarize(evs, steps, {})
    others = [
      (name, ms)
      for name, ms in s["top_kernels_ms"]
      if profile_mesh._kind(name) not in ("gemm", "collective")
    ]
    out[dev] = dict(
      span_ms=s["span_ms"], idle_ms=s["idle_ms"], by_kind_ms=s["by_kind_ms"], others=others[:top]
    )
  return out


def after_gathers(events, steps):
  """Per GPU, for each all-gather of the first traced step: what ran from the gather's end to
  the start of the next GEMM kernel (the gap before the GEMM that reads the gathered rows), as
  ``dict(gap_us, idle_us, kernels=[(name, us, HLO op)], gemm)``, the kernels in the order they
  started (the HLO op where the trace names it, else "")."""
  import profile_mesh  # bench/, beside this script

  out = {}
  for dev, evs in profile_mesh.gpu_events(events).items():
    evs = sorted(evs)
    gathers = [e for e in evs if "allgather" in e[2].lower().replace("_", "")]
    gathers = gathers[: len(gathers) // steps] if steps else gathers
    rows = []
    for _, end, _, _, _ in gathers:
      nxt = next((e for e in evs if e[0] >= end and profile_mesh._kind(e[2]) == "gemm"), None)
      if nxt is None:
        continue
      inside = [e for e in evs if e[1] > end and e[0] < nxt[0] and e[2] != nxt[2]]
      busy = profile_mesh._union([(max(a, end), min(b, nxt[0])) for a, b, *_ in inside])
      rows.append(
        dict(
          gap_us=nxt[0] - end,
          idle_us=nxt[0] - end - busy,
          kernels=[
            (name[:80], b - a, str(args.get("hlo_op", ""))) for a, b, name, _, args in inside
          ],
          gemm=nxt[2][:80],
        )
      )
    out[dev] = rows
  return out


def profile(configs, steps, out_dir=None):
  """Traces ``steps`` steps of every sharded configuration; each config gets ``overlap`` and
  ``between_gemms``."""
  import gzip
  import json

  import profile_mesh  # bench/, beside this script

  kept, kinds, gaps = {}, {}, {}
  for c in configs:
    if c["plan"] == "single":
      continue
    events = profile_mesh.trace(c["run"], steps)
    spans = _kernel_spans(events)
    comm = {}
    for evs in profile_mesh.gpu_events(events).values():
      for _, _, name, _, _ in evs:
        if profile_mesh._kind(name) == "collective":
          comm[name[:60]] = comm.get(name[:60], 0) + 1
    print(f"  communication {c['plan']} {c['variant']}: {comm}", flush=True)
    c["overlap"] = overlap(spans, steps)
    c["between_gemms"] = between_gemms(events, steps, top=16)
    c["after_gathers"] = after_gathers(events, steps)
    for dev, o in sorted(c["overlap"].items()):
      share = o["nccl_beside_gemm_ms"] / o["nccl_ms"] if o["nccl_ms"] else float("nan")
      print(
        f"  profile {c['plan']} {c['variant']} {dev}: GEMMs {o['gemm_ms']:.2f} ms, NCCL "
        f"and peer copies {o['nccl_ms']:.2f} ms ({o['nccl_kernels']:.0f} of them), of which "
        f"{o['nccl_beside_gemm_ms']:.2f} ms beside a GEMM ({share:.0%}) a step",
        flush=True,
      )
    for dev, b in sorted(c["between_gemms"].items()):
      kind = ", ".join(f"{k} {v:.2f}" for k, v in sorted(b["by_kind_ms"].items()))
      others = "; ".join(f"{name[:60]} {ms * 1e3:.0f} us" for name, ms in b["others"])
      print(
        f"  kernels {c['plan']} {c['variant']} {dev}: span {b['span_ms']:.2f} ms, idle "
        f"{b['idle_ms']:.2f} ms, by kind (ms) {kind}; others a step: {others}",
        flush=True,
      )
    for dev, rows in sorted(c["after_gathers"].items()):
      for k, r in enumerate(rows):
        names = "; ".join(
          f"{name[:50]}{f' [{op}]' if op else ''} {us:.0f}" for name, us, op in r["kernels"][:12]
        )
        print(
          f"  after gather {k} {c['plan']} {c['variant']} {dev}: {r['gap_us']:.0f} us to "
          f"{r['gemm'][:40]} (idle {r['idle_us']:.0f} us): {names}",
          flush=True,
        )
    kept[f"{c['plan']} {c['variant']}"] = spans
    kinds[f"{c['plan']} {c['variant']}"] = c["between_gemms"]
    gaps[f"{c['plan']} {c['variant']}"] = c["after_gathers"]
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with gzip.open(os.path.join(out_dir, "kernels.json.gz"), "wt") as f:
      json.dump({"steps": steps, "configs": kept, "between_gemms": kinds, "after_gathers": gaps}, f)
  return configs


def _put(mesh, device, a, spec):
  if mesh is None:
    return jax.device_put(a, device)
  return jax.device_put(a, NamedSharding(mesh, spec))


def _collectives(text):
  counts = {}
  for c in inspect.hlo_collectives(text):
    dtype = c.arrays[-1][0] if c.arrays else "?"
    key = f"{c.op} {dtype}"
    counts[key] = counts.get(key, 0) + 1
  return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "-"


def format_tables(configs):
  med = {(c["plan"], c["variant"]): float(np.median(c["times"])) for c in configs}
  lines = [
    f"{'plan':<9}{'variant':<17}{'median ms':>10}{'min-max':>16}{'vs bf16':>9}"
    f"{'eff':>6}  FP8/other GEMMs; the extension's casts/GEMMs; collectives"
  ]
  for c in configs:
    t = med[(c["plan"], c["variant"])]
    bf16 = med.get((c["plan"], "bf16"), float("nan"))
    single = med.get(("single", c["variant"]))
    eff = "" if single is None or c["plan"] == "single" else f"{single / (c['n'] * t):.2f}"
    spread = f"{min(c['times']):.2f}-{max(c['times']):.2f}"
    lines.append(
      f"{c['plan']:<9}{c['variant']:<17}{t:>10.2f}{spread:>16}{bf16 / t:>8.2f}x"
      f"{eff:>6}  {c['gemms']}; {c['ext']}; {c['collectives']}"
    )
  return "\n".join(lines)


def main():
  args = ARGS
  dev = jax.devices()[0]
  print(
    f"date: {datetime.date.today()}; device: {dev.platform} {dev.device_kind} x "
    f"{args.devices or jax.device_count()}; jax {jax.__version__}"
  )
  print(
    f"x ({args.seq}, {args.batch}, {args.hidden}) bf16, ffn {args.ffn}, {args.heads} heads; "
    f"fwd + bwd; median over {args.repeats} interleaved rounds of {args.iters} "
    f"{'pipelined' if args.pipelined else 'synchronised'} steps\n"
  )
  configs = run(args)
  print(format_tables(configs))
  if args.profile:
    profile(configs, args.profile, args.out)


if __name__ == "__main__":
  main()
