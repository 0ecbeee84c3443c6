"""`jaxquant.flax.GroupedDense`: one linear layer per group (mixture-of-experts experts)."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding
from jaxquant.flax.quantization import (init_axis_names, logical_init, module_key,
                                        module_quantizers, module_states,
                                        record_uncached_weight)
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
  `jax.lax.ragged_dot` on the kernel cast to `dtype`; the kernel's gradient is the float32 sums
  rounded once to `param_dtype` (float32 parameters get float32 sums, not a widened bfloat16
  gradient; `jaxquant.grouped_dense`).

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
    kernel_axes: logical names of the kernel's axes `(groups, in, features)`; the kernel is
      boxed with them (the bias with the groups and features names). Under a mesh the groups
      axis may map to an expert mesh axis (`ep`); `in` and `features` must stay unsharded.
    input_axes: logical names `(tokens, in)` of the input's axes. Under a mesh that shards the
      tokens (or the experts) the layer is **sharded**: every token shard holds its own rows,
      sorted by its own experts (those of its expert-axis index, `num_groups / ep` of them, all
      of them without an expert axis), `group_sizes` is `[shards * num_groups / ep]` (each
      shard's counts, sharded like the tokens) and each device multiplies its rows by its
      experts only (`jaxquant.expert_parallel.dispatch` produces exactly this layout).
      Delayed scaling is not supported there (its per-expert state would be summed over the
      data shards).
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
  kernel_axes: tuple = ()
  input_axes: tuple = ()

  @nn.compact
  def __call__(self, inputs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    kernel_axes = tuple(self.kernel_axes)
    if kernel_axes and len(kernel_axes) != 3:
      raise ValueError(f"kernel_axes={kernel_axes}: expected 3 names (groups, in, features)")
    kernel_shape = (self.num_groups, jnp.shape(inputs)[-1], self.features)
    kernel = self.param("kernel", logical_init(self.kernel_init, kernel_axes), kernel_shape,
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", logical_init(self.bias_init, kernel_axes[::2]),
                        (self.num_groups, self.features), self.param_dtype)
    # the kernel stays in param_dtype: quantized, or cast for the products, from it (docstring)
    inputs, _, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    quantizers = module_quantizers(self, MODULE_TYPE)
    if quantizers is not None:
      record_uncached_weight(self, quantizers, "GroupedDense")
    layout = self._layout(kernel_shape)
    if layout is not None:
      return self._sharded(layout, inputs, kernel, group_sizes, bias, quantizers)
    if quantizers is None:
      return grouped_dense(inputs, kernel, group_sizes, bias, precision=self.precision)
    return grouped_dense(inputs, kernel, group_sizes, bias, quantizers,
                         key=module_key(self, quantizers),
                         states=module_states(self, quantizers, batch_shape=(self.num_groups,)),
                         precision=self.precision)

  def _layout(self, kernel_shape) -> Optional[tuple]:
    """(mesh, token axes, expert axes) when the layer is sharded, else None."""
    mesh = _sharding.current_mesh()
    if mesh is None or not self.input_axes:
      return None
    if len(self.input_axes) != 2:
      raise ValueError(f"input_axes={tuple(self.input_axes)}: expected 2 names (tokens, in)")
    x_spec = tuple(nn.logical_to_mesh_axes(tuple(self.input_axes)))
    names, logical = tuple(self.kernel_axes), True
    if not names:
      found, logical = init_axis_names(self.kernel_init, kernel_shape, self.param_dtype)
      names = found or (None, None, None)
    k_spec = tuple(nn.logical_to_mesh_axes(names) if logical else P(*names))
    k_spec += (None,) * (3 - len(k_spec))
    sized = lambda entry: tuple(a for a in _sharding.axes_tuple(entry) if mesh.shape[a] > 1)
    token_axes, expert_axes = sized(x_spec[0]), sized(k_spec[0])
    if not token_axes and not expert_axes:
      return None
    for what, entry in (("in features of the input", x_spec[1]),
                        ("in features of the kernel", k_spec[1]),
                        ("features of the kernel", k_spec[2])):
      if sized(entry):
        raise ValueError(f"GroupedDense '{self.name}': the {what} map to mesh axes {entry!r}; "
                         "only the tokens and the experts (groups) can be sharded")
    if not set(expert_axes) <= set(token_axes):
      raise ValueError(f"GroupedDense '{self.name}': the experts are sharded over "
                       f"{expert_axes} but the tokens only over {token_axes}: each expert "
                       "device must hold its own tokens (shard the tokens over the expert axis "
                       "too)")
    ep = _sharding.axis_size(mesh, expert_axes)
    if self.num_groups % ep:
      raise ValueError(f"GroupedDense '{self.name}': num_groups={self.num_groups} is not "
                       f"divisible by the {ep} devices of the expert axes {expert_axes}")
    return mesh, token_axes, expert_axes

  def _sharded(self, layout, inputs, kernel, group_sizes, bias, quantizers):
    """Each device: its token shard times its experts (`grouped_dense` in `shard_map`)."""
    mesh, token_axes, expert_axes = layout
    local_groups = self.num_groups // _sharding.axis_size(mesh, expert_axes)
    shards = _sharding.axis_size(mesh, token_axes)
    if group_sizes.shape != (shards * local_groups,):
      raise ValueError(f"group_sizes: a sharded GroupedDense takes each token shard's counts "
                       f"of its {local_groups} local experts, shape ({shards * local_groups},) "
                       f"for {shards} token shards; got {tuple(group_sizes.shape)}")
    if quantizers is not None and quantizers.stateful:
      raise NotImplementedError(
          f"GroupedDense '{self.name}': delayed scaling under a token- or expert-sharded mesh "
          "(its per-expert state would be summed over the data shards); use a stateless "
          "recipe (current scaling, block scaling) here")
    key = None if quantizers is None else module_key(self, quantizers)
    tokens, experts = (P(_sharding.spec_entry(token_axes)),
                       P(_sharding.spec_entry(expert_axes)))

    def local(x, w, sizes, b, key):
      return grouped_dense(x, w, sizes, b, quantizers, key=key, precision=self.precision)

    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(tokens, experts, tokens, None if bias is None else experts,
                                 None if key is None else P()),
                       out_specs=tokens, check_vma=False)
    return fn(inputs, kernel, group_sizes, bias, key)
