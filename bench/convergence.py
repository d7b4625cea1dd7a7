"""Does FP8 training reach bf16's loss? A GPT-style byte-level LM on the Python standard library.

A pre-norm decoder (causal self-attention, GELU MLP, learned positions, 256-byte vocabulary) is
trained with AdamW, linear warm-up and cosine decay on the bytes of the standard library's ``.py``
files (sorted file list, a fixed held-out set of files, batches drawn from a seeded generator),
in bf16 and with FP8 recipes, through each adapter.

The model is written once per framework in plain Flax Linen, Flax NNX and Haiku, and converted
with ``te_adapters.linen.quantize`` / ``te_adapters.nnx.quantize_model`` /
``te_adapters.haiku.quantize``: the bf16 baseline is then the unmodified model, every FP8 run
differs from it only by the conversion, and the conversion is what a user with a model does.
Every projection GEMM (QKV, attention output, MLP in and out) is converted; the byte head is
filtered out (N = 256 is far below the size threshold) and attention's batched score and value
GEMMs are ``jax.nn.dot_product_attention``'s: both stay in bf16. Each adapter's training step is
its ordinary one as the user guide gives it (recipe state fed back every step).

``--size gpu`` (d_model 2048, 4 layers, 16 sequences of 1024 bytes) gives every projection GEMM
an M*K*N of at least 4096**3 with every dim >= 2048, so all of them run in FP8 under the default
size threshold on an H100; ``--size tiny`` is a CPU model with ``threshold=None``.

Output: one JSON line per evaluation point (step, mean train loss since the last point, held-out
loss, tokens/s, MFU against ``--peak-tflops``) and a summary line per run, to stdout and, with
``--out``, appended to a file; ``python bench/convergence_plot.py`` turns them into plots and a
table. ``--save DIR`` writes a checkpoint per run (parameters, optimizer and recipe state, the
data position) with ``np.savez``; ``--resume DIR`` continues from one, bit for bit on CPU.
``--time-limit`` stops cleanly (checkpoint saved) before a command's time runs out.

  python bench/convergence.py --size tiny --adapter nnx --recipes bf16,current --steps 150
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python bench/convergence.py --size gpu \\
      --adapter nnx --recipes bf16,current,delayed,block --steps 1000 --time-limit 540 \\
      --save ckpt --resume ckpt --out convergence.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import sysconfig
import time
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import te_adapters as ta
from te_adapters import core, inspect

VOCAB = 256
ADAPTERS = ("linen", "nnx", "haiku")
RECIPES = {
  "bf16": lambda: None,
  "current": ta.Float8CurrentScaling,
  "delayed": ta.DelayedScaling,  # TE's defaults: amax history 1024, "max"
  "block": ta.Float8BlockScaling,
  "rowwise": ta.Float8RowwiseScaling,
}
# H100 SXM dense bf16 peak; MFU is stated against it for every recipe.
H100_BF16_PEAK_TFLOPS = 989.0


@dataclasses.dataclass(frozen=True)
class Size:
  d_model: int
  heads: int
  layers: int
  seq_len: int
  batch: int
  mlp_ratio: int = 4
  learning_rate: float = 3e-4
  warmup_steps: int = 100
  eval_every: int = 100
  eval_batches: int = 4
  # True: threshold=None, every converted GEMM in FP8 whatever its size (CPU tests); False:
  # the library's default size threshold, as a user gets it.
  fp8_everywhere: bool = False


SIZES = {
  # 4 x 12 * 2048**2 = 201M parameters in projections, 16k tokens per step: about 21 TFLOP a
  # step, 40-60 ms on an H100 in bf16.
  "gpu": Size(d_model=2048, heads=16, layers=4, seq_len=1024, batch=16),
  # d_model 128 so that Float8BlockScaling's 128-wide blocks tile every GEMM (512 tokens). In
  # bf16 it trains well at 1e-3 to 2e-3; at 3e-3 to 1e-2 it stalled near 3.0 nats per byte.
  "tiny": Size(
    d_model=128,
    heads=4,
    layers=2,
    seq_len=64,
    batch=8,
    learning_rate=2e-3,
    warmup_steps=15,
    eval_every=25,
    eval_batches=4,
    fp8_everywhere=True,
  ),
}


# ----------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # uint8
  heldout: np.ndarray  # uint8
  info: dict


def is_heldout(relative_path: str) -> bool:
  """One file in 20, chosen by a hash of its path: stable whatever other files exist."""
  return zlib.crc32(relative_path.encode()) % 20 == 0


def stdlib_files() -> tuple[pathlib.Path, list[str]]:
  """The standard library's directory and its ``.py`` files (installed packages left out),
  relative to it, sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(
    p.relative_to(root).as_posix()
    for p in root.rglob("*.py")
    if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
  )
  if not files:
    raise RuntimeError(f"no .py files under the standard library's directory {root}")
  return root, files


@functools.cache
def stdlib_corpus() -> Corpus:
  """The bytes of the standard library's ``.py`` files (installed packages left out)."""
  root, files = stdlib_files()
  parts = {False: [], True: []}
  for name in files:
    parts[is_heldout(name)].append((root / name).read_bytes())
  train = np.frombuffer(b"".join(parts[False]), np.uint8)
  heldout = np.frombuffer(b"".join(parts[True]), np.uint8)
  digest = hashlib.sha256(train.tobytes() + heldout.tobytes()).hexdigest()[:16]
  info = dict(
    python=sys.version.split()[0],
    files=len(files),
    heldout_files=len(parts[True]),
    train_bytes=int(train.size),
    heldout_bytes=int(heldout.size),
    sha256=digest,
  )
  return Corpus(train, heldout, info)


def train_batch(corpus: Corpus, size: Size, seed: int, step: int) -> np.ndarray:
  """The batch of step ``step``: random windows of seq_len + 1 bytes, a function of the step
  alone, so a resumed run reads what the straight run would have read."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, corpus.train.size - size.seq_len - 1, size=size.batch)
  return corpus.train[starts[:, None] + np.arange(size.seq_len + 1)].astype(np.int32)


def heldout_batches(corpus: Corpus, size: Size) -> list[np.ndarray]:
  """Evenly spaced held-out windows: the same for every seed, recipe and adapter."""
  n = size.eval_batches * size.batch
  starts = np.linspace(0, corpus.heldout.size - size.seq_len - 1, n).astype(np.int64)
  windows = corpus.heldout[starts[:, None] + np.arange(size.seq_len + 1)].astype(np.int32)
  return list(windows.reshape(size.eval_batches, size.batch, size.seq_len + 1))


# ----------------------------------------------------------------------------------------------
# The model, once per framework


def causal_attention(qkv: jax.Array, heads: int) -> jax.Array:
  """Multi-head causal self-attention of a fused (batch, seq, 3 * d) projection; its batched
  GEMMs run in the input dtype."""
  b, t, three_d = qkv.shape
  d = three_d // 3
  q, k, v = (a.reshape(b, t, heads, d // heads) for a in jnp.split(qkv, 3, axis=-1))
  return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)


def cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), tokens[:, 1:]
  ).mean()


def init_std(size: Size) -> tuple[float, float]:
  """GPT-2's initialisation: 0.02, and 0.02 / sqrt(2 * layers) for the residual projections."""
  return 0.02, 0.02 / math.sqrt(2 * max(size.layers, 1))


def is_head(path: str) -> bool:
  return path.split("/")[-1] == "head"


# The three models name their layers alike (embed, positions, block_<i>/{norm1, qkv, out, norm2,
# mlp_in, mlp_out}, norm, head); their parameters differ only in the frameworks' own names.
_LEAF_NAMES = {
  "kernel": "kernel",
  "w": "kernel",
  "embedding": "table",
  "embeddings": "table",
  "positions": "table",
  "scale": "scale",
  "bias": "bias",
  "offset": "bias",
}


def canonical_name(path) -> str:
  """``block_0/qkv/kernel`` for Linen's ``params/block_0/qkv/kernel``, NNX's
  ``blocks/0/qkv/kernel`` and Haiku's ``block_0/qkv/w``."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts += str(key.key).split("/")
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
  parts = [p for p in parts if p not in ("params", "~")]
  if len(parts) > 1 and parts[0] == "blocks":
    parts = [f"block_{parts[1]}", *parts[2:]]
  *module, leaf = parts
  if leaf == "positions":
    module = ["positions"]
  return "/".join([*module, _LEAF_NAMES.get(leaf, leaf)])


def shared_init(params, size: Size, seed: int):
  """``params`` with the same initial values in every framework, drawn from a generator seeded
  by ``seed`` and the parameter's canonical name: GPT-2's initialisation (normal 0.02, and
  0.02 / sqrt(2 * layers) for the residual projections; norms at 1 and 0). So the adapters'
  bf16 runs start alike and their curves can be compared."""
  std, out_std = init_std(size)

  def init(path, leaf):
    name = canonical_name(path)
    shape, dtype = np.shape(leaf), np.asarray(leaf).dtype
    if name.endswith("/scale"):
      return jnp.ones(shape, dtype)
    if name.endswith("/bias"):
      return jnp.zeros(shape, dtype)
    rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
    sigma = out_std if name.split("/")[-2] in ("out", "mlp_out") else std
    return jnp.asarray(rng.normal(0.0, sigma, shape), dtype)

  return jax.tree_util.tree_map_with_path(init, params)


def linen_model(size: Size):
  from flax import linen as nn

  std, out_std = init_std(size)
  dense = functools.partial(
    nn.Dense, use_bias=False, dtype=jnp.bfloat16, kernel_init=nn.initializers.normal(std)
  )
  out_dense = functools.partial(dense, kernel_init=nn.initializers.normal(out_std))

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      d = size.d_model
      h = nn.LayerNorm(epsilon=1e-5, name="norm1")(x)
      x = x + out_dense(d, name="out")(causal_attention(dense(3 * d, name="qkv")(h), size.heads))
      h = nn.LayerNorm(epsilon=1e-5, name="norm2")(x)
      h = nn.gelu(dense(size.mlp_ratio * d, name="mlp_in")(h))
      return x + out_dense(d, name="mlp_out")(h)

  class LanguageModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      t = tokens.shape[1]
      init = nn.initializers.normal(std)
      x = nn.Embed(VOCAB, size.d_model, embedding_init=init, name="embed")(tokens)
      x = x + self.param("positions", init, (size.seq_len, size.d_model))[:t]
      for i in range(size.layers):
        x = Block(name=f"block_{i}")(x)
      return dense(VOCAB, name="head")(nn.LayerNorm(epsilon=1e-5, name="norm")(x))

  return LanguageModel()


def nnx_model(size: Size, seed: int):
  from flax import nnx

  std, out_std = init_std(size)
  init, out_init = nnx.initializers.normal(std), nnx.initializers.normal(out_std)

  class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      d, f = size.d_model, size.mlp_ratio * size.d_model
      linear = functools.partial(nnx.Linear, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
      self.norm1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.qkv = linear(d, 3 * d, kernel_init=init)
      self.out = linear(d, d, kernel_init=out_init)
      self.norm2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.mlp_in = linear(d, f, kernel_init=init)
      self.mlp_out = linear(f, d, kernel_init=out_init)

    def __call__(self, x):
      x = x + self.out(causal_attention(self.qkv(self.norm1(x)), size.heads))
      return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))

  class LanguageModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      d = size.d_model
      self.embed = nnx.Embed(VOCAB, d, embedding_init=init, rngs=rngs)
      self.positions = nnx.Param(init(rngs.params(), (size.seq_len, d)))
      self.blocks = nnx.List([Block(rngs) for _ in range(size.layers)])
      self.norm = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.head = nnx.Linear(
        d, VOCAB, use_bias=False, dtype=jnp.bfloat16, kernel_init=init, rngs=rngs
      )

    def __call__(self, tokens):
      x = self.embed(tokens) + self.positions[...][: tokens.shape[1]]
      for block in self.blocks:
        x = block(x)
      return self.head(self.norm(x))

  return LanguageModel(nnx.Rngs(seed))


def haiku_forward(tokens, size: Size, compute_dtype):
  """The model in plain Haiku. ``hk.Linear`` computes in its input's dtype, so the inputs of the
  projections are cast to ``compute_dtype`` (float32 at init, giving float32 parameters)."""
  import haiku as hk

  std, out_std = init_std(size)
  init, out_init = hk.initializers.RandomNormal(std), hk.initializers.RandomNormal(out_std)

  def linear(features, name, w_init=init):
    layer = hk.Linear(features, with_bias=False, w_init=w_init, name=name)
    return lambda h: layer(h.astype(compute_dtype))

  class Block(hk.Module):
    def __call__(self, x):
      d = size.d_model
      h = hk.LayerNorm(-1, True, True, eps=1e-5, name="norm1")(x)
      x = x + linear(d, "out", out_init)(causal_attention(linear(3 * d, "qkv")(h), size.heads))
      h = hk.LayerNorm(-1, True, True, eps=1e-5, name="norm2")(x)
      h = jax.nn.gelu(linear(size.mlp_ratio * d, "mlp_in")(h))
      return x + linear(d, "mlp_out", out_init)(h)

  t = tokens.shape[1]
  x = hk.Embed(VOCAB, size.d_model, w_init=init, name="embed")(tokens).astype(jnp.float32)
  x = x + hk.get_parameter("positions", [size.seq_len, size.d_model], init=init)[:t]
  for i in range(size.layers):
    x = Block(name=f"block_{i}")(x)
  return linear(VOCAB, "head")(hk.LayerNorm(-1, True, True, eps=1e-5, name="norm")(x))


# ----------------------------------------------------------------------------------------------
# Training, the ordinary way of each adapter


@dataclasses.dataclass
class Trainer:
  """One adapter's training step and evaluation as pure functions of a pytree ``carry`` that
  holds everything a checkpoint needs: parameters, optimizer state, recipe state."""

  carry: object
  step: object  # (carry, tokens) -> (carry, loss)
  eval_loss: object  # (carry, tokens) -> loss
  report: object  # the conversion's report, or None for bf16


def optimizer(size: Size, steps: int) -> optax.GradientTransformation:
  """AdamW (GPT-3's betas and weight decay, gradients clipped to norm 1), linear warm-up to the
  peak learning rate, cosine decay to a tenth of it at the last step."""
  warmup = min(size.warmup_steps, steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, size.learning_rate, warmup, max(steps, warmup + 1), end_value=0.1 * size.learning_rate
  )
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)
  )


def linen_trainer(size, recipe, threshold, seed, tx, sample, config=None) -> Trainer:
  from te_adapters import linen as ta_linen

  model = linen_model(size)
  q = ta_linen.quantize(rules=[(is_head, None), (".*", recipe)], threshold=threshold, config=config)
  # Not jitted: one compile less, and shared_init replaces the random values anyway.
  variables = q(model.init)(jax.random.key(seed), sample[:, :-1])
  variables = dict(variables, params=shared_init(variables["params"], size, seed))
  state = ta_linen.TrainState.create(apply_fn=q(model.apply), variables=variables, tx=tx)

  def loss_fn(variables, tokens):
    return cross_entropy(state.apply_fn(variables, tokens[:, :-1]), tokens)

  def step(state, tokens):
    loss, grads = state.value_and_grad(loss_fn, tokens)
    return state.apply_gradients(grads=grads), loss

  def eval_loss(state, tokens):
    return loss_fn(state.variables, tokens)

  return Trainer(state, step, eval_loss, q.report if recipe is not None else None)


def nnx_trainer(size, recipe, threshold, seed, tx, sample, config=None) -> Trainer:
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  model = nnx_model(size, seed)
  report = None
  if recipe is not None:
    report = ta_nnx.quantize_model(
      # The embedding is a lookup: its attend (a tied head) is never called.
      model,
      rules=[(is_head, None), ("embed", None), (".*", recipe)],
      threshold=threshold,
      config=config,
    )
  params = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(params, shared_init(nnx.to_pure_dict(params), size, seed))
  nnx.update(model, params)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, tokens):
    return cross_entropy(model(tokens[:, :-1]), tokens)

  def train_step(model, opt, tokens):  # the user guide's NNX loop
    loss, (grads, state_grads) = ta_nnx.value_and_grad(loss_fn)(model, tokens)
    opt.update(model, grads)
    ta_nnx.update_recipe_state(model, state_grads)
    return loss

  # The functional form of nnx.jit (split once, merge inside jit): the same step, a pure
  # function of the state, which is also the checkpoint.
  graphdef, carry = nnx.split((model, opt))

  def step(carry, tokens):
    model, opt = nnx.merge(graphdef, carry)
    loss = train_step(model, opt, tokens)
    return nnx.state((model, opt)), loss

  def eval_loss(carry, tokens):
    model, _ = nnx.merge(graphdef, carry)
    return loss_fn(model, tokens)

  return Trainer(carry, step, eval_loss, report)


def haiku_trainer(size, recipe, threshold, seed, tx, sample, config=None) -> Trainer:
  import haiku as hk

  from te_adapters import haiku as ta_hk

  q = ta_hk.quantize(rules=[(is_head, None), (".*", recipe)], threshold=threshold, config=config)
  init = hk.transform_with_state(q(lambda t: haiku_forward(t, size, jnp.float32)))
  model = hk.transform_with_state(q(lambda t: haiku_forward(t, size, jnp.bfloat16)))
  params, state = init.init(jax.random.key(seed), sample[:, :-1])
  params = shared_init(params, size, seed)

  def loss_fn(params, state, tokens):
    # float32 parameters, the projections' kernels cast to bf16 (as Linen's and NNX's
    # dtype=bfloat16 layers do): FP8 GEMMs quantize the bf16 operands.
    compute = jax.tree_util.tree_map_with_path(
      lambda path, p: p.astype(jnp.bfloat16) if canonical_name(path).endswith("/kernel") else p,
      params,
    )
    logits, state = model.apply(compute, state, None, tokens[:, :-1])
    return cross_entropy(logits, tokens), state

  def step(carry, tokens):  # the user guide's Haiku loop
    params, state, opt_state = carry
    loss, _, grads, state = ta_hk.value_grad_and_state(loss_fn)(params, state, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), state, opt_state), loss

  def eval_loss(carry, tokens):
    params, state, _ = carry
    return loss_fn(params, state, tokens)[0]

  return Trainer(
    (params, state, tx.init(params)), step, eval_loss, q.report if recipe is not None else None
  )


TRAINERS = {"linen": linen_trainer, "nnx": nnx_trainer, "haiku": haiku_trainer}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What ``run`` trains: a size (``Size`` or any object with its fields: ``seq_len``,
  ``batch``, ``learning_rate``, ``warmup_steps``, ``eval_every``, ``eval_batches``,
  ``fp8_everywhere``), the trainer of each adapter (``(size, recipe, threshold, seed, tx,
  sample, config=) -> Trainer``), the model FLOPs of one step, and the FP8 GEMMs the step should
  hold (None: no expectation)."""

  size: object
  trainers: dict
  flops_per_step: float
  fp8_gemms_expected: int | None


def gpt_workload(size_name: str) -> Workload:
  """The byte-level GPT of this file at ``SIZES[size_name]``."""
  size = SIZES[size_name]
  return Workload(size, TRAINERS, model_flops_per_step(size), expected_fp8_gemms(size))


# ----------------------------------------------------------------------------------------------
# Checkpoints: the carry's leaves by path, with np.savez


def _leaves(tree) -> dict[str, object]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def save_checkpoint(path: pathlib.Path, carry, meta: dict) -> None:
  """``carry``'s leaves and ``meta``; ``carry`` None writes ``meta`` alone (a finished run)."""
  arrays = {} if carry is None else {f"carry{k}": np.asarray(v) for k, v in _leaves(carry).items()}
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, __meta__=np.array(json.dumps(meta)), **arrays)
  os.replace(tmp, path)


def load_checkpoint(path: pathlib.Path, template) -> tuple[object, dict]:
  """The carry saved at ``path``, in ``template``'s structure, dtypes and shapes."""
  with np.load(path) as data:
    meta = json.loads(str(data["__meta__"]))
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    saved = {k for k in data.files if k != "__meta__"}
    wanted = {f"carry{jax.tree_util.keystr(p)}" for p, _ in flat}
    if saved != wanted:
      raise ValueError(
        f"checkpoint {path} does not match this model: missing {sorted(wanted - saved)[:5]}, "
        f"unexpected {sorted(saved - wanted)[:5]}"
      )
    leaves = []
    for p, leaf in flat:
      value = data[f"carry{jax.tree_util.keystr(p)}"]
      if value.shape != np.shape(leaf) or value.dtype != np.asarray(leaf).dtype:
        raise ValueError(
          f"checkpoint {path}: {jax.tree_util.keystr(p)} is {value.dtype}"
          f"{list(value.shape)}, the model has {np.asarray(leaf).dtype}"
          f"{list(np.shape(leaf))}"
        )
      leaves.append(jnp.asarray(value))
  return jax.tree_util.tree_unflatten(treedef, leaves), meta


def canonical(carry):
  """Every leaf a committed jax array of a fixed dtype (no Python scalars, no weak types), so
  a fresh carry and a restored one give the same compiled step. A copy: the caller's carry
  survives the step's donation. Strong-typed device arrays are copied on their device (a
  model of hundreds of millions of parameters would take seconds through the host)."""

  def leaf(x):
    if isinstance(x, jax.Array) and not x.weak_type:
      return jnp.copy(x)
    return jnp.asarray(np.asarray(x))

  return jax.tree.map(leaf, carry)


# ----------------------------------------------------------------------------------------------
# A run


def model_flops_per_step(size: Size) -> float:
  """6 * (projection and head parameters) per token, plus attention's score and value GEMMs
  (12 * layers * d_model * seq_len per token, the PaLM convention; causal masking not
  discounted)."""
  d, f = size.d_model, size.mlp_ratio * size.d_model
  params = size.layers * (4 * d * d + 2 * d * f) + d * VOCAB
  per_token = 6 * params + 12 * size.layers * d * size.seq_len
  return float(per_token * size.batch * size.seq_len)


def expected_fp8_gemms(size: Size) -> int:
  """Forward, dgrad and wgrad of the four projections of every layer."""
  return 3 * 4 * size.layers


def count_gemms(step, carry, tokens, compiled_text: str) -> dict:
  """FP8 GEMMs of the compiled step (GPU), or of its jaxpr elsewhere: XLA's CPU compiler may
  rewrite FP8 dots in the compiled program, where they are emulated anyway."""
  if jax.default_backend() == "gpu":
    fp8, other = inspect.count_fp8_gemms(compiled_text)
    return dict(fp8_gemms=fp8, gemms=fp8 + other, gemm_count_source="compiled HLO")
  fp8, total = inspect.count_fp8_dot_generals(step, carry, tokens)
  return dict(fp8_gemms=fp8, gemms=total, gemm_count_source="jaxpr")


def emit(record: dict, out) -> None:
  line = json.dumps(record)
  print(line, flush=True)
  if out is not None:
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
      f.write(line + "\n")


def checkpoint_path(directory, adapter: str, recipe: str) -> pathlib.Path:
  return pathlib.Path(directory) / f"{adapter}_{recipe}.npz"


def run(
  adapter: str,
  recipe_name: str,
  size_name: str,
  steps: int,
  seed: int = 0,
  *,
  out=None,
  save=None,
  resume=None,
  deadline: float | None = None,
  stop_at: int | None = None,
  peak_tflops: float = H100_BF16_PEAK_TFLOPS,
  corpus: Corpus | None = None,
  cache: dict | None = None,
  config: core.GemmConfig | None = None,
  workload: Workload | None = None,
  save_every: int | None = None,
  save_completed_state: bool = True,
) -> dict:
  """Trains one (adapter, recipe) run of ``steps`` steps (the schedule's length), up to step
  ``stop_at`` if given, until ``deadline`` (``time.monotonic()``) at the latest; returns its
  summary, with the loss of every step it ran under ``"losses"``, the held-out loss by step
  under ``"evals"`` and the final carry under ``"carry"``. ``cache``, a dict kept by the
  caller, lets later runs of the same (adapter, recipe, size, steps, seed) in this process reuse
  the model and its compiled step (the pieces of a run split by checkpoints). ``config``: the
  ``core.GemmConfig`` every quantized layer gets (``None``: the default). ``workload``: the model
  to train (default: this file's GPT at ``SIZES[size_name]``; ``size_name`` then only names it).
  With ``save``: a checkpoint also every ``save_every`` steps (at evaluation points), and, if
  ``save_completed_state`` is False, a completed run leaves only its record (the step reached,
  no arrays), which ``resume`` reads as "nothing to do"."""
  workload = workload or gpt_workload(size_name)
  size = workload.size
  corpus = corpus or stdlib_corpus()
  if resume is not None and checkpoint_path(resume, adapter, recipe_name).exists():
    with np.load(checkpoint_path(resume, adapter, recipe_name)) as data:
      done = json.loads(str(data["__meta__"]))
    if done["step"] >= steps and done["steps"] == steps:
      print(
        f"{adapter}/{recipe_name}: the checkpoint in {resume} is at step {done['step']} of "
        f"{steps}: nothing to do",
        file=sys.stderr,
      )
      return dict(done, summary=True, already_done=True, losses=[], carry=None)
  recipe = RECIPES[recipe_name]()
  threshold = None if size.fp8_everywhere else core.DEFAULT_SIZE_THRESHOLD
  tx = optimizer(size, steps)
  name = f"{adapter}/{recipe_name}"
  tag = dict(run=name, adapter=adapter, recipe=recipe_name, size=size_name, seed=seed)
  sample = jnp.asarray(train_batch(corpus, size, seed, 0))
  key = (adapter, recipe_name, size_name, steps, seed, config)
  compiled = cache.get(key) if cache is not None else None
  if compiled is None:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      trainer = workload.trainers[adapter](size, recipe, threshold, seed, tx, sample, config=config)
  else:
    trainer = compiled[0]
  carry = canonical(trainer.carry)  # a copy: the trainer's own carry is never donated

  start_step, meta = 0, None
  if resume is not None and checkpoint_path(resume, adapter, recipe_name).exists():
    carry, meta = load_checkpoint(checkpoint_path(resume, adapter, recipe_name), carry)
    for field in ("adapter", "recipe", "size", "seed", "steps", "corpus_sha256"):
      mine = dict(tag, steps=steps, corpus_sha256=corpus.info["sha256"])[field]
      if meta[field] != mine:
        raise ValueError(
          f"--resume: the checkpoint of {name} has {field}={meta[field]!r}, this run {mine!r}"
        )
    start_step = meta["step"]

  if compiled is None:
    compile_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught_step:
      warnings.simplefilter("always")
      step_fn = jax.jit(trainer.step, donate_argnums=0).lower(carry, sample).compile()
      eval_fn = jax.jit(trainer.eval_loss).lower(carry, sample).compile()
    compile_s = time.perf_counter() - compile_start
    high_precision = sorted(
      {
        str(w.message)
        for w in caught + caught_step
        if issubclass(w.category, core.HighPrecisionGemmWarning)
      }
    )
    gemms = count_gemms(trainer.step, carry, sample, step_fn.as_text())
    compiled = (trainer, step_fn, eval_fn, compile_s, high_precision, gemms)
    if cache is not None:
      cache[key] = compiled
  trainer, step_fn, eval_fn, compile_s, high_precision, gemms = compiled
  is_fp8 = recipe is not None and gemms["fp8_gemms"] > 0
  if recipe is not None and not is_fp8:
    print(f"WARNING: {name} ran no FP8 GEMM: it is not an FP8 run", file=sys.stderr)

  heldout = [jnp.asarray(b) for b in heldout_batches(corpus, size)]
  flops = workload.flops_per_step
  tokens_per_step = size.batch * size.seq_len

  def evaluate(carry) -> float:
    evals[step] = float(np.mean([float(eval_fn(carry, b)) for b in heldout]))
    return evals[step]

  def meta_of(step: int) -> dict:
    return dict(tag, steps=steps, step=step, corpus_sha256=corpus.info["sha256"])

  losses, pending, evals = [], [], {}
  train_s, timed_steps = 0.0, 0
  stopped = False
  step = start_step
  last_eval = None
  if step == 0:
    last_eval = dict(
      tag, step=0, train_loss=None, heldout_loss=evaluate(carry), tokens_per_s=None, mfu=None
    )
    emit(last_eval, out)
  interval_start = time.perf_counter()
  interval_steps = 0
  end = steps if stop_at is None else min(stop_at, steps)
  while step < end:
    if deadline is not None and time.monotonic() > deadline:
      stopped = True
      break
    carry, loss = step_fn(carry, jnp.asarray(train_batch(corpus, size, seed, step)))
    pending.append(loss)
    step += 1
    interval_steps += 1
    if step % size.eval_every == 0 or step == steps:
      interval_losses = [float(x) for x in pending]  # waits for the steps to finish
      seconds = time.perf_counter() - interval_start
      losses += interval_losses
      pending = []
      tokens_per_s = interval_steps * tokens_per_step / seconds
      train_s += seconds
      timed_steps += interval_steps
      last_eval = dict(
        tag,
        step=step,
        train_loss=float(np.mean(interval_losses)),
        heldout_loss=evaluate(carry),
        tokens_per_s=tokens_per_s,
        mfu=tokens_per_s / tokens_per_step * flops / (peak_tflops * 1e12),
      )
      emit(last_eval, out)
      if save is not None and save_every and step % save_every == 0 and step < end:
        save_checkpoint(checkpoint_path(save, adapter, recipe_name), carry, meta_of(step))
      interval_start, interval_steps = time.perf_counter(), 0
  losses += [float(x) for x in pending]
  if pending:
    train_s += time.perf_counter() - interval_start
    timed_steps += interval_steps

  if save is not None:
    state = carry if save_completed_state or step < steps else None
    save_checkpoint(checkpoint_path(save, adapter, recipe_name), state, meta_of(step))
  tokens_per_s = timed_steps * tokens_per_step / train_s if timed_steps else None
  report = trainer.report
  summary = dict(
    tag,
    summary=True,
    steps=steps,
    start_step=start_step,
    step=step,
    completed=step >= steps,
    stopped_by_time_limit=stopped,
    final_heldout_loss=last_eval["heldout_loss"] if last_eval else None,
    final_step_evaluated=last_eval["step"] if last_eval else None,
    tokens_per_s=tokens_per_s,
    mfu=tokens_per_s / tokens_per_step * flops / (peak_tflops * 1e12) if tokens_per_s else None,
    peak_tflops=peak_tflops,
    model_tflop_per_step=flops / 1e12,
    compile_s=compile_s,
    **gemms,
    fp8_gemms_expected=workload.fp8_gemms_expected if recipe is not None else 0,
    fp8=is_fp8,
    quantized_layers=len(report.quantized) if report is not None else 0,
    skipped_layers=sorted(dict(report.skipped)) if report is not None else [],
    kept_layers=sorted(p for p in report.high_precision if p not in report.quantized)
    if report is not None
    else [],
    high_precision_warnings=high_precision,
    threshold=repr(threshold),
    gemm_config=repr(config) if config is not None else None,
    device=str(jax.devices()[0].device_kind),
    backend=jax.default_backend(),
    corpus=corpus.info,
  )
  emit(summary, out)
  return dict(summary, losses=losses, evals=evals, carry=carry)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
  parser.add_argument(
    "--adapter", default="nnx", help=f"comma-separated, from {', '.join(ADAPTERS)}"
  )
  parser.add_argument(
    "--recipes",
    default="bf16,current,delayed,block",
    help=f"comma-separated, from {', '.join(RECIPES)}",
  )
  parser.add_argument("--steps", type=int, default=200, help="total steps of each run")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="append the JSON lines to this file too")
  parser.add_argument("--save", help="write a checkpoint per run into this directory")
  parser.add_argument("--resume", help="continue the runs that have a checkpoint here")
  parser.add_argument(
    "--stop-at",
    type=int,
    default=None,
    help="stop each run at this step (the schedule still spans --steps)",
  )
  parser.add_argument(
    "--time-limit",
    type=float,
    default=None,
    help="seconds: stop (and save) then, and start no run in its last 60 s",
  )
  parser.add_argument(
    "--peak-tflops",
    type=float,
    default=H100_BF16_PEAK_TFLOPS,
    help="the peak that MFU is stated against (H100 SXM dense bf16)",
  )
  parser.add_argument(
    "--gemm-config",
    default="",
    help="GemmConfig fields for every quantized layer, e.g. "
    "'fp8_gemm=xla,backend=jax' (to tell kernels' effects apart)",
  )
  args = parser.parse_args(argv)
  config = None
  if args.gemm_config:
    try:
      config = core.GemmConfig(**dict(kv.split("=", 1) for kv in args.gemm_config.split(",")))
      core.check_config(config)
    except (TypeError, ValueError) as e:
      parser.error(f"--gemm-config: {e}")
  adapters = args.adapter.split(",")
  recipes = args.recipes.split(",")
  for a in adapters:
    if a not in ADAPTERS:
      parser.error(f"unknown adapter {a!r}; known: {', '.join(ADAPTERS)}")
  for r in recipes:
    if r not in RECIPES:
      parser.error(f"unknown recipe {r!r}; known: {', '.join(RECIPES)}")
  if args.steps < 1:
    parser.error("--steps must be >= 1")
  deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
  summaries = []
  for adapter in adapters:
    for recipe in recipes:
      if deadline is not None and deadline - time.monotonic() < 60:
        print(
          f"{adapter}/{recipe}: not started, less than 60 s of --time-limit left", file=sys.stderr
        )
        continue
      result = run(
        adapter,
        recipe,
        args.size,
        args.steps,
        args.seed,
        out=args.out,
        save=args.save,
        resume=args.resume,
        deadline=deadline,
        stop_at=args.stop_at,
        peak_tflops=args.peak_tflops,
        config=config,
      )
      summaries.append({k: v for k, v in result.items() if k not in ("losses", "evals", "carry")})
  return summaries


if __name__ == "__main__":
  main()
