"""Command line: ``python -m te_adapters demo`` and ``python -m te_adapters bench``."""

import sys


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
    from te_adapters import _bench

    _bench.main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
