"""FSDP on the fused norm and MLP paths: ``core.layernorm_dense`` and ``core.layernorm_mlp`` with
``kernel_all_gather``, on a 2-device ``fsdp`` mesh, against the same call on one device.

The fused path is kept (one run of the quantized GEMM rule, the norm inside it, no
``FusedPathFallbackWarning``), each kernel shard is cast to FP8 and its bytes all-gathered (the
compiled program's all-gathers are u8, one byte per kernel element), and the outputs, the
gradients and the recipe state equal one device's. The rows are sharded over ``fsdp`` too (FSDP
is data parallel), so every weight, gamma and bias gradient is the two devices' row sums added
and reduce-scattered: float32 reassociation, bounded as ``test_fused_sharding`` bounds it (normwise
1e-6 for float32, 1e-3 for bfloat16 arrays, where a last-bit float32 difference tips a rounding
now and then; a missing or doubled sum over the devices is off by a factor of 2). Recipe state
to 2 float32 ulps (the norm's amax comes from each program's own fusion). A bad spec raises
``dot_general``'s error, and where the fused path does not apply the composed path hands the
spec to ``dot_general``.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_adapters as ta
from te_adapters import core
from tests import spmd_checks
from tests.core import test_fused_sharding as fused

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

B, S, K, F = fused.B, fused.S, fused.K, fused.F
RECIPES = fused.RECIPES
FSDP = P("fsdp")


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((2,), ("fsdp",), axis_types=(axis_type,), devices=jax.devices()[:2])


def _sharded(mesh, p, x, dy):
  """The kernels (and rows) on the mesh, FSDP's way: each kernel over its first dim."""
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  kernels = {n: put(p[n], FSDP) for n in ("wi_kernel", "wo_kernel", "kernel")}
  return {**p, **kernels}, put(x, FSDP), put(dy, FSDP)


def _u8_gathers(step, *args):
  """The compiled step's all-gathers, ``(dtype, elements)``."""
  _, gathers = spmd_checks.fsdp_gathers(step, args)
  return sorted((dtype, int(np.prod(shape))) for dtype, shape in gathers)


@pytest.mark.parametrize("block", ["mlp", "dense"])
@pytest.mark.parametrize(
  "name, axis_type",
  [(name, AxisType.Auto) for name in RECIPES] + [("current", AxisType.Explicit)],
  ids=lambda v: getattr(v, "name", v),
)
def test_fused_path_gathers_fp8_kernels_under_jit_and_matches_one_device(
  monkeypatch, name, axis_type, block
):
  """Under ``jit``, the mesh's axes Auto (the gather a pair of sharding constraints) or
  Explicit (the kernel's type carries its sharding; the gather a reshard). The GEMMs are the
  extension's (on CPU its stand-in), in every program: on Explicit axes too, where the backward
  GEMMs name their outputs' shardings; XLA's FP8 dot there rounded the input gradient otherwise,
  which moved current scaling's next amax and the FP8 codes it scales (2.8e-2 on two H100s)."""
  spmd_checks.emulate_fp8_gemm(monkeypatch)
  recipe, fn = RECIPES[name], {"mlp": fused._mlp, "dense": fused._dense}[block]
  x, dy_mlp, dy_dense = fused._data()
  dy = dy_mlp if block == "mlp" else dy_dense
  p, states = fused._params(), fused._states(recipe, 2 if block == "mlp" else 1)
  loss = functools.partial(fused._loss, fn, recipe, {"kernel_all_gather": FSDP})
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    ps, xs, dys = _sharded(mesh, p, x, dy)
    with warnings.catch_warnings():
      warnings.simplefilter("error", core.FusedPathFallbackWarning)
      assert fused._fused(loss, xs, ps, states, dy)
      step = fused._grad(loss)
      gathers = _u8_gathers(step, xs, ps, states, dys)
      got = fused._steps(step, xs, ps, states, dys)
  # One gather per kernel, of its FP8 bytes (the gathered kernel is kept for the backward pass).
  kernels = [K * 2 * F, F * K] if block == "mlp" else [K * F]
  assert gathers == sorted(("u8", n) for n in kernels), gathers
  want = fused._steps(fused._grad(functools.partial(fused._loss, fn, recipe, {})), x, p, states, dy)
  fused._assert_within_reassociation(got, want)
  # The kernel gradients stay sharded like the kernels (reduce-scattered back).
  grads = got[0][1][1]
  for n in ("wi_kernel", "wo_kernel") if block == "mlp" else ("kernel",):
    assert grads[n].sharding.spec[0] == "fsdp", (n, grads[n].sharding)


@pytest.mark.parametrize("block", ["mlp", "dense"])
def test_fused_path_gathers_fp8_kernel_shards_inside_shard_map(block):
  """Inside ``shard_map`` each device holds its kernel shards (and rows): the gathered shapes
  size the GEMMs, and the gradients come back as shards."""
  recipe, fn = RECIPES["delayed"], {"mlp": fused._mlp, "dense": fused._dense}[block]
  x, dy_mlp, dy_dense = fused._data()
  dy = dy_mlp if block == "mlp" else dy_dense
  p, states = fused._params(), fused._states(recipe, 2 if block == "mlp" else 1)
  loss = functools.partial(fused._loss, fn, recipe, {"kernel_all_gather": FSDP})

  def body(x, p, states, dy):
    value, y = loss(x, p, states, dy)
    return jax.lax.psum(value, "fsdp"), y

  p_specs = {n: FSDP if n in ("wi_kernel", "wo_kernel", "kernel") else P() for n in p}
  sharded = jax.shard_map(
    body, mesh=_mesh(), in_specs=(FSDP, p_specs, P(), FSDP), out_specs=(P(), FSDP)
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.FusedPathFallbackWarning)
    assert fused._fused(sharded, x, p, states, dy)
    gathers = _u8_gathers(fused._grad(sharded), x, p, states, dy)
    got = fused._steps(fused._grad(sharded), x, p, states, dy)
  kernels = [K * 2 * F, F * K] if block == "mlp" else [K * F]
  assert gathers == sorted(("u8", n) for n in kernels), gathers
  want = fused._steps(fused._grad(functools.partial(fused._loss, fn, recipe, {})), x, p, states, dy)
  fused._assert_within_reassociation(got, want)


def test_layernorm_dense_gathers_a_kernel_sharded_on_its_second_feature_dim():
  """A kernel ``(K, heads, head_dim)`` gathered on ``head_dim``: the layout orders that dim first
  in N, as ``dot_general``'s does, and puts the output's dims (and the bias's) back. The output
  and the gradients (from the same bf16 output gradient) are compared, not a float32 loss of
  the bf16 output: XLA may skip that rounding in one program and not the other."""
  recipe = RECIPES["current"]
  x, _, _ = fused._data()
  p = fused._params()
  kernel = p["kernel"].reshape(K, 4, F // 4)
  bias = p["dense_bias"].reshape(4, F // 4)
  dz = spmd_checks.random((B, S, 4, F // 4), 12).astype(jnp.bfloat16)

  def dense(x, kernel, bias, **kw):
    return core.layernorm_dense(
      x, p["scale"], p["ln_bias"], kernel, recipe=recipe, threshold=None, dense_bias=bias, **kw
    )[0]

  def step(x, kernel, bias, **kw):
    z, vjp = jax.vjp(functools.partial(dense, **kw), x, kernel, bias)
    return z, vjp(dz)

  want = jax.jit(step)(x, kernel, bias)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    spec = P(None, None, "fsdp")
    gathered = functools.partial(step, kernel_all_gather=spec)
    ks = jax.device_put(kernel, NamedSharding(mesh, spec))
    with warnings.catch_warnings():
      warnings.simplefilter("error", core.FusedPathFallbackWarning)
      assert fused._fused(functools.partial(dense, kernel_all_gather=spec), x, ks, bias)
      assert _u8_gathers(gathered, x, ks, bias) == [("u8", K * F)]
      got = jax.jit(gathered)(x, ks, bias)
  assert got[1][1].sharding.spec == spec
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    spmd_checks.assert_close_to_one_device(a, b, cpu_rel=1e-6 if a.dtype == jnp.float32 else 1e-3)


def test_dgrad_of_a_kernel_gathered_on_its_output_features_sums_on_one_device(monkeypatch):
  """``dot_general`` with the kernel ``(K, heads, head_dim)`` sharded and gathered on ``head_dim``
  (N), the input replicated, the extension's GEMM and cast (on CPU the GEMM's stand-in): their
  rules let XLA's partitioner choose the shardings, and the kernel's gradient, sharded on N,
  drew the output gradient's FP8 copies onto ``fsdp`` on N too, so that dgrad summed partial
  products over the devices on the gathered kernel sliced again (an all-reduce of the input
  gradient, 2.8e-3 off one device's on CPU; on two H100s ``layernorm_dense`` compiled with no FP8
  gather at all). Those copies are kept whole on the gathered dim: one FP8 gather, no sum over
  devices, the outputs and gradients one device's."""
  spmd_checks.emulate_fp8_gemm(monkeypatch)
  config = core.GemmConfig(backend="ffi")
  x, _, _ = fused._data()
  kernel = fused._params()["kernel"].reshape(K, 4, F // 4).astype(jnp.bfloat16)
  dz = spmd_checks.random((B, S, 4, F // 4), 12).astype(jnp.bfloat16)

  def step(x, kernel, **kw):
    def gemm(x, kernel):
      return core.dot_general(
        x,
        kernel,
        (((2,), (0,)), ((), ())),
        recipe=RECIPES["current"],
        threshold=None,
        config=config,
        **kw,
      )

    z, vjp = jax.vjp(gemm, x, kernel)
    return z, vjp(dz)

  want = jax.jit(step)(x, kernel)
  mesh = _mesh()
  spec = P(None, None, "fsdp")
  with jax.set_mesh(mesh):
    gathered = jax.jit(functools.partial(step, kernel_all_gather=spec))
    ks = jax.device_put(kernel, NamedSharding(mesh, spec))
    text = gathered.lower(x, ks).compile().as_text()
    got = gathered(x, ks)
  collectives = ta.inspect.hlo_collectives(text)
  gathers = [a for c in collectives if c.op == "all-gather" for a in spmd_checks.result_arrays(c)]
  assert [(d, int(np.prod(s))) for d, s in gathers] == [("u8", K * F)], gathers
  sums = [a for c in collectives if c.op == "all-reduce" for a in spmd_checks.result_arrays(c)]
  assert all(int(np.prod(s)) <= 1 for _, s in sums), sums  # the amaxes only
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    spmd_checks.assert_close_to_one_device(a, b)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"kernel_all_gather": P("fsdp", None, None, None)}, ValueError, "has 4 entries"),
    ({"kernel_all_gather": P(None, None)}, ValueError, "names no mesh axis"),
    ({"kernel_all_gather": "fsdp"}, TypeError, "must be a PartitionSpec"),
    ({"recipe": None, "kernel_all_gather": FSDP}, ValueError, "need a recipe"),
    ({"kernel_all_gather": P("nope")}, ValueError, "kernel_all_gather needs a mesh"),
    (
      {"recipe": ta.MXFP8BlockScaling(), "kernel_all_gather": FSDP},
      NotImplementedError,
      "per-tensor FP8 recipes",
    ),
  ],
)
@pytest.mark.parametrize("block", ["mlp", "dense"])
def test_bad_kernel_all_gather_raises_dot_generals_error(block, kwargs, error, match):
  x, _, _ = fused._data()
  p = fused._params()
  kwargs = {"recipe": RECIPES["current"], **kwargs}
  fn = {"mlp": fused._mlp, "dense": fused._dense}[block]
  recipe = kwargs.pop("recipe")
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda x: fn(x, p, None, recipe, **kwargs), x)
  # dot_general's own, on the same kernel.
  with pytest.raises(error, match=match):
    jax.eval_shape(
      lambda x: core.dot_general(
        x,
        p["wi_kernel"] if block == "mlp" else p["kernel"],
        (((2,), (0,)), ((), ())),
        recipe=recipe,
        threshold=None,
        **kwargs,
      ),
      x,
    )


def test_composed_path_passes_the_gather_to_dot_general():
  """Where the fused path does not apply (the norm's output asked for), ``dot_general`` takes
  ``kernel_all_gather``: the same FP8 gather, the same results as one device's composed path."""
  recipe = RECIPES["current"]
  x, _, dy = fused._data()
  p = fused._params()

  def step(x, kernel, **kw):
    def dense(x, kernel):
      z, ln = core.layernorm_dense(
        x,
        p["scale"],
        p["ln_bias"],
        kernel,
        recipe=recipe,
        threshold=None,
        return_layernorm_output=True,
        **kw,
      )
      return z, ln

    (z, ln), vjp = jax.vjp(dense, x, kernel)
    return z, ln, vjp((dy.astype(z.dtype), jnp.zeros_like(ln)))

  want = jax.jit(step)(x, p["kernel"])
  mesh = _mesh()
  with jax.set_mesh(mesh):
    gathered = functools.partial(step, kernel_all_gather=FSDP)
    ks = jax.device_put(p["kernel"], NamedSharding(mesh, FSDP))
    xs = jax.device_put(x, NamedSharding(mesh, FSDP))
    assert _u8_gathers(gathered, xs, ks) == [("u8", K * F)]
    got = jax.jit(gathered)(xs, ks)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    spmd_checks.assert_close_to_one_device(a, b, cpu_rel=1e-6 if a.dtype == jnp.float32 else 1e-3)
