"""Train a small transformer language model with Flax NNX in bf16 and in FP8.

The same model, initialisation and synthetic data are trained three times: plain bf16 GEMMs,
FP8 with current scaling, and FP8 with delayed scaling. The only differences from an ordinary
NNX training script are the ``recipe=`` of the ``te_adapters.nnx.Linear`` layers and two lines
of the training step: ``te_adapters.nnx.value_and_grad`` in place of ``nnx.value_and_grad`` (it
also returns the new recipe state), and ``te_adapters.nnx.update_recipe_state`` writing that
state into the model.

Run:
  python examples/train_nnx.py               # a few hundred steps, prints the three loss curves
  python examples/train_nnx.py --tiny --steps 3   # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_adapters as ta
from te_adapters import nnx as ta_nnx


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  d_model: int = 128
  heads: int = 4
  layers: int = 2
  seq_len: int = 64
  batch: int = 16
  learning_rate: float = 3e-3


TINY = Config(vocab=32, d_model=32, heads=2, layers=1, seq_len=16, batch=4)

# This model's GEMMs (1024 rows, 128 to 512 features) are far below the size at which FP8 is
# faster than bf16 on a GPU, so by default (core.DEFAULT_SIZE_THRESHOLD) they would run in bf16
# there. The example is about FP8's numerics, so it quantizes them whatever their size.
THRESHOLD = None


class Block(nnx.Module):
  """Pre-norm transformer block; its four GEMMs use ``recipe``."""

  def __init__(self, cfg: Config, recipe, rngs: nnx.Rngs):
    d = cfg.d_model
    kw = dict(recipe=recipe, threshold=THRESHOLD, dtype=jnp.bfloat16, rngs=rngs)
    self.heads = cfg.heads
    self.norm1 = nnx.RMSNorm(d, dtype=jnp.bfloat16, rngs=rngs)
    self.qkv = ta_nnx.Linear(d, 3 * d, use_bias=False, **kw)
    self.out = ta_nnx.Linear(d, d, use_bias=False, **kw)
    self.norm2 = nnx.RMSNorm(d, dtype=jnp.bfloat16, rngs=rngs)
    self.up = ta_nnx.Linear(d, 4 * d, **kw)
    self.down = ta_nnx.Linear(4 * d, d, **kw)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
    mask = nnx.make_causal_mask(jnp.ones((b, t)))
    attn = nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d)
    x = x + self.out(attn)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class LanguageModel(nnx.Module):
  def __init__(self, cfg: Config, recipe, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=jnp.bfloat16, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))
    self.blocks = nnx.List([Block(cfg, recipe, rngs) for _ in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.bfloat16, rngs=rngs)
    self.head = ta_nnx.Linear(
      cfg.d_model, cfg.vocab, recipe=recipe, threshold=THRESHOLD, dtype=jnp.bfloat16, rngs=rngs
    )

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]].astype(jnp.bfloat16)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x)).astype(jnp.float32)


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
  # In place of `loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)`:
  loss, (grads, state_grads) = ta_nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  ta_nnx.update_recipe_state(model, state_grads)  # the one added line
  return loss


def synthetic_batches(cfg: Config, steps: int, seed: int):
  """Token sequences from a fixed random Markov chain: each token has 4 likely successors."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
  probs = np.array([0.55, 0.25, 0.15, 0.05])
  for _ in range(steps):
    tokens = np.empty((cfg.batch, cfg.seq_len + 1), np.int32)
    tokens[:, 0] = rng.integers(0, cfg.vocab, size=cfg.batch)
    for t in range(1, cfg.seq_len + 1):
      choice = rng.choice(4, size=cfg.batch, p=probs)
      tokens[:, t] = successors[tokens[:, t - 1], choice]
    yield jnp.asarray(tokens)


RECIPES = {
  "bf16": None,
  "fp8-current": ta.Float8CurrentScaling(),
  "fp8-delayed": ta.DelayedScaling(amax_history_len=16),
}


def fp8_gemms(model, tokens) -> tuple[int, int]:
  """(GEMMs with FP8 operands, all GEMMs) in one training step's forward and backward pass."""
  graphdef, state = nnx.split(model)
  step = lambda state, tokens: ta_nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), tokens)
  return ta.inspect.count_fp8_dot_generals(step, state, tokens)


def train(
  cfg: Config, recipe, steps: int, seed: int, name: str = "", every: int = 0
) -> tuple[list[float], tuple[int, int]]:
  """The loss of every step and the FP8 GEMM count; with ``every``, a progress line on stderr
  after the first step (which compiles) and every ``every`` steps."""
  model = LanguageModel(cfg, recipe, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
  batches = list(synthetic_batches(cfg, steps, seed))
  counts = fp8_gemms(model, batches[0])
  losses, start, since = [], time.perf_counter(), 0
  for step, batch in enumerate(batches, 1):
    losses.append(float(train_step(model, optimizer, batch)))  # float() waits for the step
    if every and (step == 1 or step % every == 0 or step == steps):
      now = time.perf_counter()
      note = " (the first step compiles)" if since == 0 else ""
      print(
        f"{name}: step {step}/{steps} loss {losses[-1]:.4f} "
        f"{1e3 * (now - start) / (step - since):.1f} ms/step{note}",
        file=sys.stderr,
        flush=True,
      )
      start, since = now, step
  return losses, counts


def main(argv=None) -> dict[str, list[float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--log-every",
    type=int,
    default=0,
    help="steps between progress lines and table rows (default: about 15)",
  )
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  every = args.log_every or max(1, args.steps // 15)

  # Progress on stderr as each run trains; the loss table on stdout once all have.
  runs = {
    name: train(cfg, recipe, args.steps, args.seed, name, every) for name, recipe in RECIPES.items()
  }
  curves = {name: run[0] for name, run in runs.items()}
  print(f"{'step':>6}" + "".join(f"{name:>14}" for name in curves))
  for step in range(args.steps):
    if step % every == 0 or step == args.steps - 1:
      print(f"{step:>6}" + "".join(f"{curves[name][step]:>14.4f}" for name in curves))
  tail = max(1, args.steps // 10)
  base = np.mean(curves["bf16"][-tail:])
  for name in ("fp8-current", "fp8-delayed"):
    print(
      f"{name}: mean of the last {tail} losses {np.mean(curves[name][-tail:]):.4f} "
      f"(bf16 {base:.4f})"
    )
  for name, (_, (fp8, total)) in runs.items():
    print(f"{name}: {fp8} of {total} GEMMs per step with FP8 operands ({jax.default_backend()})")
  return curves


if __name__ == "__main__":
  main()
