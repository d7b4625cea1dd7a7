"""Train a small Haiku transformer language model in bf16 and with FP8 GEMMs.

The model is plain Haiku (``hk.MultiHeadAttention``, ``hk.Linear``); ``te_adapters.haiku.quantize``
makes its linear layers FP8 without editing it. Three runs on the same synthetic data:

* ``bf16``: bf16 compute, float32 parameters (the baseline);
* ``current``: the same with FP8 GEMMs, current scaling (stateless);
* ``delayed``: FP8 GEMMs with delayed scaling (amax histories and scales in Haiku state).

The task is to continue sequences that repeat a random block of tokens: the first block is
unpredictable, every later token can be copied from one period back, so the loss can fall well
below ``log(vocab)``. The FP8 loss curves should track the bf16 one.

    python examples/train_haiku.py            # minutes on a CPU
    python examples/train_haiku.py --tiny     # a few seconds; what CI runs
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import te_adapters as ta
from te_adapters import haiku as ta_hk


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  seq_len: int = 64
  batch: int = 32
  d_model: int = 128
  heads: int = 4
  layers: int = 2
  steps: int = 300
  learning_rate: float = 3e-3
  log_every: int = 25
  seed: int = 0


TINY = Config(
  vocab=32,
  seq_len=16,
  batch=16,
  d_model=32,
  heads=2,
  layers=1,
  steps=100,
  learning_rate=1e-2,
  log_every=20,
)

# This model's GEMMs (1024 rows, 128 to 512 features) are far below the size at which FP8 is
# faster than bf16 on a GPU, so by default (core.DEFAULT_SIZE_THRESHOLD) they would run in bf16
# there. The example is about FP8's numerics, so it quantizes them whatever their size.
THRESHOLD = None

RECIPES = {
  "bf16": None,
  "current": ta.Float8CurrentScaling(),
  "delayed": ta.DelayedScaling(amax_history_len=16),
}


def transformer(tokens: jax.Array, cfg: Config, dtype=jnp.bfloat16) -> jax.Array:
  """A pre-LayerNorm decoder in plain Haiku; returns float32 logits."""
  _, length = tokens.shape
  init = hk.initializers.VarianceScaling(1.0, "fan_in", "normal")
  x = hk.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens)
  x = x + hk.get_parameter("positions", [length, cfg.d_model], init=init)
  x = x.astype(dtype)
  mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
  for i in range(cfg.layers):
    h = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(x)
    x = x + hk.MultiHeadAttention(
      cfg.heads, cfg.d_model // cfg.heads, w_init=init, name=f"attention_{i}"
    )(h, h, h, mask=mask)
    h = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(x)
    h = jax.nn.gelu(hk.Linear(4 * cfg.d_model, w_init=init, name=f"mlp_in_{i}")(h))
    x = x + hk.Linear(cfg.d_model, w_init=init, name=f"mlp_out_{i}")(h)
  x = hk.LayerNorm(-1, True, True, name="ln_final")(x)
  return hk.Linear(cfg.vocab, w_init=init, name="logits")(x).astype(jnp.float32)


def batches(cfg: Config):
  """Endless batches of periodic sequences (inputs and next-token targets).

  Each sequence repeats a random block of ``seq_len // 4`` tokens, so every token after the first
  block can be predicted by looking back one period: a job for attention.
  """
  rng = np.random.default_rng(cfg.seed)
  period = cfg.seq_len // 4
  while True:
    block = rng.integers(0, cfg.vocab, size=(cfg.batch, period), dtype=np.int32)
    seq = np.tile(block, (1, cfg.seq_len // period + 1))[:, : cfg.seq_len + 1]
    yield seq[:, :-1], seq[:, 1:]


def init(cfg: Config):
  """Float32 parameters and the delayed-scaling recipe state of the model.

  ``quantize`` does not change parameters (same names, shapes and initial values as the plain
  model), so one set of initial parameters serves the three runs.
  """
  tokens, _ = next(batches(cfg))
  forward = ta_hk.quantize(RECIPES["delayed"], threshold=THRESHOLD)(
    lambda t: transformer(t, cfg, jnp.float32)
  )
  return jax.jit(hk.transform_with_state(forward).init)(jax.random.key(cfg.seed), tokens)


def train(recipe, params, state, cfg: Config, name: str = ""):
  """Trains the model from ``params``; returns the loss of every step, what was quantized, and
  (GEMMs with FP8 operands, all GEMMs) of one step's forward and backward pass. Prints a
  progress line on stderr after the first step (which compiles) and every ``cfg.log_every``."""
  quantize = ta_hk.quantize(recipe, threshold=THRESHOLD)
  model = hk.transform_with_state(quantize(lambda tokens: transformer(tokens, cfg)))
  optimizer = optax.adam(cfg.learning_rate)
  opt_state = optimizer.init(params)

  def loss_fn(params, state, tokens, targets):
    # Mixed precision: float32 parameters, bf16 compute; FP8 GEMMs quantize the bf16 operands.
    compute_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    logits, state = model.apply(compute_params, state, None, tokens)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, state

  @jax.jit
  def step(params, state, opt_state, tokens, targets):
    # Recipe state comes out of the gradient; it never reaches the optimizer.
    loss, _, grads, state = ta_hk.value_grad_and_state(loss_fn)(params, state, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss

  losses = []
  data = batches(cfg)
  gemms = ta.inspect.count_fp8_dot_generals(
    ta_hk.value_grad_and_state(loss_fn), params, state, *batches(cfg).__next__()
  )
  start, since = time.perf_counter(), 0
  for i in range(1, cfg.steps + 1):
    tokens, targets = next(data)
    params, state, opt_state, loss = step(params, state, opt_state, tokens, targets)
    losses.append(float(loss))  # float() waits for the step
    if i == 1 or i % cfg.log_every == 0 or i == cfg.steps:
      now = time.perf_counter()
      note = " (the first step compiles)" if since == 0 else ""
      print(
        f"{name}: step {i}/{cfg.steps} loss {losses[-1]:.4f} "
        f"{1e3 * (now - start) / (i - since):.1f} ms/step{note}",
        file=sys.stderr,
        flush=True,
      )
      start, since = now, i
  return losses, quantize.report, gemms


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a few-second run (CI)")
  parser.add_argument("--steps", type=int, default=None, help="override the number of steps")
  args = parser.parse_args(argv)
  cfg = TINY if args.tiny else Config()
  if args.steps is not None:
    cfg = dataclasses.replace(cfg, steps=args.steps)
  print(f"{jax.default_backend()}: {cfg}")
  print(f"loss at chance: log(vocab) = {math.log(cfg.vocab):.3f}")

  params, delayed_state = init(cfg)
  curves = {}
  for name, recipe in RECIPES.items():
    start = time.perf_counter()
    # Only delayed scaling keeps state (amax histories and scales of every FP8 layer).
    state = delayed_state if name == "delayed" else {}
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # skipped layers are listed from the report below
      curves[name], report, (fp8, gemms) = train(recipe, params, state, cfg, name)
    seconds = time.perf_counter() - start
    print(
      f"{name:8s} {len(report.quantized)} FP8 layers, skipped {report.skipped or 'none'}, "
      f"{fp8} of {gemms} GEMMs per step with FP8 operands, {seconds:.1f} s"
    )

  print("step  " + "  ".join(f"{name:>8s}" for name in curves))
  for i in list(range(0, cfg.steps, cfg.log_every)) + [cfg.steps - 1]:
    print(f"{i:4d}  " + "  ".join(f"{c[i]:8.4f}" for c in curves.values()))
  tail = max(1, cfg.steps // 10)
  final = {name: float(np.mean(c[-tail:])) for name, c in curves.items()}
  print("mean of the last steps: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
  return curves


if __name__ == "__main__":
  main()
