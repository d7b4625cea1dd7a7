"""The user guide's "Every recipe on every path" table, checked cell by cell: the table is read
from docs/guide/recipes.md (rows: recipes; columns: paths), and each cell's word is checked
against what a training step of that path under that recipe traces (its GEMMs' operand dtypes,
the custom VJPs it runs, the warning or the error it raises)."""

import functools
import pathlib
import re
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_adapters as ta
from te_adapters import core, inspect
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "recipes.md"
SECTION = "## Every recipe on every path"
WORDS = ("native", "native (CUTLASS build)", "emulated", "fused", "composed (reported)")
M, K, F = 128, 128, 256  # blocks of 128 tile every GEMM
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_QUANTIZED = (*_FP8, "float4_e2m1fn")


def _table():
  """``{(recipe row, column): cell}`` from the page's section."""
  text = PAGE.read_text()
  assert SECTION in text, f"{PAGE.name} has no section {SECTION!r}"
  body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
  lines = [ln for ln in body.splitlines() if ln.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  cells = {}
  for line in lines[2:]:
    row = [c.strip() for c in line.strip("|").split("|")]
    assert len(row) == len(header), line
    for column, cell in zip(header[1:], row[1:], strict=True):
      cells[(row[0], column)] = cell
  return header[1:], cells


COLUMNS, CELLS = _table()


def _recipe(row):
  """The row's recipe: the class named in backticks, with its defaults."""
  name = re.search(r"`(\w+)`", row).group(1)
  return getattr(ta, name)()


def _keys(recipe, n=1):
  if not recipe.uses_rng:
    return (None,) * n
  return tuple(jax.random.key(10 + i) for i in range(n))


def _data(seed=0):
  rng = np.random.default_rng(seed)

  def r(*shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  return {
    "x": r(M, K).astype(jnp.bfloat16),
    "w": r(K, F, scale=K**-0.5),
    "scale": 1.0 + r(K, scale=0.1),
    "bias": r(K, scale=0.1),
    "wi": r(K, 1, F, scale=K**-0.5),
    "wo": r(F, K, scale=F**-0.5),
    "experts": r(4, K, F, scale=K**-0.5),
  }


_GEMMS = ("dot_general", "ragged_dot_general")


def _gemm_dtypes(closed):
  """Operand dtypes of each GEMM of a jaxpr: dot_generals, ragged dots, and the extension's
  GEMM calls (per-tensor, block-scaled, grouped)."""
  out = []
  for eqn in inspect.equations(closed):
    name = eqn.primitive.name
    target = str(eqn.params.get("target_name", ""))
    if name in _GEMMS or (name == "ffi_call" and "gemm" in target):
      out.append(tuple(str(np.dtype(v.aval.dtype)) for v in eqn.invars[:2]))
  return out


def _quantizes(closed) -> bool:
  return any(
    str(np.dtype(v.aval.dtype)) in _QUANTIZED
    for eqn in inspect.equations(closed)
    for v in eqn.outvars
  )


def _traced(step, recipe, grad):
  """The jaxpr of the path's loss (``grad``: of its gradient with respect to every argument)."""
  loss, args = step(recipe, _data())
  fn = getattr(loss, "grad", jax.grad(loss, argnums=tuple(range(len(args))))) if grad else loss
  return jax.make_jaxpr(fn)(*args)


def _check_gemms(word, step, recipe, where):
  if word == "native (CUTLASS build)":  # the extension's grouped GEMM with blockwise scaling
    word = "native" if core.kernels.block_available() else "emulated"
  closed = _traced(step, recipe, grad=True)
  dtypes = _gemm_dtypes(closed)
  fp8 = [d for d in dtypes if all(t in _FP8 for t in d)]
  assert len(dtypes) >= 3, (where, dtypes)  # the forward, dgrad and wgrad GEMMs at least
  if word == "native":
    assert len(fp8) == len(dtypes), (where, dtypes)
  else:
    assert word == "emulated", (where, word)
    assert not fp8 and _quantizes(closed), (where, dtypes)


def _check_fused(word, step, recipe, where):
  # The custom VJPs by name in the forward's jaxpr (differentiated, they are traced through);
  # and the gradient traces.
  _traced(step, recipe, grad=True)
  text = str(_traced(step, recipe, grad=False))
  rules = text.count("name=_quantized_gemms")
  composed = "name=_activation" in text or "name=_norm" in text
  if word == "fused":
    assert rules == 1 and not composed, (where, rules, composed)
  else:
    assert word == "composed (reported)", (where, word)
    assert composed, where


# --- one training step per path -----------------------------------------------------------------


def _dot_general(recipe, d):
  (rng,) = _keys(recipe)

  def loss(x, w, state):
    y = core.dot_general(
      x, w, (((1,), (0,)), ((), ())), recipe=recipe, state=state, rng=rng, threshold=None
    )
    return jnp.sum(y.astype(jnp.float32))

  return loss, (d["x"], d["w"], core.init_state(recipe) or None)


def _layernorm_dense(recipe, d):
  (rng,) = _keys(recipe)
  state = core.init_state(recipe) or None

  def loss(x, w, state):
    z, _ = core.layernorm_dense(
      x, d["scale"], d["bias"], w, recipe=recipe, state=state, rng=rng, threshold=None
    )
    return jnp.sum(z.astype(jnp.float32))

  return loss, (d["x"], d["w"], state)


FUSED = core.GemmConfig(fuse_activation_cast=True)


def _layernorm_mlp(recipe, d, config=None):
  states = (core.init_state(recipe), core.init_state(recipe)) if core.init_state(recipe) else None

  def loss(x, wi, wo, states):
    out, _ = core.layernorm_mlp(
      x,
      d["scale"],
      d["bias"],
      wi,
      wo,
      recipe=recipe,
      states=states,
      rngs=_keys(recipe, 2),
      threshold=None,
      config=config,
    )
    return jnp.sum(out.astype(jnp.float32))

  return loss, (d["x"], d["wi"], d["wo"], states)


def _ragged_dot(recipe, d):
  state = core.init_ragged_state(recipe, 4) or None
  sizes = jnp.array([40, 0, 60, 20], jnp.int32)

  def loss(x, w, state):
    y = core.ragged_dot(x, w, sizes, recipe=recipe, state=state)
    return jnp.sum(y.astype(jnp.float32))

  return loss, (d["x"], d["experts"], state)


# TE's defaults leave the norm outside (its output returned) and drop out the activation: the
# ordinary training configuration of the fused block has neither.
_MLP = dict(
  activations=("gelu",),
  recipe=None,
  threshold=None,
  return_layernorm_output=False,
  intermediate_dropout_rate=0.0,
)


def _linen(recipe, d):
  layer = ta_linen.LayerNormMLP(F, **{**_MLP, "recipe": recipe})
  rngs = {"sr_rng": jax.random.key(3)} if recipe.uses_rng else None
  variables = layer.init({"params": jax.random.key(0), **(rngs or {})}, d["x"])

  def loss(v):
    out, _ = layer.apply(v, d["x"], rngs=rngs)
    return jnp.sum(out.astype(jnp.float32))

  return loss, (variables,)


def _nnx(recipe, d):
  layer = ta_nnx.LayerNormMLP(K, F, rngs=nnx.Rngs(0, sr_rng=1), **{**_MLP, "recipe": recipe})
  graph, params, rest = nnx.split(layer, nnx.Param, ...)

  def layer_loss(layer):
    out, _ = layer(d["x"])
    return jnp.sum(out.astype(jnp.float32))

  def loss(params, rest):  # the PRNG streams traced too: the layer draws its rounding keys
    return layer_loss(nnx.merge(graph, params, rest))

  def grad(params, rest):  # NNX's grad: the layer's streams advance inside its trace
    return nnx.grad(layer_loss, argnums=nnx.DiffState(0, nnx.Param))(nnx.merge(graph, params, rest))

  loss.grad = grad
  return loss, (params, rest)


def _haiku(recipe, d):
  model = hk.transform_with_state(lambda x: ta_hk.LayerNormMLP(F, **{**_MLP, "recipe": recipe})(x))
  params, state = model.init(jax.random.key(0), d["x"])

  def loss(p, s):
    out, _ = model.apply(p, s, jax.random.key(2), d["x"])[0]
    return jnp.sum(out.astype(jnp.float32))

  return loss, (params, state)


STEPS = {
  "`dot_general`": (_dot_general, _check_gemms),
  "`layernorm_dense`": (_layernorm_dense, _check_fused),
  "`layernorm_mlp`": (_layernorm_mlp, _check_fused),
  "`ragged_dot`": (_ragged_dot, _check_gemms),
  "Linen": (_linen, _check_fused),
  "NNX": (_nnx, _check_fused),
  "Haiku": (_haiku, _check_fused),
}


def test_the_table_has_every_recipe_and_path():
  rows = {row for row, _ in CELLS}
  assert {type(_recipe(r)).__name__ for r in rows} == {
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
  }
  assert COLUMNS == list(STEPS)
  for cell in CELLS.values():
    assert cell in WORDS or cell.startswith("error: "), cell


@pytest.mark.parametrize("row, column", sorted(CELLS), ids=lambda v: re.sub(r"\W+", "", v))
def test_cell(row, column):
  word, recipe = CELLS[(row, column)], _recipe(row)
  step, check = STEPS[column]
  where = f"{row} x {column}: {word}"
  with warnings.catch_warnings():
    warnings.simplefilter("error", core.HighPrecisionGemmWarning)  # every GEMM in FP8
    if word.startswith("error: "):
      with pytest.raises(Exception, match=re.escape(word[len("error: ") :])):
        _traced(step, recipe, grad=True)
      return
    if word == "composed (reported)":
      with pytest.warns(core.FusedPathFallbackWarning):
        check(word, step, recipe, where)
    else:
      warnings.simplefilter("error", core.FusedPathFallbackWarning)
      check(word, step, recipe, where)


@functools.cache
def _fused_gemm_dtypes(row):
  return _gemm_dtypes(_traced(functools.partial(_layernorm_mlp, config=FUSED), _recipe(row), True))


@pytest.mark.parametrize("row", sorted({r for r, _ in CELLS}), ids=lambda v: re.sub(r"\W+", "", v))
def test_fused_gemms_are_those_of_dot_general(row):
  # "fused ... with the GEMMs of the dot_general column": the fused MLP's six GEMMs are FP8
  # exactly where dot_general's are.
  dtypes = _fused_gemm_dtypes(row)
  fp8 = [d for d in dtypes if all(t in _FP8 for t in d)]
  if CELLS[(row, "`dot_general`")] == "native":
    assert len(fp8) == len(dtypes) == 6, dtypes
  else:
    assert not fp8, dtypes
