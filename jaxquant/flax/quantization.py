"""How a Flax module obtains its quantizers, delayed-scaling state and rounding key.

Modules only map roles to quantizers (the recipe does the choosing, `jaxquant.dense` the math):
- recipe: the module's `recipe` attribute if set, else the innermost `jaxquant.autocast`;
  none means no quantization.
- state: delayed-scaling `scale`/`amax_history` in the `"_overwrite_with_gradient"` collection,
  so the updated values come back as their gradient (TrainState.apply_gradients keeps them).
- key: from the Flax RNG stream `"quantize"` when a quantizer rounds stochastically.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax

from jaxquant.quantized_dense import TENSOR_TYPES, DenseQuantizers
from jaxquant.quantizers import NVFP4Quantizer
from jaxquant.recipes import Recipe, current_recipe
from jaxquant.state import DelayedScalingState

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
QUANTIZE_RNG = "quantize"


def resolve_recipe(module: nn.Module) -> Optional[Recipe]:
  recipe = getattr(module, "recipe", None)
  if recipe is None:
    recipe = current_recipe()
  if recipe is not None and not isinstance(recipe, Recipe):
    raise TypeError(f"{type(module).__name__}.recipe: expected a jaxquant Recipe or None, got "
                    f"{type(recipe).__name__}")
  return recipe


def module_quantizers(module: nn.Module, module_type: str = "linear",
                      name: Optional[str] = None) -> Optional[DenseQuantizers]:
  """The quantizers a module's contraction uses, or None when no recipe is active."""
  recipe = resolve_recipe(module)
  if recipe is None:
    return None
  name = name if name is not None else (module.name or type(module).__name__)
  path = "/".join(str(p) for p in module.path) if module.scope is not None else name
  return DenseQuantizers.from_recipe(recipe, module_type, name, path)


def _state_variables(module: nn.Module, prefix: str, state: Any):
  """Mirror an init state pytree as variables of the overwrite-with-gradient collection."""
  if state is None:
    return None
  if isinstance(state, tuple):  # Hybrid: (rowwise, columnwise)
    return tuple(_state_variables(module, f"{prefix}_{d}", s)
                 for d, s in zip(("rowwise", "columnwise"), state))
  scale = module.variable(OVERWRITE_WITH_GRADIENT, f"{prefix}_scale", lambda: state.scale)
  history = module.variable(OVERWRITE_WITH_GRADIENT, f"{prefix}_amax_history",
                            lambda: state.amax_history)
  return DelayedScalingState(scale.value, history.value)


def module_states(module: nn.Module, quantizers: DenseQuantizers,
                  prefix: str = "") -> Optional[tuple]:
  """Delayed-scaling states of a module's three roles, kept as Flax variables."""
  if not quantizers.stateful:
    return None
  init = quantizers.init_states()
  return tuple(_state_variables(module, f"{prefix}{t}", s) for t, s in zip(TENSOR_TYPES, init))


def stochastic_roles(quantizers: DenseQuantizers) -> list:
  """The roles whose quantizer rounds stochastically."""
  return [role if role is not None else t
          for t, role in zip(TENSOR_TYPES, quantizers.roles)
          if any(isinstance(leaf, NVFP4Quantizer) and leaf.stochastic_rounding
                 for leaf in quantizers.quantizer(t).leaves())]


def module_key(module: nn.Module, quantizers: DenseQuantizers) -> Optional[jax.Array]:
  """A fresh key from the "quantize" RNG stream when stochastic rounding needs one.

  `init` may omit the stream (its outputs are discarded and no backward pass runs): a fixed
  key is used then. `apply` without the stream is an error.
  """
  roles = stochastic_roles(quantizers)
  if not roles:
    return None
  if module.has_rng(QUANTIZE_RNG):
    return module.make_rng(QUANTIZE_RNG)
  if module.is_initializing():
    return jax.random.key(0)
  raise ValueError(
      f"{type(module).__name__} '{module.name or type(module).__name__}': the recipe rounds "
      f"{', '.join(str(r) for r in roles)} stochastically and needs the Flax RNG stream "
      f"'{QUANTIZE_RNG}'; pass rngs={{'{QUANTIZE_RNG}': key}} to apply")
