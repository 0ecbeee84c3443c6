"""`jaxquant.flax.Dense`: `flax.linen.Dense` with a quantized contraction."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.quantization import quantized_contraction
from jaxquant.recipes import Recipe

default_kernel_init = nn.initializers.lecun_normal()


class Dense(nn.Module):
  """A linear transformation over the last axis, quantized by a recipe.

  Same constructor arguments and parameter tree (`kernel [in, features]`, `bias [features]`)
  as `flax.linen.Dense`, so checkpoints load into either.

  Example::

    model = jaxquant.flax.Dense(256, recipe=jaxquant.Float8CurrentScaling())
    variables = model.init(jax.random.key(0), x)
    y = jax.jit(model.apply)(variables, x)

  Attributes:
    features: number of output features.
    use_bias: whether to add a bias.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    precision: precision of high-precision (Identity) contractions.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast`, or no quantization.
  """

  features: int
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  recipe: Optional[Recipe] = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    return quantized_contraction(self, inputs, kernel, bias, precision=self.precision)
