"""Flax NNX: `jaxquant.nnx.Linear`, `flax.nnx.Linear` with a quantized contraction.

Same constructor, parameters (`kernel [in, out]`, `bias [out]`) and initialization as
`flax.nnx.Linear` (the same `rngs` give the same parameters), plus `recipe`, `name` and `path`
(the roles, see `jaxquant.nnx.module`); `Linear.from_flax` wraps an existing `nnx.Linear`'s
variables (what `quantize_model` does).

Example::

  model = jaxquant.nnx.Linear(64, 32, recipe=jaxquant.DelayedScaling(), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = nnx.grad(loss_fn, argnums=jaxquant.nnx.diff_state(0))(model, x, y)
    jaxquant.nnx.apply_gradients(optimizer, model, grads)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Optional

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from jaxquant.layers.einsum import plan_linear_general
from jaxquant.nnx.module import (QuantizedContraction, RngsArg, existing_value, finish_output,
                                 quantize_stream)
from jaxquant.layers.dense import dense, runs_unquantized
from jaxquant.recipes import Recipe

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class Linear(QuantizedContraction):
  """A linear transformation over the last axis, quantized by a recipe (see the module doc).

  Args:
    in_features, out_features, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init, promote_dtype, preferred_element_type, kernel_metadata, bias_metadata: as
      `flax.nnx.Linear`.
    recipe: quantization recipe; None: the innermost `jaxquant.autocast` at call time. Delayed
      scaling needs its state created here: pass the recipe, or construct under `autocast`.
    name: the roles' name; path: the roles' path (informational, for factories and explain).
    rngs: `nnx.Rngs` for the parameters (`params` stream); its `"quantize"` stream, if any,
      is forked for stochastic rounding.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Optional[Any] = None, param_dtype: Any = jnp.float32,
               precision: Any = None, kernel_init: Any = default_kernel_init,
               bias_init: Any = default_bias_init,
               promote_dtype: Any = nnx.nn.dtypes.promote_dtype,
               preferred_element_type: Any = None, recipe: Optional[Recipe] = None,
               name: str = "Linear", path: str = "", rngs: nnx.Rngs,
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({})):
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features),
                                        param_dtype), **kernel_metadata)
    self.bias: Optional[nnx.Param]
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype),
                            **bias_metadata)
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type
    self._init_quantization(recipe, name, path, rngs)

  @classmethod
  def from_flax(cls, module: nnx.Linear, *, recipe: Optional[Recipe] = None,
                name: str = "Linear", path: str = "",
                rngs: Optional[nnx.Rngs] = None) -> "Linear":
    """A `Linear` that holds `module`'s own `kernel` / `bias` variables (not copies)."""
    new = cls(module.in_features, module.out_features, use_bias=module.use_bias,
              dtype=module.dtype, param_dtype=module.param_dtype, precision=module.precision,
              kernel_init=existing_value(module.kernel), bias_init=existing_value(module.bias),
              promote_dtype=module.promote_dtype,
              preferred_element_type=module.preferred_element_type, recipe=recipe, name=name,
              path=path, rngs=nnx.Rngs(0))
    new.kernel, new.bias = module.kernel, module.bias
    new.rngs = quantize_stream(rngs)
    return new

  def __call__(self, inputs: jax.Array, out_sharding: Any = None, *,
               rngs: RngsArg = None) -> jax.Array:
    """Apply the layer; `rngs` overrides the constructor's `"quantize"` stream."""
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    quantizers = self._quantizers(self.recipe)
    plan = plan_linear_general(inputs.ndim, (-1,), 0, 1)
    sharding = None if quantizers is None else self._sharding(plan)
    if runs_unquantized(quantizers, sharding, what="nnx.Linear"):  # flax.nnx.Linear's own
      kwargs = {"out_sharding": out_sharding}
      if self.preferred_element_type is not None:
        kwargs["preferred_element_type"] = self.preferred_element_type
      y = jax.lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                              precision=self.precision, **kwargs)
      if bias is not None:
        y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
      return y
    # the kernel in its parameter dtype: quantized weights are read from it (jaxquant.dense)
    y = dense(inputs, self.kernel[...], bias, quantizers, key=self._key(quantizers, rngs),
              states=self._states(quantizers), precision=self.precision, sharding=sharding)
    return finish_output(y, out_sharding, self.preferred_element_type)
