"""Every custom derivative rule of the package is listed, with its reason, in
docs/architecture.md; the quantizing ones are exactly those the table marks."""

import ast
import pathlib
import re

import te_adapters

PACKAGE = pathlib.Path(te_adapters.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
_RULES = {"custom_vjp", "custom_jvp"}


def _is_rule(decorator) -> bool:
  """``@jax.custom_vjp``, ``@jax.custom_jvp`` or ``@functools.partial(jax.custom_vjp, ...)``."""
  if isinstance(decorator, ast.Call):
    if decorator.args and isinstance(decorator.func, (ast.Attribute, ast.Name)):
      name = getattr(decorator.func, "attr", getattr(decorator.func, "id", ""))
      if name == "partial":
        return _is_rule(decorator.args[0])
    return _is_rule(decorator.func)
  return getattr(decorator, "attr", getattr(decorator, "id", None)) in _RULES


def rules_in_code() -> set[str]:
  found = set()
  for path in PACKAGE.rglob("*.py"):
    module = ".".join(("te_adapters", *path.relative_to(PACKAGE).with_suffix("").parts))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.FunctionDef) and any(_is_rule(d) for d in node.decorator_list):
        found.add(f"{module}.{node.name}")
  return found


def rules_in_doc() -> dict[str, bool]:
  """``{rule: quantizes}`` from the table under "Custom derivative rules"."""
  text = DOC.read_text().split("## Custom derivative rules", 1)[1].split("\n## ", 1)[0]
  rows = re.findall(r"^\| `([\w.]+)` \| (yes|no) \|", text, flags=re.M)
  return {name: quantizes == "yes" for name, quantizes in rows}


def test_the_finder_sees_each_form():
  tree = ast.parse(
    "import functools, jax\n"
    "@jax.custom_vjp\ndef a(x): return x\n"
    "@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))\ndef b(x, n): return x\n"
    "@jax.custom_jvp\ndef c(x): return x\n"
    "@functools.lru_cache\ndef d(x): return x\n"
  )
  marked = [
    n.name
    for n in tree.body
    if isinstance(n, ast.FunctionDef) and any(_is_rule(d) for d in n.decorator_list)
  ]
  assert marked == ["a", "b", "c"]


def test_every_rule_is_listed_with_its_reason():
  listed = rules_in_doc()
  assert len(listed) >= 10  # the table was found and parsed
  assert rules_in_code() == set(listed), (
    "custom VJP/JVP rules in the code and in docs/architecture.md differ: "
    f"only in code {sorted(rules_in_code() - set(listed))}, "
    f"only in the doc {sorted(set(listed) - rules_in_code())}"
  )


def test_one_quantized_gemm_rule_serves_the_dense_and_fused_paths():
  quantizing = {name for name, q in rules_in_doc().items() if q}
  assert "te_adapters.core.gemm._gemm._quantized_gemms" in quantizing
  # The dense, block-scaled, norm+GEMM and MLP paths have no quantized rule of their own; the
  # grouped GEMM has one, for every format with a grouped GEMM.
  assert quantizing == {
    "te_adapters.core.gemm._gemm._quantized_gemms",
    "te_adapters.core.gemm._ragged._grouped_gemms",
  }
