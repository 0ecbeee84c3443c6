"""`quantize_dense(recipe)`: quantize every `flax.linen.Dense` of an unmodified model.

Built on `flax.linen.intercept_methods`: while the context is active (around `init`/`apply`, or
around the first trace of a jitted function), each `nn.Dense.__call__` is replaced by the
quantized contraction of `jaxquant.flax.Dense`. The replacement creates the same parameters
(`kernel`, `bias`, same shapes, initializers and rng paths) in the Dense's own scope, so the
parameter tree and checkpoints are unchanged, and the roles are named after the Dense
(`"Dense_0"`, or the name it was given). Delayed-scaling state is added to the
`"_overwrite_with_gradient"` collection, and stochastic rounding uses the `"quantize"` stream, as
for `jaxquant.flax.Dense`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.quantization import check_recipe, quantized_contraction
from jaxquant.recipes import Recipe

# The active recipe is part of jax.jit's cache key (as for `jaxquant.autocast`), so a function
# traced with or without the swap is traced again when that changes.
_SWAP = jax.make_user_context(default_value=None)


def _swappable(module: nn.Module, method_name: str) -> bool:
  """A plain `nn.Dense` call: subclasses (which may override `__call__`) and Dense layers with a
  custom `dot_general` (already a quantization of their own) are left alone."""
  return (method_name == "__call__" and type(module) is nn.Dense
          and module.dot_general is None and module.dot_general_cls is None)


def _quantized_dense_call(module: nn.Dense, inputs: jax.Array, recipe: Recipe) -> jax.Array:
  """`nn.Dense.__call__`'s parameters and promotion, with the quantized contraction."""
  kernel = module.param("kernel", module.kernel_init, (jnp.shape(inputs)[-1], module.features),
                        module.param_dtype)
  bias = None
  if module.use_bias:
    bias = module.param("bias", module.bias_init, (module.features,), module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  return quantized_contraction(module, inputs, kernel, bias, precision=module.precision,
                               recipe=recipe)


def _interceptor(next_fun, args, kwargs, context):
  recipe = _SWAP.value  # read at call time: the innermost quantize_dense wins
  if recipe is None or not _swappable(context.module, context.method_name):
    return next_fun(*args, **kwargs)
  return _quantized_dense_call(context.module, *args, recipe=recipe, **kwargs)


@contextlib.contextmanager
def quantize_dense(recipe: Optional[Recipe]) -> Iterator[Optional[Recipe]]:
  """Quantize the `flax.linen.Dense` layers of a model traced inside this block with `recipe`.

  Example::

    model = MyTransformer()  # built from plain nn.Dense
    with jaxquant.flax.quantize_dense(jaxquant.Float8CurrentScaling()):
      variables = model.init(key, x)
      loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables, x)

  The swap happens at trace time: a jitted function must be traced inside the block (the
  recipe is part of jit's cache key, so it is re-traced when the block changes). Only exact
  `nn.Dense` instances without a custom `dot_general` are swapped; `jaxquant.flax` modules keep
  their own `recipe` / `jaxquant.autocast`. `recipe=None` swaps nothing.

  Args:
    recipe: a `jaxquant.Recipe`; every swapped layer asks it for the roles
      `("linear", "input" | "weight" | "grad_output", <the Dense's name>)`.
  """
  check_recipe(recipe, "quantize_dense(recipe)")
  with _SWAP(recipe), nn.intercept_methods(_interceptor):
    yield recipe
