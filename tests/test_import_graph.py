"""The package's modules import each other without cycles (function-level imports included)."""

import ast
import pathlib

import te_adapters

PACKAGE = pathlib.Path(te_adapters.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = ("te_adapters", *path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """``{module: the package's modules it imports}``, from every import statement in its source.

  ``from a.b import c`` counts as importing ``a.b.c`` where that is a module, else ``a.b``. The
  implicit import of a module's parent packages is not an edge (every module has it).
  """
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
          full = f"{base}.{alias.name}"
          found.add(full if full in modules else base)
    graph[name] = {m for m in found if m in modules and m != name}
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
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_the_graph_sees_imports():
  graph = import_graph()
  # Module-level and function-level imports, absolute and through a package's names.
  assert "te_adapters.core._gemm" in graph["te_adapters.core"]
  assert "te_adapters.core._scaling" in graph["te_adapters.core._quantize"]
  assert "te_adapters.core" in graph["te_adapters.linen._module"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)
