"""The user guide's performance page and its plots: every plot finds its figures in
bench/RESULTS.md and draws them as recorded (checked without matplotlib, through an axes that
records what it is given), and the page shows exactly the plots the script draws. The guide's
code blocks run in tests/test_readme.py."""

import pathlib
import re

import pytest

from bench import results_plots

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "performance.md"
FIGURES = ROOT / "docs" / "guide" / "figures"


class RecordingAxes:
  """Stands in for a matplotlib Axes: records the data of every drawing call."""

  def __init__(self):
    self.calls = []

  def get_ylim(self):
    return (0.0, 1.0)

  def __getattr__(self, name):
    return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

  def drawn(self, name):
    return [args for call, args, _ in self.calls if call == name]


def _draw(name):
  (plot,) = [p for p in results_plots.PLOTS if p.name == name]
  table = plot.table()
  ax = RecordingAxes()
  plot.draw(table, ax)
  return table, ax


def test_cells_read_as_numbers():
  assert results_plots.number("75,577 (74,622-75,869)") == 75577.0
  assert results_plots.number("6.41 (**1.65x**)") == 6.41
  assert results_plots.speedup("6.41 (**1.65x**)") == 1.65
  assert results_plots.number("-") is None and results_plots.speedup("22.35") is None


@pytest.mark.parametrize("plot", results_plots.PLOTS, ids=lambda p: p.name)
def test_every_plot_finds_its_table_with_device_and_date(plot):
  table = plot.table()
  assert len(table.rows) >= 4 and all(len(r) == len(table.header) for r in table.rows)
  assert re.fullmatch(r"(One |Two |Four )?H100s?, 2026-11-2\d", table.where), table.where


def test_llama_plot_shows_the_recorded_tokens_per_second():
  table, ax = _draw("llama_1b.png")
  ((_, values),) = ax.drawn("barh")
  assert len(values) == len(table.rows) == 8
  assert values[0] == 59561.0 and max(values) == 80450.0  # bf16; the fused modules, delayed


def test_sweep_plot_has_every_grid_point_of_both_recipes():
  table, ax = _draw("sweep.png")
  points = [(x, y) for xs, ys in ax.drawn("scatter") for x, y in zip(xs, ys, strict=True)]
  assert len(points) == 2 * len(table.rows) == 56
  assert (2048 * 1024 * 1024, 0.57) in points and (16384 * 4096 * 4096, 1.47) in points


def test_grouped_plot_leaves_out_what_was_not_run():
  table, ax = _draw("grouped.png")
  bars = {
    kwargs["label"]: heights
    for _, (xs, heights, _w), kwargs in [(c, a, k) for c, a, k in ax.calls if c == "bar"]
  }
  assert bars["lax.ragged_dot bf16"] == [63.66]  # run at G=8, random routing only
  assert bars["ours delayed"] == [7.44, 16.49, 7.34, 17.78]


def test_mesh_plot_shows_each_adapter_and_recipe_synced_and_pipelined():
  table, ax = _draw("mesh2x2.png")
  bars = {kwargs["label"]: args[1] for name, args, kwargs in ax.calls if name == "bar"}
  assert len(bars["every step synchronised"]) == len(bars["steps back to back"]) == 6
  assert bars["every step synchronised"][0] == 1.488  # Linen, current scaling
  assert bars["steps back to back"][-1] == 1.562  # Haiku, delayed scaling


def test_a_missing_table_is_an_error_naming_it():
  with pytest.raises(ValueError, match="0 sections of RESULTS.md start with 'H100, 1999'"):
    results_plots.read_table("H100, 1999", "x")
  with pytest.raises(ValueError, match="no line starting with 'nowhere'"):
    results_plots.read_table("H100, 2026-11-27: the re-cut finished", "nowhere")


def test_the_page_shows_the_plots_the_script_draws():
  shown = re.findall(r"!\[[^\]]*\]\(figures/([\w.]+)\)", PAGE.read_text())
  assert sorted(shown) == sorted(p.name for p in results_plots.PLOTS)
  for name in shown:
    assert (FIGURES / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
