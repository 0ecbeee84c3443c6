"""`jaxquant.flax.Dense`: `flax.linen.Dense` with a quantized contraction."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.quantization import logical_init, quantized_contraction
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

  Sharded (Flax's logical axes; the kernel is column-parallel over "tp", FSDP over "fsdp")::

    layer = jaxquant.flax.Dense(4 * d, kernel_axes=("embed", "mlp"),
                                input_axes=("batch", "length", "embed"), recipe=recipe)
    rules = [("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("mlp", "tp")]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      ...  # init/apply under jit; the kernel is boxed with its logical names

  Attributes:
    features: number of output features.
    use_bias: whether to add a bias.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    precision: precision of high-precision (Identity) contractions.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast`, or no quantization.
    kernel_axes: logical names of the kernel's axes `(in, out)`; the kernel is boxed with them
      (as `nn.with_logical_partitioning`), and under a mesh they give its spec through
      `nn.logical_axis_rules`. A `kernel_init` boxed with names serves the same purpose.
    input_axes: logical names of the input's axes; under a mesh the input is kept on that
      spec, and mesh axes shared by the kernel and the input's batch axes are FSDP axes (the
      kernel is gathered after quantization where exact, see `jaxquant.sharding`).
    reduce_dtype: dtype of the partial-sum reductions of K-sharded GEMMs under a mesh (None:
      the GEMM's output dtype, as XLA reduces nn.Dense's; `jnp.float32` sums the partial
      products in float32 and rounds once, see `jaxquant.sharding.DenseSharding`).
  """

  features: int
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  recipe: Optional[Recipe] = None
  kernel_axes: tuple = ()
  input_axes: tuple = ()
  reduce_dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.param("kernel", logical_init(self.kernel_init, self.kernel_axes),
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = None
    if self.use_bias:
      bias_axes = tuple(self.kernel_axes)[-1:]
      bias = self.param("bias", logical_init(self.bias_init, bias_axes),
                        (self.features,), self.param_dtype)
    inputs, _, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    # The kernel stays in param_dtype: a quantized weight is read from it (an unquantized
    # contraction casts it as Flax does; see `jaxquant.dense`).
    return quantized_contraction(self, inputs, kernel, bias, precision=self.precision)
