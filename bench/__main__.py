"""``python -m bench [--cases dense,layer,sweep] ...``, from the repository root."""

import sys

from bench import speed

if __name__ == "__main__":
  speed.main(sys.argv[1:])
  sys.exit(0)
