"""What jaxquant's NNX modules share: recipe, roles, delayed-scaling state, rounding keys and
sharding of one quantized contraction.

- recipe: the module's `recipe` attribute if set, else the innermost `jaxquant.autocast` at call
  time; none means no quantization. With none, or an all-Identity recipe outside a sharding
  plan, the module runs the Flax original's own contraction, differentiated by JAX, so it is
  the unswapped module bit for bit (`jaxquant.layers.dense.runs_unquantized`).
- roles: `("linear", "input" | "weight" | "grad_output", name)` with the module's full path in
  `role.path` (set by `quantize_model`, e.g. `"layers/0/attn/qkv_einsum"`).
- state: delayed-scaling `scale` / `amax_history` as `OverwriteWithGradient` attributes next to
  the parameters (`input_scale`, `weight_amax_history`, ...; `..._rowwise_...` /
  `..._columnwise_...` for a Hybrid's stateful halves), created at construction from the recipe
  known then; with batch axes every batch element keeps its own.
- keys: from the `nnx.Rngs` stream `"quantize"`, forked at construction (or passed to the call).
- sharding: under a mesh, the kernel's `nnx.with_partitioning` names reach `jaxquant.dense`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding
from jaxquant.flax.quantization import QUANTIZE_RNG, check_recipe, stochastic_roles
from jaxquant.layers.einsum import ContractionPlan
from jaxquant.nnx.training import OverwriteWithGradient
from jaxquant.layers.dense import TENSOR_TYPES, DenseQuantizers
from jaxquant.recipes import Recipe, current_recipe
from jaxquant.state import DelayedScalingState

RngsArg = Union[nnx.Rngs, nnx.RngStream, jax.Array, None]


def quantize_stream(rngs: Optional[nnx.Rngs]):
  """A fork of `rngs`' `"quantize"` stream, or `nnx.data(None)` without one.

  Only an explicit "quantize" stream is forked: forking a fallback ("default") stream would shift
  the keys of every module created after this one."""
  if isinstance(rngs, nnx.Rngs) and QUANTIZE_RNG in rngs:
    return rngs[QUANTIZE_RNG].fork()
  return nnx.data(None)


def _state_leaves(prefix: str, state: Any):
  """`(name, value)` of every array of an init state pytree, named as in linen."""
  if state is None:
    return []
  if isinstance(state, tuple):  # Hybrid: (rowwise, columnwise)
    return [leaf for d, s in zip(("rowwise", "columnwise"), state)
            for leaf in _state_leaves(f"{prefix}_{d}", s)]
  return [(f"{prefix}_scale", state.scale), (f"{prefix}_amax_history", state.amax_history)]


def existing_value(variable: Optional[nnx.Variable]):
  """An initializer that returns `variable`'s value (to construct around existing params)."""
  return lambda key, shape, dtype=None: None if variable is None else variable.get_value()


def finish_output(y: jax.Array, out_sharding: Any, preferred_element_type: Any) -> jax.Array:
  """The quantized path's output in the caller's requested sharding and dtype (the GEMM
  accumulates in float32 and rounds to the input dtype; `preferred_element_type` casts that)."""
  if preferred_element_type is not None:
    y = y.astype(preferred_element_type)
  if out_sharding is not None:
    y = jax.lax.with_sharding_constraint(y, out_sharding)
  return y


class QuantizedContraction(nnx.Module):
  """Base of `Linear`, `LinearGeneral` and `Einsum`: see the module doc.

  Subclasses set `kernel` (an `nnx.Param`) and call `_init_quantization` at construction.
  """

  def _init_quantization(self, recipe: Optional[Recipe], name: str, path: str,
                         rngs: Optional[nnx.Rngs],
                         batch_shape: Optional[Sequence[int]] = ()) -> None:
    """Set recipe, name, path and the "quantize" stream; create delayed-scaling state for the
    recipe known now (`batch_shape` None: the layout is unknown until called, so none)."""
    self.recipe = check_recipe(recipe, f"{type(self).__name__}(recipe)")
    self.name = name
    self.path = path
    self.rngs = quantize_stream(rngs)
    quantizers = self._quantizers(self.recipe)
    if quantizers is None or not quantizers.stateful or batch_shape is None:
      return
    for t, s in zip(TENSOR_TYPES, quantizers.init_states()):
      for leaf_name, value in _state_leaves(t, s):
        setattr(self, leaf_name, OverwriteWithGradient(
            jnp.broadcast_to(value, tuple(batch_shape) + value.shape)))

  def _quantizers(self, recipe: Optional[Recipe] = None) -> Optional[DenseQuantizers]:
    """The quantizers of the contraction (None: no recipe, no quantization)."""
    recipe = recipe if recipe is not None else current_recipe()
    if recipe is None:
      return None
    return DenseQuantizers.from_recipe(recipe, "linear", self.name, self.path)

  def _states(self, quantizers: DenseQuantizers,
              batch_shape: Sequence[int] = ()) -> Optional[tuple]:
    """The delayed-scaling states of the three roles (None for stateless quantizers)."""
    if not quantizers.stateful:
      return None
    return tuple(self._read_state(t, s, tuple(batch_shape))
                 for t, s in zip(TENSOR_TYPES, quantizers.init_states()))

  def _read_state(self, prefix: str, state: Any, batch_shape: tuple[int, ...]):
    if state is None:
      return None
    if isinstance(state, tuple):
      return tuple(self._read_state(f"{prefix}_{d}", s, batch_shape)
                   for d, s in zip(("rowwise", "columnwise"), state))
    values = []
    for field, init in (("scale", state.scale), ("amax_history", state.amax_history)):
      variable = getattr(self, f"{prefix}_{field}", None)
      shape = batch_shape + init.shape
      if not isinstance(variable, OverwriteWithGradient) or variable.shape != shape:
        raise ValueError(
            f"{type(self).__name__} '{self.path or self.name}': the recipe uses delayed "
            f"scaling for '{prefix}', whose state ({prefix}_{field}, shape {shape}) was not "
            "created at construction; pass the recipe to the constructor (recipe=...) or to "
            "quantize_model, or construct / swap under the same jaxquant.autocast")
      values.append(variable[...])
    return DelayedScalingState(*values)

  def _key(self, quantizers: DenseQuantizers, rngs: RngsArg) -> Optional[jax.Array]:
    """A fresh key when a quantizer rounds stochastically (call's `rngs` first, else the
    stream forked at construction)."""
    roles = stochastic_roles(quantizers)
    if not roles:
      return None
    rngs = rngs if rngs is not None else self.rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs[QUANTIZE_RNG] if QUANTIZE_RNG in rngs else None
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    if isinstance(rngs, jax.Array):
      return rngs
    raise ValueError(
        f"{type(self).__name__} '{self.path or self.name}': the recipe rounds "
        f"{', '.join(str(r) for r in roles)} stochastically and needs the nnx.Rngs stream "
        f"'{QUANTIZE_RNG}': construct with rngs=nnx.Rngs(params=..., {QUANTIZE_RNG}=...), "
        f"swap with quantize_model(..., rngs=nnx.Rngs({QUANTIZE_RNG}=...)), or call with rngs=")

  def _sharding(self, plan: ContractionPlan) -> Optional[_sharding.DenseSharding]:
    """The kernel's mesh-axis spec (from its `nnx.with_partitioning` metadata) in the GEMM's
    layout, under a mesh; None without a mesh, names or with batch axes."""
    mesh = _sharding.current_mesh()
    if mesh is None:
      return None
    spec = nnx.get_partition_spec(self.kernel).get_value()
    if not isinstance(spec, P) or not tuple(spec):
      return None
    spec = plan.kernel_spec(spec, self.kernel.ndim)
    return None if spec is None else _sharding.DenseSharding(kernel=spec, mesh=mesh)
