"""FSDP on every adapter's fused modules: ``LayerNormDenseGeneral`` and ``LayerNormMLP`` (Linen,
NNX, Haiku) built with ``kernel_all_gather=P("fsdp")``, their kernels sharded over a 2-device
``fsdp`` mesh on their first dim (and the rows over it too), against the same module on one
device.

Each keeps the fused path (one run of the quantized GEMM rule with the norm inside, no
``FusedPathFallbackWarning``), its compiled step all-gathers each kernel as u8 (one byte per
element: the FP8 shard, not bf16 or float32), and its output and gradients equal one device's:
the output exactly (each device's rows are computed as one device computes them), the gradients
within float32 reassociation, normwise 1e-6 (the weight, gamma and bias gradients are each
device's row sums added; a missing or doubled sum is off by a factor of 2). A spec that does not
fit the kernels raises ``core.dot_general``'s error.
"""

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

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")

B, S, K, F = 4, 16, 64, 128
RECIPE = ta.Float8CurrentScaling()
ACTS = ("silu", "linear")
KERNELS = ("kernel", "wi_kernel", "wo_kernel")


def _module(framework, block, gather, recipe=RECIPE):
  """``(apply(params, x) -> out, params)`` of the module built with ``kernel_all_gather``."""
  x = jnp.ones((B, S, K))
  kw = dict(recipe=recipe, threshold=None, return_layernorm_output=False)
  if gather is not None:
    kw["kernel_all_gather"] = gather
  if framework == "linen":
    from te_adapters import linen as ta_linen

    if block == "dense":
      m = ta_linen.LayerNormDenseGeneral(F, **kw)
      call = {}
    else:
      m = ta_linen.LayerNormMLP(F, activations=ACTS, intermediate_dropout_rate=0.0, **kw)
      call = {"deterministic": True}
    variables = m.init(jax.random.key(0), x, **call)
    rest = {c: v for c, v in variables.items() if c != "params"}
    return lambda p, x: m.apply({**rest, "params": p}, x, **call)[0], variables["params"]
  if framework == "nnx":
    from flax import nnx

    from te_adapters import nnx as ta_nnx

    if block == "dense":
      m = ta_nnx.LayerNormDenseGeneral(K, F, **kw, rngs=nnx.Rngs(0))
    else:
      m = ta_nnx.LayerNormMLP(K, F, activations=ACTS, **kw, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    return lambda p, x: nnx.merge(graphdef, p, rest)(x)[0], params
  import haiku as hk

  from te_adapters import haiku as ta_hk

  def forward(x):
    if block == "dense":
      return ta_hk.LayerNormDenseGeneral(F, **kw)(x)[0]
    return ta_hk.LayerNormMLP(F, activations=ACTS, **kw)(x)[0]

  f = hk.transform_with_state(forward)
  params, state = f.init(jax.random.key(0), x)
  return lambda p, x: f.apply(p, state, None, x)[0], params


def _key(path):
  return str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))


def _placed(mesh, params):
  """The kernels sharded over ``fsdp`` on their first dim, the rest replicated."""

  def put(path, leaf):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    spec = P("fsdp") if any(n in KERNELS for n in names) else P()
    return jax.device_put(leaf, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(put, params)


def _step(apply, dy):
  def step(p, x):
    out, vjp = jax.vjp(apply, p, x)
    return out, vjp(dy)

  return step


@pytest.mark.parametrize("block", ["dense", "mlp"])
@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_fused_module_gathers_fp8_kernels_and_matches_one_device(framework, block):
  x = spmd_checks.random((B, S, K), 10)
  dy = spmd_checks.random((B, S, F if block == "dense" else K), 11)
  apply_ref, params = _module(framework, block, None)
  want = jax.jit(_step(apply_ref, dy))(params, x)
  mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("error", core.FusedPathFallbackWarning)
    apply, _ = _module(framework, block, P("fsdp"))
    placed, xs = _placed(mesh, params), jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    text = str(jax.make_jaxpr(apply)(placed, xs))
    # The fused path: one run of the GEMM rule, the norm inside it.
    assert text.count("name=_quantized_gemms") == 1 and "name=_norm\n" not in text
    step = _step(apply, jax.device_put(dy, NamedSharding(mesh, P("fsdp"))))
    _, gathers = spmd_checks.fsdp_gathers(step, (placed, xs))
    got = jax.jit(step)(placed, xs)
  kernels = [K * F] if block == "dense" else [K * 2 * F, F * K]
  assert sorted((d, int(np.prod(s))) for d, s in gathers) == sorted(("u8", n) for n in kernels)
  spmd_checks.assert_close_to_one_device(got[0], want[0], "out")
  leaves = jax.tree_util.tree_leaves_with_path(got[1])
  for (path, a), b in zip(leaves, jax.tree.leaves(want[1]), strict=True):
    name = jax.tree_util.keystr(path)
    spmd_checks.assert_close_to_one_device(a, b, name, cpu_rel=1e-6)
    if _key(path) in KERNELS or any(k in name for k in KERNELS):
      assert a.sharding.spec[0] == "fsdp", (name, a.sharding)  # reduce-scattered back


@pytest.mark.parametrize("block", ["dense", "mlp"])
@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_fused_module_with_a_bad_spec_raises_dot_generals_error(framework, block):
  x = jnp.ones((B, S, K))
  with pytest.raises(ValueError, match="has 4 entries but the kernel has"):
    apply, params = _module(framework, block, P("fsdp", None, None, None))
    jax.eval_shape(apply, params, x)
  with pytest.raises(ValueError, match="kernel_all_gather needs a mesh"):
    apply, params = _module(framework, block, P("fsdp"))
    jax.eval_shape(apply, params, x)
  # As the adapters' Dense and Linear layers refuse it: an FP8 gather without a recipe.
  with pytest.raises(ValueError, match=r"(?i)layer_?norm.*: amax_axes and kernel_all_gather need"):
    apply, params = _module(framework, block, P("fsdp"), recipe=None)
    jax.eval_shape(apply, params, x)
