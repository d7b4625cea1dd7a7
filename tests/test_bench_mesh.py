"""bench/mesh2x2.py's dry run: seed 000's Dense on a 2x2 mesh of virtual CPU devices through
every adapter, each against the same program on one device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh2x2_dry_run_matches_one_device(tmp_path):
  out = tmp_path / "mesh.json"
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [
    sys.executable,
    os.path.join(ROOT, "bench", "mesh2x2.py"),
    "--cpu-devices",
    "4",
    "--batch",
    "4",
    "--seq",
    "32",
    "--hidden",
    "128",
    "--features",
    "256",
    "--iters",
    "1",
    "--trials",
    "1",
    "--warmup",
    "1",
    "--configs",
    "base,f",
    "--nccl",
    "ctas16",
    "--json",
    str(out),
  ]
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert {(r["framework"], r["variant"]) for r in rows} == {
    (f, v) for f in ("linen", "nnx", "haiku") for v in ("bf16", "current", "delayed")
  }
  # Each FP8 variant also with GemmConfig(fold_amax=True): the same numbers, one amax
  # all-reduce; the NCCL settings named are recorded, and each program's schedule.
  assert {r["config"] for r in rows if r["variant"] != "bf16"} == {"base", "f"}
  assert json.loads(out.read_text())["meta"]["nccl"] == {
    "name": "ctas16",
    "env": {"NCCL_MAX_CTAS": "16"},
  }
  assert all(r["schedule"] for r in rows), [r["schedule"] for r in rows]
  for r in rows:
    r = dict(
      r,
      what=f"{r['framework']} {r['variant']}: rel y {r['rel_y']}, dx {r['rel_dx']}, "
      f"dW {r['rel_dw']}, state {r['rel_state']}",
    )
    assert r["rel_y"] == 0.0, r["what"]
    if r["variant"] == "bf16":
      # dx and dW are sums over shards of partial products each rounded to bf16 (unit roundoff
      # 2**-9), whose cancellation can make the error relative to the sum several times larger
      # (dW 1.4e-2 seen with jax 0.11.2 on CPU). A wrong shard is O(1).
      assert r["rel_dx"] < 3e-2 and r["rel_dw"] < 3e-2, r["what"]
    else:
      # FP8: the same quantized operands and state. dx is a sum over the tp shards of partial
      # products, which jax 0.11.2 rounds to bf16 before the sum (3.1e-3 seen on CPU; float32
      # partials with jax 0.10.2, 1e-7). A wrong scale or shard would be O(1e-1) and up.
      assert r["rel_dx"] < 1e-2 and r["rel_dw"] < 1e-4, r["what"]
      assert r["rel_state"] in (None, 0.0), r["what"]
    assert np.isfinite(r["ms_1"]) and np.isfinite(r["ms_2x2"])


def test_mesh2x2_config_tokens_split_levers_from_compile_options():
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  try:
    import mesh2x2
  finally:
    sys.path.remove(os.path.join(ROOT, "bench"))
  one_shot_off = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False}
  assert mesh2x2.split_config("base") == ("base", {})
  assert mesh2x2.split_config("o") == ("base", one_shot_off)
  assert mesh2x2.split_config("m16c4fo") == ("m16c4f", one_shot_off)
  assert mesh2x2.parse_config("m16c4fo") == {
    "comm_sm_margin": 16,
    "sum_chunks": 4,
    "fold_amax": True,
  }
  assert mesh2x2.parse_config("o") == {}
  assert mesh2x2.parse_config("m8c2") == {"comm_sm_margin": 8, "sum_chunks": 2}
  assert mesh2x2.parse_config("sxp") == {"non_finite": "saturate", "device_sums": "exchange"}
  assert mesh2x2.split_config("xp") == (
    "x",
    {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"},
  )
  peer_sol = {
    "xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY",
    "xla_gpu_enable_analytical_sol_latency_estimator": True,
  }
  assert mesh2x2.split_config("c2xpa") == ("c2x", peer_sol)
  assert mesh2x2.options_letter("c2xpa") == "pa" and mesh2x2.options_letter("c2x") == "base"
  with pytest.raises(SystemExit, match="is not base or m<SMs>"):
    mesh2x2.parse_config("x16")


def test_spmd_configurations_pair_fp8_configs_with_bf16_options():
  """bench/spmd.py --configs: one device runs the defaults; each sharded plan runs FP8 with
  every config and bf16 once per distinct set of XLA options (a GemmConfig part is FP8's only);
  the XLA options and GemmConfig fields of a config are its parts'."""
  import argparse

  from bench import spmd

  args = argparse.Namespace(
    plans="single,dp,fsdp",
    variants="bf16,current,current+fp8_gather",
    configs="base,m16,no_one_shot,m16+no_one_shot",
  )
  got = list(spmd._configurations(args))
  fp8 = ["base", "m16", "no_one_shot", "m16+no_one_shot"]
  want = [("single", v, "base") for v in ("bf16", "current")]  # fp8_gather: FSDP only
  for plan in ("dp", "fsdp"):
    want += [(plan, "bf16", "base"), (plan, "bf16", "no_one_shot")]
    want += [(plan, "current", c) for c in fp8]
    if plan == "fsdp":
      want += [(plan, "current+fp8_gather", c) for c in fp8]
  assert got == want
  fields, options = spmd.config_parts("m16+no_one_shot")
  assert fields == {"comm_sm_margin": 16}
  assert options == {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False}
  assert spmd.config_parts("exchange+peer") == (
    {"device_sums": "exchange"},
    {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"},
  )
  with pytest.raises(SystemExit, match="unknown 'fast'"):
    spmd.config_parts("base+fast")
