"""Tokens/s and MFU of the Llama-style decoder's training step, bf16 against FP8 variants.

  python -m bench.llama.train --config cpu --variants nnx-bf16,nnx-current --steps 3
  python -m bench.llama.data bench/llama/tokens      # once, where `tokenizers` is installed
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m bench.llama.train --config 1b \\
      --tokens bench/llama/tokens --variants nnx-bf16,nnx-current,nnx-delayed --windows 5 \\
      --window-steps 3 --profile nnx-delayed --out llama.jsonl

Every variant trains the same model code from the same initial parameters on the same batches,
with the same step: AdamW (float32 master weights, gradients clipped to norm 1), the whole step
jitted with the carry (parameters, optimizer state, recipe state) donated, the layers scanned, and
the configuration's rematerialisation policy (the 1b one: ``model.save_gemm_outputs``, which
recomputes only elementwise work). The variants differ only by the conversion:

* ``nnx-bf16`` / ``linen-bf16``: the plain model;
* ``nnx-<recipe>``: ``te_adapters.nnx.quantize_model(model, recipe)``, the NNX README's step
  (``ta_nnx.value_and_grad``, ``optimizer.update``, ``ta_nnx.update_recipe_state``);
* ``linen-<recipe>``: ``te_adapters.linen.quantize(recipe)`` around init and apply, with
  ``te_adapters.linen.TrainState``;
* ``haiku-bf16`` / ``haiku-<recipe>``: ``te_adapters.haiku.quantize(recipe)`` around the
  transformed function, the Haiku README's step (``ta_hk.value_grad_and_state``);
* ``nnx-modules-<recipe>``: the blocks written with the library's ``LayerNormDenseGeneral``,
  ``Linear`` and ``LayerNormMLP`` built with the recipe (``bf16``: recipe None);
* ``linen-flax-fp8``: Flax's own ``nn.Fp8DirectDotGeneralOp`` as every projection's
  ``dot_general_cls``, its ``_overwrite_with_gradient`` state replaced by its gradient each step;
* ``linen-qwix``: the plain Linen model rewritten by Qwix's quantized training
  (``qwix.quantize_model`` with a ``QtProvider``): every projection's ``dot_general`` (not the
  head's) with per-tensor e4m3 operands forward and e5m2 gradients backward (Qwix's dynamic
  absmax scales, the rule of ``bench/qwix_variants.py``).

Recipes: ``current`` (Float8CurrentScaling), ``delayed`` (DelayedScaling, TE's defaults),
``block`` (Float8BlockScaling). The output head stays in bf16 in every variant (a rule keeps it
in high precision in the conversions, no ``dot_general_cls``), as FP8 recipes usually keep it;
attention's batched GEMMs are cuDNN's bf16 flash attention on GPU.

FSDP (``--fsdp N``): a one-axis mesh ``fsdp`` over the first N devices; the batch is N times the
configuration's (each device keeps the one-device batch), the projections' kernels and the
embedding table (and AdamW's moments of them) are sharded over ``fsdp`` along their input
dimension, everything else is replicated, and the step is jitted with those shardings in and
out. The converted layers and the library's modules (``LayerNormDenseGeneral``, ``Linear``,
``LayerNormMLP``: both its kernels) get ``kernel_all_gather=P("fsdp", None)``: each kernel shard
is quantized and its FP8 bytes all-gathered, the kernel gradient reduce-scattered back
(``--no-fp8-gather``: XLA gathers the unquantized kernel). The bf16 model, Flax's op and Qwix
are partitioned by XLA from the same shardings. ``--reference FILE`` (the one-device records of the
same variants) adds the scaling efficiency: tokens/s over N times the one-device tokens/s.

Timing: after ``--warmup`` steps (the recipe state then is a trained one), ``--windows`` windows
of ``--window-steps`` steps each, each ended by waiting for its last loss; tokens/s is the median
window's, MFU that over the peak (H100 SXM dense bf16, 989 TFLOP/s) with
``Config.flops_per_step``. FP8 GEMMs are counted in the compiled program on GPU
(``te_adapters.inspect.count_fp8_gemms``) and in the jaxpr elsewhere. ``--profile VARIANT``
splits a few traced steps of that variant's GPU time into FP8 GEMMs, bf16 GEMMs, the library's
casts, attention, the optimizer (work outside the differentiated function), other XLA fusions
and idle time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from bench.convergence import count_gemms, cross_entropy
from te_adapters import core

from . import data as data_lib
from . import model as model_lib

H100_BF16_PEAK_TFLOPS = 989.0
RECIPES = {
  "current": ta.Float8CurrentScaling,
  "delayed": ta.DelayedScaling,
  "block": ta.Float8BlockScaling,
}
OVERWRITE = "_overwrite_with_gradient"
FSDP = "fsdp"
# FSDP shards these parameters (and their optimizer moments) along their input dim: the
# projections' kernels (Flax's, the library's fused modules', Haiku's ``w``) and the embedding.
FSDP_SHARDED = ("kernel", "wi_kernel", "wo_kernel", "w", "embedding", "embeddings")


def variant_names() -> list[str]:
  out = ["nnx-bf16", "linen-bf16", "haiku-bf16", "nnx-modules-bf16", "linen-flax-fp8", "linen-qwix"]
  for r in RECIPES:
    out += [f"nnx-{r}", f"linen-{r}", f"haiku-{r}", f"nnx-modules-{r}"]
  return out


def run_header(name: str, cfg, **extra) -> dict:
  """The first record of a run's output: the configuration ``name`` and its fields, its sizes
  (parameters, tokens and model TFLOP a step), ``extra``, JAX's version and the device."""
  return dict(
    config=name,
    **dataclasses.asdict(cfg),
    params=cfg.params(),
    matmul_params=cfg.matmul_params(),
    tokens_per_step=cfg.tokens_per_step,
    model_tflop_per_step=cfg.flops_per_step() / 1e12,
    **extra,
    jax=jax.__version__,
    device=str(jax.devices()[0].device_kind),
  )


def parse_variant(name: str) -> tuple[str, str]:
  """(family, recipe name): family in nnx, linen, haiku, nnx-modules, linen-flax, linen-qwix."""
  if name == "linen-flax-fp8":
    return "linen-flax", "flax-fp8"
  if name == "linen-qwix":
    return "linen-qwix", "qwix-fp8"
  for family in ("nnx-modules", "nnx", "linen", "haiku"):
    prefix = family + "-"
    if name.startswith(prefix) and (
      name[len(prefix) :] in RECIPES or name[len(prefix) :] == "bf16"
    ):
      return family, name[len(prefix) :]
  raise ValueError(f"unknown variant {name!r}; known: {', '.join(variant_names())}")


def optimizer(cfg: model_lib.Config) -> optax.GradientTransformation:
  """AdamW (betas 0.9/0.95, weight decay 0.1), linear warm-up, gradients clipped to norm 1."""
  schedule = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)
  )


@dataclasses.dataclass
class Trainer:
  carry: object
  step: object  # (carry, tokens) -> (carry, loss)
  quantized: int  # layers converted (0 for bf16 and Flax's op)
  eval_loss: object = None  # (carry, tokens) -> loss, where the family gives one (NNX)
  report: object = None  # the conversion's report (NNX quantize_model), else None


def _threshold(cfg):
  return None if cfg.fp8_everywhere else core.DEFAULT_SIZE_THRESHOLD


def _rules(recipe, gather, *high_precision):
  """A conversion's rules: the head (and the ``high_precision`` paths) in high precision, every
  other layer with ``recipe``; under FSDP (``gather``, the kernel's sharding inside the scanned
  layer) its kernel is all-gathered in FP8."""
  rest = (".*", recipe) if gather is None else ta.Rule(".*", recipe, kernel_all_gather=gather)
  return [(model_lib.is_head, None), *[(path, None) for path in high_precision], rest]


def nnx_trainer(cfg, family, recipe, seed, tx, config=None, gather=None) -> Trainer:
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  quantized, report = 0, None
  if family == "nnx-modules":
    model = model_lib.nnx_model(
      cfg,
      seed,
      modules=True,
      modules_recipe=recipe,
      threshold=_threshold(cfg),
      gemm_config=config,
      kernel_all_gather=gather,
    )
    quantized = (3 if cfg.scan else 3 * cfg.layers) if recipe is not None else 0
  else:
    model = model_lib.nnx_model(cfg, seed)
    if recipe is not None:
      report = ta_nnx.quantize_model(
        # The embedding is a lookup: its attend (a tied head) is never called.
        model,
        rules=_rules(recipe, gather, "embed"),
        threshold=_threshold(cfg),
        config=config,
      )
      quantized = len(report.quantized)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, tokens):
    return cross_entropy(model(tokens[:, :-1]), tokens)

  def train_step(model, opt, tokens):  # the README's NNX loop
    loss, (grads, state_grads) = ta_nnx.value_and_grad(loss_fn)(model, tokens)
    opt.update(model, grads)
    ta_nnx.update_recipe_state(model, state_grads)
    return loss

  graphdef, carry = nnx.split((model, opt))

  def step(carry, tokens):
    model, opt = nnx.merge(graphdef, carry)
    loss = train_step(model, opt, tokens)
    return nnx.state((model, opt)), loss

  def eval_loss(carry, tokens):
    model, _ = nnx.merge(graphdef, carry)
    return loss_fn(model, tokens)

  return Trainer(carry, step, quantized, eval_loss, report)


def _plain_linen_trainer(model, params, tx, extra=None) -> Trainer:
  """A Linen model trained with ``jax.value_and_grad`` over its params; ``extra``: Flax's FP8
  op's ``_overwrite_with_gradient`` collection, whose gradient is its next value (Flax's rule)."""

  def loss_fn(params, extra, tokens):
    variables = {"params": params} if extra is None else {"params": params, OVERWRITE: extra}
    return cross_entropy(model.apply(variables, tokens[:, :-1]), tokens)

  def step(carry, tokens):
    params, extra, opt_state = carry
    loss, (grads, extra_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, extra, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), extra_grads, opt_state), loss

  return Trainer((params, extra, tx.init(params)), step, 0)


def linen_trainer(cfg, family, recipe, seed, tx, sample, config=None, gather=None) -> Trainer:
  from flax import linen as nn

  from te_adapters import linen as ta_linen

  if family == "linen-flax":
    model = model_lib.linen_model(cfg, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    variables = jax.jit(model.init)(jax.random.key(seed), sample[:, :-1])
    return _plain_linen_trainer(model, variables["params"], tx, variables[OVERWRITE])
  if family == "linen-qwix":
    import qwix

    from bench.qwix_variants import qt_rule

    # Every projection but the head (Qwix's module path of the head is "head").
    rule = qt_rule(qwix, jnp.float8_e5m2, module_path=r"(?!head$).*")
    model = qwix.quantize_model(model_lib.linen_model(cfg), qwix.QtProvider([rule]))
    variables = jax.jit(model.init)(jax.random.key(seed), sample[:, :-1])
    if set(variables) != {"params"}:
      raise ValueError(f"Qwix added variable collections {sorted(set(variables) - {'params'})}")
    return _plain_linen_trainer(model, variables["params"], tx)

  model = model_lib.linen_model(cfg)
  q = ta_linen.quantize(rules=_rules(recipe, gather), threshold=_threshold(cfg), config=config)
  variables = jax.jit(q(model.init))(jax.random.key(seed), sample[:, :-1])
  state = ta_linen.TrainState.create(apply_fn=q(model.apply), variables=variables, tx=tx)

  def loss_fn(variables, tokens):
    return cross_entropy(state.apply_fn(variables, tokens[:, :-1]), tokens)

  def step(state, tokens):
    loss, grads = state.value_and_grad(loss_fn, tokens)
    return state.apply_gradients(grads=grads), loss

  return Trainer(state, step, len(q.report.quantized) if recipe is not None else 0)


def haiku_trainer(cfg, recipe, seed, tx, sample, config=None, gather=None) -> Trainer:
  import haiku as hk

  from te_adapters import haiku as ta_hk

  q = ta_hk.quantize(rules=_rules(recipe, gather), threshold=_threshold(cfg), config=config)
  init = hk.transform_with_state(q(lambda t: model_lib.haiku_forward(t, cfg, jnp.float32)))
  model = hk.transform_with_state(q(lambda t: model_lib.haiku_forward(t, cfg, jnp.bfloat16)))
  params, state = jax.jit(init.init)(jax.random.key(seed), sample[:, :-1])

  def loss_fn(params, state, tokens):
    # float32 parameters, the projections' kernels cast to bf16 (as Linen's and NNX's
    # dtype=bfloat16 layers do): FP8 GEMMs quantize the bf16 operands.
    compute = jax.tree_util.tree_map_with_path(
      lambda path, p: p.astype(jnp.bfloat16) if path[-1].key == "w" and p.ndim >= 2 else p, params
    )
    logits, state = model.apply(compute, state, None, tokens[:, :-1])
    return cross_entropy(logits, tokens), state

  def step(carry, tokens):  # the README's Haiku loop
    params, state, opt_state = carry
    loss, _, grads, state = ta_hk.value_grad_and_state(loss_fn)(params, state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), state, opt_state), loss

  quantized = len(q.report.quantized) if recipe is not None else 0
  return Trainer((params, state, tx.init(params)), step, quantized)


def make_trainer(cfg, variant: str, seed: int, sample, config=None, gather=None) -> Trainer:
  """The variant's model, optimizer state and step; ``gather``: FSDP's ``kernel_all_gather``
  for the converted layers and the library's modules (None: no FP8 gather)."""
  family, recipe_name = parse_variant(variant)
  recipe = RECIPES[recipe_name]() if recipe_name in RECIPES else None
  if recipe is None or family not in ("nnx", "linen", "haiku", "nnx-modules"):
    gather = None
  tx = optimizer(cfg)
  if family in ("nnx", "nnx-modules"):
    return nnx_trainer(cfg, family, recipe, seed, tx, config, gather)
  if family == "haiku":
    return haiku_trainer(cfg, recipe, seed, tx, sample, config, gather)
  return linen_trainer(cfg, family, recipe, seed, tx, sample, config, gather)


# ----------------------------------------------------------------------------------------------
# FSDP


def fsdp_mesh(devices: int) -> jax.sharding.Mesh:
  """A one-axis mesh ``fsdp`` over the first ``devices`` devices, Auto axis (XLA partitions)."""
  if devices > jax.device_count():
    raise ValueError(f"--fsdp {devices}: only {jax.device_count()} devices here")
  return jax.make_mesh(
    (devices,), (FSDP,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:devices]
  )


def _key_name(key) -> str | None:
  for attr in ("key", "name"):
    name = getattr(key, attr, None)
    if isinstance(name, str):
      return name
  return None


def fsdp_spec(path, leaf, size: int) -> P:
  """The FSDP sharding of one leaf of a trainer's carry: a projection's kernel or the embedding
  (or an optimizer moment of one) along its input dim, the dim after the layer axis of the scanned
  stack; replicated otherwise (norms' scales, recipe state, counters)."""
  names = [n for n in map(_key_name, path) if n is not None and n != "value"]
  shape = getattr(leaf, "shape", ())
  if not names or names[-1] not in FSDP_SHARDED or len(shape) < 2:
    return P()
  dim = 1 if any(n == "blocks" or n.startswith("blocks/") for n in names) else 0
  if shape[dim] % size:
    return P()
  return P(*([None] * dim), FSDP)


def fsdp_shardings(carry, mesh):
  """The carry's shardings under FSDP (``fsdp_spec`` of each leaf)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: NamedSharding(mesh, fsdp_spec(path, leaf, mesh.size)), carry
  )


def sharded_fraction(carry) -> float:
  """The fraction of the carry's bytes held in shards (leaves not fully replicated)."""
  total = sharded = 0
  for leaf in jax.tree.leaves(carry):
    n = leaf.size * leaf.dtype.itemsize
    total += n
    sharded += 0 if leaf.sharding.is_fully_replicated else n
  return sharded / max(total, 1)


def all_gathers(hlo_text: str) -> dict[str, int]:
  """The all-gathers of compiled HLO by element type (``u8``: FP8 bytes), each counted once
  where it appears in the program (a scanned layer's once, not once per layer)."""
  out: dict[str, int] = {}
  for c in ta.inspect.hlo_collectives(hlo_text):
    if c.op == "all-gather":
      dtype = c.arrays[-1][0]
      out[dtype] = out.get(dtype, 0) + 1
  return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# Data


def token_data(cfg, tokens_dir=None) -> tuple[np.ndarray, dict]:
  if tokens_dir:
    train, _, info = data_lib.load_tokens(tokens_dir)
    if info["vocab"] > cfg.vocab:
      raise ValueError(
        f"the token files' vocabulary ({info['vocab']}) exceeds the model's ({cfg.vocab})"
      )
    return train, dict(info, source=str(tokens_dir))
  train, _ = data_lib.byte_tokens()
  return train, dict(source="standard library bytes", vocab=256, train_tokens=int(train.size))


def batch(train: np.ndarray, cfg, seed: int, step: int) -> np.ndarray:
  """Random windows of seq_len + 1 tokens, a function of (seed, step) alone."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, train.size - cfg.seq_len - 1, size=cfg.batch)
  return train[starts[:, None] + np.arange(cfg.seq_len + 1)].astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Profile


def hlo_instructions(hlo_text: str) -> dict[str, dict]:
  """name -> {line, target, op_name} of each instruction of compiled HLO text."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
    if not m:
      continue
    target = re.search(r'custom_call_target="([^"]+)"', line)
    op_name = re.search(r'op_name="([^"]+)"', line)
    out[m.group(1)] = dict(
      line=m.group(2)[:200],
      target=target.group(1) if target else "",
      op_name=op_name.group(1) if op_name else "",
    )
  return out


def classify(event: dict, instructions: dict) -> str:
  """The profile's class of one GPU kernel event."""
  name = event["name"].lower()
  op = str(event.get("args", {}).get("hlo_op", ""))
  info = instructions.get(op)
  if info is not None:
    target = info["target"].lower()
    if target:
      if "f8" in target or ("gemm" in target and "te_adapters" in target):
        return "FP8 GEMMs"
      if "cublas" in target:
        return "bf16 GEMMs"
      if "cudnn" in target:
        return "attention (cuDNN)"
      return "library casts and amaxes (FFI)"
    if re.search(r"\bdot\(", info["line"]):
      return "FP8 GEMMs" if "f8e" in info["line"].split("dot(")[1][:200] else "bf16 GEMMs"
    if info["line"].startswith(("f8e", "(f8e")):
      return "casts to FP8 (XLA fusions)"
    if info["op_name"] and "jvp(" not in info["op_name"] and "transpose(" not in info["op_name"]:
      return "optimizer and state update (outside the gradient)"
    return "other XLA fusions (norms, rotary, SwiGLU, residuals, loss)"
  # Kernels inside a CUDA graph (XLA's command buffers) name the graph as their hlo_op: by name.
  if "te_adapters" in name:
    return "library casts and amaxes (FFI)"
  if any(k in name for k in ("cudnn", "fmha", "sdpa", "flash")):
    return "attention (cuDNN)"
  if any(k in name for k in ("gemm", "xmma", "nvjet", "cutlass", "cublas")):
    # cuBLASLt's nvjet kernels spell the operand types first: q (e4m3) and r (e5m2) are FP8.
    types = re.search(r"nvjet_sm\d+_([a-z]+)_", name)
    if types and types.group(1)[:2] in ("qq", "qr", "rq", "rr"):
      return "FP8 GEMMs"
    return "bf16 GEMMs (by kernel name)"
  return "XLA fusions in CUDA graphs (norms, rotary, SwiGLU, residuals, loss, optimizer)"


def profile(step_fn, carry, batches, hlo_text: str, steps: int = 3):
  """GPU time per step by class, the top kernels, and idle time, from a JAX profiler trace of
  ``steps`` steps; returns (report dict, carry)."""
  from bench import speed

  carry, loss = step_fn(carry, batches[0])
  jax.block_until_ready(loss)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for i in range(steps):
        carry, loss = step_fn(carry, batches[(i + 1) % len(batches)])
      jax.block_until_ready(loss)
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      return dict(error="no perfetto trace"), carry
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
  events = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu_pids]
  instructions = hlo_instructions(hlo_text)
  groups, kernels = {}, {}
  for e in events:
    c = classify(e, instructions)
    groups[c] = groups.get(c, 0.0) + e["dur"] / steps / 1e3
    key = (e["name"][:90], c)
    kernels[key] = kernels.get(key, 0.0) + e["dur"] / steps / 1e3
  idle, gaps = speed.gpu_idle(events, steps)
  span = (
    (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / steps / 1e3
    if events
    else 0.0
  )
  report = dict(
    ms_per_step_span=span,
    idle_ms=idle,
    groups_ms=dict(sorted(groups.items(), key=lambda kv: -kv[1])),
    top_kernels=[(k[0], k[1], v) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:15]],
    events_with_hlo_op=sum("hlo_op" in e.get("args", {}) for e in events),
    events=len(events),
    sample_args=events[0].get("args", {}) if events else {},
  )
  return report, carry


# ----------------------------------------------------------------------------------------------
# A variant


def run_variant(
  cfg,
  variant: str,
  train: np.ndarray,
  *,
  seed: int = 0,
  warmup: int = 2,
  windows: int = 5,
  window_steps: int = 3,
  do_profile: bool = False,
  peak_tflops: float = H100_BF16_PEAK_TFLOPS,
  config=None,
  hlo_dir=None,
  mesh=None,
  fp8_gather: bool = True,
) -> dict:
  """Builds, compiles and times one variant; returns its record (``losses``: every step's).

  ``mesh``: FSDP over its ``fsdp`` axis (``cfg.batch`` is then the global batch), with the
  converted layers' kernels all-gathered in FP8 unless ``fp8_gather`` is False."""
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    return _run_variant(
      cfg,
      variant,
      train,
      seed=seed,
      warmup=warmup,
      windows=windows,
      window_steps=window_steps,
      do_profile=do_profile,
      peak_tflops=peak_tflops,
      config=config,
      hlo_dir=hlo_dir,
      mesh=mesh,
      fp8_gather=fp8_gather,
    )


def _run_variant(
  cfg,
  variant,
  train,
  *,
  seed,
  warmup,
  windows,
  window_steps,
  do_profile,
  peak_tflops,
  config,
  hlo_dir,
  mesh,
  fp8_gather,
) -> dict:
  t0 = time.perf_counter()
  total_steps = warmup + windows * window_steps
  batches = [jnp.asarray(batch(train, cfg, seed, s)) for s in range(total_steps)]
  gather = P(FSDP, None) if mesh is not None and fp8_gather else None
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = make_trainer(cfg, variant, seed, batches[0], config, gather)
    carry = trainer.carry
    jit_kwargs = {}
    if mesh is not None:
      shardings = fsdp_shardings(carry, mesh)
      data = NamedSharding(mesh, P(FSDP))
      carry = jax.device_put(carry, shardings)
      batches = [jax.device_put(b, data) for b in batches]
      jit_kwargs = dict(
        in_shardings=(shardings, data), out_shardings=(shardings, NamedSharding(mesh, P()))
      )
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    lowered = jax.jit(trainer.step, donate_argnums=0, **jit_kwargs).lower(carry, batches[0])
    step_fn = lowered.compile()
    compile_s = time.perf_counter() - t1
  high_precision = sorted(
    {str(w.message)[:200] for w in caught if issubclass(w.category, core.HighPrecisionGemmWarning)}
  )
  text = step_fn.as_text() if jax.default_backend() == "gpu" or mesh is not None else ""
  gemms = count_gemms(trainer.step, carry, batches[0], text)
  if hlo_dir:
    pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(hlo_dir) / f"{variant}.hlo.txt").write_text(text)
  quantized = trainer.quantized
  fsdp = {}
  if mesh is not None:
    fsdp = dict(
      fsdp_devices=mesh.size,
      fp8_gather=gather is not None,
      sharded_fraction=sharded_fraction(carry),
      all_gathers=all_gathers(text),
    )
  del trainer
  losses = []
  for s in range(warmup):
    carry, loss = step_fn(carry, batches[s])
    losses.append(float(loss))
  window_s = []
  for w in range(windows):
    start = time.perf_counter()
    pending = []
    for s in range(window_steps):
      carry, loss = step_fn(carry, batches[warmup + w * window_steps + s])
      pending.append(loss)
    jax.block_until_ready(pending[-1])
    window_s.append(time.perf_counter() - start)
    losses += [float(x) for x in pending]
  tokens = cfg.tokens_per_step * window_steps
  tps = sorted(tokens / s for s in window_s)
  median = float(np.median(tps))
  flops = cfg.flops_per_step()
  devices = mesh.size if mesh is not None else 1
  family, recipe_name = parse_variant(variant)
  record = dict(
    variant=variant,
    family=family,
    recipe=recipe_name,
    tokens_per_step=cfg.tokens_per_step,
    tokens_per_s=median,
    tokens_per_s_min=tps[0],
    tokens_per_s_max=tps[-1],
    step_ms=1e3 * cfg.tokens_per_step / median,
    mfu=median / cfg.tokens_per_step * flops / (devices * peak_tflops * 1e12),
    model_tflop_per_step=flops / 1e12,
    windows=windows,
    window_steps=window_steps,
    warmup=warmup,
    **gemms,
    fp8=recipe_name != "bf16" and gemms["fp8_gemms"] > 0,
    quantized_layers=quantized,
    **fsdp,
    high_precision=high_precision,
    first_loss=losses[0],
    last_loss=losses[-1],
    losses=losses,
    build_s=build_s,
    compile_s=compile_s,
    device=str(jax.devices()[0].device_kind),
  )
  if recipe_name != "bf16" and not record["fp8"]:
    print(f"WARNING: {variant} ran no FP8 GEMM: it is not an FP8 run", file=sys.stderr)
  if do_profile and jax.default_backend() == "gpu":
    try:
      record["profile"], carry = profile(step_fn, carry, batches, text)
    except Exception as e:  # noqa: BLE001 - the timing above stands without the profile
      record["profile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
  del carry, step_fn, lowered
  gc.collect()
  return record


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", choices=sorted(model_lib.CONFIGS), default="cpu")
  p.add_argument("--variants", default="nnx-bf16,nnx-current,nnx-delayed")
  p.add_argument(
    "--tokens",
    default=None,
    help="directory of bench.llama.data's token files (default: stdlib bytes)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--windows", type=int, default=5)
  p.add_argument("--window-steps", type=int, default=3)
  p.add_argument("--profile", default="", help="comma-separated variants to profile (GPU)")
  p.add_argument("--no-scan", action="store_true", help="unrolled layers instead of a scan")
  p.add_argument(
    "--remat",
    default=None,
    help="rematerialisation for every variant: gemm_outputs "
    "(model.save_gemm_outputs), a jax.checkpoint_policies name, or none "
    "(default: the configuration's)",
  )
  p.add_argument(
    "--time-limit",
    type=float,
    default=None,
    help="seconds: start no variant after this much time has passed",
  )
  p.add_argument(
    "--fsdp",
    type=int,
    default=0,
    help="FSDP over this many devices (the batch scaled by it); 0: one device, no mesh",
  )
  p.add_argument(
    "--no-fp8-gather",
    action="store_true",
    help="FSDP: no kernel_all_gather (XLA gathers the unquantized kernels)",
  )
  p.add_argument(
    "--reference",
    default=None,
    help="FSDP: the one-device records (--out of a run without --fsdp) for scaling efficiency",
  )
  p.add_argument("--hlo-dir", default=None)
  p.add_argument("--out", default=None, help="append the JSON records to this file")
  args = p.parse_args(argv)
  cfg = model_lib.CONFIGS[args.config]
  remat = cfg.remat if args.remat is None else (None if args.remat == "none" else args.remat)
  cfg = dataclasses.replace(cfg, scan=not args.no_scan, remat=remat)
  mesh = None
  if args.fsdp:
    mesh = fsdp_mesh(args.fsdp)
    cfg = dataclasses.replace(cfg, batch=cfg.batch * args.fsdp)
  reference = {}
  if args.reference:
    with open(args.reference) as f:
      reference = {r["variant"]: r for r in map(json.loads, f) if "tokens_per_s" in r}
  variants = args.variants.split(",")
  for v in variants:
    parse_variant(v)
  train, info = token_data(cfg, args.tokens)
  header = run_header(args.config, cfg, data=info, backend=jax.default_backend())
  header.update(devices=jax.device_count(), fsdp=args.fsdp)
  print(json.dumps(header), flush=True)
  start = time.monotonic()
  records = []
  for v in variants:
    if args.time_limit is not None and time.monotonic() - start > args.time_limit:
      print(f"{v}: not started, --time-limit passed", file=sys.stderr, flush=True)
      continue
    try:
      record = run_variant(
        cfg,
        v,
        train,
        seed=args.seed,
        warmup=args.warmup,
        windows=args.windows,
        window_steps=args.window_steps,
        do_profile=v in args.profile.split(","),
        hlo_dir=args.hlo_dir,
        mesh=mesh,
        fp8_gather=not args.no_fp8_gather,
      )
      one = reference.get(v)
      if mesh is not None and one is not None:
        record["one_device_tokens_per_s"] = one["tokens_per_s"]
        record["scaling_efficiency"] = record["tokens_per_s"] / (mesh.size * one["tokens_per_s"])
    except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others
      record = dict(variant=v, error=f"{type(e).__name__}: {str(e)[:2000]}")
    records.append(record)
    line = json.dumps({k: val for k, val in record.items() if k != "losses"})
    print(line, flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
  print_table(records)
  return records


def print_table(records) -> None:
  base = next((r for r in records if r.get("recipe") == "bf16" and "tokens_per_s" in r), None)
  print(
    f"\n{'variant':22s} {'tok/s':>9s} {'x bf16':>7s} {'MFU':>6s} {'step ms':>8s} "
    f"{'FP8/all GEMMs':>13s} {'compile s':>9s} {'loss 1st->last':>15s}"
  )
  for r in records:
    if "error" in r:
      print(f"{r['variant']:22s} ERROR {r['error'][:200]}")
      continue
    ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    print(
      f"{r['variant']:22s} {r['tokens_per_s']:9.0f} {ratio:7.3f} {r['mfu']:6.3f} "
      f"{r['step_ms']:8.1f} {r['fp8_gemms']:>6d}/{r['gemms']:<6d} {r['compile_s']:9.1f} "
      f"{r['first_loss']:7.3f}->{r['last_loss']:.3f}"
      + (f"  efficiency {r['scaling_efficiency']:.3f}" if "scaling_efficiency" in r else "")
      + (f"  all-gathers {r['all_gathers']}" if "all_gathers" in r else "")
    )
  for r in records:
    if "profile" in r:
      prof = r["profile"]
      print(
        f"\nprofile of {r['variant']}: {json.dumps(prof.get('groups_ms'))}, idle "
        f"{prof.get('idle_ms')} ms, span {prof.get('ms_per_step_span')} ms per step"
      )
      for name, cls, ms in prof.get("top_kernels", []):
        print(f"  {ms:8.3f} ms  {cls[:28]:28s} {name}")


if __name__ == "__main__":
  main()
