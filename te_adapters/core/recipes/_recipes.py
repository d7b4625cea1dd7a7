"""Quantization recipes: frozen, hashable descriptions of how a GEMM is quantized.

Names, fields and defaults follow TransformerEngine's common recipes, so a recipe written for TE
reads the same here.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

import jax.numpy as jnp
import numpy as np

__all__ = [
  "Format",
  "MMParams",
  "Recipe",
  "DelayedScaling",
  "Float8CurrentScaling",
  "MXFP8BlockScaling",
  "NVFP4BlockScaling",
  "Float8BlockScaling",
  "Float8RowwiseScaling",
]


class Format(enum.Enum):
  """FP8 formats of a recipe.

  ``E4M3`` quantizes every tensor to ``float8_e4m3fn``. ``HYBRID`` uses ``float8_e4m3fn`` for the
  forward operands (x and kernel) and ``float8_e5m2`` for the output gradient. ``E5M2`` exists for
  name compatibility with TE and is rejected by every recipe, as in TE's JAX layer. ``E2M1``
  (``float4_e2m1fn``) is the element format of ``NVFP4BlockScaling`` only.

  Attributes:
    fwd_dtype: the dtype of the forward operands (x and kernel).
    bwd_dtype: the dtype of the output gradient.

  Example:
    >>> import te_adapters as ta
    >>> ta.Format.HYBRID.fwd_dtype, ta.Format.HYBRID.bwd_dtype
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
  """

  E4M3 = "E4M3"
  E5M2 = "E5M2"
  HYBRID = "HYBRID"
  E2M1 = "E2M1"

  @property
  def fwd_dtype(self) -> np.dtype:
    """Dtype of x and kernel."""
    if self is Format.E5M2:
      return np.dtype(jnp.float8_e5m2)
    if self is Format.E2M1:
      return np.dtype(jnp.float4_e2m1fn)
    return np.dtype(jnp.float8_e4m3fn)

  @property
  def bwd_dtype(self) -> np.dtype:
    """Dtype of the output gradient."""
    if self is Format.E4M3:
      return np.dtype(jnp.float8_e4m3fn)
    if self is Format.E2M1:
      return np.dtype(jnp.float4_e2m1fn)
    return np.dtype(jnp.float8_e5m2)


def _check_format(name: str, value: object) -> None:
  if not isinstance(value, Format):
    raise TypeError(f"{name}.fp8_format must be a te_adapters.Format, got {value!r}")
  if value is Format.E5M2:
    raise ValueError(
      f"{name}: pure E5M2 training is not supported; use Format.HYBRID (E4M3 forward, "
      "E5M2 gradients) or Format.E4M3"
    )
  if value is Format.E2M1:
    raise ValueError(f"{name}: Format.E2M1 is the FP4 format of NVFP4BlockScaling only")


def _check_margin(name: str, margin: object) -> None:
  if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
    raise TypeError(f"{name}.margin must be a real number, got {margin!r}")
  if not np.isfinite(float(margin)) or margin < 0:
    raise ValueError(f"{name}.margin must be finite and >= 0, got {margin!r}")


def _check_bool(name: str, field: str, value: object) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}.{field} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MMParams:
  """How one per-tensor FP8 GEMM accumulates (TE's ``MMParams``).

  On Hopper, cuBLASLt's FP8 GEMMs either keep their running sums in the tensor cores' reduced
  precision ("fast accumulation") or promote them to float32 as they go ("split accumulator").
  The fast sums err about 20 times more than the promoted ones at large K, and the promoted
  ones cost GEMM time (``bench/RESULTS.md`` has the figures). TE's recipes ask for fast sums in
  the forward GEMM and promoted sums in dgrad and wgrad, whose K is the token count; this library
  honours them (TE's JAX layer ignores them and uses fast sums everywhere unless an environment
  variable says otherwise, as Flax's fp8 op does).

  Args:
    use_split_accumulator: promote the sums to float32 (``lax.Precision.HIGHEST``). ``False``:
      the ``precision`` given to ``dot_general`` decides (``DEFAULT``: fast sums). Emulated and
      CPU GEMMs sum in float32 either way.

  Raises:
    TypeError: ``use_split_accumulator`` is not a bool.

  Example:
    >>> import te_adapters as ta
    >>> fast = ta.MMParams(use_split_accumulator=False)
    >>> ta.Float8CurrentScaling(fp8_gemm_dgrad=fast).fp8_gemm_dgrad.use_split_accumulator
    False
  """

  use_split_accumulator: bool = True

  def __post_init__(self):
    _check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)


_GEMMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def _check_mm_params(recipe) -> None:
  for field in _GEMMS:
    value = getattr(recipe, field)
    if not isinstance(value, MMParams):
      raise TypeError(
        f"{type(recipe).__name__}.{field} must be a te_adapters.MMParams, got {value!r}"
      )


class Recipe:
  """Base class of every recipe. A recipe is a frozen dataclass, usable as a static argument.

  Not constructed itself: each recipe below is a subclass, and ``isinstance(r, Recipe)`` tells a
  recipe from anything else.

  Attributes:
    fp8_format: the recipe's ``Format``.
    stateful: whether the recipe keeps state between steps (amax histories and scales).
    block_scaled: whether it scales blocks of elements instead of whole tensors.
    uses_rng: whether ``dot_general`` needs an ``rng`` key under it.
    fwd_dtype: the dtype the forward operands are quantized to.
    bwd_dtype: the dtype the output gradient is quantized to.

  Example:
    >>> import te_adapters as ta
    >>> r = ta.NVFP4BlockScaling()
    >>> isinstance(r, ta.Recipe), r.stateful, r.block_scaled, r.uses_rng
    (True, False, True, True)
    >>> {r: "hashable"}[ta.NVFP4BlockScaling()]  # equal recipes hash equal (static arguments)
    'hashable'
  """

  fp8_format: Format

  @property
  def stateful(self) -> bool:
    """Whether the recipe keeps state between steps (amax histories and scales)."""
    return False

  @property
  def block_scaled(self) -> bool:
    """Whether the recipe scales blocks of elements (MXFP8, NVFP4, 1x128) instead of tensors."""
    return False

  @property
  def uses_rng(self) -> bool:
    """Whether ``dot_general`` needs an ``rng`` key (stochastic rounding) under this recipe."""
    return False

  @property
  def fwd_dtype(self) -> np.dtype:
    return self.fp8_format.fwd_dtype

  @property
  def bwd_dtype(self) -> np.dtype:
    return self.fp8_format.bwd_dtype


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
  """Per-tensor FP8 scaling from a history of past amaxes (TE's ``DelayedScaling``).

  Each quantized tensor role (``x``, ``kernel``, ``grad``) keeps a ``scale`` of shape (1,) and an
  ``amax_history`` of shape (``amax_history_len``,). A GEMM quantizes with the stored scale, then
  records the current amax and computes the scale for the next step:
  ``scale = fp8_max / amax / 2**margin``, where ``amax`` is the maximum over the history window
  (``"max"``) or the current amax (``"most_recent"``). The old scale is kept when that amax is zero
  or not finite.

  Args:
    margin: the scale is divided by ``2**margin``; a non-negative number.
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
    amax_history_len: length of the amax history window, at least 1.
    amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: each GEMM's ``MMParams`` (TE's defaults:
      fast sums forward, float32-promoted sums in dgrad and wgrad).

  Raises:
    TypeError: a field of the wrong type (``fp8_format`` not a ``Format``, a non-integer
      ``amax_history_len``, ``MMParams`` fields of another type).
    ValueError: a negative or non-finite margin, ``Format.E5M2`` or ``Format.E2M1``, a history
      shorter than 1, or another ``amax_compute_algo``.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=8)
    >>> state = ta.core.init_state(recipe)
    >>> state["x_amax_history"].shape, state["x_scale"].tolist()
    ((8,), [1.0])
    >>> x, w, dn = jnp.full((16, 32), 2.0), jnp.ones((32, 16)), (((1,), (0,)), ((), ()))
    >>> gemm = lambda s: ta.core.dot_general(x, w, dn, recipe=recipe, state=s, threshold=None)
    >>> state = ta.core.updated_state(state, jax.grad(lambda s: gemm(s).sum())(state))
    >>> state["x_amax_history"].tolist(), state["x_scale"].tolist()  # E4M3's 448 / amax 2
    ([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0], [224.0])
  """

  margin: float = 0
  fp8_format: Format = Format.HYBRID
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    name = type(self).__name__
    _check_margin(name, self.margin)
    _check_format(name, self.fp8_format)
    if isinstance(self.amax_history_len, bool) or not isinstance(
      self.amax_history_len, numbers.Integral
    ):
      raise TypeError(f"{name}.amax_history_len must be an int, got {self.amax_history_len!r}")
    if self.amax_history_len < 1:
      raise ValueError(f"{name}.amax_history_len must be >= 1, got {self.amax_history_len}")
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(
        f"{name}.amax_compute_algo must be 'max' or 'most_recent', got "
        f"{self.amax_compute_algo!r} (callables are not supported)"
      )
    _check_mm_params(self)

  @property
  def stateful(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
  """Per-tensor FP8 scaling from the tensor's own amax (TE's ``Float8CurrentScaling``).

  ``scale = fp8_max / amax(|x|)``, or 1 when the amax is zero or not finite. No state.

  Args:
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: each GEMM's ``MMParams`` (TE's defaults:
      fast sums forward, float32-promoted sums in dgrad and wgrad).

  Raises:
    TypeError: ``fp8_format`` is not a ``Format``, or a GEMM's field is not an ``MMParams``.
    ValueError: ``Format.E5M2`` or ``Format.E2M1``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.Float8CurrentScaling(fp8_format=ta.Format.E4M3)
    >>> ta.core.init_state(recipe)  # stateless
    EmptyState()
    >>> x, w = jnp.arange(32.0).reshape(2, 16), jnp.eye(16)
    >>> y = ta.core.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, threshold=None)
    >>> y.dtype, bool(jnp.abs(y - x).max() <= 31 * 2**-4)  # E4M3 rounds to 3 mantissa bits
    (dtype('float32'), True)
  """

  fp8_format: Format = Format.HYBRID
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    _check_format(type(self).__name__, self.fp8_format)
    _check_mm_params(self)


class _BlockRecipe(Recipe):
  @property
  def block_scaled(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_BlockRecipe):
  """MXFP8: blocks of 32 consecutive elements share a power-of-two (E8M0) scale (TE's recipe).

  Every GEMM operand is quantized in 1x32 blocks along its contracting dimension, each copy
  (forward and backward use different contracting dimensions) from the high-precision input. The
  block scale is ``2**e`` with ``e`` the E8M0 exponent of ``block_amax / fp8_max`` rounded up.
  No state. Needs the M, N and K sizes of every GEMM to be multiples of 32.

  Args:
    margin: kept for TE compatibility; TE ignores it, so only 0 is accepted.
    fp8_format: ``Format.E4M3`` (default; gradients in E4M3 too) or ``Format.HYBRID``.

  Raises:
    TypeError: ``fp8_format`` is not a ``Format``.
    ValueError: a margin other than 0, ``Format.E5M2`` or ``Format.E2M1``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> q = ta.quantize(jnp.ones((4, 64)), recipe=ta.MXFP8BlockScaling())
    >>> q.data.dtype, q.scale_inv.shape  # one E8M0 scale per 32 elements of a row
    (dtype(float8_e4m3fn), (4, 2))
  """

  margin: int = 0
  fp8_format: Format = Format.E4M3

  def __post_init__(self):
    name = type(self).__name__
    if self.margin != 0:
      raise ValueError(
        f"{name}.margin must be 0 (block scales do not use a margin), got {self.margin!r}"
      )
    _check_format(name, self.fp8_format)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(_BlockRecipe):
  """NVFP4: FP4 (E2M1) values with an E4M3 scale per 16 elements and an FP32 tensor scale.

  As in TE: x and the output gradient use 1x16 blocks along the contracting dimension; the kernel
  uses 16x16 tiles (so its forward and backward copies are the same values); the gradient is
  stochastically rounded; the operands of the weight-gradient GEMM go through a 16-point random
  Hadamard transform along the contracted (token) dimension. No state; with stochastic rounding,
  ``dot_general`` needs an ``rng`` key. Needs M, N and K to be multiples of 16.

  Args:
    disable_rht: no random Hadamard transform on the weight-gradient operands.
    disable_stochastic_rounding: round the gradient to nearest (then no ``rng`` is needed).
    disable_2d_quantization: 1x16 blocks for the kernel too.
    fp4_format: ``Format.E2M1`` (the only choice).
    fp8_format: ``Format.E4M3`` (the block-scale format; the only choice).

  Raises:
    TypeError: a ``disable_*`` field that is not a bool.
    ValueError: another ``fp4_format`` or ``fp8_format``.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.NVFP4BlockScaling()
    >>> recipe.fwd_dtype, recipe.uses_rng  # gradients round stochastically: dot_general needs rng
    (dtype(float4_e2m1fn), True)
    >>> ta.NVFP4BlockScaling(disable_stochastic_rounding=True).uses_rng
    False
  """

  disable_rht: bool = False
  disable_stochastic_rounding: bool = False
  disable_2d_quantization: bool = False
  fp4_format: Format = Format.E2M1
  fp8_format: Format = Format.E4M3

  def __post_init__(self):
    name = type(self).__name__
    for field in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
      _check_bool(name, field, getattr(self, field))
    if self.fp4_format is not Format.E2M1:
      raise ValueError(f"{name}.fp4_format must be Format.E2M1, got {self.fp4_format!r}")
    if self.fp8_format is not Format.E4M3:
      raise ValueError(f"{name}.fp8_format must be Format.E4M3, got {self.fp8_format!r}")

  @property
  def fwd_dtype(self) -> np.dtype:
    return np.dtype(jnp.float4_e2m1fn)

  @property
  def bwd_dtype(self) -> np.dtype:
    return np.dtype(jnp.float4_e2m1fn)

  @property
  def uses_rng(self) -> bool:
    return not self.disable_stochastic_rounding


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_BlockRecipe):
  """DeepSeek-style FP8 block scaling: 1x128 blocks for x and gradients, 128x128 for weights.

  TE's common recipe of that name (TE's JAX layer lacks it). Each block has a float32 scale
  ``fp8_max / block_amax``, by default rounded down to a power of two. Each GEMM runs as FP8
  GEMMs over 128-wide slices of the contracting dimension whose partial sums are scaled and
  accumulated in float32. No state. Needs M, N and K to be multiples of 128.

  Args:
    use_f32_scales: keep the exact float32 scales instead of powers of two.
    fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID``.
    x_block_scaling_dim: 1 (1x128 blocks, default) or 2 (128x128 tiles) for x.
    w_block_scaling_dim: 1 or 2 (default) for the kernel.
    grad_block_scaling_dim: 1 (default) or 2 for the output gradient.
      Two operands of one GEMM may not both use 2 (TE rejects 2Dx2D GEMMs).

  Raises:
    TypeError: ``use_f32_scales`` is not a bool, or ``fp8_format`` not a ``Format``.
    ValueError: a block dim other than 1 or 2, two 2D operands in one GEMM, ``Format.E5M2`` or
      ``Format.E2M1``.

  Example:
    >>> import te_adapters as ta
    >>> ta.Float8BlockScaling().power_2_scale
    True
    >>> ta.Float8BlockScaling(x_block_scaling_dim=2)
    Traceback (most recent call last):
      ...
    ValueError: Float8BlockScaling: x_block_scaling_dim and w_block_scaling_dim are both 2; ...
  """

  use_f32_scales: bool = False
  fp8_format: Format = Format.E4M3
  x_block_scaling_dim: int = 1
  w_block_scaling_dim: int = 2
  grad_block_scaling_dim: int = 1

  def __post_init__(self):
    name = type(self).__name__
    _check_bool(name, "use_f32_scales", self.use_f32_scales)
    _check_format(name, self.fp8_format)
    dims = {}
    for role in ("x", "w", "grad"):
      value = getattr(self, f"{role}_block_scaling_dim")
      if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{name}.{role}_block_scaling_dim must be 1 or 2, got {value!r}")
      dims[role] = value
    for a, b, gemm in (("x", "w", "forward"), ("grad", "w", "dgrad"), ("x", "grad", "wgrad")):
      if dims[a] == 2 and dims[b] == 2:
        raise ValueError(
          f"{name}: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2; the {gemm} "
          "GEMM would multiply two 128x128-tiled operands, which is not supported"
        )

  @property
  def power_2_scale(self) -> bool:
    """Whether block scales are rounded down to powers of two."""
    return not self.use_f32_scales


@dataclasses.dataclass(frozen=True)
class Float8RowwiseScaling(Recipe):
  """Rowwise FP8 scaling: one scale per row of each GEMM operand, from its current amax.

  torchao's float8 ``rowwise`` recipe (``rowwise_with_gw_hp`` with
  ``weight_grad_high_precision=True``). Every operand of each of the three GEMMs is quantized
  with one float32 scale per row along the GEMM's contracting dimension: x per token and the
  kernel per output channel in the forward GEMM; in dgrad the gradient per token and the kernel
  per input channel; in wgrad x and the gradient per channel over the tokens. Each copy's scales
  are computed from the high-precision tensor along its own contracting dimension, so one outlier
  token costs only its own row's resolution. Each scale is a power of two, as torchao's rowwise
  recipes round theirs: the largest ``2**e`` with ``row_amax * 2**e <= fp8_max / 2**margin``, or
  1 where the row's amax is zero or not finite; exact, so the quantization is bit for bit the
  same on CPU and GPU. No state. The GEMM is an FP8 GEMM whose float32 output is multiplied by
  the outer product of the two operands' scale inverses; any shape.

  Args:
    margin: the scale is divided by ``2**margin``; a non-negative number.
    fp8_format: ``Format.HYBRID`` (default: E4M3 forward, E5M2 gradient) or ``Format.E4M3``
      (torchao's choice: E4M3 for the gradient too).
    weight_grad_high_precision: the weight-gradient GEMM takes x and the output gradient
      unquantized (the forward and dgrad GEMMs stay in FP8), as torchao's ``rowwise_with_gw_hp``.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: each FP8 GEMM's ``MMParams`` (as for
      ``Float8CurrentScaling``: fast sums forward, float32-promoted sums in dgrad and wgrad).

  Raises:
    TypeError: a field of the wrong type (``fp8_format``, ``weight_grad_high_precision``, the
      ``MMParams`` fields).
    ValueError: a negative or non-finite margin, ``Format.E5M2`` or ``Format.E2M1``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x = jnp.array([[1.0, 2.0, 3.0], [100.0, 0.5, 0.25]])
    >>> q = ta.quantize(x, recipe=ta.Float8RowwiseScaling())
    >>> q.scale_inv.ravel().tolist()  # 1 / scale, one power of two per row: 3 * 128, 100 * 4
    [0.0078125, 0.25]
  """

  margin: float = 0
  fp8_format: Format = Format.HYBRID
  weight_grad_high_precision: bool = False
  fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
  fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
  fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)

  def __post_init__(self):
    name = type(self).__name__
    _check_margin(name, self.margin)
    _check_format(name, self.fp8_format)
    _check_bool(name, "weight_grad_high_precision", self.weight_grad_high_precision)
    _check_mm_params(self)


_RECIPES = (
  DelayedScaling,
  Float8CurrentScaling,
  MXFP8BlockScaling,
  NVFP4BlockScaling,
  Float8BlockScaling,
  Float8RowwiseScaling,
)


def check_recipe(recipe: object) -> Recipe:
  """Returns ``recipe`` if it is a supported recipe instance, else raises a TypeError.

  Args:
    recipe: the object to check.

  Returns:
    ``recipe`` itself.

  Raises:
    TypeError: ``recipe`` is a recipe class rather than an instance, or not a recipe at all.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.check_recipe(ta.MXFP8BlockScaling())
    MXFP8BlockScaling(margin=0, fp8_format=<Format.E4M3: 'E4M3'>)
    >>> ta.core.check_recipe(ta.DelayedScaling)
    Traceback (most recent call last):
      ...
    TypeError: recipe must be a recipe instance, got the class DelayedScaling; ...
  """
  if isinstance(recipe, type) and issubclass(recipe, Recipe):
    raise TypeError(
      f"recipe must be a recipe instance, got the class {recipe.__name__}; "
      f"write {recipe.__name__}()"
    )
  if not isinstance(recipe, Recipe):
    names = ", ".join(f"te_adapters.{r.__name__}" for r in _RECIPES)
    raise TypeError(
      f"recipe must be one of {names}; got {type(recipe).__module__}.{type(recipe).__name__}"
    )
  return recipe
