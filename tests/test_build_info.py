"""te_adapters.build_info(): what is installed, and whether the CUDA kernels can run on the GPUs
found (the CUDA release of the driver, the compute capability the kernels were built for)."""

import importlib.util
import pathlib
import re
import sys
import types

import jax
import pytest

import te_adapters as ta
from te_adapters.core import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_written_once_and_the_package_reports_it():
  # The imported package's own file: the source tree's, or an installed wheel's.
  text = (pathlib.Path(ta.__file__).parent / "_version.py").read_text()
  assert re.search(r'^__version__ = "(\d+\.\d+\.\d+)"$', text, re.M).group(1) == ta.__version__
  # pyproject.toml reads it from there rather than writing it again.
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject
  assert 'metadata.version.input = "te_adapters/_version.py"' in pyproject


def test_build_info_on_this_machine():
  info = ta.build_info()
  assert info.version == ta.__version__ and info.jax_version == jax.__version__
  assert info.cpu_kernels == (importlib.util.find_spec("te_adapters._csrc_cpu") is not None)
  assert info.cuda_kernels == (importlib.util.find_spec("te_adapters._csrc_cuda") is not None)
  assert info.backend == jax.default_backend()
  if info.backend != "gpu":
    assert info.fp8_gemms == "emulated" and not info.gpu_kernels_run
  if info.cuda_kernels:
    assert info.cuda_archs and all(a.startswith("sm_") for a in info.cuda_archs)
    assert re.fullmatch(r"\d+\.\d", info.cuda_version)
  else:
    assert info.cuda_archs == () and info.cuda_version is None and not info.gpu_kernels_run
  text = str(info)
  assert text.splitlines()[0] == f"te_adapters {ta.__version__}, jax {jax.__version__}"
  assert f"FP8 GEMMs: {info.fp8_gemms}" in text


class _Device:
  def __init__(self, capability):
    self.compute_capability = capability
    self.device_kind = f"a GPU of compute capability {capability}"


@pytest.fixture
def fake_gpu(monkeypatch):
  """A GPU backend with devices of a given compute capability and CUDA kernels that say what
  they were built for: ``fake_gpu(capability, archs, runtime, driver)``."""

  def make(capability, archs="sm_90a", runtime=13000, driver=13000):
    module = types.ModuleType("te_adapters._csrc_cuda")
    module.build_info = lambda: {
      "cuda_runtime_version": runtime,
      "cuda_driver_version": driver,
      "archs": archs,
      "cublaslt_gemm": True,
      "grouped_gemm": False,
    }
    module.registrations = lambda: {}
    monkeypatch.setitem(sys.modules, "te_adapters._csrc_cuda", module)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(capability)])
    kernels.gpu_kernels_unusable_reason.cache_clear()

  yield make
  kernels.gpu_kernels_unusable_reason.cache_clear()


def test_the_kernels_run_on_the_gpus_they_were_built_for(fake_gpu):
  fake_gpu("9.0", archs="sm_90a,sm_100a")
  assert kernels.gpu_kernels_unusable_reason() is None
  info = ta.build_info()
  assert info.gpu_kernels_run and info.fp8_gemms == "native" and not info.notes
  assert info.cuda_archs == ("sm_90a", "sm_100a") and info.cuda_version == "13.0"
  assert info.cublaslt_gemm and not info.grouped_gemm
  fake_gpu("10.0", archs="sm_90a,sm_100a")
  assert kernels.gpu_kernels_unusable_reason() is None


def test_a_gpu_the_kernels_were_not_built_for_runs_pure_jax_and_says_so(fake_gpu):
  fake_gpu("8.0")  # an A100: no FP8 GEMMs, and no machine code of the kernels
  reason = kernels.gpu_kernels_unusable_reason()
  assert "built for sm_90a (compute capability 9.0)" in reason
  assert "compute capability 8.0" in reason and "pure JAX" in reason
  info = ta.build_info()
  assert not info.gpu_kernels_run and info.fp8_gemms == "emulated" and info.notes == (reason,)


def test_a_driver_older_than_the_kernels_cuda_runs_pure_jax_and_says_so(fake_gpu):
  fake_gpu("9.0", runtime=13000, driver=12080)
  reason = kernels.gpu_kernels_unusable_reason()
  assert "built with CUDA 13.0" in reason and "this one supports 12.8" in reason
  info = ta.build_info()
  assert not info.gpu_kernels_run and info.cuda_driver_version == "12.8"
  assert "FP8 GEMMs are native here; the casts to FP8 run in pure JAX" in _demo_note(info)


def _demo_note(info):
  from te_adapters import _demo

  return _demo.emulation_note(info)
