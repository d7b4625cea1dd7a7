"""The NNX variable type that holds recipe state."""

from __future__ import annotations

from flax import nnx


class RecipeState(nnx.Variable):
  """Recipe state of a quantized layer (amax histories and scales, TE's names).

  A separate ``nnx.Variable`` type, so ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never updates
  it; its new value comes from the gradient with respect to it (see ``te_adapters.core``).
  """
