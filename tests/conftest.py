import os

import numpy as np
import pytest

# Sharding tests run on 8 virtual CPU devices. XLA reads the flag when JAX first starts, so it is
# set here, before any test module imports JAX; a flag the caller already set wins.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()

# The README runs the suite in one process per core (pytest-xdist): on a GPU, each allocates its
# memory as it goes instead of most of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from te_adapters import core  # noqa: E402

# The suite takes the GPU's size decisions on every platform: the default threshold applies on
# CPU too, so a test's small GEMMs run in high precision on CPU exactly as they do on an H100,
# and a test of FP8 behaviour must ask for FP8 with threshold=None wherever it runs. (The
# threshold's own tests build their SizeThreshold objects explicitly.) Set before any test runs,
# so every default argument that holds this object sees the same rule for the whole session.
GPU_PLATFORMS = core.DEFAULT_SIZE_THRESHOLD.platforms
object.__setattr__(core.DEFAULT_SIZE_THRESHOLD, "platforms", tuple(sorted({*GPU_PLATFORMS, "cpu"})))


# XLA:GPU's float32 division is not correctly rounded: seen 1 ulp off on an H100 (448/3 gave
# 149.33334, not 149.33333). TE's JAX layer computes its scales with the same XLA division. So a
# scale (fp8_max / amax) computed on a GPU is compared to 1 ulp there, and exactly on CPU.
SCALE_ULPS = 0 if jax.default_backend() == "cpu" else 1


def assert_scales_equal(actual, desired, ulps: int = SCALE_ULPS):
  """Scales equal to ``ulps`` float32 units in the last place (exactly where ``ulps`` is 0)."""
  actual = np.asarray(actual, np.float32)
  desired = np.asarray(desired, np.float32)
  if ulps:
    np.testing.assert_array_max_ulp(actual, desired, maxulp=ulps)
  else:
    np.testing.assert_array_equal(actual, desired)


# Hopper's FP8 tensor cores sum with fewer mantissa bits than float32 before the sums are
# promoted (about 2**-14: errors near 5e-5 relative seen on an H100 at K=32, with and without a
# split accumulator), so an FP8 GEMM's output matches a float32 reference of the same quantized
# operands to this relative tolerance there, and to float32 rounding on CPU.
FP8_GEMM_RTOL = 1e-5 if jax.default_backend() == "cpu" else 1e-3


def rel_err(actual, reference) -> float:
  """Normwise relative error ||a - r|| / ||r||, computed in float64."""
  a = np.asarray(actual, np.float64)
  r = np.asarray(reference, np.float64)
  return float(np.linalg.norm(a - r) / np.linalg.norm(r))


@pytest.fixture
def rel():
  return rel_err
