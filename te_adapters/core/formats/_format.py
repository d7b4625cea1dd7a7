"""The one format interface: what every recipe's quantization gives the quantized GEMM.

A format is a few pure functions bundled in a ``QuantizationFormat``, the way optax bundles a
transformation's ``init`` and ``update``: the state it keeps per GEMM, the quantized copies of an
operand for its uses, the GEMM those copies feed, dequantization and the next state.
``_registry.format_of`` maps a recipe to its format (an unknown recipe is an error); the quantized
GEMM (``_gemm``) and the fused norm and MLP paths (producers into the same rule) and the grouped
GEMM (``_ragged``, through the format's ``GroupedFormat``) call these functions and never name a
recipe class.

Two families build most formats: per-tensor scaling (``_tensor_format.tensor_format`` over a
``_tensor_scaling.TensorScaling``: delayed and current scaling) and block scaling
(``_block_scaled.block_format`` over a ``BlockFormat``: MXFP8, NVFP4, FP8 1x128/128x128). A new
format implements ``QuantizationFormat`` directly or through one of them.

Operands arrive contracting-last: ``(..., P, C)``, the GEMM's contracting dimension ``C`` last.
``quantize`` gives the copy for that use (``rows``: blocks or scales along ``C``) and the copy of
the swapped operand ``(..., C, P)`` (``cols``: along ``P``), which the backward GEMMs take: x's
for the weight gradient, the kernel's for the input gradient, the output gradient's for the
weight gradient.

A format with a grouped GEMM (``ragged_dot``, one kernel per group of rows) also gives a
``GroupedFormat``: the same quantize, GEMM and next-state steps over grouped operands, where what
depends on the groups (a scale per group, blocks that never cross a group) is the format's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from te_adapters.core import recipes, sharding

__all__ = [
  "BlockFormat",
  "GroupedFormat",
  "GroupedRequest",
  "OperandSpec",
  "Producer",
  "QuantizationFormat",
  "Quantized",
  "QuantizeRequest",
]


class Quantized(NamedTuple):
  """The copies of one operand that ``QuantizationFormat.quantize`` made (None where not asked
  for), and the operand's role state for the next step (None for stateless formats).

  Args:
    rows: the ``ScaledTensor`` quantized along the GEMM's contracting dimension, or None.
    cols: the ``ScaledTensor`` of the swapped operand (for the backward GEMMs), or None.
    state: the role's next state (a ``RoleState`` for delayed scaling), or None.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.Float8CurrentScaling()
    >>> request = ta.core.QuantizeRequest(jnp.ones((2, 16)), "x", recipe, cols=False)
    >>> q = ta.core.format_of(recipe).quantize(request)
    >>> q.rows.shape, q.cols, q.state
    ((2, 16), None, None)
  """

  rows: Any
  cols: Any
  state: Any


class Producer(NamedTuple):
  """An operand made inside its own cast (the fused norm, activation and bias gradient).

  A format takes what its scaling needs: one scale per tensor takes ``cast`` (and ``amax``),
  scales per block or per row take ``value``.

  Attributes:
    cast: ``(scale, with_amax) -> (rows data, cols data, amax or None)``: the FP8 copies, cast
      from float32 in the pass that computes the operand (per-tensor formats).
    amax: ``() -> amax`` (float32 (1,)): the operand's amax, for scalings that need it before
      the cast (current scaling); None to compute it from the operand.
    value: ``() -> array``: the operand's values (float32 where it is computed here, never
      rounded to the activations' dtype), for formats whose scales depend on more than one amax
      (blocks, rows): they quantize it as they would an operand, and XLA fuses its formula into
      their amaxes and casts. None: such a format cannot take this producer.
    block_cast: ``(q_dtype, power_2) -> (rows data, rows scale_inv, cols data, cols scale_inv,
      amax)`` or None: the operand cast into 1x128 blocks of FP8 block scaling in the pass that
      computes it (both orientations, ``kernels.block_cast_call``'s outputs, 2-D), or None where
      no kernel does (the format then quantizes ``value``). None: no such cast.

  Example:
    The operand ``2 * x``, computed inside its own cast:

    >>> import jax.numpy as jnp, te_adapters as ta
    >>> x = jnp.array([[1.0, -3.0]])
    >>> def cast(scale, with_amax):
    ...   y = 2 * x
    ...   q = (y * scale).astype(jnp.float8_e4m3fn)
    ...   return q, q.T, jnp.abs(y).max().reshape(1) if with_amax else None
    >>> producer = ta.core.Producer(cast, amax=lambda: jnp.abs(2 * x).max().reshape(1),
    ...                             value=lambda: 2 * x)
    >>> recipe = ta.Float8CurrentScaling()
    >>> request = ta.core.QuantizeRequest(x, "x", recipe, producer=producer)
    >>> q = ta.core.format_of(recipe).quantize(request)
    >>> [round(v, 3) for v in ta.dequantize(q.rows)[0].tolist()]  # 2 * x, through E4M3
    [1.929, -6.0]
  """

  cast: Callable[..., tuple[jax.Array, jax.Array, jax.Array | None]]
  amax: Callable[[], jax.Array] | None = None
  value: Callable[[], jax.Array] | None = None
  block_cast: Callable[..., tuple | None] | None = None


@dataclasses.dataclass(frozen=True)
class QuantizeRequest:
  """What the quantized GEMM asks a format to quantize (not a pytree: built inside a trace).

  Attributes:
    x: the operand, contracting-last ``(..., P, C)``; with a ``producer`` only its type counts.
    role: ``"x"``, ``"kernel"`` or ``"grad"``.
    recipe: the recipe.
    state: the GEMM's recipe state (the format's state type; None for stateless formats).
    plan: the ``SpmdPlan`` (amax reductions inside ``shard_map``, FSDP); None: no plan.
    config: the ``GemmConfig`` (which kernels cast); None: the default.
    rows: whether the copy along ``C`` is needed.
    cols: whether the copy of the swapped operand is needed.
    key: PRNG key for stochastic rounding (formats that use one), else None.
    producer: a ``Producer`` that casts the operand in the pass that makes it, or None.

  Raises:
    ValueError: ``role`` is not one of the three.

  Example:
    >>> import jax, jax.numpy as jnp, te_adapters as ta
    >>> recipe = ta.DelayedScaling(amax_history_len=4)
    >>> state = ta.core.init_state(recipe)
    >>> x = jnp.array([[1.0, -2.0], [0.5, 4.0]])  # (P, C): contracting dimension last
    >>> request = ta.core.QuantizeRequest(x, "x", recipe, state=state)
    >>> q = ta.core.format_of(recipe).quantize(request)
    >>> q.rows.shape, q.cols.shape  # the copy along C and the swapped copy (C, P)
    ((2, 2), (2, 2))
    >>> q.state.amax_history.tolist(), q.state.scale.tolist()  # x's next state
    ([0.0, 0.0, 0.0, 4.0], [112.0])
  """

  x: Any
  role: str
  recipe: Any
  state: Any = None
  plan: Any = None
  config: Any = None
  rows: bool = True
  cols: bool = True
  key: Any = None
  producer: Producer | None = None

  def __post_init__(self):
    if self.role not in ("x", "kernel", "grad"):
      raise ValueError(f"role must be 'x', 'kernel' or 'grad', got {self.role!r}")
    if self.state is None:
      object.__setattr__(self, "state", {})
    if self.plan is None:
      object.__setattr__(self, "plan", sharding.SpmdPlan())
    if self.config is None:
      object.__setattr__(self, "config", recipes.GemmConfig())


@dataclasses.dataclass(frozen=True)
class GroupedRequest:
  """What the grouped GEMM asks a format to quantize (not a pytree: built inside a trace).

  The grouped GEMM multiplies rows ``x`` (M, K), grouped contiguously by ``group_sizes`` (rows
  past their sum are in no group), by one kernel per group, ``w`` (G, K, N): forward ``y (M, N)``
  contracting K, dgrad ``dx (M, K)`` contracting N, and wgrad ``dw (G, K, N)`` contracting the
  rows of each group.

  Attributes:
    x: the operand as the grouped GEMM holds it: x (M, K) for ``"x"``, the kernels (G, K, N)
      for ``"kernel"``, the output gradient (M, N) for ``"grad"``.
    role: ``"x"``, ``"kernel"`` or ``"grad"``.
    recipe: the recipe.
    group_sizes: (G,) int32, on the device.
    state: the grouped GEMM's state (G stacked states of the format; ``{}`` when stateless).
    rows: whether the copy for the operand's first GEMM is needed: x's and the kernel's for the
      forward GEMM, the gradient's for dgrad.
    cols: whether the copy for its other GEMM is needed: x's and the gradient's for wgrad (the
      rows of each group contracted), the kernel's for dgrad.
    route: the format's choice of GEMMs for this grouped GEMM (``GroupedFormat.route``).
    granularity: ``"group"`` (the grouped GEMM's scales and blocks are per group) or
      ``"tensor"`` (per-tensor formats: one amax over all groups, the alternative kept for
      measurements).
    non_finite: ``GemmConfig.non_finite``: ``"propagate"`` (NaN inverse scales where an amax is
      not finite) or ``"saturate"``.
  """

  x: Any
  role: str
  recipe: Any
  group_sizes: Any
  state: Any = None
  rows: bool = True
  cols: bool = True
  route: Any = None
  granularity: str = "group"
  non_finite: str = "propagate"

  def __post_init__(self):
    if self.role not in ("x", "kernel", "grad"):
      raise ValueError(f"role must be 'x', 'kernel' or 'grad', got {self.role!r}")
    if self.granularity not in ("group", "tensor"):
      raise ValueError(f"granularity must be 'group' or 'tensor', got {self.granularity!r}")
    if self.state is None:
      object.__setattr__(self, "state", {})


class GroupedFormat(NamedTuple):
  """A format's grouped GEMM (``ragged_dot``): the steps of the one grouped rule (``_ragged``).

  Attributes:
    check: ``(recipe, k, n, backward) -> None``: raises where the format cannot quantize a
      grouped GEMM with contracting size K and output size N (``backward``: its gradient GEMMs
      too).
    route: ``(lhs, rhs, recipe, out_dtypes) -> hashable``: which GEMMs run (for example a native
      grouped kernel where it runs); ``out_dtypes`` are those of y, dx and dw. The rule passes it
      back to ``quantize`` and ``gemm``.
    quantize: ``GroupedRequest -> Quantized``: the operand's copies (``rows``, ``cols``), in the
      format's own grouped layout, and its role's next state (per group).
    gemm: ``(a, b, group_sizes, out_dtype, which, recipe, precision, route) -> array``: for
      ``which`` ``"fwd"`` (x's rows, the kernel's rows) -> (M, N), ``"dgrad"`` (the gradient's
      rows, the kernel's cols) -> (M, K), ``"wgrad"`` (x's cols, the gradient's cols) ->
      (G, K, N); rows past the groups give zeros.
    next_state: ``(recipe, state, {role: role state}) -> state``: the grouped GEMM's next state.
  """

  check: Callable[..., None]
  route: Callable[..., Any]
  quantize: Callable[[GroupedRequest], Quantized]
  gemm: Callable[..., jax.Array]
  next_state: Callable[..., Any]


class QuantizationFormat(NamedTuple):
  """The functions of one quantization format.

  Attributes:
    recipe_type: the recipe class whose GEMMs use this format.
    scaling_modes: the ``ScaledTensor.scaling_mode`` values of its tensors.
    init_state: ``recipe -> state``: one GEMM's initial state (an empty ``{}`` when stateless).
    state_shapes: ``recipe -> {name: shape}``: the state one GEMM keeps, with TE's names.
    quantize: ``QuantizeRequest -> Quantized``: the operand's copies (``ScaledTensor``) and its
      role's next state.
    gemm: ``(a, b, out_dtype, which, recipe, config, precision, out_sharding) -> array``:
      ``(..., M, K) x (..., N, K) -> (..., M, N)`` from two copies quantized along K, in
      ``out_dtype``; ``which`` is ``"fwd"``, ``"dgrad"`` or ``"wgrad"``.
    next_state: ``(recipe, state, {role: role state}) -> state``: the GEMM's next state.
    dequantize: ``(t, dtype) -> array``: the high-precision values of one of its tensors.
    check: ``(recipe, layout, backward, lhs, rhs) -> None``: raises where the format cannot
      quantize a GEMM of this ``_layout.GemmLayout`` (``backward``: its gradient GEMMs too;
      ``lhs``/``rhs``: the operands, for their shardings, or None).
    per_tensor: one scale per tensor. Its FP8 copies transpose exactly, so FSDP gathers the FP8
      kernel shard and transposes it after the gather (``kernel_all_gather``); block formats
      refuse that. Inside ``shard_map`` block formats sum cotangents in float32 and name the
      forward GEMM's output sharding under Explicit mesh axes.
    scaling: the per-tensor ``TensorScaling`` (state, scale rule); None for block formats.
    block: the ``BlockFormat`` of a block format (its operand blocks), else None.
    grouped: the format's ``GroupedFormat`` (``ragged_dot``), or None: no grouped GEMM.
    takes_producer: whether ``quantize`` takes a ``Producer`` (``QuantizeRequest.producer``):
      the fused norm and MLP paths of ``layernorm_dense`` and ``layernorm_mlp``. False: those
      take the composed path for this format, with a ``FusedPathFallbackWarning``.

  Example:
    A new recipe class served by an existing format under its own name (``register_format``
    makes ``dot_general`` take it):

    >>> import dataclasses, jax.numpy as jnp, te_adapters as ta
    >>> @dataclasses.dataclass(frozen=True)
    ... class MyScaling(ta.Float8CurrentScaling):
    ...   pass
    >>> fmt = ta.core.format_of(ta.Float8CurrentScaling())._replace(recipe_type=MyScaling)
    >>> fmt.per_tensor, fmt.scaling_modes, fmt.state_shapes(MyScaling())
    (True, ('tensor',), {})
    >>> ta.core.register_format(fmt)
    >>> y = ta.core.dot_general(jnp.ones((2, 16)), jnp.ones((16, 16)), (((1,), (0,)), ((), ())),
    ...                         recipe=MyScaling(), threshold=None)
    >>> round(float(y[0, 0]), 4)
    16.0
    >>> ta.core.unregister_format(MyScaling)
  """

  recipe_type: type
  scaling_modes: tuple[str, ...]
  init_state: Callable[..., Any]
  state_shapes: Callable[..., dict[str, tuple[int, ...]]]
  quantize: Callable[[QuantizeRequest], Quantized]
  gemm: Callable[..., jax.Array]
  next_state: Callable[..., Any]
  dequantize: Callable[..., jax.Array]
  check: Callable[..., None]
  per_tensor: bool
  scaling: Any = None
  block: Any = None
  grouped: GroupedFormat | None = None
  takes_producer: bool = False


# --- the block family's parameters --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one copy of one GEMM operand is quantized in blocks (static)."""

  mode: str  # "mxfp8", "nvfp4" or "float8_block"
  block_shape: tuple[int, ...]
  q_dtype: np.dtype
  rht: bool = False
  stochastic: bool = False
  power_2: bool = True

  @property
  def block_size(self) -> int:
    return self.block_shape[-1]


class BlockFormat(NamedTuple):
  """The block-level functions of one block-scaled format (``_block_scaled.block_format`` makes
  its ``QuantizationFormat``).

  Attributes:
    recipe_type: the recipe class whose GEMMs use this format.
    scaling_modes: the ``ScaledTensor.scaling_mode`` values of its tensors.
    operand_spec: ``(recipe, role, wgrad) -> OperandSpec``: how ``recipe`` quantizes the
      operand ``role`` (``"x"``, ``"kernel"``, ``"grad"``); ``wgrad`` marks the copy that feeds
      the weight-gradient GEMM.
    quantize: ``(x, spec, key, stream, reduce_amax) -> (data, scale_inv, amax, scaling_mode)``:
      blocks of ``spec.block_shape`` over the trailing axes of ``x`` (already checked to divide
      them); ``key`` and its random ``stream`` feed stochastic rounding (``spec.stochastic``),
      ``reduce_amax`` maps a shard's amax to the whole tensor's (or is None).
    dequantize: ``(t, dtype) -> array``: the high-precision values of a ``ScaledTensor``.
    gemm: ``(a, b, out_dtype, out_sharding, choice) -> array``: ``(B, M, K) x (B, N, K) ->
      (B, M, N)`` from two ``ScaledTensor`` operands blocked along K, float32 (or ``out_dtype``
      where the kernel writes it); ``choice`` is ``GemmConfig.block_gemm``.
  """

  recipe_type: type
  scaling_modes: tuple[str, ...]
  operand_spec: Callable[..., OperandSpec]
  quantize: Callable[..., tuple[jax.Array, jax.Array, jax.Array, str]]
  dequantize: Callable[..., jax.Array]
  gemm: Callable[..., jax.Array]
