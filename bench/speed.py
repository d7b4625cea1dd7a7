"""``python -m bench`` (from a source checkout): fwd+bwd step times of quantized GEMMs against
bf16 and peers (Flax's fp8 op, and Qwix's FP8 quantized training when Qwix imports).

Every variant runs ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` with
``loss(variables, x) = sum(f32(y) * f32(dy))`` for a fixed output gradient ``dy`` (TE's
speedometer loss), on the same inputs; times are medians over repeats of several steps, each
repeat ended by ``block_until_ready``. For each variant the compiled HLO's cuBLASLt FP8 GEMMs are
counted (GPU only).

Every FP8 variant forces FP8 (``threshold=None``); the GEMM sweep adds variants with the default
size threshold (``core.DEFAULT_SIZE_THRESHOLD``), and the table flags every point more than 3%
slower than bf16 (the threshold's goal) and every point where the threshold gave up FP8 speed.

A one-GEMM step of a small sweep point takes less GPU time than the host needs to launch it, so
its wall time measures the launch (and grows with every array passed, such as DelayedScaling's
state). On GPUs the sweep therefore also reports, for points under 2 ms, the GPU time per step:
the sum of the step's kernel times in a JAX profiler trace. The flags use it where it exists.
In the sweep, DelayedScaling's state is fed back and donated from step to step, as a training
step does; the other cases time their steps on the recipe state of three training steps
(``trained_state``), not on the initial state.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import te_adapters as ta
from bench.qwix_variants import qwix_variants
from bench.seed_layer import ATTENTIONS, FlaxDenseBlock
from te_adapters import core, inspect
from te_adapters import linen as ta_linen
from te_adapters.core import MMParams

_DN = (((1,), (0,)), ((), ()))
# A variant more than this much slower than bf16 is flagged.
_SLOWER_TOLERANCE = 1.03
_DEFAULT_THRESHOLD = " (default threshold)"


def _timed(step: Callable, args, steps: int, repeats: int) -> tuple[float, float]:
  start = time.perf_counter()
  out = step(*args)
  jax.block_until_ready(out)
  _timed.last_compile_s = time.perf_counter() - start
  for _ in range(2):
    jax.block_until_ready(step(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      out = step(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / steps * 1e3)
  return float(np.median(times)), float(np.max(times) - np.min(times))


def _count_cublas_fp8(step, args) -> str | None:
  """'FP8 GEMMs/other GEMMs' in the compiled GPU program (None off GPU)."""
  if jax.default_backend() != "gpu":
    return None
  fp8, other = inspect.count_fp8_gemms(step.lower(*args).compile().as_text())
  return f"{fp8}/{other}"


def _speedometer(apply_fn):
  # dy is an argument, not a closed-over constant XLA would fold into the program.
  def loss(variables, x, dy):
    y = apply_fn(variables, x)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


_WARM_STEPS = 3


def fast_sums(recipe):
  """``recipe`` with fast FP8 accumulation in dgrad and wgrad as well as in fprop: what
  TransformerEngine's JAX layer runs by default (it ignores the recipe's ``MMParams`` unless
  ``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1``), and what Flax's fp8 op and Qwix get from
  XLA's cuBLASLt GEMMs. Our recipes' defaults promote the backward GEMMs' sums (TE's recipe
  defaults), which costs GEMM time: these rows compare the peers at their own numerics."""
  fast = MMParams(use_split_accumulator=False)
  return dataclasses.replace(recipe, fp8_gemm_fprop=fast, fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast)


def trained_state(step, variables, *args, steps: int = _WARM_STEPS):
  """``variables`` with their recipe state after ``steps`` training steps of ``step``.

  By the overwrite-with-gradient rule a step's gradient with respect to the recipe state is the
  next state. Timing every step on the initial state would run DelayedScaling (TE's, Flax's and
  ours) with a scale of 1 throughout: seed 000's kernel (lecun-normal, std 0.011) then becomes
  mostly subnormal FP8 codes, which the H100's tensor cores multiply faster than the codes of a
  scaled tensor, so the step would look faster than in training. The state is found by structure:
  a Linen collection ``_overwrite_with_gradient`` (ours and Flax's fp8 op), the core's
  ``{"w", "state"}``, or the second half of an adapter's ``(params, recipe_state)`` pair.
  """

  def with_next(v, g):
    if isinstance(v, dict):
      keys = [k for k in ("_overwrite_with_gradient", "state") if k in v]
      return {**v, **{k: g[k] for k in keys}} if keys else v
    if isinstance(v, tuple) and len(v) == 2:
      return (v[0], g[1])
    return v

  for _ in range(steps):
    _, (grads, _) = step(variables, *args)
    variables = with_next(variables, grads)
  return jax.block_until_ready(variables)


def _linen_variants(make_model, recipes, include_flax=True):
  """(name, model) pairs: bf16, ours through Linen per recipe, Flax's fp8 op."""
  out = [("bf16", make_model(lambda: None))]
  for label, recipe in recipes:
    cls = ta_linen.make_dot_general_cls(recipe, threshold=None)
    out.append((f"linen {label}", make_model(cls)))
  if include_flax:
    out.append(("flax Fp8DirectDotGeneralOp", make_model(nn.Fp8DirectDotGeneralOp)))
    out += qwix_variants(make_model)
  return out


def _make_dense(features):
  return lambda dot_general_cls: FlaxDenseBlock(features, dot_general_cls=dot_general_cls)


def _core_variant(recipe, w_shape, kernel_dtype=jnp.bfloat16, config=None):
  """The core called directly: params {'w': f32}, bf16 output like nn.Dense(dtype=bf16).

  ``kernel_dtype`` bf16: the kernel is copied to bf16 first, the work nn.Dense does.
  float32: the stored kernel goes straight into the FP8 cast (as TE's dense quantizes it),
  with ``preferred_element_type=bf16``, which saves that copy.
  """
  state = core.init_state(recipe)

  def apply_fn(variables, x):
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    return core.dot_general(
      x,
      variables["w"].astype(kernel_dtype),
      dn,
      preferred_element_type=jnp.bfloat16,
      recipe=recipe,
      state=variables.get("state") or None,
      threshold=None,
      config=config,
    )

  def init(key):
    v = {"w": nn.initializers.lecun_normal()(key, w_shape, jnp.float32)}
    if state:
      v["state"] = state
    return v

  return apply_fn, init


def bench_dense(batch, seq, hidden, out_features, steps, repeats, recipes, log) -> list[dict]:
  k_init, k_x, k_dy = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k_x, (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(k_dy, (batch, seq, out_features)).astype(jnp.bfloat16)
  rows = []
  variants = []
  for name, model in _linen_variants(_make_dense(out_features), recipes):
    variants.append((name, model.apply, model.init(k_init, x)))
  # The core doing nn.Dense's work (a bf16 copy of the kernel first), then with the float32
  # kernel straight into the cast, then also with fast sums in dgrad and wgrad (what TE's JAX
  # layer and Flax's fp8 op do).
  for suffix, kernel_dtype, fast in [
    ("", jnp.bfloat16, False),
    (", f32 kernel", jnp.float32, False),
    (", f32 kernel, fast sums", jnp.float32, True),
  ]:
    for label, recipe in recipes:
      if fast:
        recipe = fast_sums(recipe)
      apply_fn, init = _core_variant(recipe, (hidden, out_features), kernel_dtype)
      variants.append((f"core {label}{suffix}", apply_fn, init(k_init)))
  for extra in _adapter_variants(hidden, out_features, recipes, k_init, x):
    variants.append(extra)
  for name, apply_fn, variables in variants:
    step = _speedometer(apply_fn)
    variables = trained_state(step, variables, x, dy)
    ms, spread = _timed(step, (variables, x, dy), steps, repeats)
    rows.append(
      dict(
        case="seed000 dense",
        variant=name,
        ms=ms,
        spread_ms=spread,
        cublas_fp8=_count_cublas_fp8(step, (variables, x, dy)),
      )
    )
    log(rows[-1])
    del step
  return rows


def _adapter_variants(hidden, out_features, recipes, key, x):
  """NNX and Haiku adapters, when they exist, wrapped as (name, apply_fn, variables)."""
  out = []
  try:
    from flax import nnx

    from te_adapters import nnx as ta_nnx

    if hasattr(ta_nnx, "Linear"):
      for label, recipe in recipes:
        model = ta_nnx.Linear(
          hidden,
          out_features,
          use_bias=False,
          dtype=jnp.bfloat16,
          recipe=recipe,
          threshold=None,
          rngs=nnx.Rngs(0),
        )
        graphdef, recipe_state, rest = nnx.split(model, ta_nnx.RecipeState, ...)

        def apply_fn(variables, x, graphdef=graphdef):
          return nnx.merge(graphdef, variables[0], variables[1])(x)

        out.append((f"nnx {label}", apply_fn, (rest, recipe_state)))
  except ImportError:
    pass
  try:
    import haiku as hk

    from te_adapters import haiku as ta_hk

    if hasattr(ta_hk, "Linear"):
      for label, recipe in recipes:

        def fwd(x, recipe=recipe):
          return ta_hk.Linear(out_features, with_bias=False, recipe=recipe, threshold=None)(x)

        f = hk.transform_with_state(fwd)
        # float32 parameters (initialised from a float32 input), computed in bf16 like nn.Dense.
        params, state = f.init(key, x.astype(jnp.float32))

        def apply_fn(variables, x, f=f):
          p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), variables[0])
          return f.apply(p, variables[1], None, x)[0]

        out.append((f"haiku {label}", apply_fn, (params, state)))
  except ImportError:
    pass
  return out


def bench_layer(dtype, steps, repeats, recipes, log, size, attention="flax") -> list[dict]:
  """Seed 001's layer, fwd+bwd: plain Flax, Flax with each FP8 ``dot_general``, Qwix, and (with a
  dtype) the layer from te_adapters' modules. ``attention`` (``seed_layer.ATTENTIONS``) is the
  attention implementation of every variant alike."""
  from bench.seed_layer import FlaxTransformerLayer

  batch, seq, hidden, ffn, heads = size
  key = jax.random.PRNGKey(42)
  x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
  label_dtype = "dtype unset" if dtype is None else "dtype bf16"
  if attention != "flax":
    label_dtype += f", {attention} attention"
  rows = []

  def make(cls):
    kw = {} if dtype is None else {"dtype": dtype}
    return FlaxTransformerLayer(
      hidden_size=hidden,
      ffn_hidden_size=ffn,
      num_attention_heads=heads,
      dot_general_cls=cls,
      attention=attention,
      **kw,
    )

  variants = _linen_variants(make, recipes)
  if dtype is not None:
    # The same layer from te_adapters' Linen modules (computed in bf16, as this variant's).
    from bench.seed_layer import ModulesTransformerLayer

    for label, recipe in recipes + [(f"{n}, fast sums", fast_sums(r)) for n, r in recipes]:
      variants.append(
        (
          f"modules {label}",
          ModulesTransformerLayer(
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            recipe=recipe,
            attention=attention,
          ),
        )
      )
  for name, model in variants:
    variables = model.init(key, x, deterministic=True)
    apply_fn = lambda v, x, model=model: model.apply(v, x, deterministic=True)
    step = _speedometer(apply_fn)
    variables = trained_state(step, variables, x, dy)
    ms, spread = _timed(step, (variables, x, dy), steps, repeats)
    rows.append(
      dict(
        case=f"seed001 layer ({label_dtype})",
        variant=name,
        ms=ms,
        spread_ms=spread,
        cublas_fp8=_count_cublas_fp8(step, (variables, x, dy)),
      )
    )
    log(rows[-1])
  return rows


def gpu_trace_events(step, args, steps: int) -> list[dict]:
  """The GPU's events (Chrome-trace "X" events with ``ts`` and ``dur`` in microseconds) of a JAX
  profiler trace of ``steps`` calls of ``step(*args)`` after one warm-up call; empty off GPU or
  when the trace has none."""
  if jax.default_backend() != "gpu":
    return []
  jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        out = step(*args)
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      return []
    with gzip.open(paths[0]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = {
    e["pid"]
    for e in events
    if e.get("ph") == "M"
    and e.get("name") == "process_name"
    and "/device:GPU" in str(e.get("args", {}).get("name", ""))
  }
  return [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu_pids]


def gpu_kernel_ms(step, args, steps: int) -> dict[str, float]:
  """GPU time per step (ms) of each kernel of ``step(*args)``, from a JAX profiler trace of
  ``steps`` calls after one warm-up call; empty off GPU or when the trace has no GPU events."""
  return kernel_ms(gpu_trace_events(step, args, steps), steps)


def kernel_ms(events, steps: int) -> dict[str, float]:
  """Each kernel's time per step (ms) in the trace ``events`` of ``steps`` steps."""
  per_kernel: dict[str, float] = {}
  for e in events:
    per_kernel[e["name"]] = per_kernel.get(e["name"], 0.0) + e["dur"] / steps / 1e3
  return per_kernel


def gpu_idle(events, steps: int, top: int | None = 5):
  """Where the GPU waits: ``(idle ms per step, [(gap us, kernel before, kernel after), ...])``,
  the time between the first event's start and the last one's end in which no event runs (on any
  stream), and its ``top`` longest gaps (all of them for ``None``) with the kernels that end before
  and start after them."""
  spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events)
  idle, gaps = 0.0, []
  if not spans:
    return 0.0, gaps
  end, last = spans[0][1], spans[0][2]
  for start, stop, name in spans[1:]:
    if start > end:
      idle += start - end
      gaps.append((start - end, last, name))
    if stop >= end:
      end, last = stop, name
  gaps.sort(key=lambda g: -g[0])
  return idle / steps / 1e3, gaps if top is None else gaps[:top]


def _gpu_ms(step, args, steps: int) -> float | None:
  """GPU kernel time per step (ms); None off GPU or without events."""
  return sum(gpu_kernel_ms(step, args, steps).values()) or None


def bench_sweep(shapes, steps, repeats, recipes, log) -> list[dict]:
  """x (M, K) @ w (K, N) per shape: bf16, each recipe forced to FP8, each with the default
  size threshold."""
  rows = []
  variants = [("bf16", None, None)]
  for label, recipe in recipes:
    variants += [
      (label, recipe, None),
      (label + _DEFAULT_THRESHOLD, recipe, core.DEFAULT_SIZE_THRESHOLD),
    ]
  for m, k, n in shapes:
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(m + k + n), 3)
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n)).astype(jnp.bfloat16)
    for label, recipe, threshold in variants:
      state = core.init_state(recipe) if recipe is not None else {}

      def loss(w, state, x, dy, recipe=recipe, threshold=threshold):
        y = core.dot_general(x, w, _DN, recipe=recipe, state=state or None, threshold=threshold)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

      jitted = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), donate_argnums=(1,) if state else ()
      )
      step = _feed_state_back(jitted, state) if state else jitted
      args = (w, state, x, dy)
      ms, spread = _timed(step, args, steps, repeats)
      gpu_ms = _gpu_ms(step, args, 10) if ms < 2.0 else None
      rows.append(
        dict(
          case=f"gemm {m}x{k}x{n}",
          variant=f"core {label}",
          ms=ms,
          spread_ms=spread,
          cublas_fp8=_count_cublas_fp8(jitted, args),
          gpu_ms=gpu_ms,
        )
      )
      log(rows[-1])
  return rows


def _feed_state_back(jitted, state):
  """A training step's handling of the recipe state: each step's new state (the state's
  gradient) is the next step's state, and the old one is donated. (Without donation XLA must
  copy a state that a small, high-precision GEMM leaves unchanged into a new buffer: a 6-8 us
  memcpy on an H100, a quarter of a 1024^3 step.)"""
  current = [jax.tree_util.tree_map(jnp.copy, state)]

  def step(w, _state, x, dy):
    out = jitted(w, current[0], x, dy)
    current[0] = out[1][1]
    return out

  return step


def format_table(rows: list[dict]) -> str:
  """The rows as a table; ``>3% slower`` flags a variant more than 3% slower than bf16. Below
  it, a summary of the default-threshold variants of the GEMM sweep."""
  slower = f">{round((_SLOWER_TOLERANCE - 1) * 100)}% slower"
  cw = max([30] + [len(r["case"]) + 2 for r in rows])  # the case column's width
  lines = [
    f"{'case':<{cw}}{'variant':<36}{'ms':>9}{'vs bf16':>9}{'GPU ms':>9}{'vs bf16':>9}"
    f"{'FP8/other GEMMs':>17}  {slower}"
  ]

  def judged(r):  # GPU time where both it and its case's bf16 row have one, else wall time
    return "gpu_ms" if r.get("gpu_ms") and gpu_base.get(r["case"]) else "ms"

  base = {r["case"]: r["ms"] for r in rows if r["variant"] in ("bf16", "core bf16")}
  gpu_base = {r["case"]: r.get("gpu_ms") for r in rows if r["variant"] in ("bf16", "core bf16")}
  by_key = {(r["case"], r["variant"]): r for r in rows}
  slow, unused = [], []
  for r in rows:
    bf16 = base.get(r["case"], float("nan"))
    key = judged(r)
    ref = (gpu_base if key == "gpu_ms" else base).get(r["case"], float("nan"))
    is_slow = r[key] > _SLOWER_TOLERANCE * ref
    fp8 = "-" if r["cublas_fp8"] is None else str(r["cublas_fp8"])
    gpu = (
      f"{r['gpu_ms']:>9.3f}{gpu_base[r['case']] / r['gpu_ms']:>8.2f}x"
      if key == "gpu_ms"
      else f"{'-':>9}{'-':>9}"
    )
    lines.append(
      f"{r['case']:<{cw}}{r['variant']:<36}{r['ms']:>9.2f}{bf16 / r['ms']:>8.2f}x{gpu}"
      f"{fp8:>17}  {'SLOWER' if is_slow else ''}".rstrip()
    )
    if r["variant"].endswith(_DEFAULT_THRESHOLD):
      forced = by_key.get((r["case"], r["variant"][: -len(_DEFAULT_THRESHOLD)]))
      if is_slow:
        slow.append(f"{r['case']} {r['variant']}")
      forced_ms = forced.get(key) if forced is not None else None
      if forced_ms is not None and r[key] is not None and r[key] > _SLOWER_TOLERANCE * forced_ms:
        unused.append(f"{r['case']} {r['variant']}")
  if any(r["variant"].endswith(_DEFAULT_THRESHOLD) for r in rows):
    lines.append(f"\ndefault threshold, {slower} than bf16: {', '.join(slow) or 'none'}")
    lines.append(f"default threshold, {slower} than forced FP8: {', '.join(unused) or 'none'}")
    backend = jax.default_backend()
    if not core.DEFAULT_SIZE_THRESHOLD.applies_to(backend):
      lines.append(f"(the default threshold does not apply on {backend}: every GEMM ran in FP8)")
  return "\n".join(lines)


class _FlaxLnMlp(nn.Module):
  """Seed 001's LayerNorm + MLP in plain Flax (bf16, biases, tanh GELU), GEMMs swappable."""

  hidden: int
  intermediate: int
  dot_general_cls: Callable = lambda: None

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16)(x)
    h = nn.Dense(self.intermediate, dtype=jnp.bfloat16, dot_general=self.dot_general_cls())(h)
    h = nn.gelu(h, approximate=True)
    return nn.Dense(self.hidden, dtype=jnp.bfloat16, dot_general=self.dot_general_cls())(h)


def te_layernorm_mlp(intermediate, recipe, config=None):
  """The block as ``te_adapters.linen.LayerNormMLP`` with TE's fields: float32 parameters,
  computed in the input's dtype, gelu, biases, no dropout, no size threshold (both GEMMs
  quantized)."""
  return ta_linen.LayerNormMLP(
    intermediate_dim=intermediate,
    activations=("gelu",),
    use_bias=True,
    intermediate_dropout_rate=0.0,
    return_layernorm_output=False,
    recipe=recipe,
    threshold=None,
    config=config,
  )


def bench_mlp(steps, repeats, recipes, log, size) -> list[dict]:
  """LayerNorm + MLP (x ``(batch, seq, hidden)`` bf16, ``intermediate``, gelu, biases): plain
  Flax in bf16, Flax's modules with our ``dot_general`` (unfused), and
  ``te_adapters.linen.LayerNormMLP`` with the fused activation casts and without them
  (``fused``/``unfused``: ``GemmConfig(fuse_activation_cast=True/False)``)."""
  batch, seq, hidden, intermediate = size
  key = jax.random.PRNGKey(7)
  x = jax.random.normal(key, (batch, seq, hidden)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(8), (batch, seq, hidden)).astype(jnp.bfloat16)
  variants = _linen_variants(lambda cls: _FlaxLnMlp(hidden, intermediate, cls), recipes)
  if hasattr(ta_linen, "LayerNormMLP"):
    # The fused activation casts (the default), and the activation between two dot_generals.
    configs = (
      (" fused", ta.core.GemmConfig(fuse_activation_cast=True)),
      (" unfused", ta.core.GemmConfig(fuse_activation_cast=False)),
    )
    for label, recipe in recipes:
      for suffix, config in configs:
        variants.append(
          (f"LayerNormMLP {label}{suffix}", te_layernorm_mlp(intermediate, recipe, config))
        )
    for label, recipe in recipes:
      variants.append(
        (
          f"LayerNormMLP {label} fused, fast sums",
          te_layernorm_mlp(intermediate, fast_sums(recipe), configs[0][1]),
        )
      )
  rows = []
  for name, model in variants:
    kw = {"deterministic": True} if isinstance(model, getattr(ta_linen, "LayerNormMLP", ())) else {}
    variables = model.init(key, x, **kw)

    def apply_fn(v, x, model=model, kw=kw):
      y = model.apply(v, x, **kw)
      return y[0] if isinstance(y, tuple) else y

    step = _speedometer(apply_fn)
    variables = trained_state(step, variables, x, dy)
    ms, spread = _timed(step, (variables, x, dy), steps, repeats)
    rows.append(
      dict(
        case="seed001 LayerNorm+MLP",
        variant=name,
        ms=ms,
        spread_ms=spread,
        cublas_fp8=_count_cublas_fp8(step, (variables, x, dy)),
      )
    )
    log(rows[-1])
  return rows


def main(argv=None) -> None:
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
  p.add_argument("--cases", default="dense,layer,sweep", help="comma list: dense,layer,mlp,sweep")
  p.add_argument("--steps", type=int, default=20 if on_gpu else 2)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None, help="write the rows here")
  p.add_argument(
    "--shapes",
    default=None,
    help="GEMM sweep shapes instead of the built-in ones: comma list of MxKxN",
  )
  p.add_argument(
    "--full-size",
    action=argparse.BooleanOptionalAction,
    default=on_gpu,
    help="seed sizes (default on GPU); small sizes otherwise",
  )
  p.add_argument(
    "--attention",
    default="flax",
    choices=ATTENTIONS,
    help="the layer case's attention, in every variant: flax (the seed's "
    "nn.dot_product_attention), or jax.nn.dot_product_attention's xla or cudnn "
    "(cudnn: bf16 only, so the dtype-unset layer is left out)",
  )
  args = p.parse_args(argv)
  recipes = [
    ("current", ta.Float8CurrentScaling()),
    ("delayed", ta.DelayedScaling(amax_history_len=1024)),
  ]
  log = lambda r: print(f"  {r['case']:<30} {r['variant']:<36}{r['ms']:9.2f} ms", flush=True)
  rows = []
  cases = args.cases.split(",")
  if args.full_size:
    dense, layer = (8, 2048, 8192, 32768), (4, 2048, 4096, 16384, 32)
    mlp = (4, 2048, 4096, 16384)
    sweep = [(s, s, s) for s in (1024, 2048, 4096, 8192, 16384)] + [
      (8192, 4096, 14336),
      (8192, 14336, 4096),
      (16384, 4096, 4096),
      (4096, 4096, 1024),
      # Around the default size threshold (M*K*N = 4096**3, min dim 2048), from both sides.
      (2048, 8192, 8192),
      (1024, 8192, 8192),
      (8192, 2048, 2048),
      (4096, 4096, 2048),
      (16384, 1024, 1024),
    ]
  else:
    dense, layer = (2, 64, 256, 512), (2, 64, 128, 256, 4)
    mlp = (2, 64, 128, 256)
    sweep = [(128, 256, 256), (256, 256, 512)]
  if "dense" in cases:
    rows += bench_dense(*dense, args.steps, args.repeats, recipes, log)
  if "layer" in cases:
    if args.attention != "cudnn":  # cuDNN's attention takes bf16 / fp16 only
      rows += bench_layer(None, args.steps, args.repeats, recipes, log, layer, args.attention)
    rows += bench_layer(jnp.bfloat16, args.steps, args.repeats, recipes, log, layer, args.attention)
  if "mlp" in cases:
    rows += bench_mlp(args.steps, args.repeats, recipes, log, mlp)
  if args.shapes:
    sweep = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
  if "sweep" in cases:
    rows += bench_sweep(sweep, args.steps, args.repeats, recipes, log)
  device = jax.devices()[0]
  meta = dict(
    device=f"{device.platform} {device.device_kind}",
    jax=jax.__version__,
    python=platform.python_version(),
    date=time.strftime("%Y-%m-%d"),
  )
  import flax

  meta["flax"] = flax.__version__
  print(f"\n{meta}\n")
  print(format_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
