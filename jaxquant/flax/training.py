"""Applying gradients when delayed-scaling state rides in the gradient.

Delayed-scaling `scale`/`amax_history` variables live in the `"_overwrite_with_gradient"`
collection: `jax.grad` of a loss with respect to all variables returns their *new values* in
that collection. `flax.training.train_state.TrainState.apply_gradients` already overwrites
them; `apply_gradients` below does the same for a plain optax loop.

The convention's limits (Flax's, not ours): the loss must depend on every stateful module's
output (a state that receives no gradient comes back as zeros), and a stateful module must be
called once per step (the "gradients" of several calls are summed).

`quantize_weights` quantizes every weight once for several forward/backward passes with the
same parameters (gradient accumulation's micro-batches).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import optax

from jaxquant.flax.quantization import OVERWRITE_WITH_GRADIENT, WEIGHT_CACHE

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
    `(new_variables, new_opt_state)`; without a `"jaxquant_weights"` collection (the
    quantized weights of the old parameters).
  """
  if PARAMS not in grads:
    raise ValueError(f"grads: expected the gradient of all variables (a mapping with a "
                     f"{PARAMS!r} entry), got keys {sorted(grads)}")
  if OVERWRITE_WITH_GRADIENT in variables and OVERWRITE_WITH_GRADIENT not in grads:
    raise ValueError(f"grads has no {OVERWRITE_WITH_GRADIENT!r} entry, so the delayed-scaling "
                     "state would not advance; differentiate with respect to all variables "
                     "(jax.grad(loss)(variables)), not only variables['params']")
  updates, opt_state = tx.update(grads[PARAMS], opt_state, variables[PARAMS])
  new_variables = {k: v for k, v in variables.items() if k != WEIGHT_CACHE}  # old weights
  new_variables[PARAMS] = optax.apply_updates(variables[PARAMS], updates)
  if OVERWRITE_WITH_GRADIENT in grads:
    new_variables[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
  return new_variables, opt_state


def quantize_weights(apply_fn: Callable[..., Any], variables: Mapping[str, Any], *args,
                     **kwargs) -> dict:
  """The quantized weight of every jaxquant contraction a forward pass runs, each quantized once
  in both directions (forward and dgrad): `{"jaxquant_weights": ...}` to merge into the
  variables of later passes with the same parameters, which then reuse it instead of
  quantizing their weights again (TransformerEngine caches the weights on the first
  micro-batch the same way). The delayed-scaling state each weight leaves is stored with it,
  and those passes return it as the weight state's new value, once per step however many
  passes there are.

  Example (gradient accumulation inside one jitted step)::

    weights = jaxquant.flax.quantize_weights(model.apply, variables, micro[0], rngs=rngs)
    def micro_loss(v, tokens):  # v: params and "_overwrite_with_gradient", differentiated
      return loss_fn(model.apply({**v, **weights}, tokens, rngs=rngs), tokens)

  Call it inside the jitted step: the forward pass it runs only serves to reach every
  contraction, and XLA removes all of it but the weight quantizations. Contractions without a
  cached form (`nn.Einsum`, `GroupedDense`) keep quantizing per pass; `jaxquant.explain` says so.

  Args:
    apply_fn: the model's `apply` (`model.apply`).
    variables: its variables (parameters and any delayed-scaling state).
    *args, **kwargs: the arguments of one forward pass (e.g. the first micro-batch, `rngs`).
  """
  _, mutated = apply_fn(variables, *args, mutable=[WEIGHT_CACHE], **kwargs)
  return {WEIGHT_CACHE: mutated[WEIGHT_CACHE]} if WEIGHT_CACHE in mutated else {}
