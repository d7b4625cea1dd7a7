#!/usr/bin/env bash
# Runs the test suite on a GPU machine against an installed wheel, not the source tree: the wheel
# goes into a fresh venv with no CUDA compiler on the PATH, and the tests run from a copy of the
# repository that holds no te_adapters package, so every import of it is the wheel's.
#
#   tools/gpu_wheel_suite.sh WHEEL OUTDIR [pytest args...]
#
# Without pytest args it runs tests/ and the doctests of the installed package (the whole suite);
# args replace those paths (`... tests/core/test_block_gpu.py -x` runs one file).
# The venv sees the machine's own packages (JAX with its CUDA plugin, Flax, pip...) through a .pth
# file listing the interpreter's site-packages (`venv --system-site-packages` reaches only the
# base interpreter's, and the machine's python3 may itself be a venv). Wheels of packages the
# machine lacks may lie in .whl/ at the repository root; they are installed into a private
# folder first. WORKERS sets the number of pytest-xdist processes (default 4). Before the tests,
# `te_adapters.build_info()` must report the CUDA kernels built and running on this GPU. Left out:
# the tests that read or build the source tree (the package's import graph, its custom-VJP and
# dependency scans, the pure-JAX source install, and `python -m te_adapters bench`, which runs a
# checkout's benchmark); CI runs them. The log, the JUnit XML and the summary line go to OUTDIR.
set -uo pipefail
whl="$(realpath "${1:?usage: tools/gpu_wheel_suite.sh WHEEL OUTDIR [pytest args...]}")"
out="${2:?usage: tools/gpu_wheel_suite.sh WHEEL OUTDIR [pytest args...]}"
shift 2
mkdir -p "$out"
out="$(realpath "$out")"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$(command -v "${PYTHON:-python3}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# No CUDA compiler: the kernels must come from the wheel. Every PATH entry holding nvcc goes.
kept=()
IFS=: read -r -a entries <<<"$PATH"
for dir in "${entries[@]}"; do [ -x "$dir/nvcc" ] || kept+=("$dir"); done
PATH="$(IFS=:; echo "${kept[*]}")"
export PATH
if command -v nvcc >/dev/null; then echo "nvcc is still on the PATH: $(command -v nvcc)" >&2; exit 1; fi

if compgen -G "$root/.whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/extra" "$root"/.whl/*.whl || exit 1
  export PYTHONPATH="$work/extra${PYTHONPATH:+:$PYTHONPATH}"
fi

# --without-pip: the machine's pip (reached through the .pth) installs into the venv, and a base
# interpreter without ensurepip can still make one.
"$python" -m venv --without-pip "$work/venv" || exit 1
venv_python="$work/venv/bin/python"
site="$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$python" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/machine-packages.pth"
"$venv_python" -m pip install -q --no-index --no-deps --no-cache-dir "$whl" > "$out/install.log" 2>&1 \
  || { tail -20 "$out/install.log"; exit 1; }

# A copy of the repository without the package: tests, bench, examples, docs and the files the
# tests read.
mkdir "$work/run"
for item in tests bench examples docs csrc tools pyproject.toml README.md CHANGELOG.md LICENSE; do
  [ -e "$root/$item" ] && cp -r "$root/$item" "$work/run/"
done
cd "$work/run" || exit 1

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
"$venv_python" - "$site" <<'PY' 2>&1 | tee -a "$out/device.txt"
import os, sys
import jax
import te_adapters as ta
site = os.path.realpath(sys.argv[1])
where = os.path.realpath(ta.__file__)
info = ta.build_info()
print(f"te_adapters {ta.__version__} from {where}")
print(info)
assert where.startswith(site + os.sep), f"te_adapters imported from {where}, not the venv"
assert info.cuda_kernels and info.gpu_kernels_run, "the wheel's CUDA kernels do not run here"
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

args=("$@")
[ "${#args[@]}" -gt 0 ] || args=(tests "$site/te_adapters")
# shellcheck source=suite_pytest.sh
. "$root/tools/suite_pytest.sh"
run_suite "$venv_python" "$out" "${WORKERS:-4}" \
  --ignore=tests/test_import_graph.py --ignore=tests/test_custom_rules.py \
  --ignore=tests/test_packaging.py --ignore=tests/csrc/test_pure_jax_install.py \
  --deselect=tests/test_bench.py::test_te_adapters_bench_points_to_the_checkouts_benchmark \
  "${args[@]}"
