"""DP and FSDP training across processes, for a model from each adapter, against one process.

Run it through the launcher (one process per GPU, or per CPU device):

  python -m bench.multiprocess --processes 2 -- -m bench.multiprocess_check --out OUT/multi \\
      --reference OUT/single/results.json

and alone, one process driving the same N-device mesh (the reference):

  python -m bench.multiprocess_check --out OUT/single             # all local GPUs
  python -m bench.multiprocess_check --cpu-devices 2 --out OUT/single   # N virtual CPU devices

The model, per adapter, is two quantized layers (``in -> hidden``, GELU, ``hidden -> out``, with
biases): Linen ``nn.Dense`` with ``make_dot_general_cls``, NNX ``Linear``, Haiku ``Linear``; every
GEMM in FP8 (``threshold=None``). A step is the adapters' ``value_and_grad`` and plain SGD on a
mean squared error; the recipe state is replaced by its gradient. The global batch is the same
on every process (built from a seed) and lands sharded on batch over the mesh axis ``"data"``:

  dp    parameters replicated
  fsdp  each kernel sharded on its input dim over ``"data"``, gathered for the GEMM by XLA

Each step's batch puts the largest |x| in another process's rows, so a per-process amax would
differ from the global one. After ``--steps`` steps the check asserts, for each adapter, recipe
and plan:

- every process holds the same recipe state and the same losses (``process_allgather`` of each
  process's own copy);
- DelayedScaling: the first layer's newest x amax is the global batch's largest |x|;
- each step's loss is within ``--one-device-rtol`` (1e-2) of the same training on one device.
  The mesh sums the gradients in another order (float32 reassociation, a last bit), and an FP8
  cast can turn a last-bit difference into a step of the FP8 grid where it tips a rounding: on
  CPU, 6 steps stayed within 1e-6, and 200 steps of one configuration drifted to 2.5e-3;
- the state saved with Orbax halfway (each process writes its shards; process 0 the replicated
  arrays) restores into the same shardings and the steps from there give the same losses and
  state bit for bit;
- with ``--reference``: the losses and the state equal the reference run's bit for bit.

Process 0 writes ``OUT/results.json`` (losses as float32 bit patterns, a digest of the state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import use_cpu_devices  # noqa: E402


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--adapters", default="linen,nnx,haiku")
  p.add_argument("--recipes", default="delayed,current")
  p.add_argument("--plans", default="dp,fsdp")
  p.add_argument(
    "--configs",
    default=None,
    help="adapter/recipe/plan,... instead of every combination of the three above",
  )
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--batch", type=int, default=64, help="global batch (rows)")
  p.add_argument("--dims", default="128,128,64", help="in,hidden,out")
  p.add_argument("--lr", type=float, default=0.01)
  p.add_argument("--out", required=True, help="results.json and the checkpoints go here")
  p.add_argument(
    "--reference",
    default=None,
    help="results.json of another run (one process, same mesh): must match bitwise",
  )
  p.add_argument("--no-checkpoint", action="store_true", help="skip the Orbax save and restore")
  p.add_argument("--no-one-device", action="store_true", help="skip the one-device training")
  p.add_argument(
    "--one-device-rtol",
    type=float,
    default=1e-2,
    help="each step's loss against one device's, relative",
  )
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=None,
    help="alone, on this many virtual CPU devices (sets XLA_FLAGS)",
  )
  return p.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
use_cpu_devices(ARGS and ARGS.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import te_adapters as ta  # noqa: E402

RECIPES = {
  "delayed": lambda: ta.DelayedScaling(amax_history_len=4),
  "current": lambda: ta.Float8CurrentScaling(),
}


def _mse(y, t):
  return jnp.mean((y.astype(jnp.float32) - t) ** 2)


# Each adapter: init(recipe, dims, x) -> (params, state, grads_fn), host copies of the
# parameters and the recipe state, and grads_fn(params, state, x, t) -> (loss, grads, new_state).


def _linen(recipe, dims, x):
  from flax import linen as nn

  from te_adapters import linen as ta_linen

  cls = ta_linen.make_dot_general_cls(recipe, threshold=None)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(dims[1], dot_general_cls=cls)(x))
      return nn.Dense(dims[2], dot_general_cls=cls)(h)

  model = MLP()
  variables = model.init(jax.random.key(1), x)
  owg = ta_linen.OVERWRITE_WITH_GRADIENT
  vg = ta_linen.value_and_grad(lambda v, x, t: _mse(model.apply(v, x), t))

  def grads_fn(params, state, x, t):
    variables = {"params": params, **({owg: state} if state else {})}
    loss, (grads, new_state) = vg(variables, x, t)
    return loss, grads, new_state

  return variables["params"], variables.get(owg, {}), grads_fn


def _nnx(recipe, dims, x):
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = ta_nnx.Linear(dims[0], dims[1], recipe=recipe, threshold=None, rngs=rngs)
      self.fc2 = ta_nnx.Linear(dims[1], dims[2], recipe=recipe, threshold=None, rngs=rngs)

    def __call__(self, x):
      return self.fc2(nnx.gelu(self.fc1(x)))

  graphdef, params, state, rest = nnx.split(MLP(nnx.Rngs(1)), nnx.Param, ta_nnx.RecipeState, ...)
  vg = ta_nnx.value_and_grad(lambda m, x, t: _mse(m(x), t))

  def grads_fn(params, state, x, t):
    model = nnx.merge(graphdef, params, state, rest)
    loss, (grads, state_grads) = vg(model, x, t)
    ta_nnx.update_recipe_state(model, state_grads)
    _, _, new_state, _ = nnx.split(model, nnx.Param, ta_nnx.RecipeState, ...)
    return loss, grads, new_state

  return params, state, grads_fn


def _haiku(recipe, dims, x):
  import haiku as hk

  from te_adapters import haiku as ta_hk

  def forward(x):
    h = jax.nn.gelu(ta_hk.Linear(dims[1], recipe=recipe, threshold=None)(x))
    return ta_hk.Linear(dims[2], recipe=recipe, threshold=None)(h)

  model = hk.transform_with_state(forward)
  params, state = model.init(jax.random.key(1), x)

  def loss_fn(params, state, x, t):
    y, state = model.apply(params, state, None, x)
    return _mse(y, t), state

  vg = ta_hk.value_and_grad(loss_fn)

  def grads_fn(params, state, x, t):
    loss, (grads, new_state) = vg(params, state, x, t)
    return loss, grads, new_state

  return params, state, grads_fn


ADAPTERS = {"linen": _linen, "nnx": _nnx, "haiku": _haiku}


def batch(step, rows, dims, shards):
  """Step ``step``'s global batch (x, target), the same on every process. The rows with the
  largest |x| are shard ``step % shards``'s (four times the others): with one device per
  process, another process's rows each step."""
  rng = np.random.default_rng(1000 + step)
  x = rng.standard_normal((rows, dims[0]), np.float32)
  t = rng.standard_normal((rows, dims[2]), np.float32)
  share = rows // shards
  owner = step % shards
  x[owner * share : (owner + 1) * share] *= 4.0
  return x, t


def _specs(tree, plan, is_params):
  def spec(a):
    if is_params and plan == "fsdp" and np.ndim(a) == 2:
      return P("data", None)
    return P()

  return jax.tree.map(spec, tree)


def _place(tree, shardings):
  """Host arrays (the same on every process) as global arrays laid out by ``shardings``."""
  return jax.tree.map(
    lambda a, s: jax.make_array_from_callback(np.shape(a), s, lambda idx: np.asarray(a)[idx]),
    tree,
    shardings,
  )


def _local(tree):
  """This process's copy of replicated arrays, as numpy."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)


def _digest(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    a = np.ascontiguousarray(leaf)
    h.update(str((a.dtype, a.shape)).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _bits(values):
  return [int(v) for v in np.asarray(values, np.float32).view(np.uint32)]


def _flat(tree):
  leaves = [np.ravel(np.asarray(a, np.float32)) for a in jax.tree.leaves(tree)]
  return np.concatenate(leaves) if leaves else np.zeros((0,), np.float32)


def run_config(adapter, recipe_name, plan, args, dims, mesh, ckpt_dir):
  processes = jax.process_count()
  recipe = RECIPES[recipe_name]()
  x0, _ = batch(0, args.batch, dims, jax.device_count())
  local = jax.local_devices()[0]
  with jax.default_device(local):
    params, state, grads_fn = ADAPTERS[adapter](recipe, dims, jnp.asarray(x0[:2]))
  params, state = jax.device_get(params), jax.device_get(state)

  def step(params, state, x, t):
    loss, grads, new_state = grads_fn(params, state, x, t)
    params = jax.tree.map(lambda p, g: p - args.lr * g, params, grads)
    return loss, params, new_state

  # One device: this process alone.
  one = jax.jit(step)
  p1, s1 = jax.device_put((params, state), local)
  one_losses = []
  for i in range(0 if args.no_one_device else args.steps):
    x, t = batch(i, args.batch, dims, jax.device_count())
    loss, p1, s1 = one(p1, s1, jax.device_put(x, local), jax.device_put(t, local))
    one_losses.append(float(loss))
  one_state = jax.device_get(s1)

  # The mesh over every process's devices.
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), _specs(params, plan, True))
  s_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), _specs(state, plan, False))
  d_sh = NamedSharding(mesh, P("data"))
  rep = NamedSharding(mesh, P())
  sharded = jax.jit(step, out_shardings=(rep, p_sh, s_sh))

  def train(p, s, first, last, save_at=None):
    losses, saved = [], None
    for i in range(first, last):
      if i == save_at:
        saved = _save(ckpt_dir, p, s)
      x, t = batch(i, args.batch, dims, jax.device_count())
      loss, p, s = sharded(p, s, _place(x, d_sh), _place(t, d_sh))
      losses.append(float(np.asarray(loss.addressable_shards[0].data)))
    return losses, p, s, saved

  half = args.steps // 2
  with warnings.catch_warnings():
    # FSDP without kernel_all_gather: the kernel is gathered after the cast, as warned.
    warnings.simplefilter("ignore", ta.core.ShardingFallbackWarning)
    with jax.set_mesh(mesh):
      p, s = _place(params, p_sh), _place(state, s_sh)
      losses, p, s, saved = train(p, s, 0, args.steps, save_at=None if args.no_checkpoint else half)
      final_state = _local(s)
      if saved is not None:
        p2, s2 = _restore(saved, p_sh, s_sh, params, state)
        resumed, _, s2, _ = train(p2, s2, half, args.steps)
        assert _bits(resumed) == _bits(losses[half:]), (
          adapter,
          recipe_name,
          plan,
          "after restore",
          resumed,
          losses[half:],
        )
        assert _digest(_local(s2)) == _digest(final_state), (
          adapter,
          recipe_name,
          plan,
          "state after restore",
        )

  # Every process holds the same state and losses.
  mine = np.concatenate([np.asarray(losses, np.float32), _flat(final_state)])
  every = np.asarray(multihost_utils.process_allgather(mine))
  assert every.shape[0] == processes
  for i in range(1, processes):
    assert np.array_equal(every[i].view(np.uint32), every[0].view(np.uint32)), (
      adapter,
      recipe_name,
      plan,
      f"process {i} differs from process 0",
    )

  result = dict(
    losses=losses,
    loss_bits=_bits(losses),
    one_device_losses=one_losses,
    state_digest=_digest(final_state),
    checkpoint=saved is not None,
  )
  if one_losses:
    rel = np.abs(np.asarray(losses) - np.asarray(one_losses)) / np.abs(np.asarray(one_losses))
    result["max_rel_vs_one_device"] = float(rel.max())
  if final_state:
    # The newest x amax of the first layer is the global batch's, not a process's own rows'.
    x_last, _ = batch(args.steps - 1, args.batch, dims, jax.device_count())
    histories = {
      jax.tree_util.keystr(k): np.asarray(v)
      for k, v in jax.tree_util.tree_leaves_with_path(final_state)
      if "x_amax_history" in jax.tree_util.keystr(k)
    }
    first = sorted(histories)[0]  # fc1 / Dense_0 / linear come first
    newest = float(histories[first][-1])
    assert newest == float(np.max(np.abs(x_last))), (adapter, first, newest)
    share = args.batch // processes
    mine_rows = x_last[jax.process_index() * share : (jax.process_index() + 1) * share]
    result["x_amax"] = newest
    result["own_rows_amax"] = float(np.max(np.abs(mine_rows)))
    if one_losses:
      one_flat, mesh_flat = _flat(one_state), _flat(final_state)
      result["state_max_rel_vs_one_device"] = float(
        np.max(np.abs(mesh_flat - one_flat) / np.maximum(np.abs(one_flat), 1e-30))
      )
  return result


def _save(ckpt_dir, params, state):
  import orbax.checkpoint as ocp

  path = os.path.join(ckpt_dir, f"ckpt_{time.monotonic_ns()}")
  # The same name on every process: process 0's clock decides.
  path = multihost_utils.broadcast_one_to_all(np.frombuffer(path.encode().ljust(256), np.uint8))
  path = bytes(np.asarray(path)).decode().strip()
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {"params": params, "state": state})
    ckptr.wait_until_finished()
  return path


def _restore(path, p_sh, s_sh, params, state):
  import orbax.checkpoint as ocp

  abstract = {
    "params": jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), params, p_sh
    ),
    "state": jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), state, s_sh
    ),
  }
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, abstract)
  return restored["params"], restored["state"]


def main(args):
  dims = tuple(int(d) for d in args.dims.split(","))
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  dev = jax.devices()[0]
  lead = jax.process_index() == 0
  if lead:
    print(
      f"{jax.process_count()} processes, {n} devices ({dev.platform} {dev.device_kind}), "
      f"jax {jax.__version__}; batch {args.batch}, dims {dims}, {args.steps} steps"
    )
  os.makedirs(args.out, exist_ok=True)
  ckpt_dir = os.path.abspath(os.path.join(args.out, "checkpoints"))
  if args.configs:
    configs = [tuple(c.split("/")) for c in args.configs.split(",")]
  else:
    configs = [
      (a, r, p)
      for a in args.adapters.split(",")
      for r in args.recipes.split(",")
      for p in args.plans.split(",")
    ]
  results = {}
  for adapter, recipe_name, plan in configs:
    name = f"{adapter}/{recipe_name}/{plan}"
    start = time.perf_counter()
    r = run_config(adapter, recipe_name, plan, args, dims, mesh, ckpt_dir)
    results[name] = r
    if lead:
      amax = (
        f"x amax {r['x_amax']:.4g} (own rows {r['own_rows_amax']:.4g}), " if "x_amax" in r else ""
      )
      one = (
        f"vs one device {r['max_rel_vs_one_device']:.2e}, " if "max_rel_vs_one_device" in r else ""
      )
      print(
        f"{name:<22} loss {r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}, {amax}{one}"
        f"checkpoint {'restored' if r['checkpoint'] else 'off'} "
        f"({time.perf_counter() - start:.1f} s)",
        flush=True,
      )
  summary = dict(
    processes=jax.process_count(),
    devices=n,
    platform=dev.platform,
    device_kind=dev.device_kind,
    jax=jax.__version__,
    steps=args.steps,
    batch=args.batch,
    dims=list(dims),
    results=results,
  )
  if lead:
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(summary, f, indent=1)
  rtol = args.one_device_rtol
  bad = {
    k: r["max_rel_vs_one_device"]
    for k, r in results.items()
    if r.get("max_rel_vs_one_device", 0.0) > rtol
  }
  assert not bad, f"losses off one device's by more than {rtol}: {bad}"
  if args.reference:
    with open(args.reference) as f:
      ref = json.load(f)
    assert ref["devices"] == n, (ref["devices"], n)
    theirs = ref["results"]
    differ = [
      k
      for k, r in results.items()
      if k in theirs
      and (
        r["loss_bits"] != theirs[k]["loss_bits"] or r["state_digest"] != theirs[k]["state_digest"]
      )
    ]
    missing = [k for k in results if k not in ref["results"]]
    if lead:
      print(
        f"against {ref['processes']} process(es) on the same {n}-device mesh: "
        f"{len(results) - len(differ) - len(missing)} of {len(results)} bit for bit"
        + (f"; differ: {differ}" if differ else "")
        + (f"; not in the reference: {missing}" if missing else ""),
        flush=True,
      )
    assert not differ and not missing, (differ, missing)
  if lead:
    print(f"ok: {len(results)} configurations", flush=True)


if __name__ == "__main__":
  main(ARGS)
