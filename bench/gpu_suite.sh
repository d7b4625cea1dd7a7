#!/usr/bin/env bash
# Builds the package with its CUDA extension on a GPU machine and runs the whole test suite there.
#
#   bash bench/gpu_suite.sh OUTDIR [pytest args...]
#
# Wheels of packages the machine lacks (dm-haiku, qwix, ...) may lie in .whl/ at the repository
# root; they are installed into a private folder first. The log, the JUnit XML and the summary line
# go to OUTDIR. pytest-xdist, where present, runs the tests in 4 processes (`-n 16` after OUTDIR
# for more; the suite takes about 7 minutes in one process on 16 cores); SUITE_TIMEOUT as in
# tools/suite_pytest.sh. The build is kept
# in build/gpu, so that a second call on the same machine rebuilds only what changed.
set -uo pipefail
out=${1:?usage: bench/gpu_suite.sh OUTDIR [pytest args...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . -C build-dir=build/gpu >"$out/install.log" 2>&1 \
  || { tail -40 "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  | tee -a "$out/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$out/device.txt"
# shellcheck source=../tools/suite_pytest.sh
. tools/suite_pytest.sh
run_suite python3 "$out" 4 "$@"
