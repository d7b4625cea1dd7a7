"""A quantized drop-in for ``hk.Linear``: same parameters, recipe state in ``hk.get_state``."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_adapters import _kit as kit
from te_adapters import core
from te_adapters.haiku._scan_check import refuse_state_in_hk_scan

__all__ = ["Linear"]

# Every adapter's default recipe (stateless current scaling).
_DEFAULT_RECIPE = kit.DEFAULT_RECIPE
# How a Haiku layer gets its rounding keys, said when it has none.
_HOW_TO_GIVE_KEYS = (
  " and draws a key per call with hk.next_rng_key(), but apply was given rng=None: pass a PRNG "
  "key to apply (a fresh one per step), "
)


def linear_forward(
  module: hk.Linear,
  inputs: jax.Array,
  precision: lax.Precision | None,
  recipe,
  options: kit.GemmOptions,
) -> jax.Array:
  """The body of ``hk.Linear.__call__`` with its GEMM done by ``core.dot_general``.

  Must run inside ``module``'s method (directly or from a method interceptor), so parameters and
  state are created under the module's name. Parameter names, shapes, dtypes and initialisers are
  those of ``hk.Linear``; recipe state uses TE's names (``x_scale``, ``x_amax_history``, ...).
  A recipe that rounds stochastically draws its key with ``hk.next_rng_key()``.

  ``hk.Linear.__call__`` computes its GEMM with ``jnp.dot`` and has no hook for another, so its
  body is repeated here with the GEMM replaced (running it only for its parameters would leave
  an extra high-precision GEMM in every trace, which ``te_adapters.inspect.count_fp8_dot_generals``
  counts).
  """
  if not inputs.shape:
    raise ValueError("Input must not be scalar.")
  inputs = jnp.asarray(inputs)
  # Haiku creates the parameters in the inputs' dtype: the core's rules apply before that.
  kit.check_input_dtype(recipe, inputs.dtype, module.module_name)
  input_size = module.input_size = inputs.shape[-1]  # type: ignore[assignment]  # None until called
  dtype = inputs.dtype
  if recipe is not None:
    kit.check_gemm_dims(input_size, module.output_size, module.module_name)

  w_init = module.w_init
  if w_init is None:
    w_init = hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(input_size))
  w = hk.get_parameter("w", [input_size, module.output_size], dtype, init=w_init)

  out = core.dot_general(
    inputs,
    w,
    (((inputs.ndim - 1,), (0,)), ((), ())),
    precision,
    recipe=recipe,
    state=recipe_state(module, recipe),
    rng=rounding_key(module, recipe),
    **options.keywords(),
    layer=f"layer {module.module_name!r}",
    framework="haiku",
  )

  if module.with_bias:
    b = hk.get_parameter("b", [module.output_size], dtype, init=module.b_init)
    out = out + jnp.broadcast_to(b, out.shape)
  return out


def state_variable(name: str, initial: jax.Array) -> jax.Array:
  """One recipe-state entry of the current module with ``hk.get_state``, ``initial`` at init.

  Under ``apply`` the entry must be in the state passed in: Haiku would otherwise create it
  afresh (scale 1, empty history) and the step would quietly quantize with it, so a missing
  entry is an error naming the module.
  """
  if hk.running_init():
    return hk.get_state(name, initial.shape, initial.dtype, init=lambda *_: initial)
  try:
    return hk.get_state(name, initial.shape, initial.dtype)
  except ValueError as e:
    module = hk.experimental.current_name()
    raise ValueError(
      f"te_adapters.haiku: {module!r} keeps recipe state ({name!r} and the other entries of "
      "its recipe), but the state given to apply has none for it; pass the state that init "
      "returned (or the previous step's new state) to apply, not an empty one"
    ) from e


def refuse_ignored_state(recipe) -> None:
  """Under ``apply``, raises where the state holds recipe state for the current module that the
  stateless ``recipe`` (or None: high precision) would ignore: a ``DelayedScaling`` model's state
  given to a ``Float8CurrentScaling`` one, or to one without a recipe."""
  if hk.running_init():
    return
  stateful = core.state_names(core.DelayedScaling())
  module = hk.experimental.current_name()
  # Read without hk.get_state, which a stateless hk.transform refuses.
  if stateful[0] not in hk.experimental.get_current_state().get(module, {}):
    return  # none: as it should be
  if recipe is None:
    keeps, go_on = "it has no recipe (high precision) and keeps", "without a recipe"
  else:
    keeps, go_on = f"its recipe {type(recipe).__name__} keeps", f"with {type(recipe).__name__}"
  raise ValueError(
    f"te_adapters.haiku: the state given to apply holds recipe state for {module!r} "
    f"({', '.join(repr(n) for n in stateful)}), but {keeps} none, so it would be silently "
    "ignored: the state comes from a model with another recipe (DelayedScaling). Apply the "
    f"model with that recipe, or pass the state init returns {go_on}."
  )


def recipe_state(module: hk.Module, recipe, n_groups: int | None = None) -> dict | None:
  """The recipe state of the module's GEMM from ``hk.get_state`` (TE's names), or None where the
  recipe keeps none (a grouped GEMM's of ``n_groups`` groups with ``n_groups``).

  Must run inside the module's method. Refuses state cast away from float32 (an
  ``hk.mixed_precision`` policy), state shared by the iterations of an ``hk.scan``, and state
  that a stateless recipe would ignore.
  """
  state = kit.recipe_state(recipe, state_variable, n_groups)
  if state is None:
    refuse_ignored_state(recipe)
    return None
  cast = sorted(
    {
      str(v.dtype)
      for v in state.values()
      if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != jnp.float32
    }
  )
  if cast:
    raise TypeError(
      f"{module.module_name}: recipe state must stay float32, but a Haiku state getter cast "
      f"it to {', '.join(cast)} (an hk.mixed_precision policy on this module does that); "
      "use a stateless recipe (Float8CurrentScaling) with such policies"
    )
  return refuse_state_in_hk_scan(module.module_name, recipe, state)


def rounding_key(module: hk.Module, recipe):
  """A fresh key from Haiku's RNG sequence when ``recipe`` rounds stochastically, else None."""
  return kit.rounding_key(
    recipe, hk.maybe_next_rng_key, _HOW_TO_GIVE_KEYS, f"{module.module_name}: "
  )


class Linear(kit.GemmOptionAttributes, hk.Linear):
  """``hk.Linear`` with a quantized GEMM (FP8 per ``recipe``).

  Takes every argument of ``hk.Linear`` and creates the same parameters (``w`` of shape
  ``[input_size, output_size]``, ``b`` of shape ``[output_size]``, same default initialisers and
  dtypes), so parameters and checkpoints are interchangeable with ``hk.Linear``. ``recipe=None``
  computes exactly what ``hk.Linear`` computes.

  A stateful recipe (``DelayedScaling``) keeps its state with ``hk.get_state`` under the module's
  name, with TE's names (``x_scale``, ``x_amax_history``, ``kernel_*``, ``grad_*``), so the
  function must be transformed with ``hk.transform_with_state``. The new state comes out of the
  gradient with respect to the state: train with ``te_adapters.haiku.value_grad_and_state``.
  A recipe that rounds stochastically (``NVFP4BlockScaling``) draws a key per call with
  ``hk.next_rng_key()``, so ``apply`` needs an ``rng`` (a fresh one per step).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, te_adapters as ta
    >>> from te_adapters import haiku as ta_hk
    >>> f = hk.transform_with_state(lambda x: ta_hk.Linear(16, recipe=ta.DelayedScaling())(x))
    >>> params, state = f.init(jax.random.key(0), jnp.ones((4, 32)))
    >>> sorted(state["linear"])[:2], params["linear"]["w"].shape
    (['grad_amax_history', 'grad_scale'], (32, 16))
  """

  def __init__(
    self,
    *args,
    recipe: core.Recipe | None = _DEFAULT_RECIPE,
    threshold: core.SizeThreshold | None = kit.DEFAULT_THRESHOLD,
    amax_axes=None,
    kernel_all_gather=None,
    config: core.GemmConfig | None = None,
    enable_low_rank_adaptation: bool = False,
    low_rank_adaptation_dim: int = 32,
    low_rank_adaptation_alpha: float | None = None,
    **kwargs,
  ):
    """Constructs the quantized Linear module.

    Takes ``hk.Linear``'s arguments (``output_size``, ``with_bias``, ``w_init``, ``b_init``,
    ``name``; passed to it unchanged) and these keywords:

    Args:
      *args: positional arguments of ``hk.Linear``.
      recipe: the quantization recipe (default ``te_adapters.Float8CurrentScaling()``), or
        ``None`` for the unquantized ``hk.Linear`` computation.
      threshold: passed to ``core.dot_general``: GEMMs below this ``SizeThreshold`` stay in
        high precision (default ``core.DEFAULT_THRESHOLD``); ``None`` quantizes every GEMM.
      amax_axes: passed to ``core.dot_general`` (inside ``shard_map``: the mesh axes each amax
        is max-reduced over).
      kernel_all_gather: passed to ``core.dot_general`` (FSDP: the sharding of ``w``, gathered
        as FP8).
      config: passed to ``core.dot_general``: a ``core.GemmConfig``, or ``None`` for the
        default.
      enable_low_rank_adaptation: TE's LoRA: adds
        ``core.low_rank_adaptation(x, lora_a_kernel, lora_b_kernel)`` in high precision, with
        parameters ``lora_a_kernel`` ``[input_size, r]`` (``w``'s initialiser) and
        ``lora_b_kernel`` ``[r, output_size]`` (zeros). Train them alone by differentiating
        only the parameters named ``lora_*`` (``hk.data_structures.partition``).
      low_rank_adaptation_dim: the rank ``r`` (default 32, at most
        ``min(input_size, output_size)``).
      low_rank_adaptation_alpha: the LoRA term is scaled by ``alpha / r``; ``None`` (default)
        scales by 1.
      **kwargs: keyword arguments of ``hk.Linear``.
    """
    super().__init__(*args, **kwargs)
    self.recipe = kit.check_recipe_or_none(recipe)
    self.options = kit.GemmOptions(threshold, amax_axes, kernel_all_gather, config)
    self.enable_low_rank_adaptation = bool(enable_low_rank_adaptation)
    self.low_rank_adaptation_dim = low_rank_adaptation_dim
    self.low_rank_adaptation_alpha = low_rank_adaptation_alpha

  def __call__(self, inputs: jax.Array, *, precision: lax.Precision | None = None) -> jax.Array:
    """Computes ``inputs @ w + b`` with the GEMM quantized per the recipe.

    Args:
      inputs: a floating-point array of shape ``[..., input_size]``.
      precision: passed to the GEMM, as for ``hk.Linear``.

    Returns:
      An array of shape ``[..., output_size]`` with the dtype of ``inputs``.
    """
    if self.enable_low_rank_adaptation and jnp.ndim(inputs):
      core.check_lora_rank(
        self.low_rank_adaptation_dim, jnp.shape(inputs)[-1], self.output_size, self.module_name
      )
    out = linear_forward(self, inputs, precision, self.recipe, self.options)
    if not self.enable_low_rank_adaptation:
      return out
    input_size = jnp.shape(inputs)[-1]
    a_shape, b_shape = core.lora_shapes(input_size, self.output_size, self.low_rank_adaptation_dim)
    dtype = jnp.asarray(inputs).dtype
    w_init = self.w_init or hk.initializers.TruncatedNormal(stddev=1.0 / np.sqrt(input_size))
    lora_a = hk.get_parameter("lora_a_kernel", a_shape, dtype, init=w_init)
    lora_b = hk.get_parameter("lora_b_kernel", b_shape, dtype, init=jnp.zeros)
    return kit.add_lora(
      out,
      inputs,
      lora_a,
      lora_b,
      state=recipe_state(self, self.recipe),
      kernel_shape=(self.input_size, self.output_size),
      threshold=self.threshold,
      alpha=self.low_rank_adaptation_alpha,
      layer=f"layer {self.module_name!r}",
      framework="haiku",
    )


# hk.Linear's own signature, plus the quantization keywords (inspect.signature(Linear) shows it).
Linear.__init__.__signature__ = kit.signature_with_keywords(  # type: ignore[attr-defined]
  hk.Linear.__init__, Linear.__init__
)
