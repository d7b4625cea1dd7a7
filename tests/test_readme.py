"""Every Python block of README.md and of the user guide (``docs/**/*.md``) runs as written.

Each block is executed on its own, in a fresh namespace, exactly as the page shows it (the
multi-host script through the launcher it names, in two processes), and then checked: the
documented calls exist, take the documented arguments and return the documented structures, and
the values they promise (a trained LoRA factor, a frozen kernel, a restored checkpoint, the
global amax on every process, an expert's own amax) are there. A block that no check claims
fails the suite, so a new block on any page cannot go untested.

The blocks run with the shipped size threshold (it applies on GPUs only), as a user's program
does, not with the suite's (``tests/conftest.py`` makes it apply on CPU too).
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_adapters as ta
from te_adapters import core
from tests import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
pytestmark = [
  pytest.mark.filterwarnings("ignore::te_adapters.core.HighPrecisionGemmWarning"),
  # Orbax's and multi-device jax's notes on what they do.
  pytest.mark.filterwarnings("ignore::UserWarning:orbax"),
]


def python_blocks(page: pathlib.Path = README) -> list[tuple[int, str]]:
  """``(line, code)`` of every python block of a Markdown page (the README by default)."""
  text = page.read_text()
  return [
    (text[: m.start()].count("\n") + 2, m.group(1))
    for m in re.finditer(r"```python\n(.*?)```", text, re.S)
  ]


def pages() -> list[pathlib.Path]:
  """README.md and the documentation's Markdown pages (the user guide), ``docs/**/*.md``."""
  return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def all_blocks() -> list[tuple[str, str]]:
  """``(page:line, code)`` of every python block of README.md and the guide."""
  return [
    (f"{page.relative_to(ROOT)}:{line}", code)
    for page in pages()
    for line, code in python_blocks(page)
  ]


@pytest.fixture(autouse=True, scope="module")
def shipped_threshold():
  """The default threshold as shipped (GPUs only) while the blocks run."""
  suite = core.DEFAULT_SIZE_THRESHOLD.platforms
  object.__setattr__(core.DEFAULT_SIZE_THRESHOLD, "platforms", conftest.GPU_PLATFORMS)
  yield
  object.__setattr__(core.DEFAULT_SIZE_THRESHOLD, "platforms", suite)


def _fp8_here(x, w) -> bool:
  return core.runs_in_fp8(x.shape, w.shape, (((x.ndim - 1,), (0,)), ((), ())))


# --- the checks, each claiming its block by a line it holds -------------------------------------


def check_plain_jax(ns):
  state = ns["state"]
  assert isinstance(state, core.DelayedScalingState) and ns["g_w"].shape == (64, 128)
  assert np.isfinite(float(ns["loss"]))
  newest = float(state["x_amax_history"][-1])  # the step's amax, after the roll
  if _fp8_here(ns["x"], ns["w"]):
    assert newest == pytest.approx(float(jnp.max(jnp.abs(ns["x"]))))
    assert float(state["x_scale"][0]) == pytest.approx(448.0 / newest, rel=1e-6)
  else:
    assert newest == 0.0  # high precision: the state is left as it was


def check_orbax(ns):
  restored, w, state = ns["restored"], ns["w"], ns["state"]
  assert isinstance(restored["recipe_state"], core.DelayedScalingState)
  # Two steps were taken (one before the save, one after the restore).
  assert w.shape == (64, 128) and np.isfinite(np.asarray(w)).all()
  if _fp8_here(ns["x"], w):
    history = np.asarray(state["x_amax_history"])
    assert (history[-2:] > 0).all() and (history[:-2] == 0).all()


def check_linen(ns):
  from te_adapters import linen as ta_linen

  state = ns["state"]
  assert isinstance(state, ta_linen.TrainState) and int(state.step) == 1
  assert np.isfinite(float(ns["loss"]))
  before = ns["variables"]["params"]
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, state.params)
  assert all(jax.tree.leaves(changed))  # the optimizer stepped every parameter
  # The recipe state was overwritten by its gradient: the step's amax in every GEMM's history.
  ns_state = state.recipe_state
  assert set(ns_state) == {"DelayedScalingDotGeneral_0", "DelayedScalingDotGeneral_1"}
  assert "_overwrite_with_gradient" in ns["layer"].init(jax.random.key(1), jnp.ones((2, 64)))


def check_nnx(ns):
  report, model = ns["report"], ns["model"]
  assert sorted(report.quantized) == ["down", "up"], report
  assert np.isfinite(float(ns["loss"]))
  assert ns["layer"].kernel.shape == (1024, 4096)
  # The optimizer stepped the converted model's parameters (Adam's first step moves each).
  fresh = type(model)(__import__("flax").nnx.Rngs(0))
  assert not np.array_equal(np.asarray(model.up.kernel[...]), np.asarray(fresh.up.kernel[...]))


def check_nnx_checkpoints(ns):
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  fp8, bf16, saved = ns["fp8"], ns["bf16"], ns["saved"]
  bf16_params = ns["Model"](None, nnx.Rngs(0))  # the model the bf16 checkpoint was saved from
  for got, want in ((fp8, bf16_params), (bf16, saved)):  # the checkpoints' parameters loaded
    for a, b in zip(
      jax.tree.leaves(nnx.state(got, nnx.Param)),
      jax.tree.leaves(nnx.state(want, nnx.Param)),
      strict=True,
    ):
      np.testing.assert_array_equal(a, b)
  # The FP8 model's recipe state is a new one; the bf16 model keeps none.
  fresh = ta.core.init_state(ta.DelayedScaling())
  assert ta_nnx.recipe_state(fp8)["up"]["dot_general"]["state"]["x_scale"][...] == fresh["x_scale"]
  assert not jax.tree.leaves(nnx.state(bf16, ta_nnx.RecipeState))
  x = jnp.ones((32, 64))
  assert fp8(x).shape == bf16(x).shape == (32, 16)


def check_haiku(ns):
  assert np.isfinite(float(ns["loss"])) and ns["aux"] is None
  assert jax.tree.structure(ns["param_grads"]) == jax.tree.structure(ns["params"])
  assert len(ns["q"].report.quantized) == 2
  # Delayed scaling's state came back from the step, updated (an amax in each history), where its
  # GEMMs, (32, 64) x (64, 128) and (32, 128) x (128, 16), run in FP8 here; under the size
  # threshold (a GPU) they run in high precision and the state is left as it was.
  x = jnp.ones((32, 64))
  fp8 = _fp8_here(x, jnp.ones((64, 128)))
  assert fp8 == _fp8_here(jnp.ones((32, 128)), jnp.ones((128, 16)))
  newest = [float(s["x_amax_history"][-1]) for s in ns["state"].values()]
  assert all(a > 0 for a in newest) if fp8 else all(a == 0.0 for a in newest), newest


def check_rules(report):
  """The conversion-rules examples (``tests/test_conversion_rules.py`` compares their reports
  across adapters): attention kept in high precision, the MLP's two layers quantized."""
  assert len(report.quantized) == 2 and len(report.skipped) == 0, report
  assert [str(r) for r in report.recipes.values()].count(str(ta.DelayedScaling())) == 1


def check_layernorm_dense(ns):
  assert ns["z"].shape == (2, 16, 3072)
  assert "_overwrite_with_gradient" in ns["variables"]


def _lora_parts(tree, leaf_name):
  """{path: value} of the leaves of ``tree`` whose last path entry names ``leaf_name``."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if leaf_name in names[-2:]:
      out["/".join(names)] = np.asarray(leaf)
  return out


def check_linen_lora(ns):
  from te_adapters.linen import DenseGeneral

  model, x = ns["model"], ns["x"]
  before = model.init(jax.random.key(0), x)["params"]
  after = ns["params"]
  # Nested: four layers, two levels down, each with its factors.
  paths = sorted(_lora_parts(after, "lora_b_kernel"))
  assert len(paths) == 4 and all(p.count("/") == 2 for p in paths), paths
  for name in ("kernel", "bias", "lora_a_kernel"):  # lora_a's first gradient is 0 (b is 0)
    for path, value in _lora_parts(after, name).items():
      np.testing.assert_array_equal(value, _lora_parts(before, name)[path], err_msg=path)
  for path, value in _lora_parts(after, "lora_b_kernel").items():
    assert not np.array_equal(value, _lora_parts(before, "lora_b_kernel")[path]), path
  assert set(jax.tree.leaves(ns["labels"])) == {"train", "freeze"}
  del DenseGeneral


def check_nnx_lora(ns):
  from flax import nnx

  model = ns["model"]
  for block in model.blocks:
    assert np.abs(np.asarray(block.lora_b_kernel[...])).max() > 0  # trained (zeros at init)
  fresh = type(model)(nnx.Rngs(0))
  for block, new in zip(model.blocks, fresh.blocks, strict=True):
    np.testing.assert_array_equal(np.asarray(block.kernel[...]), np.asarray(new.kernel[...]))
    np.testing.assert_array_equal(np.asarray(block.bias[...]), np.asarray(new.bias[...]))


def check_haiku_lora(ns):
  trainable, frozen = ns["trainable"], ns["frozen"]
  assert {n for m in trainable.values() for n in m} == {"lora_a_kernel", "lora_b_kernel"}
  assert len(trainable) == 2 and {n for m in frozen.values() for n in m} == {"w", "b"}
  assert all(np.abs(np.asarray(m["lora_b_kernel"])).max() > 0 for m in trainable.values())


def check_threshold(ns):
  assert isinstance(ns["mine"], core.SizeThreshold)
  assert ns["mine"].platforms == ("gpu", "cpu")


def check_config(ns):
  assert ta.GemmConfig().non_finite == "propagate"


def check_fsdp(ns):
  x, w = (jnp.asarray(np.asarray(ns[k])) for k in ("x", "w"))  # on one device
  want = jax.grad(
    lambda w: jnp.sum(
      core.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=ta.Float8CurrentScaling())
    ),
    argnums=0,
  )(w)
  got = ns["grads"]
  assert got.shape == w.shape and len(got.sharding.device_set) == 4
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def check_device_sums(ns):
  """The exchange block: the same gradients as one device's program of the same layer, and on a
  GPU with the extension, its sums as collective permutes (no all-reduce of a partial product)."""
  x, w = (jnp.asarray(np.asarray(ns[k])) for k in ("x", "w"))  # on one device
  want_w, want_x = jax.grad(ns["loss"], argnums=(0, 1))(w, x)
  for got, want in ((ns["g_w"], want_w), (ns["g_x"], want_x)):
    assert len(got.sharding.device_set) == 4
    assert _relative_error(got, want) < 1e-5, _relative_error(got, want)
  if core.kernels.cublas_gemm_available():
    from te_adapters import inspect

    ops = [c.op for c in inspect.hlo_collectives(ns["step"].as_text())]
    assert "collective-permute" in ops, ops


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _quantized_output(got, want, fp8=True):
  """An FP8 output: close to the float64 one, and not equal to it (the operands were rounded);
  with ``fp8=False`` (the size threshold kept the GEMMs in high precision), close."""
  err = _relative_error(got, want)
  assert (1e-4 < err < 0.1) if fp8 else (err < 1e-2), err


def _quick_start_fp8() -> bool:
  """Whether the quick starts' first GEMM, (32, 64) x (64, 256), runs in FP8 here."""
  return _fp8_here(jnp.ones((32, 64)), jnp.ones((64, 256)))


def check_quick_plain(ns):
  x, w, dims, recipe = ns["x"], ns["w"], ns["dims"], ns["recipe"]
  _quantized_output(ns["y"], np.asarray(x, np.float64) @ np.asarray(w, np.float64), _fp8_here(x, w))
  fp8, gemms = ta.inspect.count_fp8_dot_generals(
    lambda x, w: core.dot_general(x, w, dims, recipe=recipe), x, w
  )
  assert (fp8, gemms) == ((1, 1) if _fp8_here(x, w) else (0, 1))
  want = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
  assert ns["g_w"].shape == w.shape and _relative_error(ns["g_w"], want) < 0.1


def _mlp64(x, up_w, up_b, down_w, down_b):
  """The quick starts' two-layer MLP in float64."""
  f = lambda a: np.asarray(a, np.float64)  # noqa: E731
  return np.maximum(f(x) @ f(up_w) + f(up_b), 0) @ f(down_w) + f(down_b)


def check_quick_linen(ns):
  report, p = ns["q"].report, ns["variables"]["params"]
  assert sorted(report.quantized) == ["Dense_0", "Dense_1"] and not report.skipped, report
  want = _mlp64(ns["x"], *(p[d][k] for d in ("Dense_0", "Dense_1") for k in ("kernel", "bias")))
  _quantized_output(ns["y"], want, _quick_start_fp8())


def check_quick_nnx(ns):
  report, model = ns["report"], ns["model"]
  assert sorted(report.quantized) == ["down", "up"] and not report.skipped, report
  layers = (model.up, model.down)
  want = _mlp64(jnp.ones((32, 64)), *(v[...] for m in layers for v in (m.kernel, m.bias)))
  _quantized_output(ns["y"], want, _quick_start_fp8())


def check_quick_haiku(ns):
  report, p = ns["q"].report, ns["params"]
  assert sorted(report.quantized) == ["linear", "linear_1"] and not report.skipped, report
  want = _mlp64(ns["x"], *(p[m][k] for m in ("linear", "linear_1") for k in ("w", "b")))
  _quantized_output(ns["y"], want, _quick_start_fp8())


def check_ragged(ns):
  x, sizes, state, g_w = ns["x"], np.asarray(ns["group_sizes"]), ns["state"], ns["g_w"]
  ends = np.cumsum(sizes)
  own = [
    np.abs(np.asarray(x)[e - n : e]).max() if n else 0.0 for n, e in zip(sizes, ends, strict=True)
  ]
  # Each expert's newest x amax is its own tokens' (0 for the expert that got none).
  np.testing.assert_allclose(np.asarray(state["x_amax_history"])[:, -1], own, rtol=1e-6)
  assert g_w.shape == (4, 32, 48) and not np.asarray(g_w[1]).any()  # no tokens, no gradient
  assert np.asarray(g_w[0]).any() and np.isfinite(float(ns["loss"]))


def check_grouped_layer(ns):
  x, sizes = np.asarray(ns["x"], np.float64), np.asarray(ns["group_sizes"])
  kernel = np.asarray(ns["experts"].kernel[...], np.float64)
  expert = np.repeat(np.arange(len(sizes)), sizes)
  want = np.einsum("mk,mkn->mn", x, kernel[expert])
  _quantized_output(ns["y"], want)


def check_formats(ns):
  x, w = ns["x"], ns["w"]
  recipe = ns["PowerOfTwoScaling"]()
  assert core.format_of(recipe).recipe_type is ns["PowerOfTwoScaling"]
  y = core.dot_general(x, ns["w"], (((1,), (0,)), ((), ())), recipe=recipe, threshold=None)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-6)
  assert ns["y"].shape == (16, 16)


CHECKS = {
  "g_w = jax.grad(lambda w: jnp.mean(ta.core.dot_general(": check_quick_plain,
  "class LinenMLP(nn.Module)": check_quick_linen,
  "class NnxMLP(nnx.Module)": check_quick_nnx,
  "def haiku_mlp(x)": check_quick_haiku,
  "ta.core.init_ragged_state(recipe, 4)": check_ragged,
  "ta_nnx.GroupedLinear(4, 32, 48": check_grouped_layer,
  "state = ta.core.with_max_grad(state)": check_plain_jax,
  'checkpointer.save(path, {"w": w, "recipe_state": state})': check_orbax,
  "ta_linen.TrainState.create": check_linen,
  "ta_nnx.update_recipe_state(model, state_grads)": check_nnx,
  "ta_hk.value_grad_and_state(loss_fn)": check_haiku,
  'checkpointer.restore(folder / "fp8", target)': check_nnx_checkpoints,
  "ta_linen.quantize(rules=": lambda ns: check_rules(ns["q"].report),
  "ta_nnx.quantize_model(Block(": lambda ns: check_rules(ns["report"]),
  "ta_hk.quantize(rules=": lambda ns: check_rules(ns["q"].report),
  "class QKV(nn.Module)": check_layernorm_dense,
  "traverse_util.path_aware_map(": check_linen_lora,
  "wrt=nnx.LoRAParam)": check_nnx_lora,
  "hk.data_structures.partition(": check_haiku_lora,
  "core.runs_in_fp8(x.shape, w.shape, dn, threshold=mine)": check_threshold,
  'ta.GemmConfig(backend="jax")': check_config,
  'kernel_all_gather=P("fsdp", None)': check_fsdp,
  'device_sums="exchange"': check_device_sums,
  "ta.core.register_format(": check_formats,
  "# train_multihost.py": None,  # test_multihost_block
}


def _claim(code: str) -> str:
  markers = [m for m in CHECKS if m in code]
  assert len(markers) == 1, f"a block is claimed by {markers or 'no check'}:\n{code}"
  return markers[0]


def test_every_block_is_claimed_by_one_check():
  claimed = [_claim(code) for _, code in all_blocks()]
  assert sorted(claimed) == sorted(CHECKS), "a check lost its block"


_BLOCKS = [b for b in all_blocks() if "# train_multihost.py" not in b[1]]


@pytest.mark.parametrize("where, code", _BLOCKS, ids=[where for where, _ in _BLOCKS])
def test_block_runs_as_written(where, code):
  marker = _claim(code)
  if marker in ('kernel_all_gather=P("fsdp", None)', 'device_sums="exchange"') and (
    jax.device_count() < 4
  ):
    pytest.skip("needs 4 devices")
  ns = {"__name__": "docs_block"}
  try:
    exec(compile(code, where, "exec"), ns)
    CHECKS[marker](ns)
  finally:
    if "PowerOfTwoScaling" in ns:
      core.unregister_format(ns["PowerOfTwoScaling"])


def test_multihost_block_runs_in_two_processes(tmp_path):
  """The multi-host script, saved as its page names it and run through the launcher the page
  shows: both processes print the same loss and the amax of the whole batch, not of their own
  rows."""
  ((page, code),) = [
    (p, c) for p in pages() for _, c in python_blocks(p) if "# train_multihost.py" in c
  ]
  script = tmp_path / "train_multihost.py"
  script.write_text(code)
  shell = re.search(
    r"```sh\n(python -m bench\.multiprocess [^\n]*train_multihost\.py)\n```", page.read_text()
  )
  assert shell, f"{page.name}: the command for the script"
  args = shell.group(1).split()[1:]
  args[-1] = str(script)
  env = dict(
    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  )
  out = subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  lines = re.findall(r"process (\d): loss (\S+), x amax (\S+)", out.stdout)
  assert sorted(i for i, _, _ in lines) == ["0", "1"], out.stdout[-3000:]
  assert len({(loss, amax) for _, loss, amax in lines}) == 1  # identical on both processes
  rows = [np.random.default_rng(i).standard_normal((4, 16, 64), np.float32) for i in range(2)]
  whole, own = max(np.abs(r).max() for r in rows), np.abs(rows[0]).max()
  amax = float(lines[0][2])
  assert amax == pytest.approx(float(whole), abs=1e-6) and whole != own
