"""Flax NNX: `jaxquant.nnx.Linear`, `flax.nnx.Linear` with a quantized contraction.

Same constructor, parameters (`kernel [in, out]`, `bias [out]`) and initialization as
`flax.nnx.Linear` (the same `rngs` give the same parameters), plus:
- `recipe`: the quantization recipe (None: the innermost `jaxquant.autocast` at call time);
- `name`: the roles' name, `("linear", "input" | "weight" | "grad_output", name)`;
- stochastic rounding keys from the `nnx.Rngs` stream `"quantize"`: forked at construction
  when the `rngs` passed there have that stream, or passed to the call (`rngs=`);
- delayed-scaling state in `OverwriteWithGradient` variables. Their gradient is their updated
  value (the convention of linen's `"_overwrite_with_gradient"` collection): differentiate with
  respect to `GRAD_WRT` (params and state) and step with `apply_gradients`, which gives the
  params to the optimizer and writes the state back.

Example::

  model = jaxquant.nnx.Linear(64, 32, recipe=jaxquant.DelayedScaling(), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = nnx.grad(loss_fn, argnums=jaxquant.nnx.diff_state(0))(model, x, y)
    jaxquant.nnx.apply_gradients(optimizer, model, grads)
"""

from __future__ import annotations

from typing import Any, Optional, Union

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from jaxquant.flax.quantization import QUANTIZE_RNG, check_recipe, stochastic_roles
from jaxquant.quantized_dense import TENSOR_TYPES, DenseQuantizers, dense
from jaxquant.recipes import Recipe, current_recipe
from jaxquant.state import DelayedScalingState

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


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


def _state_leaves(prefix: str, state: Any):
  """`(name, value)` of every array of an init state pytree, named as in linen."""
  if state is None:
    return []
  if isinstance(state, tuple):  # Hybrid: (rowwise, columnwise)
    return [leaf for d, s in zip(("rowwise", "columnwise"), state)
            for leaf in _state_leaves(f"{prefix}_{d}", s)]
  return [(f"{prefix}_scale", state.scale), (f"{prefix}_amax_history", state.amax_history)]


def _read_state(module: nnx.Module, prefix: str, state: Any):
  if state is None:
    return None
  if isinstance(state, tuple):
    return tuple(_read_state(module, f"{prefix}_{d}", s)
                 for d, s in zip(("rowwise", "columnwise"), state))
  values = []
  for field, init in (("scale", state.scale), ("amax_history", state.amax_history)):
    variable = getattr(module, f"{prefix}_{field}", None)
    if not isinstance(variable, OverwriteWithGradient) or variable.shape != init.shape:
      raise ValueError(
          f"{type(module).__name__} '{module.name}': the recipe uses delayed scaling for "
          f"'{prefix}', whose state ({prefix}_{field}, shape {init.shape}) was not created at "
          "construction; pass the recipe to the constructor (recipe=...) or construct the "
          "module under the same jaxquant.autocast")
    values.append(variable[...])
  return DelayedScalingState(*values)


class Linear(nnx.Module):
  """A linear transformation over the last axis, quantized by a recipe (see the module doc).

  Args:
    in_features, out_features, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init: as `flax.nnx.Linear`.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast` at call time. Delayed
      scaling needs its state created here: pass the recipe, or construct under `autocast`.
    name: the roles' name.
    rngs: `nnx.Rngs` for the parameters (`params` stream); its `"quantize"` stream, if any,
      is forked for stochastic rounding.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Optional[Any] = None, param_dtype: Any = jnp.float32,
               precision: Any = None, kernel_init: Any = default_kernel_init,
               bias_init: Any = default_bias_init, recipe: Optional[Recipe] = None,
               name: str = "Linear", rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                        param_dtype))
    self.bias: Optional[nnx.Param]
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.recipe = check_recipe(recipe, "Linear(recipe)")
    self.name = name
    # Only an explicit "quantize" stream: forking a fallback ("default") stream would shift
    # the keys of every module created after this one.
    self.rngs = rngs[QUANTIZE_RNG].fork() if QUANTIZE_RNG in rngs else nnx.data(None)
    quantizers = self._quantizers(self.recipe or current_recipe())
    if quantizers is not None and quantizers.stateful:
      for t, s in zip(TENSOR_TYPES, quantizers.init_states()):
        for leaf_name, value in _state_leaves(t, s):
          setattr(self, leaf_name, OverwriteWithGradient(value))

  def _quantizers(self, recipe: Optional[Recipe]) -> Optional[DenseQuantizers]:
    if recipe is None:
      return None
    return DenseQuantizers.from_recipe(recipe, "linear", self.name, self.name)

  def _key(self, quantizers: DenseQuantizers, rngs) -> Optional[jax.Array]:
    roles = stochastic_roles(quantizers)
    if not roles:
      return None
    rngs = rngs if rngs is not None else self.rngs
    if isinstance(rngs, nnx.Rngs):
      if QUANTIZE_RNG not in rngs:
        rngs = None
      else:
        rngs = rngs[QUANTIZE_RNG]
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    if isinstance(rngs, jax.Array):
      return rngs
    raise ValueError(
        f"Linear '{self.name}': the recipe rounds {', '.join(str(r) for r in roles)} "
        f"stochastically and needs the nnx.Rngs stream '{QUANTIZE_RNG}': construct with "
        f"rngs=nnx.Rngs(params=..., {QUANTIZE_RNG}=...) or call with rngs=")

  def __call__(self, inputs: jax.Array, *,
               rngs: Union[nnx.Rngs, nnx.RngStream, jax.Array, None] = None) -> jax.Array:
    """Apply the layer; `rngs` overrides the constructor's `"quantize"` stream."""
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = nnx.nn.dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    quantizers = self._quantizers(self.recipe if self.recipe is not None else current_recipe())
    if quantizers is None:
      return dense(inputs, kernel, bias, precision=self.precision)
    states = None
    if quantizers.stateful:
      states = tuple(_read_state(self, t, s)
                     for t, s in zip(TENSOR_TYPES, quantizers.init_states()))
    return dense(inputs, kernel, bias, quantizers, key=self._key(quantizers, rngs),
                 states=states, precision=self.precision)
