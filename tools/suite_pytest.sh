# Sourced by bench/gpu_suite.sh and tools/gpu_wheel_suite.sh: their one pytest run.
#
#   run_suite PYTHON OUTDIR WORKERS [pytest args...]
#
# pytest-xdist, where PYTHON has it, runs the tests in WORKERS processes (--dist loadfile) that
# allocate GPU memory as they go. Each outcome is logged as it happens (-v) to OUTDIR/pytest.log,
# beside the JUnit XML; the failures' names and the summary line are printed, the summary also to
# OUTDIR/summary.txt. SUITE_TIMEOUT (seconds) interrupts pytest then, and it still writes its
# summary, the JUnit XML and the names of the tests that failed so far. Returns pytest's status.
run_suite() {
  local python="$1" out="$2" workers="$3"
  shift 3
  local parallel=() limit=() rc
  if "$python" -c "import xdist" 2>/dev/null; then
    parallel=(-n "$workers" --dist loadfile --max-worker-restart "${MAX_WORKER_RESTART:-4}")
  fi
  [ -n "${SUITE_TIMEOUT:-}" ] && limit=(timeout -s INT -k 30 "$SUITE_TIMEOUT")
  XLA_PYTHON_CLIENT_PREALLOCATE=false "${limit[@]}" "$python" -m pytest "${parallel[@]}" -v -rfEx \
    -p no:cacheprovider --junitxml="$out/junit.xml" "$@" >"$out/pytest.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR|XPASS)|\] (FAILED|ERROR|XPASS) " "$out/pytest.log" | cut -c1-300 | sort -u
  tail -1 "$out/pytest.log" | tee "$out/summary.txt"
  return $rc
}
