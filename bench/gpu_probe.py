"""Which GEMM shapes get cuBLASLt FP8 GEMMs on this GPU (counts per fwd+bwd step; 3 = all)."""

import jax
import jax.numpy as jnp

import te_adapters as ta
from te_adapters import core

DN = (((1,), (0,)), ((), ()))
recipe = ta.Float8CurrentScaling()
print(f"{'M':>6}{'K':>6}{'N':>6}  cuBLASLt FP8 GEMMs  other GEMM calls")
for m, k, n in [(256, 512, 384), (8, 512, 384), (24, 512, 384), (256, 40, 384), (256, 512, 40),
                (256, 512, 24), (100, 200, 300), (4096, 4096, 4096)]:
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  f = jax.jit(jax.grad(lambda x, w: jnp.sum(core.dot_general(x, w, DN, recipe=recipe)
                                            .astype(jnp.float32)), argnums=(0, 1)))
  hlo = f.lower(x, w).compile().as_text()
  others = hlo.count('custom_call_target="__cublas$lt$matmul"') + hlo.count(
      'custom_call_target="__cublas$gemm"')
  print(f"{m:>6}{k:>6}{n:>6}  {core.count_fp8_cublas_gemms(hlo):>18}  {others:>16}")
