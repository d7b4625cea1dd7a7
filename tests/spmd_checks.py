"""Data and checks shared by the adapters' SPMD tests (8 virtual CPU devices, conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import te_adapters as ta

# Delayed scaling, so that the recipe state is compared too.
RECIPE = ta.DelayedScaling(amax_history_len=4)
DEVICES = 4
FACTORS = (1.0, 2.0)  # per step: the activations' amax changes between steps


def dp_mesh():
  return jax.make_mesh(
      (DEVICES,), ("dp",), devices=jax.devices()[:DEVICES], axis_types=(AxisType.Auto,)
  )


def exact_data(shape, seed):
  """Values in {0, ±0.875, ±1.75, ±3.5} with an amax of 3.5.

  Every per-tensor FP8 scale is then a power of two (448 / 3.5 = 2**7, 57344 / 3.5 = 2**14, and
  twice the amax halves them), so quantization and the weight gradient's sum over the batch are
  exact, and that sum split over devices equals the whole one bit for bit.
  """
  values = np.array([0.0, 0.875, 1.75, 3.5, -0.875, -1.75, -3.5], np.float32)
  data = np.random.default_rng(seed).choice(values, size=shape)
  data.flat[0] = 3.5
  return jnp.asarray(data)


def assert_trees_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def compare_with_one_device(loss, params, new_params, x, dy):
  """Runs ``len(FACTORS)`` steps on one device and inside ``shard_map`` over ``dp``.

  ``loss(params, x, dy) -> (loss, y)``; ``params`` is replicated, ``x`` and ``dy`` are split
  over their leading (batch) dim. ``new_params(params, grads)`` gives the next step's params (the
  recipe state replaced by its gradient). Asserts outputs, gradients and states bit-identical.
  """

  def body(params, x, dy):
    value, y = loss(params, x, dy)
    return jax.lax.psum(value, "dp"), y

  sharded = jax.shard_map(
      body, mesh=dp_mesh(), in_specs=(P(), P("dp"), P("dp")), out_specs=(P(), P("dp"))
  )
  runs = []
  for fn in (loss, sharded):
    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    p, out = params, []
    for factor in FACTORS:
      (_, y), grads = step(p, x * factor, dy)
      p = new_params(p, grads)
      out.append((y, grads))
    runs.append(out)
  assert_trees_identical(runs[1], runs[0])
  return runs[0]


def fsdp_gathers(fn, args):
  """``(compiled fn, [(dtype, shape)] of its all-gathers)`` for ``fn`` jitted over ``args``."""
  compiled = jax.jit(fn).lower(*args).compile()
  gathers = [c.arrays[-1] for c in ta.core.hlo_collectives(compiled.as_text())
             if c.op == "all-gather"]
  return compiled, gathers


def random(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def assert_spmd_keywords_reach_the_core(apply):
  """``apply(x, **keywords)`` builds a quantized model with the SPMD keywords and runs it.

  A mesh axis the mesh lacks in ``amax_axes`` (inside ``shard_map``), and ``kernel_all_gather``
  without a mesh, give the core's errors: so the adapter passed both on.
  """
  x = exact_data((16, 32), 0)
  mapped = jax.shard_map(
      lambda x: apply(x, amax_axes="nope"), mesh=dp_mesh(), in_specs=P("dp"), out_specs=P("dp")
  )
  with pytest.raises(ValueError, match=r"amax_axes for 'x' names mesh axes \['nope'\]"):
    jax.eval_shape(mapped, x)
  with pytest.raises(ValueError, match="kernel_all_gather needs a mesh"):
    jax.eval_shape(lambda x: apply(x, kernel_all_gather=P("nope", None)), x)
