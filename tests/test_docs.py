"""The API reference (docs/api, Sphinx autodoc) covers every public name: each class and function
of a module's ``__all__`` has a docstring for autodoc to render, or the page documents it by hand
(``.. data::``, for constants and for objects made by JAX). .ci/run builds the pages with
warnings as errors (``python -m sphinx -W``)."""

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = {
  "te_adapters": "te_adapters.rst",
  "te_adapters.core": "core.rst",
  "te_adapters.linen": "linen.rst",
  "te_adapters.nnx": "nnx.rst",
  "te_adapters.haiku": "haiku.rst",
  "te_adapters.inspect": "inspect.rst",
}
# Re-exported from te_adapters.core at the top level: the te_adapters page points there.
TOP_LEVEL_OWN = {"BuildInfo", "build_info"}


def _by_hand(page: str) -> set[str]:
  names = set()
  for block in re.findall(r"^\.\. data:: (.+(?:\n {10}\S.*)*)", page, re.M):
    names.update(line.strip().rsplit(".", 1)[-1] for line in block.splitlines())
  return names


@pytest.mark.parametrize("module_name", sorted(PAGES))
def test_every_public_name_is_documented(module_name):
  pytest.importorskip("flax" if module_name in ("te_adapters.linen", "te_adapters.nnx") else "jax")
  if module_name == "te_adapters.haiku":
    pytest.importorskip("haiku")
  module = importlib.import_module(module_name)
  page = (ROOT / "docs" / "api" / PAGES[module_name]).read_text()
  assert f"automodule:: {module_name}" in page
  by_hand = _by_hand(page)
  names = TOP_LEVEL_OWN if module_name == "te_adapters" else set(module.__all__)
  missing = []
  for name in sorted(names):
    obj = getattr(module, name)
    own = (inspect.isclass(obj) or inspect.isfunction(obj)) and (
      getattr(obj, "__module__", "").startswith("te_adapters")
    )
    if own and not name.startswith("_"):
      doc = inspect.getdoc(obj)
      if not doc or (inspect.isclass(obj) and doc == inspect.getdoc(type(obj).__mro__[0])):
        missing.append(name)
    elif name not in by_hand and not inspect.ismodule(obj):
      missing.append(name)
  assert not missing, f"{module_name}: not in the API reference: {missing}"


def test_top_level_page_points_to_the_core_for_the_rest():
  import te_adapters

  page = (ROOT / "docs" / "api" / "te_adapters.rst").read_text()
  rest = set(te_adapters.__all__) - TOP_LEVEL_OWN - {"core", "inspect"}
  assert all(name in page for name in rest), sorted(n for n in rest if n not in page)


# The entry points a user starts from: each docstring has its arguments, its result and a
# runnable example (a doctest, run by the suite's --doctest-modules).
ENTRY_POINTS = (
  "te_adapters.build_info",
  "te_adapters.core.dot_general",
  "te_adapters.core.quantize",
  "te_adapters.core.dequantize",
  "te_adapters.core.init_state",
  "te_adapters.core.typed_state",
  "te_adapters.core.updated_state",
  "te_adapters.core.with_max_grad",
  "te_adapters.core.format_of",
  "te_adapters.inspect.count_fp8_dot_generals",
  "te_adapters.inspect.count_fp8_gemms",
)


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_entry_point_has_arguments_result_and_example(path):
  module_name, name = path.rsplit(".", 1)
  doc = inspect.getdoc(getattr(importlib.import_module(module_name), name))
  has_args = (
    "Args:" in doc
    or not inspect.signature(getattr(importlib.import_module(module_name), name)).parameters
  )
  assert has_args and "Returns:" in doc and ">>> " in doc, f"{path}: {doc[:200]}"
