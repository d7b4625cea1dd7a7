"""bench/p2p_overlap.py on 2 virtual CPU devices, tiny sizes: every program of every config
compiles and runs, and both ways of summing over the devices give each device the same sum."""

import json

import jax
import numpy as np
import pytest

from bench import p2p_overlap

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")


def test_p2p_overlap_dry_run(tmp_path):
  out = tmp_path / "p2p.json"
  tiny = "--m 64 --k 64 --n 64 --rows 16 --cols 32 --iters 1 --rounds 1"
  p2p_overlap.main([*tiny.split(), "--json", str(out)])
  rows = {r["program"]: r for r in json.loads(out.read_text())["rows"]}
  sums = ("psum", "swap", "gemm+psum", "gemm+swap")
  want = {"gemm/default"} | {f"{p}/{c}" for p in sums for c in p2p_overlap.CONFIGS}
  assert set(rows) == want
  assert all(np.isfinite(r["ms"]) and r["ms"] > 0 for r in rows.values())
  for name in want - {"gemm/default"}:
    r = rows[name]
    # The two devices' bf16 partials added once and rounded to bf16: within half a bf16 ulp of
    # the float32 sum (|sum| < 8 for these normal samples, where an ulp is at most 2**-5),
    # bounded here by two ulps; a sum left out is off by O(1).
    assert r["replicas_equal"] and r["max_abs_err"] <= 2**-4, (name, r)
    kind = "collective_permute" if "swap" in name else "all_reduce"
    assert r[kind] == 1, (name, r)
