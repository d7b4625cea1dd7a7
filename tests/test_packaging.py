"""What the package needs: the core imports without Flax or Haiku, and every import the package
makes is a declared dependency (in pyproject.toml's dependencies, or the extra of its adapter)."""

import ast
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "te_adapters")

# Blocks flax and haiku (and their submodules) as if they were not installed.
_BLOCKER = """
import sys

class _Blocker:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("flax", "haiku"):
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None

sys.meta_path.insert(0, _Blocker())
"""


def _run_without_frameworks(code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", _BLOCKER + code], capture_output=True, text=True, cwd=ROOT, timeout=300
  )


def test_core_imports_and_runs_without_flax_or_haiku():
  done = _run_without_frameworks("""
import jax, jax.numpy as jnp, numpy as np
import te_adapters as ta
from te_adapters import core, inspect

x = jnp.arange(64.0).reshape(4, 16) / 64
w = jnp.ones((16, 16)) / 16
y = core.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling(),
                     threshold=None)
assert inspect.count_fp8_dot_generals(
    lambda x, w: core.dot_general(x, w, (((1,), (0,)), ((), ())),
                                  recipe=ta.Float8CurrentScaling(), threshold=None), x, w) == (1, 1)
np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=0.07, atol=1e-3)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "haiku"))
assert not loaded, loaded
print("ok")
""")
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("adapter, extra", [("linen", "flax"), ("nnx", "flax"), ("haiku", "haiku")])
def test_an_adapter_without_its_framework_names_the_extra(adapter, extra):
  done = _run_without_frameworks(f"import te_adapters.{adapter}")
  assert done.returncode != 0
  assert f"te_adapters[{extra}]" in done.stderr, done.stderr[-3000:]


def _imports(path: str) -> set[str]:
  """Top-level names of the absolute imports in one file (relative ones are the package's)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


def _normalized(requirement: str) -> str:
  name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
  return re.sub(r"[-_.]+", "-", name).lower()


def test_every_import_of_the_package_is_a_declared_dependency():
  tomllib = pytest.importorskip("tomllib")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  extras = project["optional-dependencies"]
  declared = {_normalized(r) for r in project["dependencies"]}
  declared |= {_normalized(r) for name, reqs in extras.items() if name != "test" for r in reqs}
  declared.discard("te-adapters")
  distributions = metadata.packages_distributions()
  stdlib = set(sys.stdlib_module_names)
  missing = {}
  for folder, _, files in os.walk(PACKAGE):
    for file in files:
      if not file.endswith(".py"):
        continue
      path = os.path.join(folder, file)
      own = {"te_adapters"}
      if file == "__main__.py":
        own.add("bench")  # the checkout's benchmark, run from a source checkout only
      for name in _imports(path) - stdlib - own:
        dists = {_normalized(d) for d in distributions.get(name, [name])}
        if not dists & declared:
          missing.setdefault(name, []).append(os.path.relpath(path, ROOT))
  assert not missing, f"imported but not declared in pyproject.toml: {missing}"
  # The core's own imports need only the required dependencies, no extra.
  required = {_normalized(r) for r in project["dependencies"]}
  core_dir = os.path.join(PACKAGE, "core")
  for file in os.listdir(core_dir):
    if file.endswith(".py"):
      for name in _imports(os.path.join(core_dir, file)) - stdlib - {"te_adapters"}:
        dists = {_normalized(d) for d in distributions.get(name, [name])}
        assert dists & required, (file, name)
