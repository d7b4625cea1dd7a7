"""Qwix quantized-training (QAT) variants for the benchmark, when ``import qwix`` works.

Each variant is the plain bf16 model (``make_model(lambda: None)``) rewritten by
``qwix.quantize_model(model, qwix.QtProvider([qwix.QtRule(...)]))``. Qwix then intercepts the
model's ``jax.lax.dot_general`` calls (the Dense layers; the rule is limited to the op
``dot_general``, so attention's ``jnp.einsum`` stays in bf16, as in our own recipes) and runs
them through its custom-VJP quantized dot_general. Scaling is per-tensor
(``disable_channelwise_axes=True``): one dynamic absmax scale per operand per step, kept in
the operand's dtype (bf16 for a bf16 Dense, float32 for a float32 one), like a current-scaling
recipe.

* ``qwix fp8 (fwd GEMM only)``: ``act_qtype = weight_qtype = float8_e4m3fn``. The forward GEMM
  is e4m3 x e4m3; the backward GEMMs (dgrad, wgrad) take the unquantized bf16 incoming
  gradient and the original bf16 residuals, so they run in bf16.
* ``qwix fp8 (fwd+dgrad+wgrad GEMMs)``: the same plus ``bwd_qtype = float8_e5m2``. The
  incoming gradient is quantized to e5m2 and the backward GEMMs reuse the forward pass's e4m3
  operands: dgrad is e5m2 dy x e4m3 w, wgrad is e5m2 dy x e4m3 x.

Qwix passes the float8 arrays themselves to ``jax.lax.dot_general`` (with
``preferred_element_type`` the operands' dtype, bf16 here) and multiplies the result by the
scales afterwards; it does not dequantize before the GEMM. Whether XLA then emits a cuBLASLt
FP8 GEMM is up to XLA.

The returned models are Linen modules, used like the bf16 one: with these rules (dynamic
scales) Qwix adds no variable collections, so ``apply(variables, x)`` returns the output array.
"""

from __future__ import annotations

import jax.numpy as jnp

_FWD_ONLY = "qwix fp8 (fwd GEMM only)"
_FWD_BWD = "qwix fp8 (fwd+dgrad+wgrad GEMMs)"


def qt_rule(qwix, bwd_qtype, module_path: str = ".*"):
  """Qwix's per-tensor FP8 rule for the ``dot_general`` of the modules ``module_path`` matches
  (``re.fullmatch`` on Qwix's ``/``-joined module path): e4m3 operands forward, and with
  ``bwd_qtype`` the incoming gradient quantized to it backward."""
  return qwix.QtRule(
    module_path=module_path,
    op_names=("dot_general",),
    weight_qtype=jnp.float8_e4m3fn,
    act_qtype=jnp.float8_e4m3fn,
    bwd_qtype=bwd_qtype,
    disable_channelwise_axes=True,
  )


def qwix_variants(make_model) -> list[tuple[str, object]]:
  """(name, model) pairs of Qwix FP8 quantized training; [] when Qwix does not import.

  ``make_model(dot_general_cls)`` builds the Linen module (its bf16 form is quantized).
  """
  try:
    import qwix
  except Exception:  # not installed, or an incompatible jax/flax
    return []
  out = []
  for name, bwd_qtype in ((_FWD_ONLY, None), (_FWD_BWD, jnp.float8_e5m2)):
    provider = qwix.QtProvider([qt_rule(qwix, bwd_qtype)])
    out.append((name, qwix.quantize_model(make_model(lambda: None), provider)))
  return out
