import numpy as np
import pytest


def rel_err(actual, reference) -> float:
  """Normwise relative error ||a - r|| / ||r||, computed in float64."""
  a = np.asarray(actual, np.float64)
  r = np.asarray(reference, np.float64)
  return float(np.linalg.norm(a - r) / np.linalg.norm(r))


@pytest.fixture
def rel():
  return rel_err
