"""The MLP's norm, two FP8 GEMMs and activation in one custom VJP (TE's structure).

``out = q(act(h + b)) . q(wo)`` with ``h = q(y) . q(wi)``: the activation of GEMM 1's output and
its bias is computed in float32 and cast straight to GEMM 2's FP8 operand in both orientations
(no activation buffer in the input's dtype), and in the backward pass
``dh = dz * act'(h + b)`` is cast straight to GEMM 1's FP8 output gradient in both orientations,
with its amax and the bias gradient, from one read of ``dz`` and ``h``; the block's output
gradient is cast for GEMM 2 in the pass that sums the output bias's gradient (the same kernel
with a linear activation, which reads the gradient alone). Each GEMM keeps its own
recipe state with ``dot_general``'s contract (the gradient with respect to it is the next
state). With ``norm``, the norm runs inside too: its float32 output is cast straight to GEMM 1's
FP8 operand, and the backward pass computes the norm's gradients from GEMM 1's dgrad.
``core.layernorm_mlp`` takes this path where it applies (``applies``, ``norm_fuses``).

The casts run as the pure-JAX formulas here (XLA fuses them), or on Hopper GPUs with the
extension's CUDA part built as the kernels of ``csrc/act_cast_cuda.cu`` (``_kernels_run``); under
``Float8BlockScaling``'s 1x128 blocks, as those of ``csrc/block_cast_cuda.cu``, which cast the
norm's output, the activation and its gradient into blocks as they compute them
(``Producer.block_cast``: no float32 tensor written and read again).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import formats, gemm, kernels, sharding
from te_adapters.core.formats import Producer
from te_adapters.core.ops import activation_product, norm_bwd, norm_gamma, norm_stats, normalized
from te_adapters.core.recipes import caller_stacklevel, check_recipe, check_rng

__all__ = [
  "KERNEL_ACTIVATIONS",
  "FusedPathFallbackWarning",
  "act_amax",
  "act_block_cast",
  "act_cast",
  "activation_f32",
  "applies",
  "dact_amax",
  "dact_block_cast",
  "dact_cast",
  "dact_f32",
  "dbias_block_cast",
  "dbias_cast",
  "format_fuses",
  "fused_mlp",
  "norm_block_cast",
  "norm_cast",
]

# The activations the CUDA kernels compute (one, or a gated pair), by their id there.
KERNEL_ACTIVATIONS = {
  "linear": 0,
  "gelu": 1,
  "relu": 2,
  "silu": 3,
  "swish": 3,
  "quick_gelu": 4,
  "squared_relu": 5,
}


class FusedPathFallbackWarning(UserWarning):
  """``layernorm_dense`` or ``layernorm_mlp`` takes the composed path because the recipe's format
  cannot take the fused path's producers (``QuantizationFormat.takes_producer``).

  The result is the same function; the composed path writes the norm's (and the activation's)
  output in the activations' dtype before quantizing it. Every format of the package takes
  producers: the warning concerns formats registered with ``register_format``.

  Example:
    >>> import dataclasses, warnings, jax.numpy as jnp, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class Unfused(ta.Float8CurrentScaling):
    ...   pass
    >>> fmt = ta.core.format_of(ta.Float8CurrentScaling())
    >>> ta.core.register_format(fmt._replace(recipe_type=Unfused, takes_producer=False))
    >>> x, kernel = jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   y = ta.core.layernorm_dense(x, jnp.ones(32), jnp.zeros(32), kernel, recipe=Unfused(),
    ...                               threshold=None)
    >>> [w.category.__name__ for w in caught]
    ['FusedPathFallbackWarning']
    >>> ta.core.unregister_format(Unfused)
  """


def format_fuses(recipe, gemm_shapes, rngs, layer: str | None = None) -> bool:
  """Whether the recipe's format takes the fused path for GEMMs of ``gemm_shapes`` (``(M, K,
  N)`` each): it takes producers (every format of the package does: per-tensor ones their FP8
  cast, block and rowwise ones their values), its blocks tile every GEMM's M, K and N
  (``format.check``; otherwise the composed path, whose GEMMs raise that error under
  differentiation), and the PRNG keys fit the recipe (one per GEMM for stochastic rounding,
  none otherwise; otherwise the composed path, whose GEMMs raise the error). A format that takes
  no producer warns (``FusedPathFallbackWarning``), naming ``layer`` where given."""
  recipe = check_recipe(recipe)
  fmt = formats.format_of(recipe)
  if not fmt.takes_producer:
    where = f"{layer}: " if layer else ""
    warnings.warn(
      f"{where}{type(recipe).__name__}: its quantization format takes no producer "
      "(QuantizationFormat.takes_producer), so the norm and MLP run composed: the norm's and "
      "the activation's outputs are written in the activations' dtype before their casts",
      FusedPathFallbackWarning,
      stacklevel=caller_stacklevel(),
    )
    return False
  given = [r is not None for r in rngs]
  if not (all(given) if recipe.uses_rng else not any(given)):
    return False
  for m, k, n in gemm_shapes:
    layout = gemm.GemmLayout((((1,), (0,)), ((), ())), (m, k), (k, n))
    try:
      fmt.check(recipe, layout, True, None, None)
    except ValueError:
      return False
  return True


def applies(
  recipe, config, *, gemm_shapes, threshold, dropout_active, constrained, rngs, layer=None
) -> bool:
  """Whether ``layernorm_mlp`` takes the fused path: a recipe whose format fuses
  (``format_fuses``), both GEMMs in FP8 (``gemm_shapes``: their ``(M, K, N)``), no dropout, and
  ``config.fuse_activation_cast`` not ``False`` (``layer``: what its warning calls the layer).
  Per-tensor recipes take it sharded too (with
  sharding constraints, inside ``shard_map``): the casts' kernels have partitioning rules
  (``_kernels_run``), and the GEMM rule sums each cotangent
  over the mesh axes its primal is replicated on. Block and rowwise recipes compose there."""
  if recipe is None or config.fuse_activation_cast is False:
    return False
  if dropout_active:
    return False
  if (constrained or sharding.manual_axes()) and not formats.format_of(
    check_recipe(recipe)
  ).per_tensor:
    return False
  if not format_fuses(recipe, gemm_shapes, rngs, layer):
    return False
  if threshold is not None:
    backend = jax.default_backend()
    if not all(threshold.allows_fp8(m, k, n, backend) for m, k, n in gemm_shapes):
      return False
  return True


def norm_fuses(x, config) -> bool:
  """Whether the norm's output is cast inside the fused path (from float32, never written):
  where the casts are pure JAX (XLA fuses the norm into them) or the CUDA norm cast runs."""
  if formats.backend(requested=config.backend) == "jax":
    return True
  return _kernels_run(x, config, kernels.NORM_CAST_TARGET)


def on_rows(constraint, lead):
  """``constraint`` (a function on arrays of shape ``lead + (F,)``) on an ``(M, F)`` array."""

  def constrained(a):
    return constraint(a.reshape(*lead, a.shape[-1])).reshape(a.shape)

  return constrained


def fused_mlp(
  y,
  wi,
  wi_bias,
  wo,
  states,
  names,
  *,
  recipe,
  config,
  norm=None,
  ln_scale=None,
  ln_bias=None,
  ffn1_ckpt_name="ffn1",
  wo_bias=None,
  rngs=None,
  layer=None,
  framework=None,
  act_constraint=None,
  plan=None,
):
  """``q(act(q(y) . q(wi) + wi_bias)) . q(wo) + wo_bias`` with both GEMMs quantized by the
  recipe's format (one that takes producers: ``format_fuses``).

  Args:
    y: GEMM 1's input ``(M, K)``, or with ``norm`` the norm's input.
    wi: ``(K, n_act, F)``. wi_bias: ``(n_act, F)`` or None. wo: ``(F, K_out)``.
    states: ``(state_0, state_1)`` (``None`` entries for a stateless recipe).
    names: normalized activation names (``normalize_activations``).
    recipe: the recipe of both GEMMs.
    config: a ``GemmConfig``.
    norm: ``(layernorm_type, zero_centered_gamma, epsilon)`` to normalize ``y`` first (as
      ``core.layernorm``, with gamma ``ln_scale`` and beta ``ln_bias``, None for rmsnorm) and
      cast the float32 result to GEMM 1's FP8 operand; None: ``y`` is GEMM 1's input.
    ffn1_ckpt_name: ``checkpoint_name`` of GEMM 1's output (before the bias), the residual the
      backward pass reads.
    wo_bias: ``(K_out,)`` or None: GEMM 2's bias, whose gradient is summed in the pass that casts
      the output gradient to FP8 (TE's dbias + quantize).
    rngs: ``(key_0, key_1)``, each GEMM's key for stochastic rounding, or None.
    layer, framework: how a ``FrozenStateWarning`` names the layer, and whose remedy it gives
      (``layer`` also names it in a ``ShardingFallbackWarning`` of the kernels).
    act_constraint: a function applied to GEMM 2's FP8 input ``(M, F)`` (a sharding
      constraint), or None.
    plan: FSDP: the ``SpmdPlan`` whose ``kernel_all_gather`` gathers both kernels in FP8
      (``gemm.fsdp_gemm_layout``'s); ``wi`` is then ``(n_act * F, K)`` and ``wo``
      ``(K_out, F)``, ``dot_general``'s layout. None: no gather.

  Returns:
    ``(M, K_out)`` in ``y``'s dtype. The gradients with respect to the states are their next
    values.
  """
  recipe = check_recipe(recipe)
  state_0, state_1 = states
  wi2 = wi.reshape(wi.shape[0], -1) if plan is None else wi
  y, wi2, state_0 = gemm_state(recipe, y, wi2, state_0, layer=layer, framework=framework)
  y, wo, state_1 = gemm_state(recipe, y, wo, state_1, layer=layer, framework=framework)
  if norm is not None and ln_bias is None:
    ln_bias = jnp.zeros((0,), ln_scale.dtype)  # rmsnorm: a placeholder, as core.layernorm's
  dtype = np.dtype(y.dtype)
  kn = plan is None  # the kernels as stored (K, N); under FSDP (N, K)
  stages = (
    gemm.Stage(
      dtype,
      kernel_kn=kn,
      name=ffn1_ckpt_name,
      activation=ActivationProducer(tuple(names), act_constraint),
    ),
    gemm.Stage(dtype, kernel_kn=kn, bias_grad=None if wo_bias is None else BiasGradProducer()),
  )
  lhs = None if norm is None else NormProducer(norm)
  inputs = (y,) if norm is None else (y, ln_scale, ln_bias)
  chain = gemm.Chain(recipe, PLAN if plan is None else plan, config, None, stages, lhs, layer)
  return gemm.quantized_gemms(
    inputs, (wi2, wo), (wi_bias, wo_bias), (state_0, state_1), stage_keys(recipe, rngs), chain
  )


def stage_keys(recipe, rngs):
  """The chain's keys, one per GEMM (``recipes.check_rng``), or None without any."""
  if rngs is None or all(r is None for r in rngs):
    return None
  return tuple(check_rng(recipe, r) for r in rngs)


PLAN = sharding.SpmdPlan()


def gemm_state(recipe, lhs, rhs, state, *, layer=None, framework=None):
  """One GEMM's recipe state as ``dot_general`` takes it (``gemm.checked_state``), and ``(lhs,
  rhs, state)`` watched for a state left out of differentiation (``gemm.watch_state``, which
  ``dot_general`` applies on its FP8 path: the fused paths are FP8 throughout); returns them."""
  state = gemm.checked_state(recipe, state, layer)
  if state:
    lhs, rhs, state = gemm.watch_state(lhs, rhs, state, layer=layer, framework=framework)
  return lhs, rhs, state


def _hb(h, b, n_act):
  """GEMM 1's output (M, n_act * F) plus its bias, float32 (M, n_act, F)."""
  m = h.shape[0]
  hb = h.astype(jnp.float32).reshape(m, n_act, -1)
  return hb if b is None else hb + b.astype(jnp.float32)


def activation_f32(h, b, names):
  """The activation (gated product) of ``h (M, n_act*F)`` plus ``b``: float32 (M, F)."""
  return activation_product(_hb(h, b, len(names)), names)


def dact_f32(dz, h, b, names):
  """``dz * act'(h + b)``: float32 (M, n_act, F)."""
  _, vjp = jax.vjp(lambda a: activation_product(a, names), _hb(h, b, len(names)))
  return vjp(dz.astype(jnp.float32))[0]


def _both(v, scale, q_dtype, with_amax):
  """Both FP8 orientations of a value computed in float32 here: the pure-JAX cast (the kernels
  that cast in the pass computing it are the producers' own)."""
  return formats.cast_transpose(v, scale, q_dtype, with_amax=with_amax, backend="jax")


def _kernels_run(x, config, target) -> bool:
  """Whether the CUDA kernel ``target`` casts ``x``: on a GPU with it built, ``config.backend``
  not ``"jax"``, a float32/bfloat16/float16 ``x``. In any program: sharded, each kernel runs per
  shard (its partitioning rule, ``kernels._partition``), and inside ``shard_map`` on the shard."""
  if jax.default_backend() != "gpu" or not kernels.registered(target, "gpu"):
    return False
  if np.dtype(x.dtype) not in formats.FFI_INPUT_DTYPES:
    return False
  return formats.backend(requested=config.backend) == "ffi"


def kernel_activations(h, names, config, target):
  """The CUDA kernels' activation ids where the kernel ``target`` runs on ``h``'s activation (one
  or two activations they know, ``_kernels_run``), else None (pure JAX)."""
  if len(names) > 2 or not all(isinstance(n, str) and n in KERNEL_ACTIVATIONS for n in names):
    return None
  if not _kernels_run(h, config, target):
    return None
  return tuple(KERNEL_ACTIVATIONS[n] for n in names)


def act_cast(h, b, names, q_dtype, scale, with_amax, config):
  """The FP8 activation in both orientations (and its amax): (M, F), (F, M), (1,)."""
  acts = kernel_activations(h, names, config, kernels.ACT_CAST_TARGET)
  if acts is not None:
    q, q_t, a = kernels.act_cast_call(h, b, scale, q_dtype, acts, with_amax)
    return q, q_t, (a if with_amax else None)
  return _both(activation_f32(h, b, names), scale, q_dtype, with_amax)


def dact_cast(dz, h, b, names, q_dtype, scale, with_amax, config):
  """GEMM 1's FP8 output gradient in both orientations, its amax and the float32 bias gradient:
  (M, n_act*F), (n_act*F, M), (1,), (n_act, F)."""
  acts = kernel_activations(h, names, config, kernels.DACT_CAST_TARGET)
  if acts is not None:
    q, q_t, a, db = kernels.dact_cast_call(dz, h, b, scale, q_dtype, acts, with_amax)
    return q, q_t, (a if with_amax else None), db.reshape(len(names), -1)
  dh = dact_f32(dz, h, b, names)
  q, q_t, a = _both(dh.reshape(dh.shape[0], -1), scale, q_dtype, with_amax)
  return q, q_t, a, jnp.sum(dh, axis=0)


def dbias_cast(g, q_dtype, scale, with_amax, config):
  """The output gradient ``g (M, N)`` in FP8 in both orientations, its amax and its float32 column
  sums (the output bias's gradient): the activation-gradient kernel with a linear activation,
  which then reads ``g`` alone, where it runs; the ordinary cast and XLA's sum otherwise."""
  if _kernels_run(g, config, kernels.DACT_CAST_TARGET):
    q, q_t, a, db = kernels.dact_cast_call(
      g, g, None, scale, q_dtype, (KERNEL_ACTIVATIONS["linear"],), with_amax
    )
    return q, q_t, (a if with_amax else None), db
  q, q_t, a = formats.cast_both(g, scale, q_dtype, config, with_amax)
  return q, q_t, a, jnp.sum(g.astype(jnp.float32), axis=0)


def act_amax(h, b, names, config):
  """The amax of the activation (current scaling's pass before ``act_cast``): the kernel's own
  float32 values where it runs, XLA's reduce over the formula otherwise."""
  acts = kernel_activations(h, names, config, kernels.ACT_AMAX_TARGET)
  if acts is not None:
    return kernels.act_amax_call(h, b, acts)
  return formats.tensor_amax(activation_f32(h, b, names))


def dact_amax(dz, h, b, names, config):
  """The amax of ``dz * act'(h + b)`` (current scaling's pass before ``dact_cast``)."""
  acts = kernel_activations(h, names, config, kernels.DACT_AMAX_TARGET)
  if acts is not None:
    return kernels.dact_amax_call(dz, h, b, acts)
  return formats.tensor_amax(dact_f32(dz, h, b, names))


def norm_cast(
  x, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma, q_dtype, scale, with_amax, config
):
  """The norm's FP8 output in both orientations (and its amax): (M, K), (K, M), (1,)."""
  if _kernels_run(x, config, kernels.NORM_CAST_TARGET):
    gamma = norm_gamma(ln_scale, zero_centered_gamma)
    beta = ln_bias if ln_bias.size else None
    q, q_t, a = kernels.norm_cast_call(x, mean, rsigma, gamma, beta, scale, q_dtype, with_amax)
    return q, q_t, (a if with_amax else None)
  y = normalized(x, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma)
  return _both(y, scale, q_dtype, with_amax)


def _block_kernel_runs(x, config, target, *dims) -> bool:
  """Whether the block cast kernel ``target`` casts the operand computed from ``x``: where
  ``_kernels_run``, on one device (the block kernels have no partitioning rule; block recipes
  compose when sharded), every one of ``dims`` a multiple of 128."""
  if any(d % 128 for d in dims):
    return False
  return _kernels_run(x, config, target) and kernels.single_device(x)


def norm_block_cast(
  x, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma, q_dtype, power_2, config
):
  """The norm's output cast into FP8 block scaling's 1x128 blocks as it is computed, both
  orientations (``kernels.block_norm_cast_call``), or None where the kernel does not run."""
  if not _block_kernel_runs(x, config, kernels.BLOCK_NORM_CAST_TARGET, *x.shape):
    return None
  gamma = norm_gamma(ln_scale, zero_centered_gamma)
  beta = ln_bias if ln_bias.size else None
  return kernels.block_norm_cast_call(x, mean, rsigma, gamma, beta, q_dtype, power_2=power_2)


def act_block_cast(h, b, names, q_dtype, power_2, config):
  """The activation cast into 1x128 blocks as it is computed (``kernels.block_act_cast_call``),
  or None where the kernel does not run."""
  acts = kernel_activations(h, names, config, kernels.BLOCK_ACT_CAST_TARGET)
  runs = _block_kernel_runs(
    h, config, kernels.BLOCK_ACT_CAST_TARGET, h.shape[0], h.shape[1] // len(names)
  )
  if acts is None or not runs:
    return None
  return kernels.block_act_cast_call(h, b, q_dtype, acts, power_2=power_2)


def dact_block_cast(dz, h, b, names, q_dtype, power_2, config):
  """GEMM 1's output gradient cast into 1x128 blocks as it is computed, and the float32 bias
  gradient (n_act, F) (``kernels.block_dact_cast_call``), or None where the kernel does not
  run."""
  acts = kernel_activations(h, names, config, kernels.BLOCK_DACT_CAST_TARGET)
  runs = _block_kernel_runs(h, config, kernels.BLOCK_DACT_CAST_TARGET, dz.shape[0], dz.shape[1])
  if acts is None or not runs or dz.dtype != h.dtype:
    return None
  *cast, db = kernels.block_dact_cast_call(dz, h, b, q_dtype, acts, power_2=power_2)
  return (*cast, db.reshape(len(names), -1))


def dbias_block_cast(g, q_dtype, power_2, config):
  """The output gradient ``g (M, N)`` cast into 1x128 blocks with its float32 column sums (the
  activation-gradient kernel with a linear activation, reading ``g`` alone), or None where the
  kernel does not run."""
  if not _block_kernel_runs(g, config, kernels.BLOCK_DACT_CAST_TARGET, *g.shape):
    return None
  linear = (KERNEL_ACTIVATIONS["linear"],)
  return kernels.block_dact_cast_call(g, g, None, q_dtype, linear, power_2=power_2)


# --- producers: the operands cast to FP8 in the pass that computes them ---------------------------


@dataclasses.dataclass(frozen=True)
class NormProducer:
  """The first GEMM's input ``norm(y)``: the norm's float32 output cast straight to its FP8
  copies with its amax, never written in the input's dtype; the backward pass keeps the input
  and the row statistics, as ``core.layernorm``'s does. ``norm``: ``(layernorm_type,
  zero_centered_gamma, epsilon)``."""

  norm: tuple[str, bool, float]

  def quantize(self, fmt, request, y, ln_scale, ln_bias):
    layernorm_type, zero_centered_gamma, epsilon = self.norm
    mean, rsigma = norm_stats(y.astype(jnp.float32), layernorm_type, epsilon)
    args = (y, mean, rsigma, ln_scale, ln_bias, zero_centered_gamma)
    q_dtype, config = request.recipe.fwd_dtype, request.config
    producer = Producer(
      cast=lambda scale, with_amax: norm_cast(*args, q_dtype, scale, with_amax, config),
      amax=lambda: formats.tensor_amax(normalized(*args)),
      value=lambda: normalized(*args),
      block_cast=lambda dtype, power_2: norm_block_cast(*args, dtype, power_2, config),
    )
    q = fmt.quantize(dataclasses.replace(request, producer=producer))
    return q, (y, mean, rsigma, ln_scale, (np.zeros((0,), ln_bias.dtype),))

  def backward(self, residuals, dy):
    return norm_bwd(*self.norm, residuals, dy)


@dataclasses.dataclass(frozen=True)
class ActivationProducer:
  """Between two GEMMs: the next one's input ``act(h + b)`` and this one's output gradient
  ``dz * act'(h + b)`` (with ``b``'s gradient summed in the same pass), each cast to FP8 as it
  is computed (``names``: normalized activation names; ``constraint``: a function applied to
  the next GEMM's FP8 input of a per-tensor format, or None)."""

  names: tuple
  constraint: Any = None

  def quantize(self, fmt, request, h, b):
    q_dtype, config = request.recipe.fwd_dtype, request.config

    def cast(scale, with_amax):
      q, q_t, a = act_cast(h, b, self.names, q_dtype, scale, with_amax, config)
      return (q if self.constraint is None else self.constraint(q)), q_t, a

    producer = Producer(
      cast,
      amax=lambda: act_amax(h, b, self.names, config),
      value=lambda: activation_f32(h, b, self.names),
      block_cast=lambda dtype, power_2: act_block_cast(h, b, self.names, dtype, power_2, config),
    )
    return fmt.quantize(dataclasses.replace(request, producer=producer))

  def quantize_grad(self, fmt, request, dz, h, b):
    q_dtype, config = request.recipe.bwd_dtype, request.config
    dbias = []

    def cast(scale, with_amax):
      q, q_t, a, db = dact_cast(dz, h, b, self.names, q_dtype, scale, with_amax, config)
      dbias.append(db)
      return q, q_t, a

    def value():
      dh = dact_f32(dz, h, b, self.names)
      dbias.append(jnp.sum(dh, axis=0))
      return dh.reshape(dh.shape[0], -1)

    def block_cast(dtype, power_2):
      out = dact_block_cast(dz, h, b, self.names, dtype, power_2, config)
      if out is None:
        return None
      dbias.append(out[-1])
      return out[:-1]

    producer = Producer(
      cast,
      amax=lambda: dact_amax(dz, h, b, self.names, config),
      value=value,
      block_cast=block_cast,
    )
    return fmt.quantize(dataclasses.replace(request, producer=producer)), dbias[0]


@dataclasses.dataclass(frozen=True)
class BiasGradProducer:
  """The output gradient ``g (M, N)`` of a GEMM with a bias, in FP8, with the bias's float32
  gradient (its column sums) summed in the pass that casts it (TE's dbias + quantize)."""

  def quantize_grad(self, fmt, request, g):
    q_dtype, config = request.recipe.bwd_dtype, request.config
    sums = []

    def cast(scale, with_amax):
      q, q_t, a, db = dbias_cast(g, q_dtype, scale, with_amax, config)
      sums.append(db)
      return q, q_t, a

    def value():
      # Block and rowwise formats quantize the gradient as it is (their own cast kernels read
      # it), and the bias gradient is XLA's float32 column sums.
      sums.append(jnp.sum(g.astype(jnp.float32), axis=0))
      return g

    def block_cast(dtype, power_2):
      out = dbias_block_cast(g, dtype, power_2, config)
      if out is None:
        return None
      sums.append(out[-1])
      return out[:-1]

    producer = Producer(cast, value=value, block_cast=block_cast)
    return fmt.quantize(dataclasses.replace(request, producer=producer)), sums[0]
