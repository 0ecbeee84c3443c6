"""`quantize_dense(recipe)`: quantize the `Dense`, `DenseGeneral` and `Einsum` layers of an
unmodified Flax linen model.

Built on `flax.linen.intercept_methods`: while the context is active (around `init`/`apply`, or
around the first trace of a jitted function), each `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum`
`__call__` is replaced by the quantized contraction of the matching `jaxquant.flax` body. The
replacement creates the same parameters (`kernel`, `bias`, same shapes, initializers and rng
paths) in the layer's own scope, so the parameter tree and checkpoints are unchanged; this
covers the `query`/`key`/`value`/`out` projections of `nn.MultiHeadDotProductAttention`, which
are `nn.DenseGeneral`s. Roles are named after the layer: `name` is its short name (`"query"`,
`"Dense_0"`), `path` its full module path (`"encoder/attention/query"`). Delayed-scaling state
is added to the `"_overwrite_with_gradient"` collection, and stochastic rounding uses the
`"quantize"` stream, as for `jaxquant.flax.Dense`. An `nn.Einsum` whose equation is not a plain
contraction stays Flax's, and `jaxquant.explain` reports it. Each
`nn.MultiHeadDotProductAttention` call runs inside `share_input_quantization()`: its `query`,
`key` and `value` projections of one input quantize it once where the quantizers allow
(stateless and equal, see `jaxquant.layers.shared_inputs`); XLA does not merge the FFI calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.dense_general import dense_general_contraction
from jaxquant.flax.einsum import einsum_contraction
from jaxquant.flax.quantization import check_recipe, quantized_contraction
from jaxquant.layers.shared_inputs import share_input_quantization
from jaxquant.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class _Swap:
  """What the innermost `quantize_dense` swaps, and with which recipe."""

  recipe: Recipe
  dense: bool
  dense_general: bool
  einsum: bool


# The swap is part of jax.jit's cache key (as `jaxquant.autocast`'s recipe), so a function
# traced with or without it (or with other options) is traced again when that changes.
_SWAP = jax.make_user_context(default_value=None)


def _no_custom_dot_general(module: nn.Module) -> bool:
  """Layers with a custom `dot_general` (already a quantization of their own) are left alone."""
  return (getattr(module, "dot_general", None) is None
          and getattr(module, "dot_general_cls", None) is None)


def _quantized_dense_call(module: nn.Dense, inputs: jax.Array, recipe: Recipe) -> jax.Array:
  """`nn.Dense.__call__`'s parameters and promotion, with the quantized contraction."""
  kernel = module.param("kernel", module.kernel_init, (jnp.shape(inputs)[-1], module.features),
                        module.param_dtype)
  bias = None
  if module.use_bias:
    bias = module.param("bias", module.bias_init, (module.features,), module.param_dtype)
  inputs, _, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  # the kernel stays in param_dtype, as jaxquant.flax.Dense's
  return quantized_contraction(module, inputs, kernel, bias, precision=module.precision,
                               recipe=recipe)


def _interceptor(next_fun, args, kwargs, context):
  swap = _SWAP.value  # read at call time: the innermost quantize_dense wins
  module = context.module
  if swap is None or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  if type(module) is nn.MultiHeadDotProductAttention and swap.dense_general:
    with share_input_quantization():  # q, k, v of one input: one quantization
      return next_fun(*args, **kwargs)
  if not _no_custom_dot_general(module):
    return next_fun(*args, **kwargs)
  # Exact types only: a subclass may override `__call__`.
  if type(module) is nn.Dense and swap.dense:
    return _quantized_dense_call(module, *args, recipe=swap.recipe, **kwargs)
  if type(module) is nn.DenseGeneral and swap.dense_general:
    return dense_general_contraction(module, *args, recipe=swap.recipe,
                                     promote_dtype=module.promote_dtype, **kwargs)
  if type(module) is nn.Einsum and swap.einsum:
    inputs, einsum_str = _einsum_args(*args, **kwargs)
    return einsum_contraction(module, inputs, einsum_str, swap.recipe, next_fun)
  return next_fun(*args, **kwargs)


def _einsum_args(inputs, einsum_str=None):
  return inputs, einsum_str


@contextlib.contextmanager
def quantize_dense(recipe: Optional[Recipe], *, dense: bool = True, dense_general: bool = True,
                   einsum: bool = True) -> Iterator[Optional[Recipe]]:
  """Quantize the Flax linen `Dense`, `DenseGeneral` and `Einsum` layers of a model traced
  inside this block with `recipe`.

  Example::

    model = MyTransformer()  # built from plain nn.Dense and nn.MultiHeadDotProductAttention
    with jaxquant.flax.quantize_dense(jaxquant.Float8CurrentScaling()):
      variables = model.init(key, x)
      loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables, x)

  The swap happens at trace time: a jitted function must be traced inside the block (the
  swap is part of jit's cache key, so it is re-traced when the block changes). Only exact
  `nn.Dense` / `nn.DenseGeneral` / `nn.Einsum` instances without a custom `dot_general` are
  swapped; `jaxquant.flax` modules keep their own `recipe` / `jaxquant.autocast`. An `nn.Einsum`
  whose equation is not a plain contraction (a kernel axis kept in the output, a trace, an axis
  summed within one operand) keeps Flax's einsum, and `jaxquant.explain` names it and why.
  `recipe=None` swaps nothing.

  Args:
    recipe: a `jaxquant.Recipe`; every swapped layer asks it for the roles
      `("linear", "input" | "weight" | "grad_output", <the layer's short name>)`, with the
      layer's full module path in `role.path`.
    dense, dense_general, einsum: swap that layer type (all by default); pass False to keep a
      type in high precision (e.g. `dense_general=False` leaves attention projections alone).
  """
  check_recipe(recipe, "quantize_dense(recipe)")
  for name, value in (("dense", dense), ("dense_general", dense_general), ("einsum", einsum)):
    if not isinstance(value, bool):
      raise TypeError(f"quantize_dense: {name}={value!r}; expected True or False")
  swap = None if recipe is None else _Swap(recipe, dense, dense_general, einsum)
  with _SWAP(swap), nn.intercept_methods(_interceptor):
    yield recipe
