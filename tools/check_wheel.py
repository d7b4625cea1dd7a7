"""Checks a built wheel or sdist of te_adapters before it is published.

  python tools/check_wheel.py FILE.whl [--cuda] [--cuda-archs "90a;100a"] [--cublaslt]
                                       [--grouped-gemm]
  python tools/check_wheel.py FILE.tar.gz

A wheel: a manylinux platform tag and the Python tag of a supported CPython; the version of
te_adapters/_version.py; the package's modules, py.typed, the license and the metadata
(Requires-Python, dependencies, extras); the C++ kernels; with --cuda the CUDA kernels, built for
the archs given (and with --cublaslt / --grouped-gemm holding those GEMMs), loaded and asked;
no vendored libraries, no CUDA library linked (only glibc, libstdc++ and libgcc), and nothing of
the repository that is not the package (tests, bench). An sdist: the sources the offline build
needs (csrc, the package, pyproject.toml, README.md, LICENSE). Exits 1 with every failure listed.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shared libraries the extension may need: the C and C++ runtimes, which every manylinux
# system provides. A CUDA library among them would pin one CUDA install.
ALLOWED_NEEDED = re.compile(
  r"^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so"
)
WHEEL_NAME = re.compile(
  r"^te_adapters-(?P<version>[^-]+)-(?P<py>cp3\d+)-(?P<abi>cp3\d+)-(?P<plat>[\w.]+)\.whl$"
)


def _version() -> str:
  text = (ROOT / "te_adapters" / "_version.py").read_text()
  return re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)


def _needed(data: bytes) -> list[str]:
  """The DT_NEEDED entries of a shared object."""
  from elftools.elf.dynamic import DynamicSection  # auditwheel's dependency
  from elftools.elf.elffile import ELFFile

  elf = ELFFile(io.BytesIO(data))
  names = []
  for section in elf.iter_sections():
    if isinstance(section, DynamicSection):
      names += [tag.needed for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
  return names


def check_wheel(path: Path, args) -> list[str]:
  errors = []
  m = WHEEL_NAME.match(path.name)
  if m is None:
    return [f"{path.name}: not a te_adapters CPython wheel name"]
  if m["version"] != _version():
    errors.append(f"version {m['version']}, te_adapters/_version.py says {_version()}")
  if m["py"] != m["abi"] or int(m["py"][3:]) < 11:
    errors.append(f"Python tag {m['py']}-{m['abi']}: expected one CPython 3.11+ ABI")
  plats = m["plat"].split(".")
  if not all(re.fullmatch(r"manylinux_2_\d+_x86_64|manylinux2014_x86_64", p) for p in plats):
    errors.append(f"platform tag {m['plat']}: not manylinux (no index accepts linux_x86_64)")
  with zipfile.ZipFile(path) as z:
    names = set(z.namelist())
    dist_info = f"te_adapters-{m['version']}.dist-info"
    for required in (
      "te_adapters/__init__.py",
      "te_adapters/_version.py",
      "te_adapters/py.typed",
      "te_adapters/core/__init__.py",
      "te_adapters/linen/__init__.py",
      "te_adapters/nnx/__init__.py",
      "te_adapters/haiku/__init__.py",
      f"{dist_info}/METADATA",
      f"{dist_info}/WHEEL",
    ):
      if required not in names:
        errors.append(f"missing {required}")
    if not any(n.startswith(f"{dist_info}/") and "LICENSE" in n for n in names):
      errors.append("no LICENSE in the dist-info")
    strays = sorted({n.split("/")[0] for n in names} - {"te_adapters", dist_info})
    if strays:
      errors.append(f"files outside the package: {strays} (vendored libraries, tests or bench)")
    meta = Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
    if meta["Requires-Python"] != ">=3.11":
      errors.append(f"Requires-Python is {meta['Requires-Python']!r}")
    requires = meta.get_all("Requires-Dist") or []
    if not any(r.startswith("jax") for r in requires):
      errors.append(f"jax is not a dependency: {requires}")
    extras = set(meta.get_all("Provides-Extra") or [])
    if not {"flax", "haiku", "all"} <= extras:
      errors.append(f"extras {sorted(extras)} lack flax, haiku or all")
    so = {n.split("/")[-1].split(".")[0]: n for n in names if n.endswith(".so")}
    expected = {"_csrc_cpu"} | ({"_csrc_cuda"} if args.cuda else set())
    if set(so) != expected:
      errors.append(f"compiled modules {sorted(so)}, expected {sorted(expected)}")
    for name in so.values():
      bad = [n for n in _needed(z.read(name)) if not ALLOWED_NEEDED.match(n)]
      if bad:
        errors.append(f"{name} links {bad}: only glibc, libstdc++ and libgcc may be linked")
    if args.cuda and "_csrc_cuda" in so:
      errors += _check_cuda_module(z, so["_csrc_cuda"], m["py"], args)
  return errors


def _check_cuda_module(z: zipfile.ZipFile, name: str, py_tag: str, args) -> list[str]:
  """Loads the CUDA module (no GPU needed: the runtime finds no driver until a kernel runs) in
  this interpreter when its ABI matches, and checks what it says it holds."""
  if f"cp{sys.version_info.major}{sys.version_info.minor}" != py_tag:
    return []
  with tempfile.TemporaryDirectory() as tmp:
    file = Path(tmp) / Path(name).name
    file.write_bytes(z.read(name))
    spec = importlib.util.spec_from_file_location("_csrc_cuda", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = module.build_info()
  errors = []
  want = [f"sm_{a}" for a in re.split(r"[;,]", args.cuda_archs or "") if a]
  if want and str(info["archs"]).split(",") != want:
    errors.append(f"CUDA kernels built for {info['archs']}, expected {','.join(want)}")
  if args.cublaslt and not info["cublaslt_gemm"]:
    errors.append("the cuBLASLt FP8 GEMM is not built in (no cublasLt.h of cuBLAS 12.9+ found)")
  if args.grouped_gemm and not info["grouped_gemm"]:
    errors.append("the grouped GEMM is not built in (TE_ADAPTERS_CUTLASS_DIR)")
  print(f"  CUDA module: {dict(info)}")
  return errors


def check_sdist(path: Path) -> list[str]:
  errors = []
  with tarfile.open(path) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for required in (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "csrc/CMakeLists.txt",
    "csrc/cuda_module.cc",
    "te_adapters/__init__.py",
    "te_adapters/_version.py",
    "te_adapters/py.typed",
  ):
    if required not in names:
      errors.append(f"missing {required}")
  if not path.name.startswith(f"te_adapters-{_version()}."):
    errors.append(f"{path.name}: expected version {_version()}")
  return errors


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("file", type=Path)
  p.add_argument("--cuda", action="store_true", help="the CUDA kernels must be in the wheel")
  p.add_argument("--cuda-archs", default="", help='their GPU targets, such as "90a;100a"')
  p.add_argument("--cublaslt", action="store_true", help="with the cuBLASLt FP8 GEMM")
  p.add_argument("--grouped-gemm", action="store_true", help="with the CUTLASS grouped GEMM")
  args = p.parse_args(argv)
  if args.file.name.endswith(".whl"):
    errors = check_wheel(args.file, args)
  else:
    errors = check_sdist(args.file)
  for e in errors:
    print(f"{args.file.name}: {e}", file=sys.stderr)
  if not errors:
    print(f"{args.file.name}: ok")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
