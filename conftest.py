"""The checkout's pytest configuration, above ``tests/``'s: the package's docstring examples
(``--doctest-modules`` over ``te_adapters``) of an adapter whose framework is not installed are
reported as skipped. Importing such a module fails by design (the adapter names the extra to
install), so collecting its examples would otherwise be an error."""

import importlib.util
import pathlib

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
