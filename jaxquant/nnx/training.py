"""Training NNX models whose modules keep delayed-scaling state.

Delayed-scaling `scale` / `amax_history` live in `OverwriteWithGradient` variables: their
"gradient" is their updated value (the convention of linen's `"_overwrite_with_gradient"`
collection). Differentiate with respect to `GRAD_WRT` (`diff_state`) and step with
`apply_gradients`, which gives the parameters to the optimizer and writes the state back.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx


class OverwriteWithGradient(nnx.Variable):
  """A variable whose gradient is its new value (delayed-scaling `scale` / `amax_history`)."""


#: What to differentiate: parameters and delayed-scaling state.
GRAD_WRT = nnx.Any(nnx.Param, OverwriteWithGradient)


def diff_state(argnum: int = 0) -> nnx.DiffState:
  """`nnx.grad(..., argnums=diff_state(i))`: gradients of params and delayed-scaling state."""
  return nnx.DiffState(argnum, GRAD_WRT)


def apply_gradients(optimizer: nnx.Optimizer, model: nnx.Module, grads: nnx.State,
                    **kwargs) -> Any:
  """`optimizer.update(model, grads)` on the parameters, then overwrite every
  `OverwriteWithGradient` variable of `model` with its gradient (its new value).

  `grads` must come from differentiating with respect to `GRAD_WRT` (see `diff_state`).
  Returns the optimizer's updates.
  """
  updates = optimizer.update(model, grads, **kwargs)
  nnx.update(model, nnx.state(grads, OverwriteWithGradient))
  return updates
