"""Command line: ``python -m te_adapters demo``, and ``python -m te_adapters bench`` from a source
checkout (the benchmark lives in the repository's ``bench/``, outside the package)."""

import sys
from pathlib import Path


def _checkout_root() -> Path | None:
  """The source checkout this package was imported from (an editable install), else None."""
  root = Path(__file__).resolve().parent.parent
  if (root / "pyproject.toml").is_file() and (root / "bench" / "speed.py").is_file():
    return root
  return None


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  commands = ("demo", "bench")
  if not argv or argv[0] not in commands:
    print(f"usage: python -m te_adapters {{{','.join(commands)}}} [options]", file=sys.stderr)
    return 2
  if argv[0] == "demo":
    from te_adapters import _demo

    _demo.main(argv[1:])
  elif argv[0] == "bench":
    root = _checkout_root()
    if root is None:
      print("python -m te_adapters bench: the benchmark is not part of the installed package; "
            "run `python -m bench` from the root of a source checkout "
            "(or install one with `pip install -e .`)", file=sys.stderr)
      return 2
    sys.path.insert(0, str(root))
    from bench import speed

    speed.main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
