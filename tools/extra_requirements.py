"""Prints the requirements of pyproject.toml's extras, one per line, with the extras they name of
te_adapters itself expanded (``te_adapters[all]``), so that ``pip install -r`` of them adds the
tools of an extra without installing (and building) the package again.

  python tools/extra_requirements.py dev > requirements-dev.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def requirements(extras: list[str]) -> list[str]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  table = project["optional-dependencies"]
  seen, out, todo = set(), [], list(extras)
  while todo:
    extra = todo.pop(0)
    if extra in seen:
      continue
    if extra not in table:
      raise SystemExit(f"no extra {extra!r} in pyproject.toml (extras: {sorted(table)})")
    seen.add(extra)
    for req in table[extra]:
      self_ref = re.fullmatch(rf"{project['name']}\[([\w,\s-]+)\]", req.replace("-", "_"))
      if self_ref:
        todo += [e.strip() for e in self_ref.group(1).split(",")]
      elif req not in out:
        out.append(req)
  return out


if __name__ == "__main__":
  print("\n".join(requirements(sys.argv[1:] or ["dev"])))
