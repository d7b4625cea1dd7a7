"""``te_adapters.build_info()``: what this install holds, and what of it runs on this machine."""

from __future__ import annotations

import dataclasses
import importlib

import jax

from te_adapters._version import __version__
from te_adapters.core.kernels import gpu_kernels_unusable_reason

__all__ = ["BuildInfo", "build_info"]

# CUDA kernels of the wheel run only on the GPUs they were compiled for ("sm_90a" -> "9.0").
_FP8_GEMM_CAPABILITY = 8.9  # Ada and newer GPUs have FP8 tensor cores; XLA emulates elsewhere.


@dataclasses.dataclass(frozen=True)
class BuildInfo:
  """What ``build_info()`` reports. ``str()`` of it is a readable summary.

  Attributes:
    version: te_adapters's version.
    jax_version: the version of the JAX imported.
    cpu_kernels: whether the C++ kernels (``te_adapters._csrc_cpu``) are installed and load.
    cuda_kernels: whether the CUDA kernels (``te_adapters._csrc_cuda``) are installed and load.
    cuda_archs: the GPU targets the CUDA kernels were compiled for, such as ``("sm_90a",)``;
      empty without them.
    cuda_version: the CUDA release the kernels were built with (``"13.0"``; its runtime is linked
      into them), or None.
    cuda_driver_version: the CUDA release the installed driver supports, or None (no kernels, or
      no driver).
    cublaslt_gemm: whether the cuBLASLt FP8 GEMM (per-tensor and 1x128 / 128x128 block scales)
      was built. It opens the cuBLASLt that JAX loads, at run time.
    grouped_gemm: whether the CUTLASS grouped GEMM of ``ragged_dot`` was built.
    backend: ``jax.default_backend()``.
    devices: the device kinds of this process, such as ``("NVIDIA H100 80GB HBM3",)``.
    gpu_kernels_run: whether the CUDA kernels run on this process's GPUs (built for their
      compute capability, and a driver new enough); False without a GPU.
    fp8_gemms: ``"native"`` where the devices have FP8 GEMMs (GPUs of compute capability 8.9 or
      newer), ``"emulated"`` elsewhere: XLA computes the same FP8 arithmetic in higher precision,
      so results match but nothing is faster.
    notes: why a part that is installed does not run here, one sentence each.

  Example:
    >>> import te_adapters as ta
    >>> info = ta.build_info()
    >>> str(info).splitlines()[0] == f"te_adapters {info.version}, jax {info.jax_version}"
    True
    >>> info.gpu_kernels_run <= info.cuda_kernels  # kernels run only where installed
    True
  """

  version: str
  jax_version: str
  cpu_kernels: bool
  cuda_kernels: bool
  cuda_archs: tuple[str, ...]
  cuda_version: str | None
  cuda_driver_version: str | None
  cublaslt_gemm: bool
  grouped_gemm: bool
  backend: str
  devices: tuple[str, ...]
  gpu_kernels_run: bool
  fp8_gemms: str
  notes: tuple[str, ...]

  def __str__(self) -> str:
    def yes(flag: bool) -> str:
      return "yes" if flag else "no"

    cuda = yes(self.cuda_kernels)
    if self.cuda_kernels:
      cuda += (
        f" ({', '.join(self.cuda_archs)}; CUDA {self.cuda_version}, driver "
        f"{self.cuda_driver_version or 'none'}; cuBLASLt GEMM {yes(self.cublaslt_gemm)}, "
        f"grouped GEMM {yes(self.grouped_gemm)})"
      )
    lines = [
      f"te_adapters {self.version}, jax {self.jax_version}",
      f"C++ kernels: {yes(self.cpu_kernels)}",
      f"CUDA kernels: {cuda}",
      f"devices: {self.backend}: {', '.join(self.devices) or 'none'}",
      f"CUDA kernels run here: {yes(self.gpu_kernels_run)}",
      f"FP8 GEMMs: {self.fp8_gemms}",
    ]
    lines += [f"note: {n}" for n in self.notes]
    return "\n".join(lines)


def _cuda_release(version: int) -> str:
  """CUDA's integer version (13000) as its release ("13.0")."""
  return f"{version // 1000}.{version % 1000 // 10}"


def _module(name: str):
  try:
    return importlib.import_module(name), None
  except ImportError as e:
    return None, str(e)


def build_info() -> BuildInfo:
  """What this install of te_adapters holds, and what of it runs on this machine's devices.

  Reads the installed extension modules and asks JAX for its devices (which starts JAX's backend).
  Nothing is registered or compiled.

  Returns:
    A ``BuildInfo``: the kernels installed (C++, CUDA and for which GPUs, the CUDA release they
    were built with), whether they run on this process's devices, and whether FP8 GEMMs are
    native here or emulated by XLA.

  Example:
    >>> import te_adapters as ta
    >>> info = ta.build_info()
    >>> info.version == ta.__version__
    True
    >>> info.fp8_gemms in ("native", "emulated")
    True
  """
  notes = []
  cpu, _ = _module("te_adapters._csrc_cpu")
  cuda, cuda_error = _module("te_adapters._csrc_cuda")
  raw = cuda.build_info() if cuda is not None and hasattr(cuda, "build_info") else {}
  archs = tuple(a for a in str(raw.get("archs", "")).split(",") if a)
  runtime = int(raw.get("cuda_runtime_version", 0))
  driver = int(raw.get("cuda_driver_version", 0))
  backend = jax.default_backend()
  devices = jax.local_devices()
  kinds = tuple(sorted({d.device_kind for d in devices}))
  capabilities = sorted({str(getattr(d, "compute_capability", "")) for d in devices})
  gpu_kernels_run = False
  if backend == "gpu":
    reason = gpu_kernels_unusable_reason()
    gpu_kernels_run = cuda is not None and reason is None
    if reason is not None:
      notes.append(reason)
    fp8_native = all(_capability(c) >= _FP8_GEMM_CAPABILITY for c in capabilities)
  else:
    fp8_native = False
    if cuda is not None:
      notes.append(f"the CUDA kernels are installed but JAX's backend is {backend!r}")
  if cuda is None and backend == "gpu":
    notes.append(f"no CUDA kernels in this install ({cuda_error}): casts run in pure JAX")
  return BuildInfo(
    version=__version__,
    jax_version=jax.__version__,
    cpu_kernels=cpu is not None,
    cuda_kernels=cuda is not None,
    cuda_archs=archs,
    cuda_version=_cuda_release(runtime) if runtime else None,
    cuda_driver_version=_cuda_release(driver) if driver else None,
    cublaslt_gemm=bool(raw.get("cublaslt_gemm", False)),
    grouped_gemm=bool(raw.get("grouped_gemm", False)),
    backend=backend,
    devices=kinds,
    gpu_kernels_run=gpu_kernels_run,
    fp8_gemms="native" if fp8_native else "emulated",
    notes=tuple(notes),
  )


def _capability(c: str) -> float:
  try:
    return float(c)
  except ValueError:
    return 0.0
