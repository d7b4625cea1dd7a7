"""Seed 001's FlaxTransformerLayer for the benchmark, with two additions: a ``dtype`` field
(default None, which is the seed's layer exactly) passed to every Dense and LayerNorm, and an
``attention`` field (default ``"flax"``, the seed's ``nn.dot_product_attention``) that can run the
same causal attention through ``jax.nn.dot_product_attention`` instead (``"xla"``, or ``"cudnn"``:
cuDNN's fused attention on the GPU, the seed's pointer to a faster attention). Both layers take the
field, so that a comparison changes the attention on both sides at once."""

import jax
import jax.numpy as jnp
from flax import linen as nn

ATTENTIONS = ("flax", "xla", "cudnn")


def causal_attention(q, k, v, mask, attention: str, **flax_kwargs):
  """``q``, ``k``, ``v`` (batch, length, heads, depth) through the implementation ``attention``
  names; ``mask``: None for causal, else the mask (``"flax"`` only)."""
  if attention == "flax":
    if mask is None:
      mask = nn.make_causal_mask(q[..., 0, 0], dtype=jnp.bool_)
    return nn.dot_product_attention(q, k, v, mask=mask, **flax_kwargs)
  if attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
  if mask is not None:
    raise ValueError(f"attention={attention!r} runs the causal mask only; pass attention_mask=None")
  if flax_kwargs.get("dropout_rate", 0.0) > 0 and not flax_kwargs.get("deterministic", True):
    raise ValueError(f"attention={attention!r} has no dropout; call with deterministic=True")
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)


class FlaxDenseBlock(nn.Module):
  """One linear layer. ``dot_general_cls`` lets us swap the GEMM impl."""

  features: int
  dtype: jnp.dtype = jnp.bfloat16
  dot_general_cls: callable = lambda: None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(
      features=self.features,
      use_bias=False,
      dtype=self.dtype,
      dot_general=self.dot_general_cls(),
    )(x)


class FlaxMLP(nn.Module):
  hidden_size: int
  ffn_hidden_size: int
  dot_general_cls: callable = lambda: None
  dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(
      features=self.ffn_hidden_size,
      use_bias=True,
      dtype=self.dtype,
      dot_general=self.dot_general_cls(),
    )(x)
    x = nn.gelu(x, approximate=True)
    x = nn.Dense(
      features=self.hidden_size, use_bias=True, dtype=self.dtype, dot_general=self.dot_general_cls()
    )(x)
    return x


class FlaxTransformerLayer(nn.Module):
  hidden_size: int
  ffn_hidden_size: int
  num_attention_heads: int
  layernorm_eps: float = 1e-5
  attention_dropout: float = 0.1
  dot_general_cls: callable = lambda: None
  dtype: jnp.dtype | None = None
  attention: str = "flax"

  def setup(self):
    self.kv_channels = self.hidden_size // self.num_attention_heads

  @nn.compact
  def __call__(self, x, attention_mask: jnp.ndarray | None = None, deterministic: bool = False):
    res = x
    x = nn.LayerNorm(epsilon=self.layernorm_eps, dtype=self.dtype)(x)
    qkv = nn.Dense(
      features=3 * self.hidden_size,
      use_bias=True,
      dtype=self.dtype,
      dot_general=self.dot_general_cls(),
    )(x)
    qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
    q, k, v = jnp.split(qkv, 3, axis=3)
    dropout_rng = None
    if not deterministic and self.attention_dropout > 0:
      dropout_rng = self.make_rng("dropout")
    x = causal_attention(
      q,
      k,
      v,
      attention_mask,
      self.attention,
      dropout_rng=dropout_rng,
      dropout_rate=self.attention_dropout,
      deterministic=deterministic,
      broadcast_dropout=True,
    )
    x = x.reshape(x.shape[0], x.shape[1], self.hidden_size)
    x = nn.Dense(
      features=self.hidden_size, use_bias=True, dtype=self.dtype, dot_general=self.dot_general_cls()
    )(x)
    x = res + x
    res = x
    x = nn.LayerNorm(epsilon=self.layernorm_eps, dtype=self.dtype)(x)
    mlp = FlaxMLP(
      hidden_size=self.hidden_size,
      ffn_hidden_size=self.ffn_hidden_size,
      dot_general_cls=self.dot_general_cls,
      dtype=self.dtype,
    )
    x = mlp(x)
    return x + res


class ModulesTransformerLayer(nn.Module):
  """Seed 001's layer rebuilt from te_adapters' Linen modules (seed 002's set): a
  ``LayerNormDenseGeneral`` for the norm and the QKV projection, the same attention, a
  ``DenseGeneral`` for the output projection and a ``LayerNormMLP`` (gelu, biases). Parameters in
  float32, computed in the input's dtype as TE's modules do; no dropout (``deterministic`` is
  accepted for the same call as ``FlaxTransformerLayer``)."""

  hidden_size: int
  ffn_hidden_size: int
  num_attention_heads: int
  recipe: object = None
  layernorm_eps: float = 1e-5
  attention: str = "flax"

  @nn.compact
  def __call__(self, x, attention_mask: jnp.ndarray | None = None, deterministic: bool = False):
    from te_adapters import linen as ta_linen

    del deterministic
    heads, kv = self.num_attention_heads, self.hidden_size // self.num_attention_heads
    qkv, _ = ta_linen.LayerNormDenseGeneral(
      3 * self.hidden_size,
      epsilon=self.layernorm_eps,
      use_bias=True,
      return_layernorm_output=False,
      recipe=self.recipe,
      threshold=None,
    )(x)
    q, k, v = jnp.split(qkv.reshape(*qkv.shape[:2], heads, 3 * kv), 3, axis=3)
    a = causal_attention(q, k, v, attention_mask, self.attention, deterministic=True)
    a = a.reshape(*a.shape[:2], self.hidden_size).astype(x.dtype)
    x = x + ta_linen.DenseGeneral(
      self.hidden_size, use_bias=True, dtype=x.dtype, recipe=self.recipe, threshold=None
    )(a)
    y, _ = ta_linen.LayerNormMLP(
      intermediate_dim=self.ffn_hidden_size,
      epsilon=self.layernorm_eps,
      activations=("gelu",),
      use_bias=True,
      intermediate_dropout_rate=0.0,
      return_layernorm_output=False,
      recipe=self.recipe,
      threshold=None,
    )(x, deterministic=True)
    return x + y
