"""`jaxquant.nnx.LinearGeneral`: `flax.nnx.LinearGeneral` with a quantized contraction.

Same constructor, parameters (`kernel [batch..., in..., out...]`, `bias [batch..., out...]`) and
initialization as `flax.nnx.LinearGeneral`. The contracted `axis` (sorted, as Flax pairs them
with the kernel) are flattened into the GEMM's contraction, the other non-batch input axes into
its rows; each `batch_axis` element is its own quantized GEMM (`jax.vmap`): own per-tensor
scales, own delayed-scaling state (shaped `[batch..., ...]`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import FrozenDict

from jaxquant.layers.dense import runs_unquantized
from jaxquant.layers.einsum import contract, plan_linear_general
from jaxquant.nnx.linear import default_bias_init, default_kernel_init
from jaxquant.nnx.module import (QuantizedContraction, RngsArg, existing_value, finish_output,
                                 quantize_stream)
from jaxquant.recipes import Recipe


def _as_tuple(value: Union[int, Sequence[int]]) -> tuple[int, ...]:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _flat_init(init, n_batch: int, n_in: Optional[int], n_out: int):
  """Initialize as Flax does: a 2-D `[batch * in, out]` matrix (a vector `[batch * out]` for
  the bias, `n_in` None) reshaped, so the same rngs give the same parameters."""

  def wrapped(rng, shape, dtype):
    if n_in is None:
      flat = (int(np.prod(shape)),)
    else:
      flat = (int(np.prod(shape[:n_batch]) * np.prod(shape[n_batch:n_batch + n_in])),
              int(np.prod(shape[len(shape) - n_out:])))
    value = init(rng, flat, dtype)
    if isinstance(value, nnx.VariableMetadata):
      value.raw_value = jnp.reshape(value.raw_value, shape)
      return value
    return jnp.reshape(value, shape)

  return wrapped


class LinearGeneral(QuantizedContraction):
  """A linear transformation over any input axes, quantized by a recipe (see the module doc).

  Args:
    in_features, out_features, axis, batch_axis, use_bias, dtype, param_dtype, kernel_init,
      bias_init, precision, promote_dtype, preferred_element_type, kernel_metadata,
      bias_metadata: as `flax.nnx.LinearGeneral`.
    recipe, name, path, rngs: as `jaxquant.nnx.Linear`.
  """

  def __init__(self, in_features: Union[int, Sequence[int]],
               out_features: Union[int, Sequence[int]], *,
               axis: Union[int, Sequence[int]] = -1,
               batch_axis: Mapping[int, int] = FrozenDict({}),
               use_bias: bool = True, dtype: Optional[Any] = None,
               param_dtype: Any = jnp.float32, kernel_init: Any = default_kernel_init,
               bias_init: Any = default_bias_init, precision: Any = None,
               promote_dtype: Any = nnx.nn.dtypes.promote_dtype,
               preferred_element_type: Any = None, recipe: Optional[Recipe] = None,
               name: str = "LinearGeneral", path: str = "", rngs: nnx.Rngs,
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({})):
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    self.axis = _as_tuple(axis)
    self.batch_axis = FrozenDict(batch_axis)
    if len(self.in_features) != len(self.axis):
      raise ValueError(f"in_features={self.in_features} and axis={self.axis} must have the "
                       "same length")
    batch_dims = tuple(self.batch_axis)
    if set(batch_dims) != set(range(len(batch_dims))):
      raise ValueError(f"batch_axis={dict(batch_axis)}: batch axes must be consecutive leading "
                       "axes starting from 0")
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type
    n_batch, n_in, n_out = len(batch_dims), len(self.in_features), len(self.out_features)
    batch_shape = tuple(self.batch_axis.values())
    self.kernel = nnx.Param(
        _flat_init(kernel_init, n_batch, n_in, n_out)(
            rngs.params(), (*batch_shape, *self.in_features, *self.out_features), param_dtype),
        **kernel_metadata)
    self.bias: Optional[nnx.Param]
    if use_bias:
      self.bias = nnx.Param(_flat_init(bias_init, n_batch, None, n_out)(
          rngs.params(), (*batch_shape, *self.out_features), param_dtype), **bias_metadata)
    else:
      self.bias = nnx.data(None)
    self._init_quantization(recipe, name, path, rngs, batch_shape)

  @classmethod
  def from_flax(cls, module: nnx.LinearGeneral, *, recipe: Optional[Recipe] = None,
                name: str = "LinearGeneral", path: str = "",
                rngs: Optional[nnx.Rngs] = None) -> "LinearGeneral":
    """A `LinearGeneral` that holds `module`'s own `kernel` / `bias` variables (not copies)."""
    new = cls(module.in_features, module.out_features, axis=module.axis,
              batch_axis=dict(module.batch_axis), use_bias=module.use_bias,
              dtype=module.dtype, param_dtype=module.param_dtype,
              kernel_init=existing_value(module.kernel), bias_init=existing_value(module.bias),
              precision=module.precision, promote_dtype=module.promote_dtype,
              preferred_element_type=module.preferred_element_type, recipe=recipe, name=name,
              path=path, rngs=nnx.Rngs(0))
    new.kernel, new.bias = module.kernel, module.bias
    new.rngs = quantize_stream(rngs)
    return new

  def __call__(self, inputs: jax.Array, out_sharding: Any = None, *,
               rngs: RngsArg = None) -> jax.Array:
    """Apply the layer; `rngs` overrides the constructor's `"quantize"` stream."""
    ndim = inputs.ndim
    n_batch = len(self.batch_axis)
    axis = tuple(sorted(a % ndim for a in self.axis))
    batch_axis = tuple(range(n_batch))
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    quantizers = self._quantizers(self.recipe)
    plan = plan_linear_general(ndim, self.axis, n_batch, len(self.out_features))
    sharding = None if quantizers is None else self._sharding(plan)
    if runs_unquantized(quantizers, sharding, what="nnx.LinearGeneral"):  # Flax's own
      kwargs = {"out_sharding": out_sharding}
      if self.preferred_element_type is not None:
        kwargs["preferred_element_type"] = self.preferred_element_type
      out = jax.lax.dot_general(
          inputs, kernel, ((axis, tuple(range(n_batch, n_batch + len(axis)))),
                           (batch_axis, batch_axis)), precision=self.precision, **kwargs)
      if bias is not None:
        expanded = tuple(inputs.shape[a] if a in batch_axis else 1
                         for a in range(ndim) if a not in axis)
        out += jnp.reshape(bias, (*expanded, *self.out_features))
      return out
    batch_shape = tuple(self.batch_axis.values())
    # the kernel in its parameter dtype: quantized weights are read from it (jaxquant.dense)
    y = contract(plan, inputs, self.kernel[...], bias, quantizers, key=self._key(quantizers, rngs),
                 states=self._states(quantizers, batch_shape), precision=self.precision,
                 sharding=sharding)
    return finish_output(y, out_sharding, self.preferred_element_type)
