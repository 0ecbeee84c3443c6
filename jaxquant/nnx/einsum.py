"""`jaxquant.nnx.Einsum`: `flax.nnx.Einsum` with a quantized contraction.

Same constructor, parameters (`kernel [kernel_shape]`, `bias [bias_shape]`) and initialization
as `flax.nnx.Einsum`. The equation runs as the TN quantized contraction of
`jaxquant.layers.einsum` (weight axes contracted with the input, kept in the output, or batch
axes shared with the input: each batch element its own quantized GEMM with its own state); the
bias is added afterwards, broadcast as Flax does.

An equation the quantized contraction cannot express raises `UnsupportedEinsum` (a ValueError
naming the equation and the axis), at construction when the equation is known then, else at the
call. With `on_unsupported="high_precision"` (what `quantize_model` sets) such an einsum runs
unquantized, as `flax.nnx.Einsum` would, and `jaxquant.explain` reports it with the reason.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import opt_einsum

from jaxquant.explain import Decision, record
from jaxquant.layers.dense import runs_unquantized
from jaxquant.layers.einsum import UnsupportedEinsum, contract, plan_einsum
from jaxquant.nnx.linear import default_bias_init, default_kernel_init
from jaxquant.nnx.module import (QuantizedContraction, RngsArg, existing_value, finish_output,
                                 quantize_stream)
from jaxquant.recipes import Recipe
from jaxquant.roles import QuantizerRole

ON_UNSUPPORTED = ("error", "high_precision")


def _check_equation(einsum_str: str) -> str:
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(f"einsum_str={einsum_str!r}: expected an explicit two-operand equation "
                     "'input,kernel->output'")
  return einsum_str


def _layout_plan(einsum_str: str, kernel_ndim: int):
  """The plan of `einsum_str` known before any input (an ellipsis taken as no axes)."""
  x_term = einsum_str.split(",")[0]
  return plan_einsum(einsum_str, len(x_term.replace("...", "")), kernel_ndim)


class Einsum(QuantizedContraction):
  """An einsum of the input with a learnable kernel, quantized by a recipe (see the module doc).

  Args:
    einsum_str, kernel_shape, bias_shape, dtype, param_dtype, precision, kernel_init,
      bias_init, promote_dtype, preferred_element_type, kernel_metadata, bias_metadata: as
      `flax.nnx.Einsum` (`einsum_str` may instead be given to the call).
    recipe, name, path, rngs: as `jaxquant.nnx.Linear`.
    on_unsupported: "error" (default): an equation the quantized contraction cannot express
      raises; "high_precision": it runs unquantized and `jaxquant.explain` says why.
  """

  def __init__(self, einsum_str: Optional[str], kernel_shape: Sequence[int],
               bias_shape: Optional[Sequence[int]] = None, *, dtype: Optional[Any] = None,
               param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Any = default_kernel_init, bias_init: Any = default_bias_init,
               promote_dtype: Any = nnx.nn.dtypes.promote_dtype,
               preferred_element_type: Any = None, recipe: Optional[Recipe] = None,
               name: str = "Einsum", path: str = "", on_unsupported: str = "error",
               rngs: nnx.Rngs, kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({})):
    if on_unsupported not in ON_UNSUPPORTED:
      raise ValueError(f"on_unsupported={on_unsupported!r}: expected one of {ON_UNSUPPORTED}")
    self.einsum_str = None if einsum_str is None else _check_equation(einsum_str)
    self.kernel_shape = tuple(kernel_shape)
    self.bias_shape = None if bias_shape is None else tuple(bias_shape)
    self.on_unsupported = on_unsupported
    self.kernel = nnx.Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype),
                            **kernel_metadata)
    self.bias: Optional[nnx.Param]
    if bias_shape is not None:
      self.bias = nnx.Param(bias_init(rngs.params(), self.bias_shape, param_dtype),
                            **bias_metadata)
    else:
      self.bias = nnx.data(None)
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type
    batch_shape = None  # no state until the layout is known
    if self.einsum_str is not None:
      try:
        batch_shape = _layout_plan(self.einsum_str, len(self.kernel_shape)).batch_shape(
            self.kernel_shape)
      except UnsupportedEinsum:
        if on_unsupported == "error":
          raise
    self._init_quantization(recipe, name, path, rngs, batch_shape)

  @classmethod
  def from_flax(cls, module: nnx.Einsum, *, recipe: Optional[Recipe] = None,
                name: str = "Einsum", path: str = "", on_unsupported: str = "high_precision",
                rngs: Optional[nnx.Rngs] = None) -> "Einsum":
    """An `Einsum` that holds `module`'s own `kernel` / `bias` variables (not copies)."""
    new = cls(module.einsum_str, module.kernel_shape, module.bias_shape, dtype=module.dtype,
              param_dtype=module.param_dtype, precision=module.precision,
              kernel_init=existing_value(module.kernel), bias_init=existing_value(module.bias),
              promote_dtype=module.promote_dtype,
              preferred_element_type=module.preferred_element_type, recipe=recipe, name=name,
              path=path, on_unsupported=on_unsupported, rngs=nnx.Rngs(0))
    new.kernel, new.bias = module.kernel, module.bias
    new.rngs = quantize_stream(rngs)
    return new

  def unsupported_reason(self, einsum_str: Optional[str] = None,
                         input_ndim: Optional[int] = None) -> str:
    """Why the equation cannot run quantized ("" when it can)."""
    einsum_str = einsum_str or self.einsum_str
    try:
      if input_ndim is None:
        _layout_plan(einsum_str, len(self.kernel_shape))
      else:
        plan_einsum(einsum_str, input_ndim, len(self.kernel_shape))
    except UnsupportedEinsum as err:
      return err.reason
    return ""

  def __call__(self, inputs: jax.Array, einsum_str: Optional[str] = None,
               out_sharding: Any = None, *, rngs: RngsArg = None) -> jax.Array:
    """Apply the einsum (`einsum_str` here wins over the constructor's, as in Flax); `rngs`
    overrides the constructor's `"quantize"` stream."""
    if einsum_str is None and self.einsum_str is None:
      raise ValueError("Einsum: no einsum_str, neither given to the constructor nor to the call")
    einsum_str = _check_equation(einsum_str) if einsum_str is not None else self.einsum_str
    inputs, kernel, bias = self.promote_dtype(
        (inputs, self.kernel[...], self.bias[...] if self.bias is not None else None),
        dtype=self.dtype)
    quantizers = self._quantizers(self.recipe)
    plan = None
    if quantizers is not None:
      try:
        plan = plan_einsum(einsum_str, inputs.ndim, kernel.ndim)
      except UnsupportedEinsum as err:
        if self.on_unsupported == "error":
          raise
        record(Decision(
            "einsum", QuantizerRole("linear", "", self.name, self.path), einsum_str,
            "high-precision", err.reason))
    sharding = None if plan is None else self._sharding(plan)
    if plan is None or runs_unquantized(quantizers, sharding, what=f"nnx.Einsum {einsum_str!r}"):
      kwargs = {"out_sharding": out_sharding}  # flax.nnx.Einsum's own contraction
      if self.preferred_element_type is not None:
        kwargs["preferred_element_type"] = self.preferred_element_type
      y = jnp.einsum(einsum_str, inputs, kernel, precision=self.precision, **kwargs)
    else:
      # the kernel in its parameter dtype: quantized weights are read from it (jaxquant.dense)
      y = contract(plan, inputs, self.kernel[...], None, quantizers,
                   key=self._key(quantizers, rngs),
                   states=self._states(quantizers, plan.batch_shape(kernel.shape)),
                   precision=self.precision, sharding=sharding)
      y = finish_output(y, out_sharding, self.preferred_element_type)
    if bias is not None:
      y += jnp.reshape(bias, self._bias_shape(einsum_str, inputs, kernel))
    return y

  def _bias_shape(self, einsum_str: str, inputs: jax.Array, kernel: jax.Array) -> list[int]:
    """The bias broadcast over the output: kernel axes the output keeps (as Flax)."""
    operands, result, _ = opt_einsum.parser.parse_einsum_input((einsum_str, inputs, kernel))
    kernel_axes = {c: i for i, c in enumerate(operands.split(",")[1])}
    return [self.kernel_shape[kernel_axes[c]] if c in kernel_axes else 1 for c in result]
