"""An adapter's framework is an optional dependency: a clear error when it is missing."""

import importlib


def require(module: str, adapter: str, extra: str) -> None:
  """Imports ``module``, or raises ImportError naming the extra that installs it."""
  try:
    importlib.import_module(module)
  except ImportError as e:
    raise ImportError(
      f"{adapter} needs {module}, which does not import ({e}): pip install "
      f"'te_adapters[{extra}]' (te_adapters.core works without it)",
      name=module,
    ) from e
