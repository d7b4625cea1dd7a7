"""A check of the CUDA sources that needs no GPU: host code never calls a ``__device__``-only
function.

nvcc compiles such a call without an error or a warning when it sits in a generic lambda passed
to a template (the FFI handlers' dtype dispatch), and the program then fails at run time: that
is how the first 16-byte-load version of ``act_cast_cuda.cu`` crashed its tests on the H100
(its handlers called ``aligned16``, then device-only, to choose the vector path)."""

import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
# Empty where the tests run from a copy without the sources (the pure-JAX install test's).
SOURCES = (
  sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cc"))
  if CSRC.is_dir()
  else []
)
# A function declared __device__ (or __global__) but not __host__: the name before its "(" (and
# before the template arguments of a specialization).
_DEVICE_DECL = re.compile(
  r"\b__(device|global)__\b(?P<rest>[^;{]*?)\b(?P<name>\w+)\s*(<[^;{()]*>)?\s*\("
)


def _strip_comments(text: str) -> str:
  text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
  return re.sub(r"//[^\n]*", " ", text)


def _split(text: str):
  """(device-only function names, the text with every device and global function cut out)."""
  names, host, pos = set(), [], 0
  for m in _DEVICE_DECL.finditer(text):
    if m.start() < pos:
      continue  # inside a body already cut
    line_start = text.rfind("\n", 0, m.start()) + 1
    if "__host__" in text[line_start : m.end()]:
      continue
    if m.group(1) == "device":
      names.add(m.group("name"))
    end = _end_of_definition(text, m.end())
    host.append(text[pos : m.start()])
    pos = end
  host.append(text[pos:])
  return names, "".join(host)


def _end_of_definition(text: str, start: int) -> int:
  """The index after the body (or the ';' of a declaration) that follows ``start``."""
  brace, semi = text.find("{", start), text.find(";", start)
  if brace < 0 or (0 <= semi < brace):
    return semi + 1
  depth = 0
  for i in range(brace, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise AssertionError("unbalanced braces")


def device_only_calls_from_host(texts: dict[str, str]) -> list[str]:
  """'file: name' for each call of a device-only function in host code of the given sources."""
  stripped = {f: _strip_comments(t) for f, t in texts.items()}
  device_only, host = set(), {}
  for f, t in stripped.items():
    names, host[f] = _split(t)
    device_only |= names
  return sorted(
    f"{f}: {name}"
    for f, h in host.items()
    for name in device_only
    if re.search(rf"(?<![\w.])(?<!->){re.escape(name)}\s*(<[^;()]*>)?\s*\(", h)
  )


def test_the_check_finds_a_device_only_call_in_a_handler():
  # The shape of the bug: a device-only helper called from a handler's dispatch lambda.
  bad = """
  __device__ __forceinline__ bool aligned16(const void* p) { return true; }
  template <typename In> __global__ void kernel(const In* p, bool a) { aligned16(p); }
  ffi::Error Impl(cudaStream_t s, const void* h) {
    return dispatch(t, [&](auto in) {
      const bool aligned = aligned16(h);
      kernel<float><<<1, 1, 0, s>>>(nullptr, aligned);
      return ffi::Error::Success();
    });
  }
  """
  assert device_only_calls_from_host({"bad.cu": bad}) == ["bad.cu: aligned16"]
  fixed = bad.replace("__device__ __forceinline__ bool", "__host__ __device__ bool")
  assert device_only_calls_from_host({"fixed.cu": fixed}) == []


@pytest.mark.skipif(not SOURCES, reason="no csrc/ in this checkout")
def test_host_code_calls_no_device_only_function():
  texts = {p.name: p.read_text() for p in SOURCES}
  assert any("__device__" in t for t in texts.values())
  assert device_only_calls_from_host(texts) == []
