"""`jaxquant.flax.GroupedDense`: one linear layer per group (mixture-of-experts experts)."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax.quantization import module_key, module_quantizers, module_states
from jaxquant.layers.grouped_dense import MODULE_TYPE, grouped_dense
from jaxquant.recipes import Recipe

# One fan-in per expert: the leading group axis is a batch axis, not part of the fan.
default_kernel_init = nn.initializers.lecun_normal(batch_axis=(0,))


class GroupedDense(nn.Module):
  """`num_groups` linear transformations, each applied to its own contiguous group of tokens.

  Tokens `[T, in]` arrive sorted by group with `group_sizes[num_groups]` rows per group (zeros
  allowed; rows past `sum(group_sizes)` give zeros); group `g` is multiplied by `kernel[g]`
  (`[num_groups, in, features]`) and gets `bias[g]` (`[num_groups, features]`). The roles are
  `("grouped_linear", "input" | "weight" | "grad_output", <name>)`; each group is quantized as
  if it were its own `jaxquant.flax.Dense` (see `jaxquant.grouped_dense`): per-expert scales,
  and per-expert delayed-scaling state (variables of shape `[num_groups]` and
  `[num_groups, history]` in `"_overwrite_with_gradient"`). Without a recipe it is
  `jax.lax.ragged_dot`.

  Example::

    experts = jaxquant.flax.GroupedDense(1024, num_groups=8, recipe=recipe)
    variables = experts.init(jax.random.key(0), tokens, group_sizes)
    y = jax.jit(experts.apply)(variables, tokens, group_sizes)  # tokens sorted by expert

  Attributes:
    features: output features of every group.
    num_groups: number of groups (experts).
    use_bias: whether to add a per-group bias.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    precision: precision of high-precision (Identity) contractions.
    kernel_init: initializer of the `[num_groups, in, features]` kernel (fan-in per group).
    bias_init: initializer of the `[num_groups, features]` bias.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast`, or no quantization.
  """

  features: int
  num_groups: int
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  recipe: Optional[Recipe] = None

  @nn.compact
  def __call__(self, inputs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init,
                        (self.num_groups, jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.num_groups, self.features),
                        self.param_dtype)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    quantizers = module_quantizers(self, MODULE_TYPE)
    if quantizers is None:
      return grouped_dense(inputs, kernel, group_sizes, bias, precision=self.precision)
    return grouped_dense(inputs, kernel, group_sizes, bias, quantizers,
                         key=module_key(self, quantizers),
                         states=module_states(self, quantizers, batch_shape=(self.num_groups,)),
                         precision=self.precision)
