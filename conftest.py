"""The checkout's pytest configuration, above ``tests/``'s: the package's docstring examples
(``--doctest-modules`` over ``te_adapters``) that need a framework which is not installed are
reported as skipped. Those of an adapter's modules are skipped whole: importing such a module
fails by design (the adapter names the extra to install), so collecting its examples would
otherwise be an error. An example elsewhere that imports Flax or Haiku is skipped alone."""

import importlib.util
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent / "te_adapters"
# Each adapter's modules and the framework they import.
FRAMEWORKS = {
  "linen": "flax",
  "nnx": "flax",
  "haiku": "haiku",
  "_flax_serialization.py": "flax",
}


def _missing_framework(file_path: pathlib.Path) -> str | None:
  try:
    part = file_path.resolve().relative_to(PACKAGE).parts[0]
  except ValueError:
    return None
  framework = FRAMEWORKS.get(part)
  if framework is None or importlib.util.find_spec(framework) is not None:
    return None
  return framework


class _NeedsFramework(pytest.File):
  framework: str

  def collect(self):
    pytest.skip(f"{self.framework} is not installed: this module's examples need it")


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
  collectors = yield
  framework = _missing_framework(file_path) if file_path.suffix == ".py" else None
  if framework is None:
    return collectors
  skipped = _NeedsFramework.from_parent(parent, path=file_path)
  skipped.framework = framework
  return [skipped]


_IMPORTS = re.compile(r"^\s*(?:import|from)\s+(flax|haiku)\b", re.M)


def pytest_collection_modifyitems(items):
  for item in items:
    test = getattr(item, "dtest", None)  # a docstring example
    if test is None:
      continue
    source = "".join(example.source for example in test.examples)
    for framework in sorted(set(_IMPORTS.findall(source))):
      if importlib.util.find_spec(framework) is None:
        item.add_marker(pytest.mark.skip(reason=f"{framework} is not installed"))
