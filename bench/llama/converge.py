"""Does FP8 training of the Llama-style decoder reach bf16's held-out loss? Convergence runs.

  python -m bench.llama.converge --config cpu --steps 20 --runs bf16:0,current:0
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m bench.llama.converge --config 350m \\
      --tokens bench/llama/tokens --steps 2000 --runs bf16:0,current:0,delayed:0,bf16:1,... \\
      --probe-steps 20 --save ckpt --resume ckpt --time-limit 500 --out llama_350m.jsonl

Each run (a recipe and a seed) trains the plain NNX model of ``model.py`` converted by
``te_adapters.nnx.quantize_model`` (bf16: unconverted), with ``train.py``'s step (the NNX
README's loop), through ``bench/convergence.py``'s ``run``: AdamW with linear warm-up and
cosine decay to a tenth over the run's steps, batches drawn from the seed and the step alone,
the held-out loss every ``Config.eval_every`` steps on a fixed slice of the held-out tokens (the
same for every run), one JSON line per evaluation and a summary per run (FP8 GEMMs counted in the
compiled step on GPU, in the jaxpr elsewhere). The seed sets both the initial parameters and the
batches.

``--save DIR`` checkpoints each run (``DIR/seed<S>/``: parameters, optimizer and recipe state,
step) when ``--time-limit`` stops it, every ``--save-every`` steps if given, and marks a finished
run with its record alone (no arrays); ``--resume DIR`` continues each run from its checkpoint
(bit for bit on CPU) and skips finished ones, so runs cut by one command's time limit go on in
the next. ``--probe-steps N`` first times N steps of each recipe (the compiled steps are then
reused by the runs) and prints the projected time of the whole plan.
``python bench/convergence_plot.py FILE --by-seed --ylabel ...`` plots the lines and tabulates
them per seed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from bench import convergence

from . import data as data_lib
from . import model as model_lib
from . import train

ADAPTER = "llama-nnx"
RECIPES = ("bf16", "current", "delayed", "block")


def corpus(cfg: model_lib.Config, tokens_dir=None) -> convergence.Corpus:
  """The BPE token files of ``data.py`` (``tokens_dir``), or the standard library's bytes."""
  if tokens_dir:
    train_tokens, heldout, info = data_lib.load_tokens(tokens_dir)
    if info["vocab"] > cfg.vocab:
      raise ValueError(
        f"the token files' vocabulary ({info['vocab']}) exceeds the model's ({cfg.vocab})"
      )
    return convergence.Corpus(train_tokens, heldout, dict(info, source=str(tokens_dir)))
  train_tokens, heldout = data_lib.byte_tokens()
  info = dict(convergence.stdlib_corpus().info, source="standard library bytes", vocab=256)
  return convergence.Corpus(train_tokens, heldout, info)


def _nnx_trainer(cfg, recipe, threshold, seed, tx, sample, config=None) -> convergence.Trainer:
  # train.py derives the same threshold from cfg.fp8_everywhere.
  if threshold != train._threshold(cfg):
    raise ValueError(f"threshold {threshold!r} is not the configuration's")
  t = train.nnx_trainer(cfg, "nnx", recipe, seed, tx, config)
  return convergence.Trainer(t.carry, t.step, t.eval_loss, t.report)


def workload(cfg: model_lib.Config) -> convergence.Workload:
  """The Llama-style model at ``cfg`` as ``convergence.run`` trains it (adapter ``llama-nnx``).
  No FP8 GEMM count is expected: the compiled program's count depends on how XLA lays out the
  scanned layer (the jaxpr holds 12: four projections' forward, dgrad and wgrad)."""
  return convergence.Workload(cfg, {ADAPTER: _nnx_trainer}, cfg.flops_per_step(), None)


def parse_runs(text: str) -> list[tuple[str, int]]:
  """``"bf16:0,current:0"`` -> ``[("bf16", 0), ("current", 0)]``."""
  runs = []
  for item in text.split(","):
    recipe, _, seed = item.partition(":")
    if recipe not in RECIPES or not seed.isdigit():
      raise ValueError(f"run {item!r}: want RECIPE:SEED, RECIPE one of {', '.join(RECIPES)}")
    runs.append((recipe, int(seed)))
  return runs


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", choices=sorted(model_lib.CONFIGS), default="cpu")
  p.add_argument("--tokens", default=None, help="bench.llama.data's token files (default: bytes)")
  p.add_argument("--steps", type=int, default=2000, help="steps of every run (its schedule)")
  p.add_argument(
    "--runs",
    default="bf16:0,current:0,delayed:0,bf16:1,current:1,delayed:1",
    help="RECIPE:SEED, comma-separated, run in this order",
  )
  p.add_argument("--out", default=None, help="append the JSON lines to this file too")
  p.add_argument("--save", default=None, help="checkpoint directory (DIR/seed<S>/)")
  p.add_argument("--resume", default=None, help="continue the runs checkpointed here")
  p.add_argument("--save-every", type=int, default=None, help="also checkpoint every N steps")
  p.add_argument(
    "--time-limit", type=float, default=None, help="seconds: stop (and save) then, from the start"
  )
  p.add_argument("--probe-steps", type=int, default=0, help="time N steps of each recipe first")
  p.add_argument(
    "--compile-cache", default=None, help="JAX's persistent compilation cache directory"
  )
  args = p.parse_args(argv)
  try:
    runs = parse_runs(args.runs)
  except ValueError as e:
    p.error(str(e))
  if args.compile_cache:
    # Seeds share one compiled step (the same program, other values): compiled once.
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
  start = time.monotonic()
  deadline = None if args.time_limit is None else start + args.time_limit
  cfg = model_lib.CONFIGS[args.config]
  data = corpus(cfg, args.tokens)
  work = workload(cfg)
  header = train.run_header(args.config, cfg, steps=args.steps, runs=args.runs, data=data.info)
  print(json.dumps(header), flush=True)
  cache = {}

  def ckpt(directory, seed):
    return None if directory is None else pathlib.Path(directory) / f"seed{seed}"

  if args.probe_steps:
    seconds = {}
    for recipe in dict.fromkeys(r for r, _ in runs):
      s = convergence.run(
        ADAPTER, recipe, args.config, args.steps, runs[0][1], stop_at=args.probe_steps,
        corpus=data, cache=cache, workload=work,
      )  # fmt: skip
      seconds[recipe] = cfg.tokens_per_step / s["tokens_per_s"]
      print(
        f"probe {recipe}: {1e3 * seconds[recipe]:.1f} ms/step, compile {s['compile_s']:.1f} s, "
        f"FP8 GEMMs {s['fp8_gemms']} of {s['gemms']}",
        flush=True,
      )
    evals = args.steps // cfg.eval_every + 1
    # An evaluation: eval_batches forward passes, about a third of a step each.
    plan = sum((args.steps + evals * cfg.eval_batches / 3) * seconds[r] for r, _ in runs)
    print(
      f"plan: {len(runs)} runs x {args.steps} steps of {cfg.tokens_per_step} tokens: about "
      f"{plan:.0f} s of steps and evaluations (compiles not counted)",
      flush=True,
    )
  summaries = []
  for recipe, seed in runs:
    if deadline is not None and deadline - time.monotonic() < 30:
      print(f"{recipe}:{seed}: not started, under 30 s of --time-limit left", file=sys.stderr)
      continue
    result = convergence.run(
      ADAPTER,
      recipe,
      args.config,
      args.steps,
      seed,
      out=args.out,
      save=ckpt(args.save, seed),
      resume=ckpt(args.resume, seed),
      deadline=deadline,
      corpus=data,
      cache=cache,
      workload=work,
      save_every=args.save_every,
      save_completed_state=False,
    )
    # The compiled step of this recipe and seed is not needed again: free its parameters.
    for key in [k for k in cache if k[1] == recipe and k[4] == seed]:
      del cache[key]
    summaries.append({k: v for k, v in result.items() if k not in ("losses", "evals", "carry")})
  return summaries


if __name__ == "__main__":
  main()
