"""The API reference (docs/api, Sphinx autodoc) covers every public name: each class and function
of a module's ``__all__`` has a docstring for autodoc to render, or the page documents it by hand
(``.. data::``, for constants and for objects made by JAX). .ci/run builds the pages with
warnings as errors (``python -m sphinx -W``)."""

import ast
import enum
import importlib
import inspect
import pathlib
import re
import textwrap

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


def _public_callables() -> dict[str, object]:
  """Each public class and function the package defines, once, by the first name it has on the
  pages' modules (``te_adapters.Float8CurrentScaling`` is ``te_adapters.core``'s too)."""
  found: dict[str, object] = {}
  seen: set[int] = set()
  for module_name in sorted(PAGES):
    try:
      module = importlib.import_module(module_name)
    except ImportError:  # an adapter whose framework is not installed
      continue
    for name in module.__all__:
      obj = getattr(module, name)
      own = (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(
        obj, "__module__", ""
      ).startswith("te_adapters")
      if own and id(obj) not in seen:
        seen.add(id(obj))
        found[f"{module_name}.{name}"] = obj
  return found


def _takes_arguments(obj) -> bool:
  if inspect.isclass(obj) and issubclass(obj, (Warning, enum.Enum)):
    return False  # a warning's message; an enum's members are its values
  try:
    params = inspect.signature(obj).parameters
  except ValueError:
    return False
  return any(name not in ("self", "cls") for name in params)


def test_every_public_callable_has_arguments_result_and_example():
  """Each public function's docstring has its arguments (``Args:``), its result (``Returns:``)
  and a runnable example (``Example:`` with ``>>>`` lines, run by the suite's
  ``--doctest-modules``); each class its constructor's arguments (``Args:`` in its docstring or
  its ``__init__``'s, or ``Attributes:`` for a dataclass whose fields are its arguments) and an
  example."""
  pytest.importorskip("jax")
  lacking = {}
  for path, obj in _public_callables().items():
    doc = inspect.getdoc(obj) or ""
    init = vars(obj).get("__init__") if inspect.isclass(obj) else None
    if init is not None and init.__doc__:
      # The reference shows a class's docstring and its __init__'s together (autoclass_content).
      doc += "\n" + inspect.getdoc(init)
    sections = re.findall(r"^(\w+):$", doc, re.M)
    missing = []
    if _takes_arguments(obj) and not {"Args", "Attributes"} & set(sections):
      missing.append("Args")
    if inspect.isfunction(obj) and "Returns" not in sections:
      missing.append("Returns")
    if "Example" not in sections or not re.search(r"^  >>> ", doc, re.M):
      missing.append("Example")
    if missing:
      lacking[path] = missing
  assert not lacking, "\n".join(f"{path}: no {', '.join(m)}" for path, m in sorted(lacking.items()))


def _raises_itself(fn) -> bool:
  """Whether ``fn``'s own body (not a function nested in it) has a ``raise`` statement."""
  try:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  except (OSError, TypeError):  # made by dataclasses or another generator: no source
    return False
  nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

  def walk(node):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Raise):
        yield child
      if not isinstance(child, nested):
        yield from walk(child)

  return any(True for _ in walk(tree.body[0]))


def test_every_public_callable_that_raises_says_what():
  """A public function, or a class whose ``__init__`` or ``__post_init__`` checks its arguments,
  that raises in its own body has a ``Raises:`` section (errors raised by the functions it calls
  are its callees' to document)."""
  pytest.importorskip("jax")
  silent = []
  for path, obj in _public_callables().items():
    if inspect.isfunction(obj):
      bodies = [obj]
    else:
      bodies = [vars(obj)[m] for m in ("__init__", "__post_init__") if m in vars(obj)]
    docs = [inspect.getdoc(obj) or ""] + [inspect.getdoc(b) or "" for b in bodies]
    if any(_raises_itself(b) for b in bodies) and not any(
      re.search(r"^Raises:$", d, re.M) for d in docs
    ):
      silent.append(path)
  assert not silent, f"raise without a Raises: section: {silent}"


# Methods a pytree protocol or a generated dataclass gives, not the reference's to explain.
PROTOCOL_METHODS = {"tree_flatten", "tree_flatten_with_keys", "tree_unflatten", "replace"}


def test_every_public_method_has_arguments_and_result():
  """The public methods of the public classes (``__call__`` included: the reference renders it)
  name their arguments and their result; the class's example shows them in use."""
  pytest.importorskip("jax")
  lacking = {}
  for path, cls in _public_callables().items():
    if not inspect.isclass(cls):
      continue
    fields = getattr(cls, "__dataclass_fields__", {})
    for name, member in vars(cls).items():
      if (name.startswith("_") and name != "__call__") or name in PROTOCOL_METHODS | set(fields):
        continue
      fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
      if not inspect.isfunction(fn):
        continue
      sections = set(re.findall(r"^(\w+):$", inspect.getdoc(fn) or "", re.M))
      params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
      missing = [s for s, needed in (("Args", bool(params)), ("Returns", True)) if needed]
      missing = [s for s in missing if s not in sections]
      if missing:
        lacking[f"{path}.{name}"] = missing
  assert not lacking, "\n".join(f"{path}: no {', '.join(m)}" for path, m in sorted(lacking.items()))
