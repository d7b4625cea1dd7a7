import os

import numpy as np
import pytest

# Sharding tests run on 8 virtual CPU devices. XLA reads the flag when JAX first starts, so it is
# set here, before any test module imports JAX; a flag the caller already set wins.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()


def rel_err(actual, reference) -> float:
  """Normwise relative error ||a - r|| / ||r||, computed in float64."""
  a = np.asarray(actual, np.float64)
  r = np.asarray(reference, np.float64)
  return float(np.linalg.norm(a - r) / np.linalg.norm(r))


@pytest.fixture
def rel():
  return rel_err
