"""Plots and a Markdown table from ``bench/convergence.py``'s JSON lines.

One PNG per adapter (``convergence_<adapter>.png``) with the held-out loss of every recipe
against bf16, and a table: final held-out loss per adapter and recipe, its difference to bf16 in
percent, tokens/s, speedup against bf16 and the FP8 GEMM count. Several files (the pieces of runs
split over several commands) may be given; a later line for the same run and step wins.

  python bench/convergence_plot.py convergence.jsonl --out-dir plots   # needs matplotlib
  python bench/convergence_plot.py convergence.jsonl --table-only      # the table alone
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

RECIPE_ORDER = ("bf16", "current", "delayed", "block", "rowwise")
SEED_LABEL = " seed "


def read_runs(paths, seed: int | None = None, by_seed: bool = False) -> dict[tuple[str, str], dict]:
  """``{(adapter, recipe): {"evals": {step: record}, "summaries": [record, ...]}}`` of the runs
  with seed ``seed`` (which may be left out when the files hold one seed only); ``by_seed``: of
  every seed, each under ``("<adapter> seed <S>", recipe)``."""
  runs = {}
  seeds = set()
  for path in paths:
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
      line = line.strip()
      if not line.startswith("{"):
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise SystemExit(f"{path}:{number}: not a JSON line: {e}") from None
      if "adapter" not in record or "recipe" not in record:
        continue
      seeds.add(record.get("seed"))
      if seed is not None and record.get("seed") != seed:
        continue
      adapter = record["adapter"]
      if by_seed:
        adapter = f"{adapter}{SEED_LABEL}{record.get('seed')}"
      run = runs.setdefault((adapter, record["recipe"]), {"evals": {}, "summaries": []})
      if record.get("summary"):
        if not record.get("already_done"):
          run["summaries"].append(record)
      else:
        run["evals"][record["step"]] = record
  if seed is None and not by_seed and len(seeds) > 1:
    raise SystemExit(f"the files hold runs of seeds {sorted(seeds)}: pick one with --seed")
  return runs


def _order(recipe: str) -> tuple[int, str]:
  return (RECIPE_ORDER.index(recipe) if recipe in RECIPE_ORDER else len(RECIPE_ORDER), recipe)


def run_figures(run: dict) -> dict:
  """Final held-out loss (at the last evaluated step), tokens/s (median over the measured
  intervals of every piece of the run) and the FP8 GEMM count."""
  evals = run["evals"]
  last = max(evals) if evals else None
  rates = [e["tokens_per_s"] for e in evals.values() if e.get("tokens_per_s")]
  summary = run["summaries"][-1] if run["summaries"] else {}
  return dict(
    step=last,
    heldout=evals[last]["heldout_loss"] if last is not None else None,
    tokens_per_s=statistics.median(rates) if rates else None,
    mfu=statistics.median([e["mfu"] for e in evals.values() if e.get("mfu")] or [math.nan]),
    fp8_gemms=summary.get("fp8_gemms"),
    gemms=summary.get("gemms"),
    fp8_expected=summary.get("fp8_gemms_expected"),
    fp8=summary.get("fp8"),
    steps=summary.get("steps"),
  )


def _num(x, fmt: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(runs: dict) -> str:
  """The Markdown table of every run, by adapter, bf16 first."""
  lines = [
    "| adapter | recipe | steps | held-out loss | vs bf16 | tokens/s | speedup | MFU | FP8 GEMMs |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  for adapter in sorted({a for a, _ in runs}):
    base = runs.get((adapter, "bf16"))
    base = run_figures(base) if base else None
    for recipe in sorted((r for a, r in runs if a == adapter), key=_order):
      f = run_figures(runs[(adapter, recipe)])
      diff = speedup = None
      if base and base["heldout"] and f["heldout"] is not None and recipe != "bf16":
        diff = 100 * (f["heldout"] / base["heldout"] - 1)
      if base and base["tokens_per_s"] and f["tokens_per_s"] and recipe != "bf16":
        speedup = f["tokens_per_s"] / base["tokens_per_s"]
      if recipe == "bf16":
        gemms = "-"
      elif f["fp8_gemms"] is None:
        gemms = "?"
      else:
        gemms = f"{f['fp8_gemms']} of {f['gemms']}"
        if f["fp8_expected"] and f["fp8_gemms"] != f["fp8_expected"]:
          gemms += f" (expected {f['fp8_expected']})"
        if not f["fp8"]:
          gemms += " **not FP8**"
      steps = _num(f["step"], "d")
      if f["steps"] and f["step"] is not None and f["step"] < f["steps"]:
        steps += f" of {f['steps']}"
      lines.append(
        f"| {adapter} | {recipe} | {steps} | {_num(f['heldout'], '.4f')} | "
        f"{_num(diff, '+.2f')}{'%' if diff is not None else ''} | "
        f"{_num(f['tokens_per_s'], ',.0f')} | {_num(speedup, '.2f')}{'x' if speedup else ''} | "
        f"{_num(100 * f['mfu'] if not math.isnan(f['mfu']) else None, '.1f')}"
        f"{'%' if not math.isnan(f['mfu']) else ''} | {gemms} |"
      )
  return "\n".join(lines)


def seed_spread(runs: dict) -> str:
  """Per adapter of a ``by_seed`` reading: each recipe's final held-out loss per seed, its mean,
  and the spread between seeds ((max - min) / mean), against which FP8's distance to bf16 of
  the same seed can be read."""
  groups = {}
  for label, recipe in runs:
    adapter, _, seed = label.partition(SEED_LABEL)
    final = run_figures(runs[(label, recipe)])["heldout"]
    groups.setdefault(adapter, {}).setdefault(recipe, {})[seed] = final
  lines = [
    "| adapter | recipe | held-out loss by seed | mean | spread over seeds |",
    "|---|---|---|---:|---:|",
  ]
  for adapter in sorted(groups):
    for recipe in sorted(groups[adapter], key=_order):
      finals = {s: f for s, f in sorted(groups[adapter][recipe].items()) if f is not None}
      values = list(finals.values())
      mean = statistics.mean(values) if values else None
      spread = 100 * (max(values) - min(values)) / mean if len(values) > 1 else None
      by_seed = ", ".join(f"{s}: {f:.4f}" for s, f in finals.items())
      lines.append(
        f"| {adapter} | {recipe} | {by_seed} | {_num(mean, '.4f')} | "
        f"{_num(spread, '.2f')}{'%' if spread is not None else ''} |"
      )
  return "\n".join(lines)


def plot(
  runs: dict, out_dir: pathlib.Path, ylabel: str = "held-out loss (nats per byte)"
) -> list[pathlib.Path]:
  """One PNG per adapter: held-out loss against step, one curve per recipe (and seed, in a
  ``by_seed`` reading: a line style per seed)."""
  try:
    import matplotlib
  except ImportError:
    raise SystemExit(
      "convergence_plot.py needs matplotlib for the plots: pip install -e '.[plot]' (or "
      "matplotlib); --table-only writes the table without it"
    ) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  colors = {r: f"C{i}" for i, r in enumerate(RECIPE_ORDER[1:])}
  labels = sorted({a for a, _ in runs})
  seeds = sorted({a.partition(SEED_LABEL)[2] for a in labels})
  for adapter in sorted({a.partition(SEED_LABEL)[0] for a in labels}):
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    curves = [(a, r) for a, r in runs if a.partition(SEED_LABEL)[0] == adapter]
    for label, recipe in sorted(curves, key=lambda c: (_order(c[1]), c[0])):
      evals = runs[(label, recipe)]["evals"]
      steps = sorted(evals)
      seed = label.partition(SEED_LABEL)[2]
      ax.plot(
        steps,
        [evals[s]["heldout_loss"] for s in steps],
        marker=".",
        label=f"{recipe}, seed {seed}" if seed else recipe,
        linewidth=2.0 if recipe == "bf16" else 1.2,
        color="black" if recipe == "bf16" else colors.get(recipe),
        linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4],
      )
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{adapter}: held-out loss, FP8 recipes against bf16")
    ax.grid(alpha=0.3)
    ax.legend()
    # The early steps fall from ln 256; the part that tells recipes apart is the tail.
    finals = [e["heldout_loss"] for c in curves for s, e in runs[c]["evals"].items() if s > 0]
    if finals:
      low = min(finals)
      ax.set_ylim(low - 0.05 * abs(low), min(max(finals), low * 2.0))
    path = out_dir / f"convergence_{adapter}.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("jsonl", nargs="+", help="JSON-lines files written by convergence.py")
  parser.add_argument("--out-dir", default=".", help="where the PNGs and table.md go")
  parser.add_argument("--table-only", action="store_true", help="no plots (no matplotlib needed)")
  parser.add_argument("--seed", type=int, default=None, help="the seed to show (if several)")
  parser.add_argument(
    "--by-seed",
    action="store_true",
    help="every seed: a table row per seed (against bf16 of the same seed), one plot per "
    "adapter with a line style per seed, and the spread of each recipe over seeds",
  )
  parser.add_argument("--ylabel", default="held-out loss (nats per byte)", help="the plots' y axis")
  args = parser.parse_args(argv)
  if args.by_seed and args.seed is not None:
    parser.error("--by-seed shows every seed: leave --seed out")
  runs = read_runs(args.jsonl, args.seed, by_seed=args.by_seed)
  if not runs:
    raise SystemExit(f"no runs in {', '.join(args.jsonl)}")
  text = table(runs)
  if args.by_seed:
    text += "\n\n" + seed_spread(runs)
  out_dir = pathlib.Path(args.out_dir)
  if not args.table_only:
    for path in plot(runs, out_dir, args.ylabel):
      print(f"wrote {path}", file=sys.stderr)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "table.md").write_text(text + "\n")
  print(text)
  return text


if __name__ == "__main__":
  main()
