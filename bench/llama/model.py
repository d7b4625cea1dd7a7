"""The Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention (one fused QKV
projection; ``jax.nn.dot_product_attention``, cuDNN's flash attention on GPU), SwiGLU MLP (one
fused gate-and-up projection), untied output head; float32 parameters, bf16 compute.

Written four times with the same initialisation rule (normal 0.02, and 0.02 / sqrt(2 * layers)
for the residual projections; each framework draws its own values):

* ``nnx_model``: plain Flax NNX (``nnx.Linear``, ``nnx.RMSNorm``, ``nnx.Embed``), converted by
  ``te_adapters.nnx.quantize_model``;
* ``linen_model``: plain Flax Linen (``nn.Dense``, ...), converted by
  ``te_adapters.linen.quantize``, or given a ``dot_general_cls`` (Flax's own FP8 op);
* ``nnx_model(..., modules=True)``: NNX with the library's fused modules,
  ``LayerNormDenseGeneral`` (RMSNorm + QKV) and ``LayerNormMLP`` (RMSNorm + SwiGLU), and
  ``Linear`` for the attention output, each built with the recipe;
* ``haiku_forward``: plain Haiku (``hk.Linear``, ``hk.RMSNorm``, ``hk.Embed``), converted by
  ``te_adapters.haiku.quantize``.

The layers are stacked and run by a scan (``nnx.scan`` / ``nn.scan`` / ``hk.layer_stack``) when
``Config.scan``: one layer's program, compiled once whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_adapters.core import kernels


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int
  d_model: int
  layers: int
  heads: int
  kv_heads: int
  ffn: int
  seq_len: int
  batch: int
  rope_theta: float = 500000.0
  norm_eps: float = 1e-5
  learning_rate: float = 3e-4
  warmup_steps: int = 20
  # True: threshold=None, every converted GEMM in FP8 whatever its size (CPU); False: the
  # library's default size threshold, as a user gets it.
  fp8_everywhere: bool = False
  scan: bool = True
  # None: no rematerialisation; else "gemm_outputs" (save_gemm_outputs) or the name of a
  # jax.checkpoint_policies policy, the same for every variant.
  remat: str | None = None
  # Convergence runs (bench/llama/converge.py): held-out loss every eval_every steps, over
  # eval_batches batches of the held-out tokens.
  eval_every: int = 100
  eval_batches: int = 4

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def qkv_features(self) -> int:
    return (self.heads + 2 * self.kv_heads) * self.head_dim

  @property
  def tokens_per_step(self) -> int:
    return self.batch * self.seq_len

  def matmul_params(self) -> int:
    """Parameters that enter a GEMM: every layer's projections and the output head (the
    embedding is a lookup)."""
    d, f = self.d_model, self.ffn
    per_layer = d * self.qkv_features + self.heads * self.head_dim * d + 3 * d * f
    return self.layers * per_layer + d * self.vocab

  def params(self) -> int:
    """All parameters: the GEMMs', the embedding and the norms' scales."""
    return self.matmul_params() + self.vocab * self.d_model + (2 * self.layers + 1) * self.d_model

  def flops_per_step(self) -> float:
    """Model FLOPs of one training step: 6 per GEMM parameter per token, plus attention's score
    and value GEMMs, 12 * layers * heads * head_dim * seq_len per token (forward and backward,
    the PaLM convention, causal masking not discounted)."""
    per_token = (
      6 * self.matmul_params() + 12 * self.layers * self.heads * self.head_dim * self.seq_len
    )
    return float(per_token * self.tokens_per_step)


CONFIGS = {
  # Llama-3.2-1B's width with 128-wide heads: 16 layers, d_model 2048, 16 query heads and 4
  # KV heads of 128, SwiGLU 8192, vocabulary 32768, untied head: 1.10B parameters (1.04B in
  # GEMMs). 8 sequences of 2048 tokens per step. Every projection GEMM has M = 16384 and
  # K, N >= 2048, so it passes the default FP8 size threshold.
  # Without rematerialisation the plain models' step needs ~61 GiB of temporaries besides the
  # 12 GiB of parameters and optimizer state: more than an 80 GB H100 holds.
  "1b": Config(
    vocab=32768,
    d_model=2048,
    layers=16,
    heads=16,
    kv_heads=4,
    ffn=8192,
    seq_len=2048,
    batch=8,
    remat="gemm_outputs",
  ),
  # Convergence (bench/llama/converge.py): the 1b configuration's layer (every projection GEMM
  # of the same K and N), 4 layers deep: 377.5M parameters, 310.4M of them in GEMMs (the head's
  # 67.1M included; the embedding 67.1M). 2 sequences of 2048 tokens a step, 8.45 TFLOP. At
  # M = 4096 the QKV and attention-output GEMMs fall under the default FP8 size threshold, so
  # every GEMM is asked for FP8 (threshold=None). Warm-up 100 steps; held-out loss every 200 over
  # 16 batches (64k tokens).
  "350m": Config(
    vocab=32768,
    d_model=2048,
    layers=4,
    heads=16,
    kv_heads=4,
    ffn=8192,
    seq_len=2048,
    batch=2,
    warmup_steps=100,
    fp8_everywhere=True,
    eval_every=200,
    eval_batches=16,
  ),
  # CPU: every dim a multiple of 128 (Float8BlockScaling tiles it), all GEMMs in FP8.
  "cpu": Config(
    vocab=512,
    d_model=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ffn=256,
    seq_len=64,
    batch=4,
    learning_rate=3e-3,
    warmup_steps=2,
    fp8_everywhere=True,
  ),
}


def attention_implementation() -> str:
  """cuDNN's flash attention on GPU, XLA's attention elsewhere."""
  return "cudnn" if jax.default_backend() == "gpu" else "xla"


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), Llama's half-split form,
  computed in float32."""
  t, d = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  angles = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
  cos = jnp.asarray(np.cos(angles), jnp.float32)[None, :, None, :]
  sin = jnp.asarray(np.sin(angles), jnp.float32)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(qkv: jax.Array, cfg: Config) -> jax.Array:
  """Causal grouped-query attention of a fused (batch, seq, qkv_features) projection."""
  b, t, _ = qkv.shape
  hd, nq, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
  q, k, v = jnp.split(qkv, [nq * hd, (nq + nkv) * hd], axis=-1)
  q = rotary(q.reshape(b, t, nq, hd), cfg.rope_theta)
  k = rotary(k.reshape(b, t, nkv, hd), cfg.rope_theta)
  v = v.reshape(b, t, nkv, hd)
  implementation, dtype = attention_implementation(), q.dtype
  if implementation == "cudnn" and dtype == jnp.float32:
    # Haiku's init traces the model in float32 (float32 parameters); cuDNN takes no float32
    # operands. Training runs in bf16 and is not touched.
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  return out.astype(dtype).reshape(b, t, nq * hd)


def swiglu(h: jax.Array) -> jax.Array:
  gate, up = jnp.split(h, 2, axis=-1)
  return jax.nn.silu(gate) * up


def init_std(cfg: Config) -> tuple[float, float]:
  """0.02, and 0.02 / sqrt(2 * layers) for the projections that write the residual stream."""
  return 0.02, 0.02 / math.sqrt(2 * cfg.layers)


def is_head(path: str) -> bool:
  return path.split("/")[-1] == "head"


def _is_extension_gemm(prim, params) -> bool:
  """Whether an equation is the extension's cuBLASLt FP8 GEMM (the library's GEMM on Hopper
  GPUs: an FFI call) or holds it. Under FSDP (Auto mesh axes) the GEMM runs inside the calls of
  its partitioning rule (``custom_vmap_call`` > ``jit`` > ``custom_partitioning``), which remat
  saves or computes again whole."""
  if prim.name == "ffi_call":
    return params.get("target_name") == kernels.GEMM_TARGET
  if prim.name not in ("custom_vmap_call", "custom_partitioning", "jit", "pjit"):
    return False
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      eqns = getattr(getattr(item, "jaxpr", item), "eqns", ())  # a ClosedJaxpr or a Jaxpr
      if any(_is_extension_gemm(e.primitive, e.params) for e in eqns):
        return True
  return False


def save_gemm_outputs(prim, *_, **params) -> bool:
  """A rematerialisation policy that treats every variant's GEMMs alike: it saves the outputs of
  ``dot_general``, of the extension's FP8 GEMM (an FFI call, which JAX's dot policies do not
  see) and of custom-VJP calls (the library's quantized GEMMs and fused modules, Flax's FP8 op,
  cuDNN's attention), and recomputes the rest (norms, rotary, SwiGLU's product, residual adds)
  in the backward pass."""
  if prim.name == "dot_general" or prim.name.startswith("custom_vjp"):
    return True
  return _is_extension_gemm(prim, params)


def remat_policy(cfg: Config):
  """None (no remat), ``"gemm_outputs"`` (``save_gemm_outputs``) or a jax.checkpoint_policies
  name."""
  if not cfg.remat:
    return None
  if cfg.remat == "gemm_outputs":
    return save_gemm_outputs
  return getattr(jax.checkpoint_policies, cfg.remat)


# ----------------------------------------------------------------------------------------------
# Flax NNX


def nnx_model(
  cfg: Config,
  seed: int = 0,
  *,
  modules_recipe=None,
  modules: bool = False,
  threshold=None,
  gemm_config=None,
  kernel_all_gather=None,
):
  """The model in plain NNX; with ``modules=True``, its blocks are the library's fused modules
  built with ``modules_recipe`` (None: bf16), ``threshold`` and ``gemm_config``, and under
  FSDP ``kernel_all_gather`` (each kernel's sharding inside the scanned layer, gathered in FP8)."""
  from flax import nnx

  from te_adapters import nnx as ta_nnx

  std, out_std = init_std(cfg)
  init, out_init = nnx.initializers.normal(std), nnx.initializers.normal(out_std)
  bf16 = jnp.bfloat16

  class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      d = cfg.d_model
      linear = functools.partial(nnx.Linear, use_bias=False, dtype=bf16, rngs=rngs)
      self.attn_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=bf16, rngs=rngs)
      self.qkv = linear(d, cfg.qkv_features, kernel_init=init)
      self.out = linear(cfg.heads * cfg.head_dim, d, kernel_init=out_init)
      self.mlp_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=bf16, rngs=rngs)
      self.gate_up = linear(d, 2 * cfg.ffn, kernel_init=init)
      self.down = linear(cfg.ffn, d, kernel_init=out_init)

    def __call__(self, x):
      x = x + self.out(attention(self.qkv(self.attn_norm(x)), cfg))
      return x + self.down(swiglu(self.gate_up(self.mlp_norm(x))))

  class FusedBlock(nnx.Module):
    """The same block through ``LayerNormDenseGeneral``, ``Linear`` and ``LayerNormMLP``."""

    def __init__(self, rngs: nnx.Rngs):
      d = cfg.d_model
      gemm = dict(recipe=modules_recipe, threshold=threshold, config=gemm_config)
      if kernel_all_gather is not None:
        gemm["kernel_all_gather"] = kernel_all_gather
      norm = dict(layernorm_type="rmsnorm", epsilon=cfg.norm_eps, return_layernorm_output=False)
      self.qkv = ta_nnx.LayerNormDenseGeneral(
        d, cfg.qkv_features, kernel_init=init, **norm, **gemm, rngs=rngs
      )
      self.out = ta_nnx.Linear(
        cfg.heads * cfg.head_dim,
        d,
        use_bias=False,
        dtype=bf16,
        kernel_init=out_init,
        **gemm,
        rngs=rngs,
      )
      self.mlp = ta_nnx.LayerNormMLP(
        d, cfg.ffn, activations=("silu", "linear"), kernel_init=init, **norm, **gemm, rngs=rngs
      )

    def __call__(self, x):
      z, _ = self.qkv(x)
      x = x + self.out(attention(z.astype(bf16), cfg))
      y, _ = self.mlp(x)
      return x + y.astype(x.dtype)

  block_cls = FusedBlock if modules else Block

  class LanguageModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      d = cfg.d_model
      self.embed = nnx.Embed(cfg.vocab, d, dtype=bf16, embedding_init=init, rngs=rngs)
      if cfg.scan:

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
          return block_cls(rngs)

        self.blocks = stack(rngs)
      else:
        self.blocks = nnx.List([block_cls(rngs) for _ in range(cfg.layers)])
      self.norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=bf16, rngs=rngs)
      self.head = nnx.Linear(d, cfg.vocab, use_bias=False, dtype=bf16, kernel_init=init, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      policy = remat_policy(cfg)
      if cfg.scan:

        def body(block, h):
          return block(h)

        if cfg.remat:
          body = nnx.remat(body, policy=policy)
        x = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
      else:
        for block in self.blocks:
          x = nnx.remat(lambda b, h: b(h), policy=policy)(block, x) if cfg.remat else block(x)
      return self.head(self.norm(x))

  return LanguageModel(nnx.Rngs(seed))


# ----------------------------------------------------------------------------------------------
# Flax Linen


def linen_model(cfg: Config, dot_general_cls=None):
  """The model in plain Linen; ``dot_general_cls`` goes to every projection (not the head)."""
  from flax import linen as nn

  std, out_std = init_std(cfg)
  bf16 = jnp.bfloat16

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
      dense = functools.partial(
        nn.Dense,
        use_bias=False,
        dtype=bf16,
        kernel_init=nn.initializers.normal(std),
        dot_general_cls=dot_general_cls,
      )
      out_dense = functools.partial(dense, kernel_init=nn.initializers.normal(out_std))
      h = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=bf16, name="attn_norm")(x)
      x = x + out_dense(cfg.d_model, name="out")(
        attention(dense(cfg.qkv_features, name="qkv")(h), cfg)
      )
      h = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=bf16, name="mlp_norm")(x)
      x = x + out_dense(cfg.d_model, name="down")(swiglu(dense(2 * cfg.ffn, name="gate_up")(h)))
      return (x, None) if cfg.scan else x

  class LanguageModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(
        cfg.vocab, cfg.d_model, dtype=bf16, embedding_init=nn.initializers.normal(std), name="embed"
      )(tokens)
      block = Block
      if cfg.remat:
        block = nn.remat(Block, policy=remat_policy(cfg))
      if cfg.scan:
        x, _ = nn.scan(
          block,
          variable_axes={"params": 0, "_overwrite_with_gradient": 0},
          split_rngs={"params": True},
          length=cfg.layers,
        )(name="blocks")(x, None)
      else:
        for i in range(cfg.layers):
          x = block(name=f"block_{i}")(x)
      x = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=bf16, name="norm")(x)
      return nn.Dense(
        cfg.vocab, use_bias=False, dtype=bf16, kernel_init=nn.initializers.normal(std), name="head"
      )(x)

  return LanguageModel()


# ----------------------------------------------------------------------------------------------
# Haiku


def haiku_forward(tokens, cfg: Config, compute_dtype):
  """The model in plain Haiku. ``hk.Linear`` creates its parameters and computes in its input's
  dtype, so the projections' inputs are cast to ``compute_dtype``: float32 at init (float32
  parameters), bf16 in training, where the caller passes the kernels cast to bf16. Their outputs
  are cast to it too: a converted layer keeps float32 kernels (bf16 x float32 gives float32), and
  cuDNN's attention takes no float32 operands."""
  import haiku as hk

  std, out_std = init_std(cfg)
  init, out_init = hk.initializers.RandomNormal(std), hk.initializers.RandomNormal(out_std)

  def linear(features, name, w_init=init):
    layer = hk.Linear(features, with_bias=False, w_init=w_init, name=name)
    return lambda h: layer(h.astype(compute_dtype)).astype(compute_dtype)

  def norm(name):
    layer = hk.RMSNorm(-1, eps=cfg.norm_eps, name=name)
    return lambda h: layer(h.astype(jnp.float32)).astype(compute_dtype)

  def block(x):
    h = norm("attn_norm")(x)
    x = x + linear(cfg.d_model, "out", out_init)(attention(linear(cfg.qkv_features, "qkv")(h), cfg))
    h = norm("mlp_norm")(x)
    return x + linear(cfg.d_model, "down", out_init)(swiglu(linear(2 * cfg.ffn, "gate_up")(h)))

  x = hk.Embed(cfg.vocab, cfg.d_model, w_init=init, name="embed")(tokens).astype(compute_dtype)
  layer = hk.remat(block, policy=remat_policy(cfg)) if cfg.remat else block
  if cfg.scan:
    x = hk.layer_stack(cfg.layers, name="blocks")(layer)(x)
  else:
    for i in range(cfg.layers):
      with hk.experimental.name_scope(f"block_{i}"):
        x = layer(x)
  return linear(cfg.vocab, "head")(norm("norm")(x))
