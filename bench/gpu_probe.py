"""Which GEMM shapes get cuBLASLt FP8 GEMMs on this GPU (counts per fwd+bwd step; 3 = all)."""

import os
import sys

import jax
import jax.numpy as jnp

import te_adapters as ta
from te_adapters import core, inspect

DN = (((1,), (0,)), ((), ()))
recipe = ta.Float8CurrentScaling()
out_dir = sys.argv[1] if len(sys.argv) > 1 else None
print(f"{'M':>6}{'K':>6}{'N':>6}  cuBLASLt-f8  FP8/other GEMMs  fused dot operand types")
for m, k, n in [
  (256, 512, 384),
  (8, 512, 384),
  (24, 512, 384),
  (256, 40, 384),
  (256, 512, 40),
  (256, 512, 24),
  (100, 200, 300),
  (4096, 4096, 4096),
]:
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  f = jax.jit(
    jax.value_and_grad(
      lambda x, w: jnp.sum(
        core.dot_general(x, w, DN, recipe=recipe, threshold=None).astype(jnp.float32)
      ),
      argnums=(0, 1),
    )
  )
  hlo = f.lower(x, w).compile().as_text()
  fp8, other = inspect.count_fp8_gemms(hlo)
  print(
    f"{m:>6}{k:>6}{n:>6}  {inspect.count_fp8_cublas_gemms(hlo):>11}  {fp8:>7}/{other:<7}  "
    f"{inspect.hlo_dot_operand_types(hlo)}"
  )
  if out_dir and m == 256 and k == 512 and n == 384:
    with open(os.path.join(out_dir, f"hlo_{m}x{k}x{n}.txt"), "w") as f:
      f.write(hlo)
