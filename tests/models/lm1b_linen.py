"""An lm1b-shaped Flax Linen decoder-only language model, small.

The module tree, names and logical partitioning are those of Flax's Linen lm1b example:
``TransformerLM`` -> ``decoder`` (``Decoder``) with an ``nn.Embed`` (``('vocab', 'embed')``), a
sinusoidal ``posembed_output``, ``encoderdecoderblock_<i>`` blocks (``nn.LayerNorm``,
``nn.SelfAttention`` with ``nn.DenseGeneral`` query/key/value/out projections, kernels
``('embed', 'kv')``, and ``MlpBlock``: ``nn.Dense`` ``('embed', 'mlp')`` -> relu ->
``nn.Dense`` ``('mlp', 'embed')``), ``encoderdecoder_norm`` and ``logitdense``
(``('embed', 'vocab')``), or the embedding's ``attend`` when ``logits_via_embedding``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TransformerConfig:
  vocab_size: int = 64
  output_vocab_size: int = 64
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  emb_dim: int = 32
  num_heads: int = 2
  num_layers: int = 2
  qkv_dim: int = 32
  mlp_dim: int = 64
  max_len: int = 64
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  deterministic: bool = True
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
  pad_widths = [(0, 0)] * x.ndim
  pad_widths[axis] = (1, 0)
  padded = jnp.pad(x, pad_widths)
  return jax.lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_table(max_len: int, d_feature: int, max_scale: float = 10_000.0):
  position = np.arange(max_len)[:, None]
  div_term = np.exp(np.arange(d_feature // 2) * -np.log(max_scale) / (d_feature // 2 - 1))
  table = np.zeros((max_len, d_feature), np.float32)
  table[:, : d_feature // 2] = np.sin(position * div_term)
  table[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
  return jnp.asarray(table[None])


class AddPositionEmbs(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    table = sinusoidal_table(self.config.max_len, inputs.shape[-1])
    return inputs + table[:, : inputs.shape[1], :]


class MlpBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    x = nn.Dense(
      config.mlp_dim,
      dtype=config.dtype,
      kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "mlp")),
      bias_init=nn.with_logical_partitioning(config.bias_init, ("mlp",)),
    )(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    output = nn.Dense(
      inputs.shape[-1],
      dtype=config.dtype,
      kernel_init=nn.with_logical_partitioning(config.kernel_init, ("mlp", "embed")),
      bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
    )(x)
    return nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)


def _layer_norm(config: TransformerConfig, **kwargs) -> nn.LayerNorm:
  return nn.LayerNorm(
    dtype=config.dtype,
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
    **kwargs,
  )


class EncoderDecoder1DBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None):
    config = self.config
    x = _layer_norm(config)(inputs)
    x = nn.SelfAttention(
      num_heads=config.num_heads,
      dtype=config.dtype,
      qkv_features=config.qkv_dim,
      kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "kv")),
      bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=config.attention_dropout_rate,
      deterministic=config.deterministic,
    )(x, mask=decoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x + inputs
    z = _layer_norm(config)(x)
    return x + MlpBlock(config=config)(z)


class Decoder(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None):
    config = self.config
    output_embed = nn.Embed(
      num_embeddings=config.output_vocab_size,
      features=config.emb_dim,
      embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(stddev=1.0), ("vocab", "embed")
      ),
    )
    y = output_embed(shift_right(inputs.astype("int32")))
    y = AddPositionEmbs(config=config, name="posembed_output")(y)
    y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
    y = y.astype(config.dtype)
    for lyr in range(config.num_layers):
      y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
        y, decoder_mask=decoder_mask
      )
    y = _layer_norm(config, name="encoderdecoder_norm")(y)
    if config.logits_via_embedding:
      return output_embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
    return nn.Dense(
      config.output_vocab_size,
      dtype=config.dtype,
      kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "vocab")),
      bias_init=nn.with_logical_partitioning(config.bias_init, ("vocab",)),
      name="logitdense",
    )(y)


class TransformerLM(nn.Module):
  """``TransformerLM(config).apply(variables, tokens) -> logits`` (tokens ``[B, L]``, 0 = pad)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    decoder_mask = nn.combine_masks(
      nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
      nn.make_causal_mask(inputs, dtype=config.dtype),
    )
    logits = Decoder(config=config, name="decoder")(inputs, decoder_mask=decoder_mask)
    return logits.astype(config.dtype)


def next_token_loss(logits, tokens):
  """lm1b's objective: cross-entropy of ``logits`` (computed from the right-shifted ``tokens``)
  against ``tokens``, averaged over the non-padding positions."""
  log_probs = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
  weights = (tokens > 0).astype(nll.dtype)
  return jnp.sum(nll * weights) / jnp.sum(weights)
