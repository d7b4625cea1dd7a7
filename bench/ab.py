"""Two source trees of te_adapters timed against each other in one call, interleaved.

Each tree runs in its own worker process (its root first on ``sys.path``, so ``te_adapters`` and
``bench.speed`` come from it; the compiled extension must lie in its ``te_adapters/``). A worker
builds the FP8 rows of ``python -m bench``'s dense, mlp and layer cases (the same models and
steps as ``bench.speed``: seed 000's Dense through Linen and the core, seed 001's LayerNorm+MLP
block through ``LayerNormMLP``, seed 001's layer from our modules with cuDNN attention, each
beside its bf16 row) on the trained recipe state, compiles each step once and reports what its
compiled program holds (cuBLASLt FP8 GEMMs / other GEMMs, fusion kernels, custom-call targets).
The parent then asks the workers in turn for one repeat of one variant at a time (``--steps``
steps, ended by ``block_until_ready``), alternating which tree goes first, for ``--repeats``
rounds, and prints per variant the median and spread of each tree and their ratio.

Usage (on the GPU, each tree with its extension built):
  python bench/ab.py --trees BEFORE_ROOT,AFTER_ROOT --repeats 5 --json ab.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

CASES = ("dense", "mlp", "layer")
_MARK = "@ab "  # the workers' protocol lines; anything else they print passes through


def _read(proc):
  for line in proc.stdout:
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK) :])
    print(line, end="", file=sys.stderr)
  raise RuntimeError(f"a worker exited with {proc.wait()}")


def _variants(cases, full_size):
  """(case, name, step, args) for each row, built from the imported tree's ``bench.speed``."""
  import jax
  import jax.numpy as jnp

  import te_adapters as ta
  from bench import speed

  recipes = [
    ("current", ta.Float8CurrentScaling()),
    ("delayed", ta.DelayedScaling(amax_history_len=1024)),
  ]
  out = []

  def add(case, name, apply_fn, variables, x, dy):
    step = speed._speedometer(apply_fn)
    variables = speed.trained_state(step, variables, x, dy)
    out.append((case, name, step, (variables, x, dy)))

  if "dense" in cases:
    batch, seq, hidden, features = (8, 2048, 8192, 32768) if full_size else (2, 64, 256, 512)
    k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(k_dy, (batch, seq, features)).astype(jnp.bfloat16)
    for name, model in speed._linen_variants(speed._make_dense(features), recipes, False):
      add("seed000 dense", name, model.apply, model.init(k_init, x), x, dy)
    for label, recipe in recipes:
      apply_fn, init = speed._core_variant(recipe, (hidden, features), jnp.float32)
      add("seed000 dense", f"core {label}, f32 kernel", apply_fn, init(k_init), x, dy)
  if "mlp" in cases:
    batch, seq, hidden, inter = (4, 2048, 4096, 16384) if full_size else (2, 64, 128, 256)
    key = jax.random.PRNGKey(7)
    x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(8), (batch, seq, hidden)).astype(jnp.bfloat16)
    plain = speed._FlaxLnMlp(hidden, inter)
    add("seed001 LayerNorm+MLP", "bf16", plain.apply, plain.init(key, x), x, dy)
    for label, recipe in recipes:
      for fused in (True, False):
        config = ta.core.GemmConfig(fuse_activation_cast=fused)
        model = speed.te_layernorm_mlp(inter, recipe, config)

        def apply_fn(v, x, model=model):
          return model.apply(v, x, deterministic=True)[0]

        add(
          "seed001 LayerNorm+MLP",
          f"LayerNormMLP {label} {'fused' if fused else 'unfused'}",
          apply_fn,
          model.init(key, x, deterministic=True),
          x,
          dy,
        )
  if "layer" in cases:
    from bench.seed_layer import FlaxTransformerLayer, ModulesTransformerLayer

    size = (4, 2048, 4096, 16384, 32) if full_size else (2, 64, 128, 256, 4)
    batch, seq, hidden, ffn, heads = size
    key = jax.random.PRNGKey(42)
    x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
    dy = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
    attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
    models = [
      (
        "bf16",
        FlaxTransformerLayer(
          hidden_size=hidden,
          ffn_hidden_size=ffn,
          num_attention_heads=heads,
          dot_general_cls=lambda: None,
          attention=attention,
          dtype=jnp.bfloat16,
        ),
      )
    ]
    for label, recipe in recipes:
      models.append(
        (
          f"modules {label}",
          ModulesTransformerLayer(
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            recipe=recipe,
            attention=attention,
          ),
        )
      )
    for name, model in models:

      def apply_fn(v, x, model=model):
        return model.apply(v, x, deterministic=True)

      add(
        f"seed001 layer ({attention} attention)",
        name,
        apply_fn,
        model.init(key, x, deterministic=True),
        x,
        dy,
      )
  return out


def _program(step, args) -> dict:
  """What the compiled program holds: FP8 and other GEMMs, fusions, custom-call targets."""
  try:
    from te_adapters import inspect
  except ImportError:  # a tree from before te_adapters.inspect: the same functions in core
    from te_adapters import core as inspect

  hlo = step.lower(*args).compile().as_text()
  fp8, other = inspect.count_fp8_gemms(hlo)
  targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
  fusions = len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", hlo, flags=re.M))
  return dict(fp8_gemms=fp8, other_gemms=other, fusions=fusions, custom_calls=dict(targets))


def worker(cases, full_size, steps):
  sys.path.insert(0, os.getcwd())
  import jax

  variants = _variants(cases, full_size)
  rows = []
  for case, name, step, args in variants:
    jax.block_until_ready(step(*args))
    rows.append(dict(case=case, variant=name, **_program(step, args)))
  print(_MARK + json.dumps(dict(ready=rows, device=jax.devices()[0].device_kind)), flush=True)
  for line in sys.stdin:
    i = int(line)
    _, _, step, args = variants[i]
    start = time.perf_counter()
    for _ in range(steps):
      out = step(*args)
    jax.block_until_ready(out)
    print(_MARK + json.dumps(dict(ms=(time.perf_counter() - start) / steps * 1e3)), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--trees", help="two source roots: A,B")
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--small", action="store_true", help="small sizes (a dry run off the GPU)")
  p.add_argument("--json", default=None)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  cases = tuple(args.cases.split(","))
  if args.worker:
    worker(cases, not args.small, args.steps)
    return
  trees = [os.path.abspath(t) for t in (args.trees or "").split(",") if t]
  if len(trees) != 2:
    p.error("--trees takes two source roots, A,B")
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    "--cases",
    args.cases,
    "--steps",
    str(args.steps),
  ] + (["--small"] if args.small else [])
  env = dict(os.environ, PYTHONPATH="")
  procs = [
    subprocess.Popen(cmd, cwd=t, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for t in trees
  ]
  ready = [_read(proc) for proc in procs]
  programs = [r["ready"] for r in ready]
  names = [(r["case"], r["variant"]) for r in programs[0]]
  assert names == [(r["case"], r["variant"]) for r in programs[1]], "the trees' variants differ"
  times = [[[] for _ in names] for _ in trees]
  for rnd in range(args.repeats):
    for i in range(len(names)):
      order = (0, 1) if (rnd + i) % 2 == 0 else (1, 0)
      for t in order:
        procs[t].stdin.write(f"{i}\n")
        procs[t].stdin.flush()
        times[t][i].append(_read(procs[t])["ms"])
  for proc in procs:
    proc.stdin.close()
    proc.wait()
  rows = []
  print(
    f"device: {ready[0]['device']}; A = {trees[0]}, B = {trees[1]}; "
    f"{args.repeats} interleaved repeats of {args.steps} steps"
  )
  print(f"{'case':<34}{'variant':<30}{'A ms':>9}{'B ms':>9}{'B/A':>7}  fp8 GEMMs A/B, same program")
  for i, (case, name) in enumerate(names):
    a, b = np.median(times[0][i]), np.median(times[1][i])
    pa, pb = programs[0][i], programs[1][i]
    same = all(pa[k] == pb[k] for k in ("fp8_gemms", "other_gemms", "custom_calls"))
    rows.append(
      dict(
        case=case,
        variant=name,
        a_ms=a,
        b_ms=b,
        ratio=b / a,
        a_spread=float(np.ptp(times[0][i])),
        b_spread=float(np.ptp(times[1][i])),
        a_program=pa,
        b_program=pb,
        same_gemms_and_kernels=same,
      )
    )
    print(
      f"{case:<34}{name:<30}{a:9.2f}{b:9.2f}{b / a:7.3f}  {pa['fp8_gemms']}/{pb['fp8_gemms']}"
      f" {same} (fusions {pa['fusions']}/{pb['fusions']}; spread "
      f"{rows[-1]['a_spread']:.2f}/{rows[-1]['b_spread']:.2f})"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=ready[0]["device"], trees=trees, rows=rows, times=times), f, indent=1)


if __name__ == "__main__":
  main()
