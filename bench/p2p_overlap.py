"""Does a sum of partial products overlap an FP8 GEMM? NCCL's all-reduce against an exchange.

On two devices of one process, a mesh axis ``tp`` of size 2. Each device holds an FP8 GEMM's
operands (a (M, K) and b (N, K), float8_e4m3fn; out (M, N) bf16, XLA's FP8 cuBLASLt GEMM) and a
bf16 partial product p (R, C) of the size a 2x2 step sums over ``tp`` (seed 000's dx: 128 MiB).
The sum of p over the two devices is written two ways:

  psum    ``lax.psum(p, "tp")``: an NCCL all-reduce (or XLA's one-shot kernel), SMs of its own;
  swap    ``p + lax.ppermute(p, "tp", [(0, 1), (1, 0)])``: each device sends its partial to the
          other and adds; with the XLA option ``xla_gpu_use_memcpy_local_p2p`` (config ``ce``)
          the send is a device-to-device copy between the process's GPUs (copy engines, no SMs)
          instead of NCCL's send/recv kernels.

``peer`` asks for it through ``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY``, the
option from which newer XLA sources build the collective permute (they no longer read
``xla_gpu_use_memcpy_local_p2p`` there); jaxlib 0.10.2 knows the option and accepts that value.
Whether the copy path ran is not in the compiled HLO: XLA's log says (with
``TF_CPP_VMODULE=collective_permute_thunk=3``, "Performing collective permute" is NCCL's path).
On two H100s with jax 0.11.2 (2026-11-27) it logged NCCL's path under ``ce`` too, and ``ce``
timed as ``default`` (``bench/RESULTS.md``).

Programs: ``gemm`` alone, ``psum`` / ``swap`` alone, and ``gemm+psum`` / ``gemm+swap``: the GEMM
and an independent sum in one program, where XLA may run them side by side. If the sum hides
beside the GEMM, ``gemm+sum`` takes about as long as ``gemm``; if not, about their total.
Every program is compiled first; then ``--rounds`` rounds run each in turn for ``--iters``
back-to-back calls (one sync); medians over rounds, ms per call.

Usage (two GPUs): ``python bench/p2p_overlap.py``
Dry run on CPU: ``python bench/p2p_overlap.py --cpu-devices 2 --m 256 --k 256 --n 256 --rows 64``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import schedule, time_steps, use_cpu_devices  # noqa: E402

CONFIGS = {
  "default": {},
  "ce": {"xla_gpu_use_memcpy_local_p2p": True},
  "peer": {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"},
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cpu-devices", type=int, default=0)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--k", type=int, default=8192)
  p.add_argument("--n", type=int, default=16384)
  p.add_argument("--rows", type=int, default=8192, help="p is (rows, 8192) bf16 per device")
  p.add_argument("--cols", type=int, default=8192)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--configs", default="default,ce,peer")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  use_cpu_devices(args.cpu_devices)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from te_adapters import inspect

  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  shard = NamedSharding(mesh, P("tp"))
  f8 = jnp.float8_e4m3fn
  ka, kb, kp = jax.random.split(jax.random.PRNGKey(0), 3)
  a = jax.device_put(jax.random.normal(ka, (2, args.m, args.k)).astype(f8), shard)
  b = jax.device_put(jax.random.normal(kb, (2, args.n, args.k)).astype(f8), shard)
  part = jax.device_put(
    jax.random.normal(kp, (2, args.rows, args.cols)).astype(jnp.bfloat16), shard
  )

  def gemm(a, b):
    return lax.dot_general(
      a[0], b[0], (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16
    )[None]

  def psum(p):
    return lax.psum(p, "tp")

  def swap(p):
    return p + lax.ppermute(p, "tp", [(0, 1), (1, 0)])

  def wrap(fn, n_in, n_out):
    spec_in = (P("tp"),) * n_in
    spec_out = (P("tp"),) * n_out if n_out > 1 else P("tp")
    return jax.shard_map(fn, mesh=mesh, in_specs=spec_in, out_specs=spec_out)

  bodies = {
    "gemm": (wrap(gemm, 2, 1), (a, b)),
    "psum": (wrap(psum, 1, 1), (part,)),
    "swap": (wrap(swap, 1, 1), (part,)),
    "gemm+psum": (wrap(lambda a, b, p: (gemm(a, b), psum(p)), 3, 2), (a, b, part)),
    "gemm+swap": (wrap(lambda a, b, p: (gemm(a, b), swap(p)), 3, 2), (a, b, part)),
  }
  programs, hlo = {}, {}
  want = np.asarray(part, np.float32).sum(0)
  for config in args.configs.split(","):
    for name, (fn, operands) in bodies.items():
      if name == "gemm" and config != "default":
        continue
      compiled = jax.jit(fn).lower(*operands).compile(compiler_options=CONFIGS[config] or None)
      text = compiled.as_text()
      ops = [c.op for c in inspect.hlo_collectives(text)]
      hlo[f"{name}/{config}"] = {
        "fp8_gemms": inspect.count_fp8_gemms(text)[0],
        "all_reduce": ops.count("all-reduce"),
        "collective_permute": ops.count("collective-permute"),
        "order": " | ".join(schedule(text)),
      }
      programs[f"{name}/{config}"] = lambda c=compiled, o=operands: c(*o)
      if name in ("psum", "swap", "gemm+psum", "gemm+swap"):
        out = compiled(*operands)
        s = out[-1] if isinstance(out, tuple) else out
        got = np.asarray(s, np.float32)
        err = float(np.abs(got - want[None]).max())
        same = bool(np.array_equal(got[0], got[1]))
        hlo[f"{name}/{config}"].update(max_abs_err=err, replicas_equal=same)
  times = {label: [] for label in programs}
  for r in range(args.rounds):
    for label, run in programs.items():
      times[label].append(time_steps(run, args.iters, 2, 1, sync_each_step=False))
    print(f"round {r + 1}/{args.rounds} done", flush=True)
  rows = []
  print(f"{'program':<22}{'ms':>8}{'min':>8}{'max':>8}  hlo")
  for label, ts in times.items():
    med = float(np.median(ts))
    rows.append(dict(program=label, ms=med, rounds=ts, **hlo[label]))
    print(f"{label:<22}{med:>8.3f}{min(ts):>8.3f}{max(ts):>8.3f}  {hlo[label]}")
  env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "XLA_FLAGS")}
  result = dict(
    devices=[str(d) for d in jax.devices()[:2]],
    jax=jax.__version__,
    env=env,
    rows=rows,
    args=vars(args),
  )
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main()
