"""One conversion API in every adapter: rules on the module path (first match wins), one report,
one warning about skipped layers at the caller's line, the same reasons everywhere."""

import pathlib
import re
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import te_adapters as ta
from te_adapters import haiku as ta_hk
from te_adapters import linen as ta_linen
from te_adapters import nnx as ta_nnx

DELAYED = ta.DelayedScaling(amax_history_len=4)
CURRENT = ta.Float8CurrentScaling()
# Attention in high precision, the MLP's first layer delayed, its second current, the head
# current too (but N=10: it cannot be quantized).
RULES = [
  ta.Rule("attn/.*", None),
  ta.Rule("mlp/in_proj", DELAYED),
  ("mlp/.*", CURRENT),
  ("out", CURRENT),
]
SKIPPED = {"out": "GEMM size K=32, N=10 is not a multiple of 16"}


def _x():
  return jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)


# One model, with the same module names, in each framework.


class _LinenAttn(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, name="query")(x)


class _LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, name="out_proj")(jax.nn.relu(nn.Dense(64, name="in_proj")(x)))


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + _LinenAttn(name="attn")(x)
    x = x + _LinenMlp(name="mlp")(x)
    return nn.Dense(10, name="out")(x)


class _NnxAttn(nnx.Module):
  def __init__(self, rngs):
    self.query = nnx.Linear(32, 32, rngs=rngs)


class _NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.in_proj = nnx.Linear(32, 64, rngs=rngs)
    self.out_proj = nnx.Linear(64, 32, rngs=rngs)


class _NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.attn, self.mlp = _NnxAttn(rngs), _NnxMlp(rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn.query(x)
    x = x + self.mlp.out_proj(jax.nn.relu(self.mlp.in_proj(x)))
    return self.out(x)


class _HkAttn(hk.Module):
  def __call__(self, x):
    return hk.Linear(32, name="query")(x)


class _HkMlp(hk.Module):
  def __call__(self, x):
    return hk.Linear(32, name="out_proj")(jax.nn.relu(hk.Linear(64, name="in_proj")(x)))


def _hk_forward(x):
  x = x + _HkAttn(name="attn")(x)
  x = x + _HkMlp(name="mlp")(x)
  return hk.Linear(10, name="out")(x)


def _convert_linen(**kwargs):
  q = ta_linen.quantize(**kwargs)
  q(_LinenModel().init)(jax.random.key(0), _x())
  return q.report


def _convert_nnx(**kwargs):
  return ta_nnx.quantize_model(_NnxModel(nnx.Rngs(0)), **kwargs)


def _convert_haiku(**kwargs):
  q = ta_hk.quantize(**kwargs)
  hk.transform_with_state(q(_hk_forward)).init(jax.random.key(0), _x())
  return q.report


CONVERT = {"linen": _convert_linen, "nnx": _convert_nnx, "haiku": _convert_haiku}
CALLER = {
  "linen": "te_adapters.linen.quantize",
  "nnx": "te_adapters.nnx.quantize_model",
  "haiku": "te_adapters.haiku.quantize",
}


def test_the_report_is_the_same_in_every_adapter():
  reports, messages = {}, {}
  for name, convert in CONVERT.items():
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      reports[name] = convert(rules=RULES, threshold=None)
    skipped = [w for w in record if issubclass(w.category, ta.SkippedLayersWarning)]
    assert len(skipped) == 1, (name, [str(w.message) for w in record])  # one per conversion
    assert skipped[0].filename == __file__, name  # the caller's line, not the adapter's
    messages[name] = str(skipped[0].message)
  report = reports["nnx"]
  assert report.quantized == ["mlp/in_proj", "mlp/out_proj"]
  assert report.recipes == {"mlp/in_proj": DELAYED, "mlp/out_proj": CURRENT}
  assert report.high_precision == {"attn/query": "rule 0 ('attn/.*') keeps it in high precision"}
  assert report.skipped == SKIPPED
  assert str(report) == (
    "quantized 2 layer(s), kept 1 in high precision, skipped 1\n"
    "  quantized mlp/in_proj: DelayedScaling\n"
    "  quantized mlp/out_proj: Float8CurrentScaling\n"
    "  high precision attn/query: rule 0 ('attn/.*') keeps it in high precision\n"
    "  skipped out: GEMM size K=32, N=10 is not a multiple of 16"
  )
  for name in ("linen", "haiku"):
    assert reports[name] == report, name
    assert str(reports[name]) == str(report), name
  # One warning text, the conversion's name aside.
  texts = {messages[name].removeprefix(CALLER[name]) for name in CONVERT}
  assert texts == {
    ": 1 layer(s) that a rule gave a recipe stay in high precision:\n"
    "  out: GEMM size K=32, N=10 is not a multiple of 16\n"
    "(listed in the report's skipped; a rule with recipe None keeps a layer in high precision "
    "without this warning)"
  }


@pytest.mark.parametrize("adapter", CONVERT)
def test_first_match_wins_and_unmatched_layers_stay_in_high_precision(adapter):
  rules = [
    (lambda path: path.endswith("in_proj"), CURRENT),  # a function of the path string
    (r"mlp/.*", None),
    (r"attn/q", CURRENT),
  ]  # fullmatch: "attn/q" is not "attn/query"
  report = CONVERT[adapter](rules=rules, threshold=None)
  assert report.quantized == ["mlp/in_proj"]
  assert report.high_precision == {
    "attn/query": "no rule selects it",
    "mlp/out_proj": "rule 1 ('mlp/.*') keeps it in high precision",
    "out": "no rule selects it",
  }
  assert report.skipped == {}  # no rule asked for the head: no warning either


@pytest.mark.parametrize("adapter", CONVERT)
def test_a_recipe_alone_converts_every_layer(adapter):
  with pytest.warns(ta.SkippedLayersWarning, match="out: GEMM size K=32, N=10"):
    report = CONVERT[adapter](recipe=CURRENT, threshold=None)
  assert report.quantized == ["attn/query", "mlp/in_proj", "mlp/out_proj"]
  assert report.recipes == dict.fromkeys(report.quantized, CURRENT)
  assert report.skipped == SKIPPED


@pytest.mark.parametrize("adapter", CONVERT)
def test_bad_rules_are_refused_with_the_reason(adapter):
  convert = CONVERT[adapter]
  with pytest.raises(TypeError, match=f"{CALLER[adapter]}: pass either a recipe or rules"):
    convert(recipe=CURRENT, rules=RULES)
  with pytest.raises(TypeError, match="rules must be a list of rules, got str"):
    convert(rules="mlp/.*")
  with pytest.raises(TypeError, match=r"each rule is a te_adapters.Rule or a tuple"):
    convert(rules=[("mlp/.*",)])
  with pytest.raises(ValueError, match=r"path '\(mlp' is not a regular expression"):
    convert(rules=[("(mlp", CURRENT)])
  with pytest.raises(TypeError, match="recipe must be"):
    convert(rules=[("mlp/.*", "fp8")])


def test_rule_checks_its_arguments():
  with pytest.raises(TypeError, match="path must be a regular expression .* got int"):
    ta.Rule(3, CURRENT)
  with pytest.raises(ValueError, match=r"Rule\('mlp'\): amax_axes and kernel_all_gather need a"):
    ta.Rule("mlp", None, amax_axes="data")
  with pytest.raises(TypeError, match="threshold"):
    ta.Rule("mlp", CURRENT, threshold=5)
  assert ta.Rule(r"a/\d", None).describe() == r"'a/\d'"
  assert re.fullmatch(r".*named_rule", ta.Rule(_named_rule, CURRENT).describe())


def _named_rule(path):
  return path.startswith("mlp")


def test_each_rule_gives_its_own_gemm_options_to_its_layers():
  model = _NnxModel(nnx.Rngs(0))
  big = ta.core.SizeThreshold(min_mkn=1, min_dim=48, platforms=(jax.default_backend(),))
  report = ta_nnx.quantize_model(
    model, rules=[("mlp/in_proj", CURRENT, {"threshold": None}), ("mlp/.*", CURRENT)], threshold=big
  )
  assert model.mlp.in_proj.dot_general.options.threshold is None
  assert model.mlp.out_proj.dot_general.options.threshold is big
  # min_dim 48: only out_proj (K=64, N=32) is kept below it, and the report says so.
  assert list(report.high_precision) == ["attn/query", "out", "mlp/out_proj"]
  assert "below the size threshold" in report.high_precision["mlp/out_proj"]
  assert "1 of the quantized run in high precision" in str(report)


GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide"


def _guide_block(page: str, marker: str) -> str:
  text = (GUIDE / page).read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
  assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks hold {marker!r}"
  return blocks[0]


def test_the_guides_rules_examples_run_as_written_and_report_alike(capsys):
  printed = {}
  for adapter, marker in (
    ("linen", "ta_linen.quantize(rules="),
    ("nnx", "ta_nnx.quantize_model(Block("),
    ("haiku", "ta_hk.quantize(rules="),
  ):
    exec(_guide_block(f"{adapter}.md", marker), {})  # self-contained: nothing defined for it
    printed[adapter] = capsys.readouterr().out.splitlines()
    assert printed[adapter][0] == "quantized 2 layer(s), kept 4 in high precision, skipped 0"
  # Linen and NNX name the layers alike (NNX lists them in attribute order).
  assert sorted(printed["linen"]) == sorted(printed["nnx"])
  assert "  quantized up: DelayedScaling" in printed["linen"]
  assert "  quantized mlp/~/linear_0: DelayedScaling" in printed["haiku"]


def test_gemms_the_threshold_keeps_warn_naming_the_layer_at_the_models_line():
  x = _x()
  nnx_model = _NnxModel(nnx.Rngs(0))
  ta_nnx.quantize_model(nnx_model, rules=[("mlp/in_proj", CURRENT)])  # the default threshold
  runs = {
    "linen": lambda: ta_linen.quantize(rules=[("mlp/in_proj", CURRENT)])(_LinenModel().init)(
      jax.random.key(0), x
    ),
    "nnx": lambda: nnx_model(x),
    "haiku": lambda: hk.transform(
      ta_hk.quantize(rules=[("mlp/in_proj", CURRENT)])(_hk_forward)
    ).init(jax.random.key(0), x),
  }
  for adapter, run in runs.items():
    with pytest.warns(ta.core.HighPrecisionGemmWarning) as record:
      run()
    [warning] = record
    # Every adapter names the layer the same way, by its path.
    assert str(warning.message).startswith(
      "te_adapters: layer 'mlp/in_proj': a GEMM with M=4, K=32, N=64 runs in high precision"
    ), adapter
    assert warning.filename == __file__, adapter  # the model's call of the layer


class _LinenNormBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = ta_linen.LayerNormDenseGeneral(32, recipe=DELAYED, threshold=None, name="qkv")(x)[0]
    mlp = ta_linen.LayerNormMLP(64, recipe=DELAYED, threshold=None, name="mlp")
    return mlp(x, deterministic=True)[0]


class _NnxNormBlock(nnx.Module):
  def __init__(self, rngs):
    self.qkv = ta_nnx.LayerNormDenseGeneral(32, 32, recipe=DELAYED, threshold=None, rngs=rngs)
    self.mlp = ta_nnx.LayerNormMLP(32, 64, recipe=DELAYED, threshold=None, rngs=rngs)

  def __call__(self, x):
    return self.mlp(self.qkv(x)[0])[0]


def _hk_norm_block(x):
  x = ta_hk.LayerNormDenseGeneral(32, recipe=DELAYED, threshold=None, name="qkv")(x)[0]
  return ta_hk.LayerNormMLP(64, recipe=DELAYED, threshold=None, name="mlp")(x)[0]


def _frozen_linen(x):
  model = _LinenNormBlock()
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  loss = lambda p, s: jnp.sum(model.apply({"params": p, "_overwrite_with_gradient": s}, x))  # noqa: E731
  jax.eval_shape(jax.grad(loss), variables["params"], variables["_overwrite_with_gradient"])


def _frozen_nnx(x):
  model = _NnxNormBlock(nnx.Rngs(0))
  nnx.eval_shape(nnx.grad(lambda m, x: jnp.sum(m(x))), model, x)


def _frozen_haiku(x):
  f = hk.transform_with_state(_hk_norm_block)
  params, state = jax.eval_shape(f.init, jax.random.key(0), x)
  loss = lambda p, s: jnp.sum(f.apply(p, s, None, x)[0])  # noqa: E731
  jax.eval_shape(jax.grad(loss), params, state)


@pytest.mark.parametrize(
  "adapter, names, remedy",
  [
    (
      "linen",
      ["layer 'qkv' (x", "layer 'mlp' (x", "layer 'mlp' (x"],
      "te_adapters.linen.TrainState.value_and_grad",
    ),
    (  # NNX gives a layer no path: its class and kernel shape name it
      "nnx",
      [
        "LayerNormDenseGeneral layer (kernel (32, 32)) (x",
        "LayerNormMLP layer (wi_kernel (32, 1, 64)) (x",
        "LayerNormMLP layer (wi_kernel (32, 1, 64)) (x",
      ],
      "te_adapters.nnx.value_and_grad",
    ),
    (
      "haiku",
      ["layer 'qkv' (x", "layer 'mlp' (x", "layer 'mlp' (x"],
      "te_adapters.haiku.value_grad_and_state",
    ),
  ],
)
def test_te_modules_frozen_state_warning_gives_the_frameworks_remedy(adapter, names, remedy):
  run = {"linen": _frozen_linen, "nnx": _frozen_nnx, "haiku": _frozen_haiku}[adapter]
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    run(jnp.ones((4, 32)))  # the parameters differentiated, the state not
  frozen = [str(w.message) for w in record if issubclass(w.category, ta.core.FrozenStateWarning)]
  # LayerNormDenseGeneral's GEMM, then LayerNormMLP's two.
  assert len(frozen) == 3, frozen
  others = {"te_adapters.linen.", "te_adapters.nnx.", "te_adapters.haiku."} - {
    remedy[: remedy.index(".", len("te_adapters.")) + 1]
  }
  for name, message in zip(names, frozen, strict=True):
    assert f"DelayedScaling state of {name} (" in message, message
    assert remedy in message and not any(o in message for o in others), message
