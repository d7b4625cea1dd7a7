"""A Gemma-shaped Flax NNX transformer, small.

The module tree, names and einsum equations are those of Flax's NNX Gemma example:
``embedder`` (``input_embedding``, ``encode`` / tied ``decode``), ``layers/<i>`` blocks with
``pre_attention_norm``, ``attn`` (``qkv_einsum`` ``'BTD,SNDH->SBTNH'`` when there are as many
key/value heads as query heads, else ``q_einsum`` ``'BTD,NDH->BTNH'`` and ``kv_einsum``
``'BSD,CKDH->CBSKH'``; ``attn_vec_einsum`` ``'BTNH,NHD->BTD'``), ``pre_ffw_norm``, ``mlp``
(``gate_proj`` / ``up_proj`` / ``down_proj``, gated GELU), and ``final_norm``; RMSNorm with a
``1 + scale`` weight and RoPE on queries and keys.

One difference: the example's ``layers.Einsum`` is a bare module holding its weight ``w`` and
calling ``jnp.einsum``, a GEMM no converter can reach. Here ``Einsum`` is an ``nnx.Einsum`` (its
weight is ``kernel``) with the same constructor, equation and shape, so the attention
projections are layers a conversion can select or keep in high precision.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  num_layers: int = 2
  num_embed: int = 64
  embed_dim: int = 32
  hidden_dim: int = 64
  num_heads: int = 2
  head_dim: int = 16
  num_kv_heads: int = 2  # 1 (fewer than num_heads) gives q_einsum + kv_einsum


class Einsum(nnx.Einsum):
  """Gemma's ``Einsum(einsum_str, shape, *, rngs)``, normal-initialised, no bias."""

  def __init__(self, einsum_str: str, shape, *, rngs: nnx.Rngs):
    super().__init__(einsum_str, shape, kernel_init=nnx.initializers.normal(), rngs=rngs)

  @property
  def shape(self):
    return self.kernel.shape


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    del rngs
    self.scale = nnx.Param(jnp.zeros((dim,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


def apply_rope(x, positions, max_wavelength: int = 10_000):
  """Rotary position embedding of ``x`` ``[B, T, N, H]`` at ``positions`` ``[B, T]``."""
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
  angle = positions[..., None, None] / timescale
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Embedder(nnx.Module):
  def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
    self.input_embedding = nnx.Param(
      nnx.initializers.normal()(rngs.params(), (vocab_size, embed_dim))
    )

  def encode(self, x):
    x = self.input_embedding[...][(x,)]
    return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

  def decode(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class Attention(nnx.Module):
  def __init__(
    self, num_heads: int, num_kv_heads: int, features: int, head_dim: int, *, rngs: nnx.Rngs
  ):
    self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (num_heads, head_dim, features), rngs=rngs)
    if num_heads == num_kv_heads:
      self.qkv_einsum = Einsum("BTD,SNDH->SBTNH", (3, num_heads, features, head_dim), rngs=rngs)
    else:
      self.q_einsum = Einsum("BTD,NDH->BTNH", (num_heads, features, head_dim), rngs=rngs)
      self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, num_kv_heads, features, head_dim), rngs=rngs)
    self.head_dim = head_dim
    self.num_heads = num_heads

  def __call__(self, x, segment_pos, attn_mask):
    if hasattr(self, "qkv_einsum"):
      query, key, value = self.qkv_einsum(x)
    else:
      query = self.q_einsum(x)
      key, value = self.kv_einsum(x)
    query = apply_rope(query, segment_pos) * self.head_dim**-0.5
    key = apply_rope(key, segment_pos)
    if key.shape[-2] != query.shape[-2]:  # grouped-query attention
      key = jnp.repeat(key, query.shape[-2] // key.shape[-2], axis=-2)
      value = jnp.repeat(value, query.shape[-2] // value.shape[-2], axis=-2)
    logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
    logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value)
    return self.attn_vec_einsum(encoded)


class FeedForward(nnx.Module):
  def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal()
    self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
    self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
    self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, kernel_init=init, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.pre_attention_norm = RMSNorm(config.embed_dim, rngs=rngs)
    self.attn = Attention(
      config.num_heads, config.num_kv_heads, config.embed_dim, config.head_dim, rngs=rngs
    )
    self.pre_ffw_norm = RMSNorm(config.embed_dim, rngs=rngs)
    self.mlp = FeedForward(config.embed_dim, config.hidden_dim, rngs=rngs)

  def __call__(self, x, segment_pos, attn_mask):
    x = x + self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
    return x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
  """``Transformer(config, rngs=...)(tokens, positions, attention_mask) -> logits``."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.embedder = Embedder(config.num_embed, config.embed_dim, rngs=rngs)
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.embed_dim, rngs=rngs)

  def __call__(self, last_tokens, positions, attention_mask):
    x = self.embedder.encode(last_tokens)
    for layer in self.layers:
      x = layer(x, positions, attention_mask)
    return self.embedder.decode(self.final_norm(x))


def causal_attn_mask(tokens):
  """Gemma's ``make_causal_attn_mask`` for an unpadded ``[B, L]`` batch: ``[B, L, L]``."""
  length = tokens.shape[-1]
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), tokens.shape + (length,))


def next_token_loss(model: Transformer, tokens):
  """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  logits = model(inputs, positions, causal_attn_mask(inputs))
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
