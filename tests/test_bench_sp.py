"""bench/sp_layer.py on 2 virtual CPU devices, tiny sizes: every configuration compiles and is
timed in interleaved rounds, the sequence-parallel plans move FP8 bytes, and the tensor- and
sequence-parallel layer computes the one-device layer's output."""

import argparse

import jax
import numpy as np
import pytest

from bench import sp_layer
from te_adapters import inspect

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

ARGS = dict(
  devices=2,
  plans="single,tp_sp,tp_ring",
  variants="bf16,current,current+fp8,current+fp8+x+peer",
  batch=2,
  seq=32,
  hidden=64,
  ffn=128,
  heads=4,
  iters=1,
  pipelined=True,
  warmup=0,
  repeats=2,
)


def test_sp_layer_bench_dry_run(tmp_path):
  configs = sp_layer.run(argparse.Namespace(**ARGS, hlo_out=str(tmp_path)))
  by = {(c["plan"], c["variant"]): c for c in configs}
  variants = ARGS["variants"].split(",")
  assert set(by) == {(p, v) for p in ARGS["plans"].split(",") for v in variants}
  assert all(len(c["times"]) == 2 and all(np.isfinite(c["times"])) for c in configs)
  # The default gathers the layer's bf16 rows (XLA:CPU widens them to f32), "+fp8" FP8 bytes.
  assert "u8" not in by[("tp_sp", "current")]["collectives"]
  assert "all-gather u8" in by[("tp_sp", "current+fp8")]["collectives"]
  assert "collective-permute u8" in by[("tp_ring", "current")]["collectives"]
  assert "u8" not in by[("tp_sp", "bf16")]["collectives"]
  # "+x": the FP8 rows and the partial sums move by exchanges, no all-gather or reduce-scatter;
  # "+peer" is a compile option (collective permutes as peer copies on GPUs).
  exchanged = by[("tp_sp", "current+fp8+x+peer")]["collectives"]
  assert "collective-permute u8" in exchanged, exchanged
  assert "all-gather" not in exchanged and "reduce-scatter" not in exchanged, exchanged
  assert sp_layer._compile_options("current+fp8+x+peer") == sp_layer.PEER
  assert sp_layer._compile_options("current+fp8") is None
  table = sp_layer.format_tables(configs)
  assert "tp_ring" in table and "vs bf16" in table
  # The extension's casts and FP8 GEMMs: none in bf16's programs, and on CPU none at all (the
  # casts are the pure-JAX ones, the GEMMs XLA's); on a GPU FP8's programs run them.
  assert "casts/GEMMs" in table
  assert all(c["ext"] == "0/0" for c in configs if c["variant"] == "bf16")
  if jax.default_backend() == "cpu":
    assert all(c["ext"] == "0/0" for c in configs)
  # --hlo-out: each configuration's compiled program, where a trace's fusion names are defined.
  text = (tmp_path / "tp_sp_current.hlo.txt").read_text()
  assert "all-gather" in text and "fusion" in text
  assert len(list(tmp_path.glob("*.hlo.txt"))) == len(configs)


def test_extension_calls_tell_the_extensions_kernels_from_xlas():
  """Lines of a GPU program (seed 001's layer under delayed scaling): the extension's cast of the
  qkv kernel and its FP8 GEMM, then XLA's FP8 GEMM, which ``count_fp8_gemms`` counts as FP8 too;
  only the first two are the extension's."""
  text = "\n".join(
    [
      "%ffi_call.193 = (f8e4m3fn[4096,6144]{1,0}, f8e4m3fn[6144,4096]{1,0}, f32[1]{0}) custom-call"
      '(%wrapped_convert, %param.194), custom_call_target="te_adapters_cast_transpose"',
      "%ffi_call.194 = (bf16[8192,6144]{1,0}, u8[33554432]{0}) custom-call(%a, %b, %c, %d), "
      'custom_call_target="te_adapters_block_gemm"',
      "%cublas-lt-matmul.1 = (bf16[8192,6144]{1,0}, s8[33554432]{0}) custom-call(%a, %b, %c, "
      '%d), custom_call_target="__cublas$lt$matmul$f8"',
    ]
  )
  assert sp_layer.extension_calls(text) == (1, 1)
  assert inspect.count_fp8_gemms(text)[0] == 2


@pytest.mark.parametrize("plan", ["tp_ring"])
@pytest.mark.parametrize("variant", ["bf16", "current"])
def test_sequence_parallel_layer_matches_one_device(plan, variant):
  """The layer's output and gradients against one device's, normwise. bf16: the row-parallel
  partial sums and the gradients' sums over the devices are rounded to bf16 in another order
  (0.3-0.8% seen on CPU). FP8: those bf16-level differences move the elements near an FP8
  rounding boundary by one FP8 step (2**-3 relative), through the layer's four GEMMs (output
  1.2%, gradients 1-7% seen on CPU). A missing shard or a wrong gather is off by O(1)."""
  s, b, h, f, heads = 32, 2, 64, 128, 4
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (s, b, h)).astype("bfloat16")
  dy = jax.random.normal(keys[1], (s, b, h)).astype("bfloat16")
  params = sp_layer.init_params(keys[2], h, f)
  states = (None,) * 4
  want = sp_layer.make_step(variant, "single", None, heads, "xla")(x, params, states, dy)
  mesh = jax.make_mesh(
    (2,), ("tp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
  )
  with jax.set_mesh(mesh):
    got = sp_layer.make_step(variant, plan, mesh, heads, "xla")(x, params, states, dy)
  y_bound, grad_bound = (1e-2, 1e-2) if variant == "bf16" else (3e-2, 0.15)
  for i, (a, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    rel = np.linalg.norm(a - w) / np.linalg.norm(w)
    assert rel < (y_bound if i == 0 else grad_bound), (i, rel)


def test_overlap_measures_nccl_time_beside_gemms():
  """``sp_layer.overlap`` from kernel spans (us) of two traced steps: GPU 0's NCCL kernels run
  0-10 (beside the GEMM 5-20 for 5 us) and 30-40 (alone); GPU 1's two NCCL kernels lie inside
  its GEMMs. Per step: GEMM time, NCCL time and the NCCL time beside a GEMM."""
  spans = {
    "gpu0": {"gemm": [(5.0, 20.0), (18.0, 25.0)], "nccl": [(0.0, 10.0), (30.0, 40.0)]},
    "gpu1": {"gemm": [(0.0, 100.0)], "nccl": [(10.0, 20.0), (15.0, 30.0)]},
  }
  got = sp_layer.overlap(spans, steps=2)
  ms = lambda us: us / 2 / 1e3  # noqa: E731
  np.testing.assert_allclose(
    [got["gpu0"][k] for k in ("gemm_ms", "nccl_ms", "nccl_beside_gemm_ms")],
    [ms(20.0), ms(20.0), ms(5.0)],
  )
  np.testing.assert_allclose(
    [got["gpu1"][k] for k in ("gemm_ms", "nccl_ms", "nccl_beside_gemm_ms")],
    [ms(100.0), ms(20.0), ms(20.0)],
  )
  assert got["gpu0"]["nccl_kernels"] == 1.0


def test_between_gemms_names_the_kernels_that_are_neither_gemms_nor_nccl():
  """``sp_layer.between_gemms`` from Chrome-trace events of one traced step on GPU 0: a GEMM
  (0-10 us), an NCCL all-gather (10-20), a transpose fusion (20-30), nothing (30-35) and a
  convert (35-40). The span, the idle time and the two kernels between the GEMMs, by time."""

  def kernel(name, start, end):
    return dict(ph="X", pid=1, tid=7, name=name, ts=start, dur=end - start)

  events = [
    dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
    dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="stream 7")),
    kernel("sm90_xmma_gemm_e4m3", 0.0, 10.0),
    kernel("ncclDevKernel_AllGather_RING_LL", 10.0, 20.0),
    kernel("loop_transpose_fusion", 20.0, 30.0),
    kernel("loop_convert_fusion", 35.0, 40.0),
  ]
  (got,) = sp_layer.between_gemms(events, steps=1).values()
  np.testing.assert_allclose([got["span_ms"], got["idle_ms"]], [0.040, 0.005])
  assert [name for name, _ in got["others"]] == ["loop_transpose_fusion", "loop_convert_fusion"]
  np.testing.assert_allclose([ms for _, ms in got["others"]], [0.010, 0.005])
  np.testing.assert_allclose(got["by_kind_ms"]["gemm"], 0.010)


def test_after_gathers_names_what_runs_between_a_gather_and_the_next_gemm():
  """``sp_layer.after_gathers`` from one traced step on GPU 0: an all-gather (0-10 us), a
  transpose (12-20, its HLO op named), nothing (20-25), a convert (25-30) and the GEMM (30-40);
  a second all-gather (40-45) followed at once by a GEMM (46-50). Per gather: the gap to the
  next GEMM, its idle part and the kernels in it, in order."""

  def kernel(name, start, end, **args):
    return dict(ph="X", pid=1, tid=7, name=name, ts=start, dur=end - start, args=args)

  events = [
    dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
    kernel("ncclDevKernel_AllGather_RING_LL", 0.0, 10.0),
    kernel("input_transpose_fusion", 12.0, 20.0, hlo_op="transpose.3"),
    kernel("loop_convert_fusion", 25.0, 30.0),
    kernel("nvjet_sm90_qqtst_128x128", 30.0, 40.0),
    kernel("ncclDevKernel_AllGather_RING_LL", 40.0, 45.0),
    kernel("nvjet_sm90_qqtst_64x128", 46.0, 50.0),
  ]
  (got,) = sp_layer.after_gathers(events, steps=1).values()
  assert [(r["gap_us"], r["idle_us"]) for r in got] == [(20.0, 7.0), (1.0, 1.0)]
  assert got[0]["kernels"] == [
    ("input_transpose_fusion", 8.0, "transpose.3"),
    ("loop_convert_fusion", 5.0, ""),
  ]
  assert got[0]["gemm"] == "nvjet_sm90_qqtst_128x128" and got[1]["kernels"] == []


def test_sp_ab_times_two_trees_in_interleaved_rounds(tmp_path):
  """``bench/sp_ab.py`` on 2 virtual CPU devices, tiny sizes: two worker processes (this tree
  twice, under two labels) each compile their configuration, the parent times both in every
  round and writes each row's times, GEMM counts and collectives."""
  import json
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "ab.json"
  tiny = "--batch 2 --seq 32 --hidden 64 --ffn 128 --heads 4 --iters 1 --warmup 0 --repeats 2"
  cmd = [sys.executable, os.path.join(root, "bench", "sp_ab.py"), "--cpu-devices", "2"]
  cmd += tiny.split() + ["--json", str(out)]
  cmd += ["--tree", f"a={root};tp_sp;current+fp8", "--tree", f"b={root};single;bf16"]
  subprocess.run(cmd, check=True, cwd=root, capture_output=True, timeout=300)
  rows = json.loads(out.read_text())
  assert [(r["tree"], r["plan"], r["variant"]) for r in rows] == [
    ("a", "tp_sp", "current+fp8"),
    ("b", "single", "bf16"),
  ]
  assert all(len(r["times"]) == 2 and r["median_ms"] > 0 for r in rows)
  assert "all-gather u8" in rows[0]["coll"] and rows[1]["coll"] == "-"
