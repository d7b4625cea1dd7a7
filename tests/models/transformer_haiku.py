"""A Haiku transformer language model shaped like Haiku's transformer example, small.

The module structure and names are the example's: a ``Transformer`` of ``num_layers`` blocks,
each ``hk.LayerNorm`` -> ``hk.MultiHeadAttention`` (``query`` / ``key`` / ``value`` / ``linear``
projections, causal mask) -> residual, ``hk.LayerNorm`` -> dense block (``hk.Linear`` of
``widening_factor * model_size``, GELU, ``hk.Linear`` of ``model_size``) -> residual, and a final
``hk.LayerNorm``; a ``LanguageModel`` with an ``hk.Embed``, learned ``positional_embeddings`` and
an ``hk.Linear`` unembedding. Haiku names them ``transformer/multi_head_attention/query``,
``transformer/linear``, ``language_model/linear`` and so on.
"""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np


def _layer_norm(x):
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)


@dataclasses.dataclass
class Transformer(hk.Module):
  num_heads: int = 2
  num_layers: int = 2
  attn_size: int = 16
  dropout_rate: float = 0.0
  widening_factor: int = 2
  name: str | None = None

  def __call__(self, embeddings, mask=None, *, is_training: bool = True):
    initializer = hk.initializers.VarianceScaling(2 / self.num_layers)
    dropout_rate = self.dropout_rate if is_training else 0.0
    _, seq_len, model_size = embeddings.shape
    causal_mask = np.tril(np.ones((1, 1, seq_len, seq_len)))
    if mask is not None:
      causal_mask = causal_mask * mask[:, None, None, :]
    h = embeddings
    for _ in range(self.num_layers):
      attn_block = hk.MultiHeadAttention(
        num_heads=self.num_heads, key_size=self.attn_size, model_size=model_size, w_init=initializer
      )
      h_norm = _layer_norm(h)
      h_attn = attn_block(h_norm, h_norm, h_norm, mask=causal_mask)
      if dropout_rate:
        h_attn = hk.dropout(hk.next_rng_key(), dropout_rate, h_attn)
      h = h + h_attn
      dense_block = hk.Sequential(
        [
          hk.Linear(self.widening_factor * model_size, w_init=initializer),
          jax.nn.gelu,
          hk.Linear(model_size, w_init=initializer),
        ]
      )
      h_dense = dense_block(_layer_norm(h))
      if dropout_rate:
        h_dense = hk.dropout(hk.next_rng_key(), dropout_rate, h_dense)
      h = h + h_dense
    return _layer_norm(h)


@dataclasses.dataclass
class LanguageModel(hk.Module):
  transformer: Transformer
  model_size: int = 32
  vocab_size: int = 64
  pad_token: int = 0
  name: str | None = None

  def __call__(self, tokens, *, is_training: bool = True):
    input_mask = jnp.greater(tokens, self.pad_token)
    _, seq_len = tokens.shape
    embed_init = hk.initializers.TruncatedNormal(stddev=0.02)
    token_embedding_map = hk.Embed(self.vocab_size, embed_dim=self.model_size, w_init=embed_init)
    positional_embeddings = hk.get_parameter(
      "positional_embeddings", [seq_len, self.model_size], init=embed_init
    )
    embeddings = token_embedding_map(tokens) + positional_embeddings
    embeddings = self.transformer(embeddings, input_mask, is_training=is_training)
    return hk.Linear(self.vocab_size)(embeddings)


def forward(tokens, *, is_training: bool = True):
  """The function to ``hk.transform``: logits ``[B, L, vocab]`` for ``tokens`` ``[B, L]``."""
  transformer = Transformer(name="transformer")
  return LanguageModel(transformer, name="language_model")(tokens, is_training=is_training)


def next_token_loss(logits, tokens):
  """The example's objective: cross-entropy of ``logits[:, :-1]`` against ``tokens[:, 1:]``,
  padding (token 0) masked out."""
  targets = tokens[:, 1:]
  log_probs = jax.nn.log_softmax(logits[:, :-1])
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  weights = (targets > 0).astype(nll.dtype)
  return jnp.sum(nll * weights) / jnp.sum(weights)
