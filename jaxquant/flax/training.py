"""Applying gradients when delayed-scaling state rides in the gradient.

Delayed-scaling `scale`/`amax_history` variables live in the `"_overwrite_with_gradient"`
collection: `jax.grad` of a loss with respect to all variables returns their *new values* in
that collection. `flax.training.train_state.TrainState.apply_gradients` already overwrites
them; `apply_gradients` below does the same for a plain optax loop.

The convention's limits (Flax's, not ours): the loss must depend on every stateful module's
output (a state that receives no gradient comes back as zeros), and a stateful module must be
called once per step (the "gradients" of several calls are summed).
"""

from __future__ import annotations

from typing import Any, Mapping

import optax

from jaxquant.flax.quantization import OVERWRITE_WITH_GRADIENT

PARAMS = "params"


def init_optimizer(tx: optax.GradientTransformation, variables: Mapping[str, Any]) -> Any:
  """`tx.init` of the `"params"` collection (the optimizer never sees the scaling state)."""
  return tx.init(variables[PARAMS])


def apply_gradients(tx: optax.GradientTransformation, variables: Mapping[str, Any],
                    grads: Mapping[str, Any], opt_state: Any) -> tuple[dict, Any]:
  """One optimizer step on `params`; the `"_overwrite_with_gradient"` collection is replaced by
  its gradient (the updated delayed-scaling state); other collections are kept.

  Example::

    opt_state = jaxquant.flax.init_optimizer(tx, variables)

    @jax.jit
    def step(variables, opt_state, x):
      grads = jax.grad(loss_fn)(variables, x)  # w.r.t. all variables
      return jaxquant.flax.apply_gradients(tx, variables, grads, opt_state)

  Args:
    tx: an optax gradient transformation.
    variables: the model's variables (`{"params": ..., "_overwrite_with_gradient": ...}`).
    grads: gradients of the loss with respect to `variables` (at least the `"params"` entry).
    opt_state: `tx`'s state for `variables["params"]`.

  Returns:
    `(new_variables, new_opt_state)`.
  """
  if PARAMS not in grads:
    raise ValueError(f"grads: expected the gradient of all variables (a mapping with a "
                     f"{PARAMS!r} entry), got keys {sorted(grads)}")
  if OVERWRITE_WITH_GRADIENT in variables and OVERWRITE_WITH_GRADIENT not in grads:
    raise ValueError(f"grads has no {OVERWRITE_WITH_GRADIENT!r} entry, so the delayed-scaling "
                     "state would not advance; differentiate with respect to all variables "
                     "(jax.grad(loss)(variables)), not only variables['params']")
  updates, opt_state = tx.update(grads[PARAMS], opt_state, variables[PARAMS])
  new_variables = dict(variables)
  new_variables[PARAMS] = optax.apply_updates(variables[PARAMS], updates)
  if OVERWRITE_WITH_GRADIENT in grads:
    new_variables[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
  return new_variables, opt_state
