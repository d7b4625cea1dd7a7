"""The package installs without its extension, and the tests pass on that pure-JAX install.

``test_install_without_extension`` builds the package from a clean copy of the source tree (the
files git lists, untracked ones included and ignored ones left out; outside a git checkout the
package, ``csrc/``, ``tests/``, ``examples/``, pyproject.toml and README.md) into temporary
directories, offline and with the build requirements of the test extra
(``pip install --no-deps --no-build-isolation --no-index --target``), twice:

- with ``TE_ADAPTERS_BUILD_EXT=OFF``;
- with the extension on but no C++ or CUDA compiler to be found (``CC``, ``CXX`` and ``CUDACXX``
  name a missing file, ``TE_ADAPTERS_CUDA=OFF``), which must fall back to the same pure-JAX files.

Neither install may hold a compiled file. Then the tests of ``NESTED_SUITE`` run in a subprocess
against the first install: the core's tests of the paths the extension replaces (GEMM, quantize,
scaling, configuration, state rule), tests/csrc and tests/test_demo.py. (More would add to CI's
time what the main run already tests; the adapters reach the cast only through these paths.)
They run from a directory holding only copies of ``tests/``, ``examples/`` and pyproject.toml,
with ``PYTHONPATH`` the install and a sitecustomize that drops an editable install's import hook,
so the checkout's ``te_adapters`` cannot be imported. The run must import every ``te_adapters``
module from the install, find the extension unavailable, skip the FFI-vs-JAX tests for the
missing extension (not fail or error them), and exit 0.
"""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The tests of the code the extension replaces (the cast, the amax, the GEMM paths, the
# configuration that picks them) and the demo; the rest of tests/core and the adapters reach the
# cast only through these paths, and the main run tests them.
NESTED_SUITE = (
  "tests/core/test_gemm.py",
  "tests/core/test_quantize.py",
  "tests/core/test_scaling.py",
  "tests/core/test_config.py",
  "tests/core/test_state_rule.py",
  "tests/csrc",
  "tests/test_demo.py",
)
# Set in the nested run, where this test would otherwise build and run itself again.
NESTED_ENV = "TE_ADAPTERS_IN_INSTALL_TEST"
MISSING = "/nonexistent/te_adapters-no-compiler"
_FALLBACK_DIRS = ("te_adapters", "csrc", "tests", "examples")
_FALLBACK_FILES = ("pyproject.toml", "README.md")
_BUILD_TOOLS = {
  "scikit-build-core": find_spec("scikit_build_core") is not None,
  "cmake": find_spec("cmake") is not None or shutil.which("cmake") is not None,
  "ninja or make": any((find_spec("ninja"), shutil.which("ninja"), shutil.which("make"))),
}
# An editable install (scikit-build-core's redirect) imports te_adapters through a finder at the
# front of sys.meta_path, ahead of PYTHONPATH. This sitecustomize, first on the nested run's
# PYTHONPATH and so loaded by every Python process of it, drops each finder that claims
# te_adapters, then runs the sitecustomize it shadows, if any.
_SITECUSTOMIZE = """
import importlib.machinery, importlib.util, os, sys

for _finder in list(sys.meta_path):
  if isinstance(_finder, type):  # the built-in, frozen and path finders are classes
    continue
  try:
    _claims = _finder.find_spec("te_adapters", None) is not None
  except Exception:
    _claims = False
  if _claims:
    sys.meta_path.remove(_finder)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""
# The probe, a conftest.py beside the copied tests: what the nested run really imported.
_PROBE = """
import json, os, sys


def pytest_sessionfinish(session):
  from te_adapters.core import kernels
  files = sorted(m.__file__ for n, m in list(sys.modules.items())
                 if n.split(".")[0] == "te_adapters" and getattr(m, "__file__", None))
  ffi = {p: kernels.ffi_available(p) for p in ("cpu", "gpu")}
  with open(os.environ["TE_ADAPTERS_INSTALL_PROBE"], "w") as f:
    json.dump({"files": files, "ffi": ffi}, f)
"""

pytestmark = [
  pytest.mark.skipif(os.environ.get(NESTED_ENV) == "1", reason="inside the install test's run"),
  pytest.mark.skipif(
    not all(_BUILD_TOOLS.values()),
    reason="build requirements of the test extra missing: "
    + ", ".join(k for k, ok in _BUILD_TOOLS.items() if not ok),
  ),
]


def _tail(text: str, n: int = 6000) -> str:
  return text if len(text) <= n else "...\n" + text[-n:]


def _env(**extra: str) -> dict[str, str]:
  """The caller's environment without the package's switches, the pytest options or the
  extra settings of pip and scikit-build-core, which would change what is built or run."""
  drop = ("TE_ADAPTERS_", "SKBUILD_", "PIP_", "PYTEST_ADDOPTS", "CMAKE_ARGS")
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update(extra)
  return env


def _copy_source(dst: Path) -> None:
  """The source tree without build outputs (an in-place extension, build/, caches)."""
  try:
    out = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=ROOT,
      capture_output=True,
      check=True,
    ).stdout
    files = [f for f in out.decode().split("\0") if f]
  except (OSError, subprocess.CalledProcessError):
    files = []
  if "pyproject.toml" in files:
    for name in files:
      src = ROOT / name
      if src.is_file():  # a tracked file deleted in the working tree is left out
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name)
    return
  ignore = shutil.ignore_patterns(
    "__pycache__", "*.so", "*.pyd", "*.dylib", "build", "dist", "*.egg-info", ".*"
  )
  for name in _FALLBACK_DIRS:
    shutil.copytree(ROOT / name, dst / name, ignore=ignore)
  for name in _FALLBACK_FILES:
    shutil.copy2(ROOT / name, dst / name)


def _pip_install(src: Path, target: Path, env: dict[str, str]) -> str:
  cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation"]
  cmd += ["--no-index", "--no-cache-dir", "--disable-pip-version-check", "--target", str(target)]
  proc = subprocess.run(
    [*cmd, str(src)], env=env, capture_output=True, text=True, timeout=600, cwd=target.parent
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"pip install failed ({proc.returncode}):\n{_tail(out)}"
  return out


def _compiled_files(target: Path) -> list[str]:
  return sorted(
    str(p.relative_to(target))
    for p in target.rglob("*")
    if p.suffix in (".so", ".pyd", ".dylib") or p.name.startswith("_csrc")
  )


def _package_files(target: Path) -> dict[str, bytes]:
  pkg = target / "te_adapters"
  return {
    str(p.relative_to(pkg)): p.read_bytes()
    for p in pkg.rglob("*")
    if p.is_file() and "__pycache__" not in p.parts
  }


def _results(junit: Path) -> dict[str, tuple[str, str]]:
  """``{file::name: (outcome, message)}`` from pytest's JUnit XML."""
  out = {}
  for case in ET.parse(junit).getroot().iter("testcase"):
    key = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
    outcome, message = "passed", ""
    for child in case:
      if child.tag in ("failure", "error", "skipped"):
        outcome, message = child.tag, child.get("message", "")
        break
    out[key] = (outcome, message)
  return out


@pytest.mark.slow
def test_install_without_extension(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  _copy_source(src)
  assert not _compiled_files(src), _compiled_files(src)

  # 1. The extension switched off.
  off = tmp_path / "install-ext-off"
  log = _pip_install(src, off, _env(TE_ADAPTERS_BUILD_EXT="OFF"))
  assert "te_adapters: extension disabled" in log, _tail(log)
  assert (off / "te_adapters" / "__init__.py").is_file(), sorted(os.listdir(off))
  assert not _compiled_files(off), _compiled_files(off)
  # Typed (PEP 561) and licensed: the marker in the package, the license text in its metadata.
  assert (off / "te_adapters" / "py.typed").is_file()
  licenses = [p for p in off.glob("te_adapters-*.dist-info/**/LICENSE*") if p.is_file()]
  assert licenses and b"Apache License" in licenses[0].read_bytes(), sorted(off.glob("*/*"))

  # 2. The extension on, but no compiler: CMakeLists.txt turns it off, and the install succeeds.
  no_cc = tmp_path / "install-no-compiler"
  env = _env(CC=MISSING, CXX=MISSING, CUDACXX=MISSING, TE_ADAPTERS_CUDA="OFF")
  log = _pip_install(src, no_cc, env)
  assert "no C++ compiler found" in log, _tail(log)
  assert not _compiled_files(no_cc), _compiled_files(no_cc)
  assert _package_files(no_cc) == _package_files(off)

  # 3. The tests against install 1, from a directory where only the install has te_adapters.
  run = tmp_path / "run"
  run.mkdir()
  for name in ("tests", "examples"):
    shutil.copytree(src / name, run / name)
  shutil.copy2(src / "pyproject.toml", run / "pyproject.toml")  # pytest's markers and options
  (run / "conftest.py").write_text(_PROBE)
  hooks = tmp_path / "hooks"
  hooks.mkdir()
  (hooks / "sitecustomize.py").write_text(_SITECUSTOMIZE)
  probe, junit = tmp_path / "probe.json", tmp_path / "junit.xml"
  # After the install: the caller's own PYTHONPATH entries (packages installed beside the
  # interpreter's, such as dm-haiku on a machine that carries it), less the checkout itself.
  inherited = [
    p
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if p and not Path(p).resolve().is_relative_to(ROOT.resolve())
  ]
  path = os.pathsep.join([str(hooks), str(off), *inherited])
  env = _env(PYTHONPATH=path, TE_ADAPTERS_INSTALL_PROBE=str(probe), **{NESTED_ENV: "1"})
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
  try:
    proc = subprocess.run(
      [*cmd, *NESTED_SUITE], cwd=run, env=env, capture_output=True, text=True, timeout=1500
    )
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() + (e.stderr or b"").decode()
    pytest.fail(f"the tests on the pure-JAX install timed out:\n{_tail(out)}")
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"the tests on the pure-JAX install failed:\n{_tail(out)}"

  seen = json.loads(probe.read_text())
  outside = [f for f in seen["files"] if not Path(f).resolve().is_relative_to(off.resolve())]
  assert seen["files"] and not outside, f"te_adapters imported from outside the install: {outside}"
  assert seen["ffi"] == {"cpu": False, "gpu": False}, seen["ffi"]

  results = _results(junit)
  bad = {k: v for k, v in results.items() if v[0] in ("failure", "error")}
  assert not bad, bad
  ffi_file = "tests/csrc/test_cast_transpose.py::"
  ffi_tests = {k: v for k, v in results.items() if k.startswith(ffi_file)}
  skipped = {k: msg for k, (outcome, msg) in ffi_tests.items() if outcome == "skipped"}
  assert any("bit_identical_to_jax" in k for k in skipped), sorted(ffi_tests)
  wrong = {k: msg for k, msg in skipped.items() if "extension not built" not in msg}
  assert not wrong, wrong
  fallback = ffi_file + "test_pure_jax_fallback_without_extension"
  assert results.get(fallback, ("missing",))[0] == "passed", results.get(fallback)
