"""Seed 000 section 4: the Dense on a 2x2 mesh (DP x column-parallel TP) through every adapter.

The layer is seed 000's: x (batch, seq, hidden) bf16 @ kernel (hidden, features), float32
parameters computed in bf16, no bias. One step is ``jax.jit(jax.value_and_grad(loss))`` with
TE's speedometer loss ``sum(f32(y) * f32(dy))`` for a given output gradient dy, differentiated
with respect to the parameters, the recipe state (DelayedScaling: the gradient is the new state,
fed back as the next step's state and donated) and x.

Frameworks (each with its own layer and parameter init):
  linen  seed 000's FlaxDenseBlock: nn.Dense(dtype=bf16, dot_general=make_dot_general_cls(...))
  nnx    nnx.Linear (bf16) / te_adapters.nnx.Linear(recipe=...), split with nnx.split
  haiku  hk.Linear (bf16) / te_adapters.haiku.Linear(recipe=...), parameters cast to bf16
Variants: bf16 (the plain layer), current (Float8CurrentScaling), delayed (DelayedScaling,
amax_history_len=1024); every FP8 GEMM is forced (threshold=None).

The mesh is jax.make_mesh((2, 2), ("dp", "tp")) over the first 4 devices: x P("dp", None, None),
dy and y P("dp", None, "tp"), kernel and its gradient P(None, "tp") (column parallel), dx like x,
recipe state replicated P(). The same step also runs on the first device alone with the same
global shapes. Every program is compiled first; then ``--trials`` repeats run them in turn, one
program after another (interleaved, so that a drift of the GPUs' clocks reaches all alike), each
timed twice per repeat: ``iters`` steps each ended by block_until_ready ("sync"), and ``iters``
steps back to back with one sync at the end ("pipelined", as a training loop runs). Reported:
the median over repeats of each. Scaling efficiency is strong scaling, t(1 device) / (4 t(2x2)).

``--configs`` gives the FP8 layers' GemmConfig levers, one mesh program each: ``base`` (the
package's default), or tokens ``m<SMs>`` (``comm_sm_margin``), ``c<n>`` (``sum_chunks``) and
``f`` (``fold_amax``), ``s`` (``non_finite="saturate"``: TE's casts; no operand's inverse
scale then waits on its amax's all-reduce, so under delayed scaling the amaxes feed only the
next state) and ``x`` (``device_sums="exchange"``: dx's and dW's sums as ``ppermute``
exchanges) in that order, e.g. ``base,m16,c4,m16c4,f,m8c4f,s,fs,x``. ``--nccl`` names NCCL
settings for the whole process (``ctas16``: ``NCCL_MAX_CTAS=16``, at most 16 blocks, so 16 SMs,
per collective); bf16 runs under them too. A last letter gives XLA compile options to this
program's compile only, so that programs with and without them are timed in one process: ``o``
XLA's one-shot all-reduce kernel off (``xla_gpu_unsupported_use_all_reduce_one_shot_kernel=
False``), ``a`` XLA's analytical speed-of-light latency estimator for its latency-hiding
scheduler (``xla_gpu_enable_analytical_sol_latency_estimator=True``), ``p`` XLA's collective
permutes as device-to-device copies over the copy engines
(``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY``, for ``x``); several letters
combine their options (``xpa``), e.g. ``base,o,a,sa,xp,xpa``;
each such letter also compiles a bf16 mesh program with the same options, so that FP8 is
compared with bf16 under the same XLA options.
The one-device program takes the default config (the levers act only on sharded programs).

Checks: y, dx and dW of the mesh run against the one-device run of the same framework and
variant (normwise relative error, flagged above 1e-2), and the new recipe state (DelayedScaling),
all at the second step (so DelayedScaling uses scales from the first step's amaxes). The
compiled mesh program's FP8/other GEMMs (te_adapters.inspect.count_fp8_gemms, GPU only) and
collectives.

Usage (4 GPUs, seed 000's sizes):
  python bench/mesh2x2.py --json mesh2x2.json
Dry run on CPU (4 virtual devices, tiny sizes):
  python bench/mesh2x2.py --cpu-devices 4 --batch 4 --seq 64 --hidden 256 --features 512 \\
      --iters 2 --trials 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multidevice import (  # noqa: E402
  add_common_arguments,
  gemm_sm_margins,
  schedule,
  time_steps,
  use_cpu_devices,
  use_nccl_config,
)


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--frameworks", default="linen,nnx,haiku")
  p.add_argument("--variants", default="bf16,current,delayed")
  p.add_argument("--json", default=None, help="write the header and rows here")
  p.add_argument("--hlo-dir", default=None, help="write each mesh program's compiled HLO here")
  p.add_argument(
    "--configs",
    default="base",
    help="FP8 mesh programs' GemmConfig levers: base, m<SMs> (comm_sm_margin), "
    "c<n> (sum_chunks), f (fold_amax), combined as m16c4f; comma-separated",
  )
  p.add_argument(
    "--partial-sums",
    choices=("output", "float32"),
    default=None,
    help="GemmConfig.partial_sums of the FP8 layers: the dtype the sharded GEMMs "
    "sum their partial products in (default: the package's default)",
  )
  add_common_arguments(p)
  return p.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
use_cpu_devices(ARGS and ARGS.cpu_devices)
NCCL_ENV = use_nccl_config(ARGS.nccl) if ARGS is not None else {}

import flax  # noqa: E402
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from seed_layer import FlaxDenseBlock  # noqa: E402  (bench/, on sys.path above)

import te_adapters as ta  # noqa: E402
from te_adapters import haiku as ta_hk  # noqa: E402
from te_adapters import inspect  # noqa: E402
from te_adapters import linen as ta_linen  # noqa: E402
from te_adapters import nnx as ta_nnx  # noqa: E402

MESH_SHAPE, MESH_AXES = (2, 2), ("dp", "tp")
X_SPEC = P("dp", None, None)
DY_SPEC = P("dp", None, "tp")  # also y's
KERNEL_SPEC = P(None, "tp")  # column parallel; also dW's
FLAG_ABOVE = 1e-2
CHECK_STEP = 2  # outputs compared at this step (DelayedScaling: scales from earlier amaxes)
TE_REFERENCE = "TE (GB200s, published): 5.52 ms bf16, 3.71 ms MXFP8"


LEVERS: dict = {}  # the GemmConfig levers of the model being built (parse_config's)
# XLA compile options of the last letter of a config token (see the module docstring).
XLA_OPTIONS = {
  "o": {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False},
  "a": {"xla_gpu_enable_analytical_sol_latency_estimator": True},
  "p": {"xla_gpu_collective_permute_mode": "COLLECTIVES_PEER_MEMORY"},
}


def split_config(token: str) -> tuple[str, dict]:
  """``m16o`` -> (``m16``, the ``o`` compile options); ``o`` -> (``base``, them); ``xpa`` ->
  (``x``, the ``p`` and ``a`` options together)."""
  letters = options_letter(token)
  if letters == "base":
    return token, {}
  options: dict = {}
  for letter in letters:
    options.update(XLA_OPTIONS[letter])
  return token[: -len(letters)] or "base", options


def options_letter(token: str) -> str:
  """The XLA-options letters ending ``token`` (``sa`` -> ``a``, ``xpa`` -> ``pa``), or ``base``
  for none: the bf16 mesh program compiled with the same options."""
  if token == "base":
    return "base"
  end = len(token)
  while end and token[end - 1] in XLA_OPTIONS:
    end -= 1
  return token[end:] or "base"


def parse_config(token: str) -> dict:
  """``base`` -> {}; ``m16c4f`` -> {comm_sm_margin: 16, sum_chunks: 4, fold_amax: True};
  ``s`` -> {non_finite: "saturate"}; ``x`` -> {device_sums: "exchange"}."""
  import re

  token = split_config(token)[0]
  if token == "base":
    return {}
  m = re.fullmatch(r"(?:m(\d+))?(?:c(\d+))?(f)?(s)?(x)?", token)
  if not m or not token:
    raise SystemExit(
      f"--configs: {token!r} is not base or m<SMs>, c<n>, f, s, x combined in order "
      f"(then any of {''.join(XLA_OPTIONS)})"
    )
  out = {}
  if m.group(1):
    out["comm_sm_margin"] = int(m.group(1))
  if m.group(2):
    out["sum_chunks"] = int(m.group(2))
  if m.group(3):
    out["fold_amax"] = True
  if m.group(4):
    out["non_finite"] = "saturate"
  if m.group(5):
    out["device_sums"] = "exchange"
  return out


def _config():
  """The FP8 layers' GemmConfig: None (the package's default) unless --partial-sums or a lever
  is given."""
  kw = dict(LEVERS)
  choice = ARGS.partial_sums if ARGS is not None else None
  if choice is not None:
    kw["partial_sums"] = choice
  return ta.core.GemmConfig(**kw) if kw else None


def _recipe(variant):
  return {
    "bf16": None,
    "current": ta.Float8CurrentScaling(),
    "delayed": ta.DelayedScaling(amax_history_len=1024),
  }[variant]


@dataclasses.dataclass
class Model:
  """A layer as ``apply(params, state, x) -> y`` with its float32 params and recipe state."""

  apply: Callable[[Any, Any, jax.Array], jax.Array]
  params: Any
  state: Any


def build_linen(variant, hidden, features, x_init) -> Model:
  del hidden
  recipe = _recipe(variant)
  if recipe is None:
    cls = lambda: None  # nn.Dense's own dot_general
  else:
    cls = ta_linen.make_dot_general_cls(recipe, threshold=None, config=_config())
  model = FlaxDenseBlock(features, dot_general_cls=cls)
  variables = dict(model.init(jax.random.PRNGKey(1), x_init))
  owg = ta_linen.OVERWRITE_WITH_GRADIENT

  def apply(params, state, x):
    variables = {"params": params, owg: state} if state else {"params": params}
    return model.apply(variables, x)

  return Model(apply, variables["params"], variables.get(owg, {}))


def build_nnx(variant, hidden, features, x_init) -> Model:
  del x_init
  recipe = _recipe(variant)
  kw = dict(use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if recipe is None:
    layer = nnx.Linear(hidden, features, **kw)
  else:
    layer = ta_nnx.Linear(hidden, features, recipe=recipe, threshold=None, config=_config(), **kw)
  graphdef, params, state = nnx.split(layer, nnx.Param, ta_nnx.RecipeState)

  def apply(params, state, x):
    return nnx.merge(graphdef, params, state)(x)

  return Model(apply, params, state)


def build_haiku(variant, hidden, features, x_init) -> Model:
  del hidden
  recipe = _recipe(variant)

  def forward(x):
    if recipe is None:
      return hk.Linear(features, with_bias=False)(x)
    return ta_hk.Linear(features, with_bias=False, recipe=recipe, threshold=None, config=_config())(
      x
    )

  f = hk.transform_with_state(forward)
  # float32 parameters (initialised from a float32 input), computed in bf16 like nn.Dense.
  params, state = f.init(jax.random.PRNGKey(1), x_init.astype(jnp.float32))

  def apply(params, state, x):
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    # The recipe state's new value is its gradient; apply's returned state is not used.
    return f.apply(bf16, state, None, x)[0]

  return Model(apply, params, state)


BUILDERS = {"linen": build_linen, "nnx": build_nnx, "haiku": build_haiku}


def _param_spec(a):
  return KERNEL_SPEC if a.ndim == 2 else P()  # the kernel is the only 2-D parameter


def make_step(model: Model, mesh, donate_state: bool):
  """``(params, state, x, dy) -> ((loss, y), (d params, new state, dx))``, jitted."""

  def loss(params, state, x, dy):
    y = model.apply(params, state, x)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

  grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  kw = {"donate_argnums": (1,)} if donate_state else {}
  if mesh is not None:
    named = lambda spec: NamedSharding(mesh, spec)
    kw["out_shardings"] = (
      (named(P()), named(DY_SPEC)),
      (
        jax.tree.map(lambda a: named(_param_spec(a)), model.params),
        jax.tree.map(lambda a: named(P()), model.state),
        named(X_SPEC),
      ),
    )
  return jax.jit(grad_fn, **kw)


def hlo_summary(text):
  """FP8/other GEMMs (GPU only, else None) and the collectives of compiled HLO text."""
  gemms = None
  if jax.default_backend() == "gpu":
    fp8, other = inspect.count_fp8_gemms(text)
    gemms = f"{fp8}/{other}"
  counts, gathered = {}, {}
  for c in inspect.hlo_collectives(text):
    counts[c.op] = counts.get(c.op, 0) + 1
    if c.op == "all-gather":
      dtype, shape = c.arrays[-1]
      itemsize = (
        1
        if dtype in ("u8", "s8") or dtype.startswith("f8")
        else int(
          jnp.dtype(
            {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}.get(dtype, jnp.float32)
          ).itemsize
        )
      )
      gathered[dtype] = gathered.get(dtype, 0) + itemsize * int(np.prod(shape))
  return gemms, counts, gathered


_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}


def _payload(c):
  """``[(dtype, shape)]`` a collective moves: an async start's type lists operands and results,
  of which the larger side is taken (the gathered result, the reduce-scattered operand)."""
  arrays = list(c.arrays)
  if "-start(" in c.line and len(arrays) % 2 == 0 and len(arrays) > 1:
    half = len(arrays) // 2
    size = lambda arrs: sum(int(np.prod(s)) for _, s in arrs)
    arrays = max(arrays[:half], arrays[half:], key=size)
  return arrays


def _reductions(text):
  """Each HLO computation's name -> "max" or "sum", for those that reduce by one of them."""
  import re

  kinds, name = {}, None
  for line in text.splitlines():
    head = re.match(r"^%?([\w.\-]+) \(.*\{\s*$", line)
    if head:
      name = head.group(1)
    elif name and re.search(r"\bROOT .* (maximum|add)\(", line):
      kinds[name] = "max" if " maximum(" in line else "sum"
  return kinds


def collective_details(text):
  """Each collective of compiled HLO text: op, what it carries, replica groups, arrays, bytes.

  What it carries: ``amax`` (a max of scalars), ``loss`` (a sum of scalars), ``grad`` (a sum of
  a GEMM's output: dx or dW), ``gather``; from the reduction and the arrays' sizes."""
  import re

  kinds = _reductions(text)
  rows = []
  for c in inspect.hlo_collectives(text):
    arrays = _payload(c)
    nbytes = sum(
      _DTYPE_BYTES.get(d, 1 if d.startswith("f8") else 4) * int(np.prod(s)) for d, s in arrays
    )
    apply = re.search(r"to_apply=%?([\w.\-]+)", c.line)
    reduction = kinds.get(apply.group(1)) if apply else None
    scalars = all(int(np.prod(s)) == 1 for _, s in arrays)
    if c.op == "all-gather":
      carries = "gather"
    elif reduction == "max":
      carries = "amax"
    elif scalars:
      carries = "loss"
    elif any(int(np.prod(s)) == 1 for _, s in arrays):
      carries = "grad+loss"  # the loss combined into a gradient's all-reduce
    else:
      carries = "grad"
    groups = re.search(r"replica_groups=(.*?)(?:, [a-z_]+=|$)", c.line)
    rows.append(
      dict(
        op=c.op,
        carries=[carries],
        reduction=reduction,
        groups=groups.group(1) if groups else "",
        arrays=[(d, list(s)) for d, s in arrays],
        bytes=nbytes,
        name=c.line.split("=")[0].replace("ROOT", "").strip().lstrip("%"),
      )
    )
  return rows


def format_collectives(rows):
  """One line per mesh program: each collective with its dtypes, shapes and bytes."""
  lines = []
  for r in rows:
    parts = []
    for c in r.get("collective_details", []):
      arrs = " ".join(f"{d}[{','.join(map(str, s))}]" for d, s in c["arrays"])
      parts.append(
        f"{c['op']}({'+'.join(c['carries']) or '?'}: {arrs}, "
        f"{c['bytes'] / 2**20:.2f} MiB, {c['groups'][:60]})"
      )
    lines.append(f"{r['framework']:<6}{r['variant']:<9}{r['config']:<8}" + "; ".join(parts))
  return "\n".join(lines)


def prepare(model: Model, x, dy, mesh, args, compiler_options=None):
  """Compiles the step on ``mesh`` (None: the first device alone) and runs it to CHECK_STEP and
  through ``args.warmup`` more steps.

  Returns ``(step_once, outputs at CHECK_STEP, compiled HLO text)``; outputs are y, dx, dW
  (device arrays) and the new recipe state (host arrays).
  """
  if mesh is None:
    dev = jax.devices()[0]
    put = lambda a, spec: jax.device_put(a, dev, may_alias=False)
    ctx = contextlib.nullcontext()
  else:
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec), may_alias=False)
    ctx = jax.set_mesh(mesh)
  stateful = bool(jax.tree.leaves(model.state))
  # Copies (may_alias=False): the state is donated, and the model's arrays serve both runs.
  with ctx:
    params = jax.tree.map(lambda a: put(a, _param_spec(a)), model.params)
    state = jax.tree.map(lambda a: put(a, P()), model.state)
    xs, dys = put(x, X_SPEC), put(dy, DY_SPEC)
    step = make_step(model, mesh, donate_state=stateful)
    compiled = step.lower(params, state, xs, dys).compile(compiler_options=compiler_options)
  current = [state]

  def step_once():
    out = compiled(params, current[0], xs, dys)
    current[0] = out[1][1]  # the recipe state's gradient is the next step's state
    return out

  for _ in range(CHECK_STEP):
    (_, y), (g_params, new_state, dx) = step_once()
  (dw,) = jax.tree.leaves(g_params)
  checked = dict(y=y, dx=dx, dw=dw, state=jax.device_get(new_state))
  for _ in range(args.warmup):
    jax.block_until_ready(step_once())
  return step_once, checked, compiled.as_text()


def time_interleaved(programs, args, log=print):
  """``{label: (sync ms, pipelined ms, sync ms per repeat, pipelined ms per repeat)}``: the
  programs timed in turn, ``args.trials`` repeats, medians over repeats; each program's turn
  starts with ``args.warmup`` untimed steps."""
  times = {label: ([], []) for label in programs}
  for r in range(args.trials):
    for label, step_once in programs.items():
      sync, pipe = times[label]
      # args.warmup steps first: the first steps after another program ran are slower.
      sync.append(time_steps(step_once, args.iters, args.warmup, 1, sync_each_step=True))
      pipe.append(time_steps(step_once, args.iters, 0, 1, sync_each_step=False))
    log(f"  repeat {r + 1}/{args.trials} done")
  return {
    label: (float(np.median(s)), float(np.median(p)), s, p) for label, (s, p) in times.items()
  }


@jax.jit
def _rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(a - b))) / jnp.sqrt(jnp.sum(jnp.square(b)))


def compare(mesh_out, one_out):
  """Normwise relative errors of the mesh's y, dx, dW against one device's; the recipe state's
  largest relative error over its arrays (0.0: bit-identical; None: no state)."""
  dev = jax.devices()[0]
  errs = {}
  for key in ("y", "dx", "dw"):
    errs[key] = float(_rel_err(jax.device_put(mesh_out[key], dev), one_out[key]))
  got, want = jax.tree.leaves(mesh_out["state"]), jax.tree.leaves(one_out["state"])
  if not want:
    errs["state"] = None
  else:
    state_errs = []
    for g, w in zip(got, want, strict=True):
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      norm = np.linalg.norm(w)
      state_errs.append(float(np.linalg.norm(g - w) / norm) if norm else float(np.abs(g).max()))
    errs["state"] = max(state_errs)
  return errs


def run(args, log=print):
  global LEVERS
  devices = jax.devices()
  n = int(np.prod(MESH_SHAPE))
  if len(devices) < n:
    raise SystemExit(
      f"a 2x2 mesh needs {n} devices; {len(devices)} present (on CPU: --cpu-devices 4)"
    )
  mesh = jax.make_mesh(
    MESH_SHAPE, MESH_AXES, devices=devices[:n], axis_types=(AxisType.Auto,) * len(MESH_AXES)
  )
  b, s, h, f = args.batch, args.seq, args.hidden, args.features
  kx, kd = jax.random.split(jax.random.PRNGKey(0), 2)
  x = jax.random.normal(kx, (b, s, h), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (b, s, f), jnp.float32).astype(jnp.bfloat16)
  x_init = x[:1, :16]  # parameter shapes depend only on the last dimension
  flops = 6.0 * b * s * h * f  # three GEMMs
  configs = args.configs.split(",")
  programs, rows = {}, []
  for framework in args.frameworks.split(","):
    for variant in args.variants.split(","):
      start = time.perf_counter()
      LEVERS = {}
      model = BUILDERS[framework](variant, h, f, x_init)
      one_step, one_out, _ = prepare(model, x, dy, None, args)
      programs[(framework, variant, "1")] = one_step
      if variant == "bf16":  # no GemmConfig levers; each set of XLA options once
        mesh_configs = list(dict.fromkeys(options_letter(c) for c in configs))
      else:
        mesh_configs = configs
      for config in mesh_configs:
        LEVERS = parse_config(config)
        model = BUILDERS[framework](variant, h, f, x_init)
        options = split_config(config)[1] or None
        mesh_step, mesh_out, text = prepare(model, x, dy, mesh, args, options)
        programs[(framework, variant, config)] = mesh_step
        errs = compare(mesh_out, one_out)
        del mesh_out
        gemms, collectives, gathered = hlo_summary(text)
        if args.hlo_dir:
          os.makedirs(args.hlo_dir, exist_ok=True)
          with open(os.path.join(args.hlo_dir, f"{framework}_{variant}_{config}.txt"), "w") as fh:
            fh.write(text)
        rows.append(
          dict(
            framework=framework,
            variant=variant,
            config=config,
            levers=dict(LEVERS),
            compiler_options=split_config(config)[1],
            rel_y=errs["y"],
            rel_dx=errs["dx"],
            rel_dw=errs["dw"],
            rel_state=errs["state"],
            gemms=gemms,
            gemm_targets=gemm_targets(text),
            collectives=collectives,
            all_gather_bytes=gathered,
            collective_details=collective_details(text),
            schedule=schedule(text),
            flagged=max(v for v in errs.values() if v is not None) > FLAG_ABOVE,
          )
        )
      LEVERS = {}
      del one_out
      log(f"  {framework:<6}{variant:<9}compiled ({time.perf_counter() - start:.1f} s)")
  timed = time_interleaved({"/".join(k): v for k, v in programs.items()}, args, log)
  for r in rows:
    one = timed[f"{r['framework']}/{r['variant']}/1"]
    mesh_t = timed[f"{r['framework']}/{r['variant']}/{r['config']}"]
    r.update(
      ms_1=one[0],
      ms_1_pipelined=one[1],
      ms_2x2=mesh_t[0],
      ms_2x2_pipelined=mesh_t[1],
      ms_1_repeats=one[2],
      ms_2x2_repeats=mesh_t[2],
      ms_1_pipelined_repeats=one[3],
      ms_2x2_pipelined_repeats=mesh_t[3],
    )
    r.update(
      speedup=r["ms_1"] / r["ms_2x2"],
      efficiency=r["ms_1"] / (n * r["ms_2x2"]),
      efficiency_pipelined=r["ms_1_pipelined"] / (n * r["ms_2x2_pipelined"]),
      tflops_per_dev_2x2=flops / (r["ms_2x2"] * 1e-3) / 1e12 / n,
    )
  return rows


def gemm_targets(text):
  """Which GEMM each cuBLASLt call of compiled GPU HLO is: the extension's FFI GEMM, XLA's FP8
  cuBLASLt GEMM, XLA's other cuBLAS GEMMs."""
  import re

  ext = text.count('custom_call_target="te_adapters_block_gemm"')
  xla_fp8 = len(re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', text))
  other = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"', text))
  return dict(extension=ext, xla_fp8=xla_fp8, xla_other=other, sm_margins=gemm_sm_margins(text))


def format_table(rows):
  # each FP8 row against the bf16 row of its framework compiled with the same XLA options
  opts = lambda r: tuple(sorted(r.get("compiler_options", {}).items()))
  bf16 = {(r["framework"], opts(r)): r for r in rows if r["variant"] == "bf16"}
  head = (
    f"{'framework':<8}{'variant':<9}{'config':<8}{'1 dev':>8}{'2x2':>8}{'eff':>6}"
    f"{'vs bf16':>8}{'1 pipe':>8}{'2x2 pipe':>9}{'eff':>6}{'vs bf16':>8}"
    f"{'rel y':>9}{'rel dx':>9}{'rel dW':>9}{'state':>9}{'FP8/oth':>8}  GEMMs; collectives"
  )
  lines = [head, "-" * len(head)]
  fmt_err = lambda v: f"{'-':>9}" if v is None else f"{v:>9.1e}"
  for r in rows:
    ref = bf16.get((r["framework"], opts(r)))
    vs = f"{ref['ms_2x2'] / r['ms_2x2']:>7.3f}x" if ref else f"{'-':>8}"
    vsp = f"{ref['ms_2x2_pipelined'] / r['ms_2x2_pipelined']:>7.3f}x" if ref else f"{'-':>8}"
    coll = ", ".join(f"{op} x{k}" for op, k in sorted(r["collectives"].items())) or "none"
    if r["all_gather_bytes"]:
      coll += (
        " (gathered "
        + ", ".join(f"{d}: {v / 2**20:.1f} MiB" for d, v in sorted(r["all_gather_bytes"].items()))
        + ")"
      )
    t = r["gemm_targets"]
    lines.append(
      f"{r['framework']:<8}{r['variant']:<9}{r['config']:<8}{r['ms_1']:>8.3f}"
      f"{r['ms_2x2']:>8.3f}{r['efficiency']:>6.2f}{vs}{r['ms_1_pipelined']:>8.3f}"
      f"{r['ms_2x2_pipelined']:>9.3f}{r['efficiency_pipelined']:>6.2f}{vsp}"
      f"{fmt_err(r['rel_y'])}{fmt_err(r['rel_dx'])}{fmt_err(r['rel_dw'])}"
      f"{fmt_err(r['rel_state'])}{r['gemms'] or '-':>8}  ext {t['extension']} xla-fp8 "
      f"{t['xla_fp8']} other {t['xla_other']}"
      f"{' sm_margin ' + ','.join(map(str, t['sm_margins'])) if any(t['sm_margins']) else ''}"
      f"; {coll}{'  CHECK' if r['flagged'] else ''}"
    )
  flagged = [f"{r['framework']} {r['variant']} {r['config']}" for r in rows if r["flagged"]]
  lines.append("")
  lines.append(
    f"relative error above {FLAG_ABOVE:g} (mesh against one device): {', '.join(flagged) or 'none'}"
  )
  return "\n".join(lines)


def main():
  args = ARGS
  dev = jax.devices()[0]
  meta = dict(
    date=time.strftime("%Y-%m-%d"),
    device=f"{dev.platform} {dev.device_kind}",
    device_count=jax.device_count(),
    jax=jax.__version__,
    flax=flax.__version__,
    haiku=hk.__version__,
    python=platform.python_version(),
    shape=dict(batch=args.batch, seq=args.seq, hidden=args.hidden, features=args.features),
    iters=args.iters,
    warmup=args.warmup,
    repeats=args.trials,
    configs=args.configs,
    timing="interleaved repeats; each step synchronised, and pipelined (one sync a trial)",
    partial_sums=args.partial_sums or ta.core.GemmConfig().partial_sums,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    nccl=dict(name=args.nccl, env=NCCL_ENV),
  )
  print(
    f"date: {meta['date']}; device: {meta['device']} x {meta['device_count']} "
    f"(mesh 2x2 over the first 4); jax {meta['jax']}, flax {meta['flax']}, "
    f"haiku {meta['haiku']}, python {meta['python']}"
  )
  print(
    f"x ({args.batch}, {args.seq}, {args.hidden}) bf16 @ kernel ({args.hidden}, "
    f"{args.features}) float32 params in bf16, no bias; fwd + bwd with a given dy; "
    f"mean of {args.iters} steps, median of {args.trials} {meta['timing']}; "
    f"partial sums: {meta['partial_sums']}; XLA_FLAGS={meta['xla_flags']!r}; "
    f"NCCL settings {args.nccl}: {NCCL_ENV or 'none'}"
  )
  print(
    f"mesh ('dp': 2, 'tp': 2): x {X_SPEC}, dy/y {DY_SPEC}, kernel/dW {KERNEL_SPEC}, "
    f"recipe state {P()}; errors at step {CHECK_STEP} against the first device alone\n"
  )
  rows = run(args)
  print()
  print(format_table(rows))
  print("\ncollectives of each mesh program (what they carry, arrays, bytes, replica groups):")
  print(format_collectives(rows))
  print("\neach mesh program's GEMMs and collectives in the order XLA scheduled them:")
  for r in rows:
    print(f"{r['framework']:<6}{r['variant']:<9}{r['config']:<8}{' | '.join(r['schedule'])}")
  print(f"\nreference, seed 000 section 4 shape: {TE_REFERENCE}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(meta=meta, te_reference=TE_REFERENCE, rows=rows), fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
