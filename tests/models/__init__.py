"""Small models shaped like third-party ones, for converting and training them in tests.

* ``gemma_nnx``: Flax NNX's Gemma example (``Embedder``, ``Attention`` with ``qkv_einsum`` /
  ``q_einsum`` + ``kv_einsum`` and ``attn_vec_einsum``, gated ``FeedForward``, ``RMSNorm``).
* ``lm1b_linen``: Flax Linen's lm1b example (``nn.SelfAttention``, ``MlpBlock`` of ``nn.Dense``
  with logical partitioning, ``nn.Embed``, ``logitdense``).
* ``transformer_haiku``: Haiku's transformer example (``hk.MultiHeadAttention``, ``hk.Linear``
  dense block, ``hk.LayerNorm``, ``hk.Embed``).

Our own code with the same module structure, names, einsum equations and sharding annotations as
those examples, at sizes small enough for a CPU test (K and N multiples of 16, so every layer can
be quantized).
"""

import jax
import jax.numpy as jnp


def token_batch(seed: int, batch: int, length: int, vocab: int) -> jax.Array:
  """A ``(batch, length)`` int32 batch of tokens with a learnable pattern (each sequence counts
  up from a random start, modulo ``vocab``), no token 0 (the examples' padding)."""
  start = jax.random.randint(jax.random.key(seed), (batch, 1), 1, vocab)
  return (start + jnp.arange(length)[None, :]) % (vocab - 1) + 1
