"""The user guide's performance plots, drawn from the tables of ``bench/RESULTS.md``.

Each plot names the section of RESULTS.md it reads (by the start of its heading) and a line that
stands just before its table, so a figure is written down once, in RESULTS.md, and the plots show
it with the device and the date of its section. Reading the tables needs nothing beyond the
standard library (the tests check that every plot still finds its figures); drawing needs
matplotlib (the ``plot`` extra):

  python -m bench.results_plots --out docs/guide/figures
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import textwrap
from collections.abc import Callable

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"


@dataclasses.dataclass(frozen=True)
class Table:
  """A Markdown table of RESULTS.md and where it stands."""

  heading: str  # the section's heading, without the "## "
  header: list[str]
  rows: list[list[str]]

  @property
  def where(self) -> str:
    """The device and the date, as the heading starts: "H100, 2026-11-27"."""
    m = re.match(r"(.*?\d{4}-\d\d-\d\d)", self.heading)
    return m.group(1) if m else self.heading

  def column(self, name: str) -> list[str]:
    i = self.header.index(name)
    return [row[i] for row in self.rows]


def read_table(heading: str, after: str, text: str | None = None) -> Table:
  """The first table after the line starting with ``after`` in the section whose heading starts
  with ``heading``."""
  text = RESULTS.read_text() if text is None else text
  sections = re.split(r"^## ", text, flags=re.M)
  found = [s for s in sections if s.startswith(heading)]
  if len(found) != 1:
    raise ValueError(f"{len(found)} sections of RESULTS.md start with {heading!r}")
  title, _, body = found[0].partition("\n")
  lines = body.splitlines()
  start = [i for i, line in enumerate(lines) if line.startswith(after)]
  if not start:
    raise ValueError(f"no line starting with {after!r} in the section {title!r}")
  table = []
  for line in lines[start[0] + 1 :]:
    if line.startswith("|"):
      table.append([c.strip() for c in line.strip().strip("|").split("|")])
    elif table:
      break
  if len(table) < 3:
    raise ValueError(f"no table after {after!r} in the section {title!r}")
  return Table(title.strip(), table[0], table[2:])


def number(cell: str) -> float | None:
  """The first number of a cell ("22.72 (1.71x)" -> 22.72, "75,577 (...)" -> 75577.0), None for
  a cell without one ("-", "not run")."""
  m = re.search(r"\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
  return float(m.group(0).replace(",", "")) if m else None


def speedup(cell: str) -> float | None:
  """The "1.71x" of a cell, None without one."""
  m = re.search(r"(\d+(?:\.\d+)?)x", cell)
  return float(m.group(1)) if m else None


# --- the plots: (file name, title, the table it reads, the function that draws it) --------------


def _bars(ax, labels, values, xlabel, fmt="{:.2f}"):
  y = range(len(labels))
  ax.barh(y, values, color="#4c72b0")
  ax.set_yticks(list(y), [textwrap.fill(label, 36) for label in labels], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel(xlabel)
  for i, v in enumerate(values):
    ax.text(v, i, " " + fmt.format(v), va="center", fontsize=8)
  ax.set_xlim(0, max(values) * 1.18)


def _grouped_bars(ax, groups, series, ylabel):
  """``series``: {name: [value per group or None]}."""
  width = 0.8 / len(series)
  for j, (name, values) in enumerate(series.items()):
    xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
    kept = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
    ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name)
  ax.set_xticks(
    range(len(groups)),
    ["\n".join(textwrap.fill(line, 22) for line in g.split("\n")) for g in groups],
    fontsize=8,
  )
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def llama(table: Table, ax):
  labels = [re.sub(r"`", "", v) for v in table.column("variant")]
  _bars(ax, labels, [number(v) for v in table.column("tokens/s (min-max)")], "tokens/s", "{:,.0f}")


def frameworks(table: Table, ax):
  names = ["ours current", "ours delayed", "Flax `Fp8DirectDotGeneralOp`", "Qwix (fwd+dgrad+wgrad)"]
  rows = [r for r in table.rows if speedup(r[table.header.index(names[0])])]
  series = {n.replace("`", ""): [speedup(r[table.header.index(n)]) for r in rows] for n in names}
  _grouped_bars(ax, [r[0] for r in rows], series, "speed over bf16 (x)")
  ax.axhline(1.0, color="gray", lw=0.8)


def block_and_layer(table: Table, ax):
  rows = [r for r in table.rows if "/" not in r[0].split(" (")[0] and speedup(r[1])]
  series = {
    column.split(" (")[0]: [speedup(r[i]) for r in rows]
    for i, column in enumerate(table.header[1:], 1)
  }
  labels = [r[0].split(" (")[0].replace("`", "") for r in rows]
  _grouped_bars(ax, labels, series, "speed over bf16 (x)")
  ax.axhline(1.0, color="gray", lw=0.8)


def sweep(table: Table, ax):
  shapes = [[int(d) for d in s.split(" x ")] for s in table.column("M x K x N")]
  mkn = [m * k * n for m, k, n in shapes]
  for column, marker in (("current, forced", "o"), ("delayed, forced", "s")):
    for small, color in ((True, "#dd8452"), (False, "#4c72b0")):
      points = [
        (x, speedup(v))
        for x, v, s in zip(mkn, table.column(column), shapes, strict=True)
        if (min(s) < 2048) == small
      ]
      label = f"{column.split(',')[0]}, min(M, K, N) {'<' if small else '>='} 2048"
      ax.scatter(
        [p[0] for p in points], [p[1] for p in points], marker=marker, c=color, label=label
      )
  ax.set_xscale("log", base=2)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.axvline(4096**3, color="gray", ls="--", lw=0.8)
  ax.text(4096**3, ax.get_ylim()[1], " default rule: M·K·N >= 4096³", va="top", fontsize=8)
  ax.set_xlabel("M·K·N")
  ax.set_ylabel("FP8 speed over bf16 (x)")
  ax.legend(fontsize=7, loc="lower right")


def mesh(table: Table, ax):
  # Two columns are named "vs bf16": the synced step's, then the pipelined one's.
  synced, pipelined = (i for i, c in enumerate(table.header) if c == "vs bf16")
  rows = [r for r in table.rows if r[2] == "base" and r[1] != "bf16"]
  series = {
    "every step synchronised": [speedup(r[synced]) for r in rows],
    "steps back to back": [speedup(r[pipelined]) for r in rows],
  }
  _grouped_bars(ax, [f"{r[0]}\n{r[1]}" for r in rows], series, "FP8 speed over bf16 (x)")
  ax.axhline(1.0, color="gray", lw=0.8)


def grouped(table: Table, ax):
  columns = table.header[1:]
  series = {
    c.replace("`", ""): [number(r[i]) for r in table.rows] for i, c in enumerate(columns, 1)
  }
  groups = ["G=" + r[0].split(" (")[0] for r in table.rows]
  _grouped_bars(ax, groups, series, "ms per training step")


def recipes(table: Table, ax):
  _bars(
    ax,
    table.column("variant"),
    [speedup(v) for v in table.column("vs bf16")],
    "speed over bf16 (x)",
  )


@dataclasses.dataclass(frozen=True)
class Plot:
  name: str
  title: str
  heading: str
  after: str
  draw: Callable
  size: tuple[float, float] = (7.5, 3.6)

  def table(self, text: str | None = None) -> Table:
    return read_table(self.heading, self.after, text)


PLOTS = (
  Plot(
    "llama_1b.png",
    "~1B Llama-style model, tokens/s",
    "H100, 2026-11-27, third session: the ~1B Llama",
    "Medians of 5 windows",
    llama,
    (8.0, 4.4),
  ),
  Plot(
    "frameworks.png",
    "Seed 000's Dense and seed 001's layer against Flax's FP8 op and Qwix",
    "H100, 2026-11-25, fourth session",
    "**Seed 000's Dense and seed 001's layer",
    frameworks,
  ),
  Plot(
    "block_and_layer.png",
    "LayerNorm + MLP block and transformer layer",
    "H100, 2026-11-26, eighth session",
    "**The LayerNorm + MLP block and the layer",
    block_and_layer,
  ),
  Plot(
    "recipes_dense.png",
    "Seed 000's Dense under each recipe (Linen)",
    "H100, 2026-11-27: the re-cut finished",
    "**`Float8RowwiseScaling` on seed 000's Dense**",
    recipes,
    (7.5, 2.6),
  ),
  Plot(
    "sweep.png",
    "One GEMM, forward and backward: FP8 against bf16",
    "H100, 2026-11-25: the whole suite on the GPU",
    "x (M, K) @ w (K, N), bf16 inputs",
    sweep,
  ),
  Plot(
    "mesh2x2.png",
    "Seed 000's Dense on a 2x2 data x tensor parallel mesh",
    "Four H100s, 2026-11-27, fourth session",
    "`o` is new",
    mesh,
  ),
  Plot(
    "grouped.png",
    "Grouped GEMM training step, M=16384, K=4096, N=14336",
    "H100, 2026-11-26, eighth session",
    "**The grouped GEMM (issue 21)**",
    grouped,
    (8.5, 3.8),
  ),
)


def draw(out: pathlib.Path) -> list[pathlib.Path]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out.mkdir(parents=True, exist_ok=True)
  written = []
  for plot in PLOTS:
    table = plot.table()
    fig, ax = plt.subplots(figsize=plot.size)
    plot.draw(table, ax)
    ax.set_title(f"{plot.title}\n{table.where} (bench/RESULTS.md)", fontsize=9)
    fig.tight_layout()
    path = out / plot.name
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/guide/figures"))
  args = parser.parse_args(argv)
  for path in draw(args.out):
    print(path)


if __name__ == "__main__":
  main()
