"""How a Flax linen module obtains its quantizers, delayed-scaling state and rounding key.

Modules only map roles to quantizers (the recipe does the choosing, `jaxquant.dense` the math):
- recipe: the module's `recipe` attribute if set, else the innermost `jaxquant.autocast`;
  none means no quantization.
- state: delayed-scaling `scale`/`amax_history` in the `"_overwrite_with_gradient"` collection,
  so the updated values come back as their gradient (TrainState.apply_gradients keeps them).
- key: from the Flax RNG stream `"quantize"` when a quantizer rounds stochastically.
- sharding: under a mesh (`jax.set_mesh`), the kernel's logical axis names (a `kernel_axes`
  attribute, or the names `nn.with_logical_partitioning` boxed into `kernel_init`) and the
  input's (`input_axes`) become mesh-axis specs through the active `nn.logical_axis_rules`,
  and reach `jaxquant.dense` as a `DenseSharding`.
- quantized weight: from the `"jaxquant_weights"` collection when it holds one (gradient
  accumulation reuses one quantization per optimizer step, see
  `jaxquant.flax.quantize_weights`); while that collection is mutable the module quantizes its
  weight in both directions and stores it there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant import explain as _explain
from jaxquant import sharding as _sharding
from jaxquant.formats import format_of
from jaxquant.layers.dense import TENSOR_TYPES, DenseQuantizers, dense, prepare_weight
from jaxquant.layers.operands import Operand
from jaxquant.recipes import Recipe, current_recipe
from jaxquant.state import DelayedScalingState

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
QUANTIZE_RNG = "quantize"
WEIGHT_CACHE = "jaxquant_weights"  # quantized weights, one per module ("weight")


def check_recipe(recipe: Any, owner: str) -> Optional[Recipe]:
  """`recipe` if it is a `Recipe` or None, else a TypeError naming `owner`."""
  if recipe is not None and not isinstance(recipe, Recipe):
    raise TypeError(f"{owner}: expected a jaxquant Recipe (e.g. jaxquant.Float8CurrentScaling()) "
                    f"or None, got {recipe!r} ({type(recipe).__name__})")
  return recipe


def resolve_recipe(module: nn.Module) -> Optional[Recipe]:
  """The module's `recipe` attribute if set, else the innermost `jaxquant.autocast` recipe."""
  recipe = check_recipe(getattr(module, "recipe", None), f"{type(module).__name__}.recipe")
  return recipe if recipe is not None else current_recipe()


def module_name(module: nn.Module) -> str:
  """The module's short instance name (Flax's auto-name such as "Dense_0" when none was given)."""
  return module.name or type(module).__name__


def module_path(module: nn.Module) -> str:
  path = "/".join(str(p) for p in module.path) if module.scope is not None else ""
  return path or module_name(module)


def module_quantizers(module: nn.Module, module_type: str = "linear",
                      name: Optional[str] = None,
                      recipe: Optional[Recipe] = None) -> Optional[DenseQuantizers]:
  """The quantizers of a module's contraction, or None when no recipe is active.

  Args:
    module: the bound module that owns the contraction.
    module_type: the roles' `module_type`.
    name: the roles' `name` (default: the module's own name).
    recipe: use this recipe instead of resolving one from the module (`quantize_dense`).
  """
  recipe = check_recipe(recipe, "recipe") if recipe is not None else resolve_recipe(module)
  if recipe is None:
    return None
  return DenseQuantizers.from_recipe(recipe, module_type,
                                     name if name is not None else module_name(module),
                                     module_path(module))


def _state_variables(module: nn.Module, prefix: str, state: Any, batch_shape: tuple[int, ...]):
  """Mirror an init state pytree as variables of the overwrite-with-gradient collection."""
  if state is None:
    return None
  if isinstance(state, tuple):  # Hybrid: (rowwise, columnwise)
    return tuple(_state_variables(module, f"{prefix}_{d}", s, batch_shape)
                 for d, s in zip(("rowwise", "columnwise"), state))

  def init(value):
    return lambda: jnp.broadcast_to(value, batch_shape + value.shape)

  scale = module.variable(OVERWRITE_WITH_GRADIENT, f"{prefix}_scale", init(state.scale))
  history = module.variable(OVERWRITE_WITH_GRADIENT, f"{prefix}_amax_history",
                            init(state.amax_history))
  return DelayedScalingState(scale.value, history.value)


def module_states(module: nn.Module, quantizers: DenseQuantizers, prefix: str = "",
                  batch_shape: tuple[int, ...] = ()) -> Optional[tuple]:
  """Delayed-scaling states of a module's three roles, kept as Flax variables.

  Variables are named `{prefix}{tensor_type}_scale` and `{prefix}{tensor_type}_amax_history`
  (`..._rowwise_...`/`..._columnwise_...` for a Hybrid whose halves are stateful). With a
  `batch_shape` (DenseGeneral's `batch_dims`) every batch element keeps its own state.
  """
  if not quantizers.stateful:
    return None
  init = quantizers.init_states()
  return tuple(_state_variables(module, f"{prefix}{t}", s, tuple(batch_shape))
               for t, s in zip(TENSOR_TYPES, init))


def stochastic_roles(quantizers: DenseQuantizers) -> list:
  """The roles whose quantizer rounds stochastically."""
  return [role if role is not None else t
          for t, role in zip(TENSOR_TYPES, quantizers.roles)
          if format_of(quantizers.quantizer(t)).needs_key(quantizers.quantizer(t))]


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
      f"{type(module).__name__} '{module_name(module)}': the recipe rounds "
      f"{', '.join(str(r) for r in roles)} stochastically and needs the Flax RNG stream "
      f"'{QUANTIZE_RNG}'; pass rngs={{'{QUANTIZE_RNG}': key}} to apply")


def init_axis_names(init: Any, shape, dtype) -> tuple[Optional[tuple], bool]:
  """(axis names, logical?) that an initializer boxes its value with, or (None, False).

  `nn.with_logical_partitioning(init, names)` gives logical names; `nn.with_partitioning` mesh
  axis names. Read off an abstract evaluation of the initializer (nothing is computed)."""
  try:
    boxed = jax.eval_shape(lambda: init(jax.random.key(0), tuple(shape), dtype))
  except Exception:  # noqa: BLE001 - an initializer that cannot be traced names nothing
    return None, False
  if isinstance(boxed, nn.LogicallyPartitioned):
    return tuple(boxed.names), True
  if isinstance(boxed, nn.Partitioned):
    return tuple(boxed.names), False
  return None, False


def logical_init(init: Any, axes: Optional[tuple]) -> Any:
  """`init` boxed with the logical `axes` (as `nn.with_logical_partitioning`), unless it is
  boxed already or no axes are given."""
  if not axes:
    return init

  def boxed(key, shape, dtype=jnp.float32):
    value = init(key, shape, dtype)
    if isinstance(value, nn.meta.AxisMetadata):
      return value
    return nn.LogicallyPartitioned(value, tuple(axes))

  return boxed


def _mesh_spec(names, logical: bool):
  if names is None:
    return None
  if logical:
    return nn.logical_to_mesh_axes(tuple(names))
  return jax.sharding.PartitionSpec(*names)


def module_reduce_dtype(module: nn.Module):
  """The module's `reduce_dtype` attribute, checked (None when it has none)."""
  value = getattr(module, "reduce_dtype", None)
  if value is None:
    return None
  return _sharding.check_reduce_dtype(value, f"{type(module).__name__}.reduce_dtype")


def module_sharding(module: nn.Module, kernel_shape, dtype,
                    input_names: Optional[tuple] = None) -> Optional[_sharding.DenseSharding]:
  """The `DenseSharding` of a module's contraction under the context mesh (None without a mesh
  or without axis names).

  Kernel names: the module's `kernel_axes` attribute, else those boxed into its `kernel_init`.
  Input names: `input_names` if given, else its `input_axes` attribute (without them the FSDP
  axes cannot be told apart from tensor-parallel ones, and the kernel keeps its sharding).
  Partial sums of K-sharded GEMMs reduce in the module's `reduce_dtype` (None: the GEMM's
  output dtype)."""
  mesh = _sharding.current_mesh()
  if mesh is None:
    return None
  kernel_names, logical = tuple(getattr(module, "kernel_axes", ()) or ()), True
  if not kernel_names:
    kernel_names, logical = init_axis_names(getattr(module, "kernel_init", None), kernel_shape,
                                            dtype)
  if input_names is None:
    input_names = tuple(getattr(module, "input_axes", ()) or ()) or None
  if not kernel_names and input_names is None:
    return None
  return _sharding.DenseSharding(x=_mesh_spec(input_names, True),
                                 kernel=_mesh_spec(kernel_names or None, logical), mesh=mesh,
                                 reduce_dtype=module_reduce_dtype(module))


def caching_weights(module: nn.Module) -> bool:
  """Whether this apply stores the quantized weights (`quantize_weights`): the collection is
  mutable, outside `init` (whose outputs are the initial variables, not a step's weights)."""
  return module.is_mutable_collection(WEIGHT_CACHE) and not module.is_initializing()


def record_uncached_weight(module: nn.Module, quantizers: DenseQuantizers, what: str) -> None:
  """While weights are being cached (`quantize_weights`), tell `jaxquant.explain` that this
  contraction has no cached form: it quantizes its weight in every pass."""
  if caching_weights(module):
    _explain.record(_explain.Decision(
        "weight-cache", quantizers.roles[1], what, "not-cached",
        f"{what} has no cached weight: quantized again in every micro-batch"))


def module_weight(module: nn.Module, prepare: Callable[[], Operand]) -> Optional[Operand]:
  """The module's quantized weight from the `"jaxquant_weights"` collection; or, while that
  collection is being filled, `prepare()` stored there; else None (the contraction quantizes
  its weight itself)."""
  if module.has_variable(WEIGHT_CACHE, "weight"):
    return module.get_variable(WEIGHT_CACHE, "weight")
  if caching_weights(module):
    weight = prepare()
    module.put_variable(WEIGHT_CACHE, "weight", weight)
    return weight
  return None


def quantized_contraction(module: nn.Module, inputs: jax.Array, kernel: jax.Array,
                          bias: Optional[jax.Array], *, contracting_dims: int = 1,
                          precision: Any = None, recipe: Optional[Recipe] = None,
                          name: Optional[str] = None, epilogue: Any = None) -> jax.Array:
  """`jaxquant.dense` of a module's (promoted) operands, with the module's quantizers, state
  and key; a plain contraction when no recipe is active. `epilogue`: `jaxquant.dense`'s
  (here a `SplitOutput`, which also applies without a recipe)."""
  quantizers = module_quantizers(module, name=name, recipe=recipe)
  if quantizers is None:
    return dense(inputs, kernel, bias, contracting_dims=contracting_dims, precision=precision,
                 epilogue=epilogue)
  sharding = module_sharding(module, kernel.shape, kernel.dtype)
  key, states = module_key(module, quantizers), module_states(module, quantizers)
  weight = module_weight(module, lambda: prepare_weight(
      inputs, kernel, quantizers, state=None if states is None else states[1], key=key,
      contracting_dims=contracting_dims, sharding=sharding))
  return dense(inputs, kernel, bias, quantizers, key=key, states=states,
               contracting_dims=contracting_dims, precision=precision, sharding=sharding,
               weight=weight, epilogue=epilogue)
