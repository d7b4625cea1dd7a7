"""Starts one JAX process per GPU (or per CPU device) on this host, as a multi-host job runs.

  python -m bench.multiprocess --processes 2 -- -m bench.multiprocess_check --out OUT
  python -m bench.multiprocess --processes 2 --platform cpu -- path/to/script.py ARGS

Everything after ``--`` is what ``python`` would take: ``-m module args`` or ``script.py args``.
Each process calls ``jax.distributed.initialize(coordinator_address=..., num_processes=N,
process_id=i, ...)`` before the target runs, so the target sees ``jax.process_count() == N``
and a global ``jax.devices()``:

  gpu  process i owns GPU i (``local_device_ids=[i]``): N processes x one GPU.
  cpu  one CPU device per process (``--xla_force_host_platform_device_count`` is taken out of
       ``XLA_FLAGS``), collectives through gloo (``jax_cpu_collectives_implementation``).

``--platform auto`` (the default) takes the GPUs when ``nvidia-smi -L`` lists at least N, else the
CPU. A process whose target fails (an exception, a non-zero exit) exits at once, without
waiting in jax.distributed's shutdown barrier. Each process's output is echoed line by line,
prefixed ``[i]``, and kept in ``--log-dir`` if given. The launcher exits 0 only if every
process exits 0 within ``--timeout`` seconds. When one fails, the others get ``--grace`` seconds
to finish (a peer left waiting in a collective would hang) and are then killed; the summary
names each process's exit code, or ``timeout``.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

ENV_COORDINATOR = "TE_ADAPTERS_COORDINATOR"
ENV_PROCESSES = "TE_ADAPTERS_NUM_PROCESSES"
ENV_PROCESS_ID = "TE_ADAPTERS_PROCESS_ID"
ENV_PLATFORM = "TE_ADAPTERS_PLATFORM"
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _parse(argv):
  if "--" not in argv:
    raise SystemExit("usage: python -m bench.multiprocess [options] -- (-m module | script) ARGS")
  cut = argv.index("--")
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
  p.add_argument(
    "--grace", type=float, default=20.0, help="seconds the others get after one process fails"
  )
  p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  p.add_argument("--log-dir", default=None, help="write process i's output to DIR/process_i.log")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv[:cut])
  target = argv[cut + 1 :]
  if not target or (target[0] == "-m" and len(target) < 2):
    p.error("nothing to run after --")
  return args, target


def _gpu_count() -> int:
  if not shutil.which("nvidia-smi"):
    return 0
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return 0
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, platform: str, coordinator: str, processes: int, i: int) -> dict:
  """The environment of process ``i``."""
  env = dict(base)
  env.update(
    {
      ENV_COORDINATOR: coordinator,
      ENV_PROCESSES: str(processes),
      ENV_PROCESS_ID: str(i),
      ENV_PLATFORM: platform,
      "PYTHONUNBUFFERED": "1",
    }
  )
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
  return env


def _pump(i, stream, sink, lock):
  for line in iter(stream.readline, ""):
    with lock:
      sys.stdout.write(f"[{i}] {line}")
      sys.stdout.flush()
    if sink:
      sink.write(line)
      sink.flush()


def _kill(proc):
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own process group
    except ProcessLookupError:
      pass


def launch(
  target, processes, platform="auto", timeout=600.0, grace=20.0, port=0, log_dir=None
) -> list:
  """Runs ``target`` (argv after ``python``) in ``processes`` processes; returns each one's exit
  code, or ``None`` for a process killed at the deadline."""
  if platform == "auto":
    platform = "gpu" if _gpu_count() >= processes else "cpu"
  coordinator = f"127.0.0.1:{port or _free_port()}"
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  lock = threading.Lock()
  procs, pumps, sinks = [], [], []
  print(
    f"launching {processes} processes on {platform}, coordinator {coordinator}: {' '.join(target)}",
    flush=True,
  )
  for i in range(processes):
    sink = open(os.path.join(log_dir, f"process_{i}.log"), "w") if log_dir else None
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--", *target]
    proc = subprocess.Popen(
      cmd,
      env=child_env(os.environ, platform, coordinator, processes, i),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    pump = threading.Thread(target=_pump, args=(i, proc.stdout, sink, lock), daemon=True)
    pump.start()
    procs.append(proc)
    pumps.append(pump)
    sinks.append(sink)
  deadline = time.monotonic() + timeout
  codes: list = [None] * processes
  try:
    while any(c is None for c in codes):
      for i, proc in enumerate(procs):
        if codes[i] is None and proc.poll() is not None:
          codes[i] = proc.returncode
          if codes[i] != 0:
            deadline = min(deadline, time.monotonic() + grace)
      if time.monotonic() > deadline:
        break
      time.sleep(0.1)
  finally:
    for proc in procs:
      _kill(proc)
    for proc, pump, sink in zip(procs, pumps, sinks, strict=True):
      proc.wait()
      pump.join(timeout=5)
      if sink:
        sink.close()
  return codes


def _worker(target):
  """In process i: ``jax.distributed.initialize``, then the target as ``python`` would run it."""
  platform = os.environ[ENV_PLATFORM]
  i = int(os.environ[ENV_PROCESS_ID])
  import jax

  kwargs = {}
  if platform == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  else:
    kwargs["local_device_ids"] = [i]
  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_PROCESSES]),
    process_id=i,
    **kwargs,
  )
  # A process whose target fails exits at once: at a normal exit jax.distributed waits in a
  # shutdown barrier for every other process, which may never come.
  try:
    if target[0] == "-m":
      sys.argv = [target[1], *target[2:]]
      sys.path[0] = os.getcwd()
      runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = list(target)
      sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
      runpy.run_path(target[0], run_name="__main__")
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if code:
      if not isinstance(e.code, int):
        print(e.code, file=sys.stderr)
      _exit_now(code)
  except BaseException:
    traceback.print_exc()
    _exit_now(1)


def _exit_now(code):
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv=None) -> int:
  args, target = _parse(sys.argv[1:] if argv is None else argv)
  if args.worker:
    _worker(target)
    return 0
  start = time.monotonic()
  codes = launch(
    target, args.processes, args.platform, args.timeout, args.grace, args.port, args.log_dir
  )
  took = time.monotonic() - start
  summary = ", ".join(
    f"process {i}: {'timeout' if c is None else f'exit {c}'}" for i, c in enumerate(codes)
  )
  if all(c == 0 for c in codes):
    print(f"all {len(codes)} processes succeeded in {took:.1f} s", flush=True)
    return 0
  print(f"FAILED after {took:.1f} s: {summary}", file=sys.stderr, flush=True)
  return 1


if __name__ == "__main__":
  sys.exit(main())
