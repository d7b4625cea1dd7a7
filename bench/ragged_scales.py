"""Per-group vs per-tensor FP8 scales for the grouped GEMM, measured on CPU.

Normwise relative errors of ``te_adapters.core.ragged_dot`` (current scaling, HYBRID) against a
float64 per-group reference, for the forward output, dgrad and wgrad, with scales per group (what
the core uses) or one scale per tensor. Prints one table per scenario; the numbers quoted in
``te_adapters/core/formats/_grouped_tensor.py`` come from this script.

Usage: ``python bench/ragged_scales.py [--m 4096] [--k 256] [--n 256] [--groups 8]``
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import gemm, init_ragged_state
from te_adapters.core.recipes import DelayedScaling, Float8CurrentScaling

CURRENT = Float8CurrentScaling()


def rel(actual, reference) -> float:
  a = np.asarray(actual, np.float64)
  return float(np.linalg.norm(a - reference) / np.linalg.norm(reference))


def reference(x, w, dy, group_sizes):
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  ends = np.cumsum(group_sizes)
  starts = ends - group_sizes
  y, dx, dw = np.zeros_like(dy), np.zeros_like(x), np.zeros_like(w)
  for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
    y[s:e] = x[s:e] @ w[g]
    dx[s:e] = dy[s:e] @ w[g].T
    dw[g] = x[s:e].T @ dy[s:e]
  return y, dx, dw


@functools.partial(jax.jit, static_argnames=("granularity", "recipe"))
def fp8_grads(x, w, dy, group_sizes, granularity, recipe=CURRENT, state=None):
  state = {} if state is None else state

  # The grouped GEMM's rule on XLA's route, with the scales per group or per tensor.
  spec = gemm.Grouped(
    recipe, None, np.dtype(np.float32), (np.dtype(x.dtype), np.dtype(w.dtype)), "xla", granularity
  )

  def f(x, w, state):
    return gemm.grouped_gemms(x, w, group_sizes, state, spec)

  y, vjp = jax.vjp(f, x, w, state)
  dx, dw, new_state = vjp(dy)
  return y, dx, dw, new_state


def errors(x, w, dy, group_sizes, granularity, rows, expert):
  """(fwd, dgrad, wgrad) errors over everything and over one group's rows / one expert."""
  y, dx, dw, _ = fp8_grads(x, w, dy, jnp.asarray(group_sizes), granularity)
  y_r, dx_r, dw_r = reference(x, w, dy, group_sizes)
  total = (rel(y, y_r), rel(dx, dx_r), rel(dw, dw_r))
  part = (rel(y[rows], y_r[rows]), rel(dx[rows], dx_r[rows]), rel(dw[expert], dw_r[expert]))
  return total, part


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--m", type=int, default=4096)
  p.add_argument("--k", type=int, default=256)
  p.add_argument("--n", type=int, default=256)
  p.add_argument("--groups", type=int, default=8)
  args = p.parse_args()
  m, k, n, g = args.m, args.k, args.n, args.groups
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(keys[0], (m, k), jnp.float32)
  w = jax.random.normal(keys[1], (g, k, n), jnp.float32)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32)
  routes = np.asarray(jax.random.randint(keys[3], (m,), 0, g))
  group_sizes = np.bincount(routes, minlength=g).astype(np.int32)
  ends = np.cumsum(group_sizes)
  last = g - 1
  last_rows = slice(ends[last] - group_sizes[last], ends[last])

  scenarios = [("N(0,1), random routing", x, w, dy)]
  for factor in (1e-2, 1e-3, 1e-4, 1e-5):
    scenarios.append((f"expert {last}'s kernel x{factor:g}", x, w.at[last].multiply(factor), dy))
  for low in (1e-2, 1e-3, 1e-5):
    gate = np.logspace(0, np.log10(low), g).astype(np.float32)
    scale_rows = np.repeat(gate, group_sizes)
    scale_rows = np.concatenate([scale_rows, np.ones(m - scale_rows.size, np.float32)])
    scenarios.append((f"dY of group j x gate_j, gates 1..{low:g}", x, w, dy * scale_rows[:, None]))
    scenarios.append((f"x of group j x gate_j, gates 1..{low:g}", x * scale_rows[:, None], w, dy))

  print(f"M={m} K={k} N={n} G={g}, group sizes {group_sizes.tolist()}")
  print("normwise relative error vs float64; 'group' = the last group's rows / expert")
  header = "| scenario | scales | fwd | dgrad | wgrad | fwd group | dgrad group | wgrad group |"
  print(header)
  print("|" + "---|" * 8)
  for name, xs, ws, dys in scenarios:
    for granularity in ("group", "tensor"):
      total, part = errors(xs, ws, dys, group_sizes, granularity, last_rows, last)
      cells = " | ".join(f"{v:.4f}" for v in total + part)
      print(f"| {name} | {granularity} | {cells} |")

  delayed(m, k, n, g)


def delayed(m, k, n, g, steps=12, history=16):
  """Delayed scaling over steps with skewed routing: fresh N(0,1) data, some tiny groups."""
  recipe = DelayedScaling(amax_history_len=history)
  probs = 1.0 / np.arange(1, g + 1) ** 2  # expert j gets about 1/j^2 of the tokens
  probs /= probs.sum()
  rng = np.random.default_rng(0)
  print()
  print(f"DelayedScaling(amax_history_len={history}), {steps} steps, fresh N(0,1) x, W, dY;")
  print(f"routing probabilities 1/j^2: {np.round(probs, 4).tolist()}")
  print(f"mean over steps 2..{steps - 1}; 'small' = the rows / expert of the rarest group {g - 1}")
  print("| scales | fwd | dgrad | wgrad | fwd small | dgrad small | wgrad small |")
  print("|" + "---|" * 7)
  for granularity in ("group", "tensor"):
    state = init_ragged_state(recipe, g)
    errs = []
    for step in range(steps):
      x = rng.standard_normal((m, k)).astype(np.float32)
      w = rng.standard_normal((g, k, n)).astype(np.float32)
      dy = rng.standard_normal((m, n)).astype(np.float32)
      group_sizes = np.bincount(rng.choice(g, m, p=probs), minlength=g).astype(np.int32)
      y, dx, dw, state = fp8_grads(x, w, dy, jnp.asarray(group_sizes), granularity, recipe, state)
      if step >= 2:  # after the first steps, whose scales come from the initial 1.0
        refs = reference(x, w, dy, group_sizes)
        end = int(group_sizes.sum())
        rows = slice(end - int(group_sizes[-1]), end)
        errs.append(
          [rel(a, r) for a, r in zip((y, dx, dw), refs, strict=True)]
          + [rel(y[rows], refs[0][rows]), rel(dx[rows], refs[1][rows]), rel(dw[-1], refs[2][-1])]
        )
    errs = np.asarray(errs)
    cells = " | ".join(f"{v:.4f}" for v in errs.mean(0))
    print(f"| {granularity} | {cells} |")


if __name__ == "__main__":
  main()
