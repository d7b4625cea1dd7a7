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


# The subcommands and what each does, as ``--help`` lists them.
COMMANDS = {
  "demo": "FP8 against bf16 on one GEMM on this device: step time, error, FP8 GEMMs counted",
  "bench": "the benchmark (python -m bench), from a source checkout",
}


def usage() -> str:
  """The command line's help text: its subcommands, one a line."""
  width = max(map(len, COMMANDS))
  lines = [
    f"usage: python -m te_adapters {{{','.join(COMMANDS)}}} [options]",
    "",
    "TransformerEngine-grade quantized GEMMs for JAX (Flax Linen, Flax NNX, Haiku).",
    "",
    "subcommands:",
  ]
  lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
  lines += ["", "  -h, --help  show this message and exit"]
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("-h", "--help", "help"):
    print(usage())
    return 0
  if not argv or argv[0] not in COMMANDS:
    print(usage(), file=sys.stderr)
    if argv:
      print(f"\npython -m te_adapters: unknown subcommand {argv[0]!r}", file=sys.stderr)
    return 2
  if argv[0] == "demo":
    from te_adapters import _demo

    _demo.main(argv[1:])
  elif argv[0] == "bench":
    root = _checkout_root()
    if root is None:
      print(
        "python -m te_adapters bench: the benchmark is not part of the installed package; "
        "run `python -m bench` from the root of a source checkout "
        "(or install one with `pip install -e .`)",
        file=sys.stderr,
      )
      return 2
    sys.path.insert(0, str(root))
    from bench import speed

    speed.main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
