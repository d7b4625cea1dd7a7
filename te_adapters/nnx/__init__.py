"""Flax NNX adapter of te_adapters."""

from te_adapters.nnx._variables import RecipeState

__all__ = ["RecipeState"]
