"""How the quantized GEMMs run: implementation choices that leave a recipe's quantized values
alone."""

from __future__ import annotations

import dataclasses
import warnings

__all__ = ["GemmConfig", "check_config"]

_CHOICES = {
  "backend": ("auto", "jax", "ffi"),
  "fp8_gemm": ("auto", "native", "xla"),
  "block_gemm": ("auto", "native", "xla"),
  "partial_sums": ("output", "float32"),
  "non_finite": ("propagate", "saturate"),
  "sequence_gather": ("auto", "fp8", "input"),
  "device_sums": ("collective", "exchange"),
}
# Measurement-only choices of earlier releases: accepted with a DeprecationWarning, no effect.
_DEPRECATED = {
  "layout": (("tn", "xla"), "both operands of every per-tensor FP8 GEMM go in contracting-last"),
  "output": (
    ("mixed32", "f32", "direct", "direct32", "mixed"),
    "the forward and dgrad GEMMs write the output dtype rescaled in float32, wgrad float32",
  ),
  "transpose": (("cast", "fp8"), "one pass writes both FP8 orientations of an operand"),
  "amax": (("jax", "ffi"), "current scaling's amax pass is XLA's reduction"),
}


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Which kernels run a quantized GEMM; hashable, so it can be a static argument.

  The defaults are the fastest choices measured (``bench/RESULTS.md``); every choice computes
  the same quantized values (``partial_sums`` chooses how sums over devices are rounded, and
  ``non_finite`` what a NaN or an infinity in an operand gives).

  Attributes:
    backend: the per-tensor FP8 cast (and amax) kernel. ``"auto"``: the extension's FFI kernel on
      GPUs where its CUDA part is built, pure JAX elsewhere. ``"jax"``: always pure JAX.
      ``"ffi"``: the FFI kernel wherever it applies (an input of float32, bfloat16 or float16 not
      sharded over several devices); an error where the extension is not built for the platform.
      ``Float8BlockScaling``'s casts (both orientations of x, the kernel and the output gradient
      in one pass each) take the extension's CUDA block cast under ``"auto"`` and ``"ffi"`` on a
      GPU, where the last two dims are multiples of 128 on one device, and pure JAX otherwise
      (there is no CPU block cast); the quantized values are the same. ``core.layernorm_mlp``'s
      fused casts (the norm's and the activation's) take the extension's CUDA kernels under
      ``"auto"`` and ``"ffi"`` on a GPU and pure JAX otherwise (there is no CPU kernel); their
      quantized values can differ from pure JAX's by one FP8 step where the kernels' fast
      ``2**x`` and reciprocal (gelu, silu, quick_gelu) differ from XLA's by a few ulp.
    fp8_gemm: per-tensor FP8 GEMMs. ``"auto"``: the extension's cuBLASLt GEMM on Hopper GPUs
      where it can run, XLA's ``dot_general`` on the FP8 arrays elsewhere. ``"native"``: the
      extension's GEMM, an error where it cannot run. ``"xla"``: always XLA's.
    block_gemm: block-scaled GEMMs. ``"auto"``: the device's block-scaled GEMM where it has one
      (cuBLASLt for FP8 1x128/128x128 blocks on Hopper GPUs, ``jax.nn.scaled_matmul`` for MXFP8
      and NVFP4 on Blackwell GPUs), XLA elsewhere. ``"native"``: the device's, an error where it
      cannot run. ``"xla"``: one FP8 GEMM per 128-wide K slice for FP8 blocks, a GEMM of the
      dequantized values for MXFP8 and NVFP4.
    layout, output, transpose, amax: deprecated measurement-only choices, accepted with a
      ``DeprecationWarning`` and without effect; removed in the next release.
    fuse_activation_cast: ``core.layernorm_mlp`` (both GEMMs in FP8, no dropout, blocks that tile
      every GEMM; per-tensor recipes under sharding constraints and inside ``shard_map`` too) casts
      the activation of GEMM 1's output straight to GEMM 2's FP8 operand, and the activation's
      gradient straight to GEMM 1's FP8 output gradient with the bias gradient, in one custom VJP
      that also casts the norm's output straight to GEMM 1's FP8 operand unless it is returned
      (``True``): per-tensor recipes through their cast kernels, block and rowwise recipes by
      quantizing the float32 values in their blocks or rows (``Float8BlockScaling``'s 1x128 blocks
      on Hopper GPUs by the kernels that compute them). ``False`` composes the norm, the
      activation and two ``dot_general`` calls. ``None`` (the default) is ``True``, the faster
      path measured on an H100 for every recipe (``bench/RESULTS.md``). With activations
      narrower than float32 the two differ by the rounding of the norm's output, the activation
      and its gradient to that dtype, which only the composed path does. The same switch
      chooses ``core.layernorm_dense``'s path: fused, the norm's output is cast straight to the
      GEMM's FP8 operand in one custom VJP (the GEMM in FP8, the norm's output not returned;
      constrained only under a per-tensor recipe).
    collective_matmul: with ``dot_general``'s ``sequence_parallel``, decompose the FP8 rows'
      all-gather and the partial sums' reduce-scatter into ring steps (``ppermute``), so that
      each chunk's GEMM runs while the next chunk moves (TE's collective GEMM). The same sums
      in another order (float32 reassociation). ``False`` (the default): one all-gather or
      reduce-scatter beside the GEMM, which XLA may schedule around other work.
    partial_sums: how a sharded program sums the partial products of a GEMM whose contracting
      dim is split over mesh axes (the forward GEMM of a row-parallel layer; dgrad of a
      column-parallel one, whose K is the sharded features; wgrad under data parallelism, whose
      K is the sharded rows), in the partitioning rule of the extension's per-tensor FP8 GEMM
      (the block-scaled GEMM's rule sums in float32). ``"output"`` (the
      default): each device's GEMM writes its partial product in the GEMM's output dtype (the
      layer's compute dtype; for wgrad the kernel's dtype as the layer passes it, bfloat16 for a
      float32 parameter computed in bfloat16) and the all-reduce sums in that dtype, as XLA's
      program of the same ``dot_general`` in that dtype does: half the bytes of float32 for
      bfloat16. Each partial and each addition is rounded to the output dtype, so with n devices
      an element is within about ``(2n - 1) * eps / 2`` of ``sum |a| |b|`` over its K (eps of
      the output dtype) from the float32 sum. ``"float32"``: float32 partial products summed in
      float32 and rounded once, one device's result up to the order of the float32 additions,
      at twice the bytes for bfloat16 outputs. Float32 outputs sum in float32 either way. Inside
      ``shard_map`` the sums over devices are autodiff's (weight gradients in float32), and
      XLA's FP8 GEMM (``fp8_gemm="xla"``, or where the extension's cannot run) is partitioned by
      XLA, which sums in the GEMM's output dtype.
    comm_sm_margin: SMs the extension's per-tensor FP8 GEMM leaves free for the communication
      running beside it, in a sharded ``jit`` program, on the shards of a GEMM whose partial
      products are summed over devices (dgrad of a column-parallel layer, wgrad under data
      parallelism, the forward GEMM of a row-parallel one: the GEMMs that run beside the sums of
      their own chunks and of the GEMM before them). cuBLASLt's persistent GEMMs otherwise hold
      every SM, and the all-reduce queued beside them waits for the GEMM to end. ``None`` (the
      default): every SM. It changes which kernel cuBLASLt runs, not the quantized values; the
      sums may be added in another order.
    sum_chunks: in the same sharded GEMMs, the shard's GEMM is computed in this many chunks of
      its output rows, each all-reduced as soon as it is computed, so that the sum of one chunk
      can run while the next chunk's GEMM does (``1``, the default: one GEMM, then one
      all-reduce). Applies where the rows split into chunks of a multiple of 16; elsewhere the
      GEMM runs whole.
    fold_amax: per-tensor recipes in a sharded ``jit`` program: each operand's amax is
      max-reduced over every mesh axis rather than over the axes that shard it (the same value:
      over an axis that does not shard an operand every device holds the same data), so that
      the amaxes of operands sharded over different axes (x over data parallelism, the kernel
      over tensor parallelism) are reduced over the same devices and XLA can combine their
      all-reduces into one. ``False`` (the default): each over its own axes.
    non_finite: what a quantized GEMM gives when an operand holds a NaN or an infinity (its
      amax, already computed for the scale, is then not finite). ``"propagate"`` (the
      default): the operand's inverse scales become NaN, so the output the operand feeds is
      NaN, as a high-precision GEMM's would be non-finite, and a loop's NaN check fires: the
      whole output for per-tensor and block-scaled recipes (the per-tensor amax, the global
      amax of the blocks), the rows (x, the gradient) or columns (the kernel) with the
      non-finite entry for ``Float8RowwiseScaling``, the group's rows for ``ragged_dot``'s
      per-group scales (one expert's kernel: every row routed to it). ``"saturate"``: TE's
      casts, which clip an infinity to the format's largest value (448 for E4M3, 57344 for
      E5M2) times the scale, so the output stays finite; a NaN stays NaN where the format has
      one (FP8, not NVFP4's FP4 data). The recipe state follows TE's rule either way.
    sequence_gather: with ``dot_general``'s ``sequence_parallel``, what the column-parallel
      GEMM gathers of its input's rows and the row-parallel GEMM of its output gradient's.
      ``"fp8"``: each device casts its shard, once the shards' amaxes are reduced over the
      devices (an all-reduce of one float: current scaling's scale and the non-finite check
      need the global amax), and both FP8 copies (the GEMM's rows and wgrad's transposed copy)
      are all-gathered. ``"input"``: the shard is all-gathered in its own dtype (bfloat16
      rows: the bytes of the two FP8 copies; float32 rows: twice them) and every device casts
      the whole tensor, whose amax it computes itself: no amax all-reduce waits before the cast,
      and the transposed copy is written in place rather than gathered and reordered. The same
      FP8 values either way (one scale, elementwise casts), so the same results; each device
      casts every row instead of its shard's. ``"auto"`` (the default): ``"input"`` for rows of
      2-byte floats (bfloat16, float16), ``"fp8"`` for wider ones and under
      ``collective_matmul`` (whose ring steps move FP8 chunks). ``"input"`` is refused with
      ``collective_matmul``. Under a remat policy that saves the FP8 operands
      (``save_quantized_operands``) ``"fp8"`` keeps each device's shard of wgrad's transposed
      copy and gathers it again in the backward pass, while ``"input"`` keeps all its rows (the
      sequence axis's size times the bytes); without remat both keep all the rows.
    device_sums: how the partitioning rule of the extension's per-tensor FP8 GEMM moves the
      partial products it sums over devices in a sharded ``jit`` program (the GEMMs
      ``partial_sums`` names). ``"collective"`` (the default): XLA's all-reduce, or
      reduce-scatter where the output is sharded over the summed axes (FSDP's weight
      gradient): NCCL's kernels, which need SMs that cuBLASLt's persistent FP8 GEMMs beside
      them hold. ``"exchange"``: pairwise exchanges (``lax.ppermute``) between devices whose
      indices differ in one bit, each followed by an add: log2(n) steps over n devices
      (recursive doubling for the all-reduce, every step moving the whole partial product,
      which is a ring all-reduce's bytes at n = 2 and 4/3 of them at n = 4; recursive halving
      for the reduce-scatter, a ring's bytes). XLA runs those exchanges as device-to-device
      copies on the copy engines, leaving the SMs to the GEMMs, when the program is compiled
      with its option ``xla_gpu_collective_permute_mode=COLLECTIVES_PEER_MEMORY`` (GPUs of one
      process that can reach each other's memory); without it, as NCCL's sends and receives.
      Every device ends with the same bits (the additions commute); the sum differs from the
      all-reduce's by the order of its additions. A count of summing devices that is not a
      power of two is summed by the collectives, with a ``ShardingFallbackWarning`` naming
      the GEMM. The rule of the block-scaled GEMM and the sums inside ``shard_map`` (autodiff's)
      are XLA's collectives either way.

  Raises:
    ValueError: a field outside the values it takes (the message names the field and them);
      ``sequence_gather="input"`` with ``collective_matmul=True``.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.GemmConfig(fp8_gemm="xla").block_gemm
    'auto'
  """

  backend: str = "auto"
  fp8_gemm: str = "auto"
  block_gemm: str = "auto"
  layout: str | None = None
  output: str | None = None
  transpose: str | None = None
  amax: str | None = None
  fuse_activation_cast: bool | None = None
  collective_matmul: bool = False
  partial_sums: str = "output"
  comm_sm_margin: int | None = None
  sum_chunks: int = 1
  fold_amax: bool = False
  non_finite: str = "propagate"
  sequence_gather: str = "auto"
  device_sums: str = "collective"

  def __post_init__(self):
    margin = self.comm_sm_margin
    if margin is not None and (
      isinstance(margin, bool) or not isinstance(margin, int) or margin < 0
    ):
      raise ValueError(
        f"GemmConfig.comm_sm_margin must be None or an int >= 0 (SMs), got {margin!r}"
      )
    chunks = self.sum_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
      raise ValueError(f"GemmConfig.sum_chunks must be an int >= 1, got {chunks!r}")
    if not isinstance(self.fold_amax, bool):
      raise ValueError(f"GemmConfig.fold_amax must be True or False, got {self.fold_amax!r}")
    if not isinstance(self.collective_matmul, bool):
      raise ValueError(
        f"GemmConfig.collective_matmul must be True or False, got {self.collective_matmul!r}"
      )
    if self.sequence_gather == "input" and self.collective_matmul:
      raise ValueError(
        "GemmConfig.sequence_gather='input' gathers whole unquantized rows and cannot be "
        "decomposed into collective_matmul's ring steps: set one of them"
      )
    if self.fuse_activation_cast is not None and not isinstance(self.fuse_activation_cast, bool):
      value = self.fuse_activation_cast
      raise ValueError(
        f"GemmConfig.fuse_activation_cast must be True, False or None, got {value!r}"
      )
    for name, allowed in _CHOICES.items():
      value = getattr(self, name)
      if value not in allowed:
        raise ValueError(f"GemmConfig.{name} must be one of {allowed}, got {value!r}")
    for name, (allowed, what) in _DEPRECATED.items():
      value = getattr(self, name)
      if value is None:
        continue
      if value not in allowed:
        raise ValueError(f"GemmConfig.{name} must be one of {allowed}, got {value!r}")
      warnings.warn(
        f"GemmConfig.{name} is deprecated and has no effect ({what}); it was a measurement "
        "choice and will be removed in the next release: leave it out",
        DeprecationWarning,
        stacklevel=3,
      )


def check_config(config: GemmConfig | None) -> GemmConfig:
  """``config``, or the default ``GemmConfig()`` for ``None``; a TypeError for anything else.

  Args:
    config: a ``GemmConfig`` or ``None``.

  Returns:
    ``config`` itself, or ``GemmConfig()`` where it is ``None``.

  Raises:
    TypeError: ``config`` is neither.

  Example:
    >>> import te_adapters as ta
    >>> ta.core.check_config(None) == ta.GemmConfig()
    True
    >>> ta.core.check_config("cublaslt")
    Traceback (most recent call last):
      ...
    TypeError: config must be a GemmConfig or None, got str
  """
  if config is None:
    return GemmConfig()
  if not isinstance(config, GemmConfig):
    raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
  return config
