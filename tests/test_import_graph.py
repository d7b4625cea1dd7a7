"""The package's imports: no cycles (function-level imports included), and te_adapters.core's
subpackages imported in one direction, each through its face.

The rules (issue 33):

- te_adapters/core holds its ``__init__`` (the user API) and the subpackages of SUBPACKAGES, each a
  folder whose ``__init__`` is its public face over private modules (``_name.py``).
- Direction: a module of a subpackage imports only its own subpackage and those before it in
  SUBPACKAGES. UPWARD lists the edges that break this today, with what would clear each: clear
  them, never add one.
- Faces: a subpackage's private modules are imported only by that subpackage's modules (directly,
  never through their own face, nor through ``te_adapters.core``: both would be cycles). Every
  other importer, in another subpackage, in core's ``__init__``, in the adapters and the rest of
  te_adapters, imports a face (``te_adapters.core.<name>``) or ``te_adapters.core``. There are no
  exceptions: a name another subpackage needs is on its owner's face.
- tests/, bench/ and examples/ import public names: te_adapters, te_adapters.core, a face,
  te_adapters.inspect, the adapters. TEST_PRIVATE_IMPORTS lists, per file, the private modules
  still imported (by an import, an attribute chain ``core.<name>._x`` or a patch target string;
  not a mention in a comment or docstring) with the reason the file needs them: it only shrinks,
  and an entry no longer needed fails too.
- te_adapters.core imports neither flax nor haiku, and nothing of te_adapters outside the core but
  te_adapters.inspect (the shim of core's deprecated names).
"""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "te_adapters"
CORE = "te_adapters.core"

# Lowest first.
SUBPACKAGES = ("recipes", "ops", "sharding", "kernels", "state", "formats", "gemm", "fused")

UPWARD = set()

# {file: (the private modules it still imports, why)}. Each needs the module itself.
TEST_PRIVATE_IMPORTS = {
  "tests/core/test_block_float8.py": (
    ("te_adapters.core.formats._float8_block",),
    "patches _PARTIALS_BUDGET, a global its gemm reads; its gemm and compute_scale are names"
    " several formats define, which the face leaves out",
  ),
  "tests/core/test_block_gpu.py": (
    ("te_adapters.core.formats._float8_block",),
    "the 1x128/128x128 format's own quantize, gemm and dequantize_values: names several"
    " formats define, which the face leaves out",
  ),
  "tests/core/test_grouped_kernel.py": (
    ("te_adapters.core.kernels._ffi", "te_adapters.core.kernels._grouped_kernel"),
    "patches rows_gemm, wgrad_gemm, available and _ffi.single_device, globals the grouped"
    " kernel's own functions read (a patch on the face would not reach them)",
  ),
  "tests/core/test_partition.py": (
    ("te_adapters.core.formats._float8_block",),
    "the 1x128/128x128 format's own quantize and XLA GEMM (_xla_gemm) as the rule's kernel and"
    " fallback: names several formats define, which the face leaves out",
  ),
  "tests/test_custom_rules.py": (
    ("te_adapters.core.gemm._gemm", "te_adapters.core.gemm._ragged"),
    "imports none: names the custom rules by their place in the source, as the table of"
    " docs/architecture.md does",
  ),
}

FRAMEWORKS = ("flax", "haiku")


def _modules(package: pathlib.Path = PACKAGE, name: str = "te_adapters") -> dict[str, pathlib.Path]:
  out = {}
  for path in package.rglob("*.py"):
    parts = (name, *path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _imported(node, package: str, modules) -> set[str]:
  """The dotted names one import statement imports: ``from a.b import c`` counts as ``a.b.c``
  where that is a module, else ``a.b``."""
  if isinstance(node, ast.Import):
    return {alias.name for alias in node.names}
  base = node.module or ""
  if node.level:
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    base = ".".join([*anchor, base] if base else anchor)
  return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


def import_graph(package: pathlib.Path = PACKAGE, name: str = "te_adapters") -> dict[str, set[str]]:
  """``{module: the package's modules it imports}``, from every import statement in its source.

  ``from a.b import c`` counts as importing ``a.b.c`` where that is a module, else ``a.b``. The
  implicit import of a module's parent packages is not an edge (every module has it).
  """
  modules = _modules(package, name)
  graph = {}
  for module, path in modules.items():
    parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        found |= _imported(node, parent, modules)
    graph[module] = {m for m in found if m in modules and m != module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
  state = {}  # 1: on the current path, 2: done
  path = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def subpackage(module: str) -> str | None:
  """The core subpackage ``module`` is (its face) or is in, else None."""
  parts = module.split(".")
  return parts[2] if len(parts) >= 3 and parts[:2] == ["te_adapters", "core"] else None


def is_private(module: str) -> bool:
  """A module inside a subpackage, not its face: ``te_adapters.core.<name>._x``."""
  parts = module.split(".")
  return subpackage(module) is not None and len(parts) >= 4


def upward_edges(graph) -> set[tuple[str, str]]:
  rank = {name: i for i, name in enumerate(SUBPACKAGES)}
  out = set()
  for a, bs in graph.items():
    for b in bs:
      sa, sb = subpackage(a), subpackage(b)
      if sa in rank and sb in rank and rank[sb] > rank[sa]:
        out.add((a, b))
  return out


def private_reaches(graph) -> dict[str, set[str]]:
  """Package modules importing a private module of a subpackage they are not in."""
  out = {}
  for a, bs in graph.items():
    found = {b for b in bs if is_private(b) and subpackage(b) != subpackage(a)}
    if found:
      out[a] = found
  return out


_CHAIN = re.compile(r"\bcore\.(\w+)\.(_\w+)\b")


def _code_text(text: str, tree) -> str:
  """``text`` with its comments and docstrings blanked out (other strings, patch targets among
  them, stay)."""
  docstrings = {
    (n.lineno, n.col_offset)
    for n in ast.walk(tree)
    if isinstance(n, ast.Expr)
    and isinstance(n.value, ast.Constant)
    and isinstance(n.value.value, str)
  }
  starts = [0]
  for line in text.splitlines(keepends=True):
    starts.append(starts[-1] + len(line))
  chars = list(text)
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in docstrings):
      for i in range(starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]):
        chars[i] = chars[i] if chars[i] == "\n" else " "
  return "".join(chars)


def outside_private_imports(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """``{file under tests/, bench/, examples/: private core modules it imports}``."""
  modules = _modules()
  out = {}
  for folder in ("tests", "bench", "examples"):
    for path in sorted((root / folder).rglob("*.py")):
      if path.resolve() == pathlib.Path(__file__).resolve():
        continue  # this file names private modules in its tables
      text = path.read_text()
      tree = ast.parse(text, str(path))
      found = set()
      for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
          found |= {m for m in _imported(node, "", modules) if is_private(m)}
          if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CORE):
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
      for m in _CHAIN.finditer(_code_text(text, tree)):
        if f"{CORE}.{m.group(1)}.{m.group(2)}" in modules:
          found.add(f"{CORE}.{m.group(1)}.{m.group(2)}")
      if found:
        out[path.relative_to(root).as_posix()] = found
  return out


def test_the_graph_sees_imports(tmp_path):
  files = {
    "__init__.py": "from pkg.sub import face_name\n",
    "sub/__init__.py": "from pkg.sub._a import face_name\n",
    "sub/_a.py": "face_name = 1\n\n\ndef f():\n  from pkg import _b\n",
    "_b.py": "import pkg.sub._a\nfrom . import _c\n",
    "_c.py": "from .sub import _a as a\nfrom pkg.sub import face_name\n",
  }
  for rel, text in files.items():
    (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / rel).write_text(text)
  graph = import_graph(tmp_path / "pkg", "pkg")
  # Module-level and function-level imports, absolute and relative, modules and packages' names.
  assert graph == {
    "pkg": {"pkg.sub"},
    "pkg.sub": {"pkg.sub._a"},
    "pkg.sub._a": {"pkg._b"},
    "pkg._b": {"pkg.sub._a", "pkg._c"},
    "pkg._c": {"pkg.sub._a", "pkg.sub"},
  }
  assert "te_adapters.core" in import_graph()["te_adapters"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_is_its_init_and_the_subpackages():
  stray = [m for m in _modules() if m.startswith(CORE + ".") and subpackage(m) not in SUBPACKAGES]
  assert not stray, f"modules of te_adapters.core outside SUBPACKAGES: {stray}"
  missing = [s for s in SUBPACKAGES if not (PACKAGE / "core" / s / "__init__.py").exists()]
  assert not missing, f"SUBPACKAGES without a folder and face: {missing}"


def test_subpackages_import_downward_only():
  found = upward_edges(import_graph())
  new = sorted(found - set(UPWARD))
  assert not new, "imports of a later subpackage (move the code, don't extend UPWARD): " + str(new)
  cleared = sorted(set(UPWARD) - found)
  assert not cleared, f"cleared, remove from UPWARD: {cleared}"


def test_private_modules_are_imported_from_their_subpackage_only():
  found = {a: sorted(bs) for a, bs in private_reaches(import_graph()).items()}
  assert not found, "private modules imported from outside their subpackage (import the face): " + (
    str(found)
  )


def test_subpackages_do_not_import_their_own_face_or_the_core():
  bad = sorted(
    (a, b)
    for a, bs in import_graph().items()
    for b in bs
    if subpackage(a) and ((b == CORE) or (b == f"{CORE}.{subpackage(a)}" and is_private(a)))
  )
  assert not bad, f"a subpackage's module imports its own face or te_adapters.core: {bad}"


def test_tests_bench_and_examples_import_public_names():
  found = outside_private_imports()
  allowed = {f: set(ms) for f, (ms, _) in TEST_PRIVATE_IMPORTS.items()}
  new = {f: sorted(ms - allowed.get(f, set())) for f, ms in found.items()}
  new = {f: ms for f, ms in new.items() if ms}
  assert not new, f"new imports of private core modules (import the face instead): {new}"
  cleared = {f: sorted(ms - found.get(f, set())) for f, ms in allowed.items()}
  cleared = {f: ms for f, ms in cleared.items() if ms}
  assert not cleared, f"cleared, remove from TEST_PRIVATE_IMPORTS: {cleared}"
  unexplained = [f for f, (_, why) in TEST_PRIVATE_IMPORTS.items() if not why.strip()]
  assert not unexplained, f"TEST_PRIVATE_IMPORTS entries without their reason: {unexplained}"


def test_core_imports_no_framework_and_nothing_above_it():
  bad = []
  for module, path in _modules().items():
    if module != CORE and not module.startswith(CORE + "."):
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top in FRAMEWORKS:
          bad.append((module, name))
        elif (
          top == "te_adapters"
          and not name.startswith(CORE)
          and name != "te_adapters"
          and not (module == CORE and name == "te_adapters.inspect")
        ):
          bad.append((module, name))
  assert not bad, f"te_adapters.core imports a framework or te_adapters above the core: {bad}"
