"""`flax.linen.Einsum` as a quantized contraction, where its equation allows one.

The equation is planned by `jaxquant.layers.einsum` (the same planner as `jaxquant.nnx.Einsum`):
every kernel axis is contracted with the input, kept as an output feature, or a batch axis
shared by input, kernel and output (per-head kernels: one quantized GEMM per element, with its
own scales and delayed-scaling state). Other equations (traces, axes summed within one operand,
outer products, an ellipsis in the kernel) are left to Flax's own einsum, and
`jaxquant.explain` says why; the parameters are the same either way.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.explain import Decision, record
from jaxquant.flax.quantization import (module_key, module_name, module_path,
                                        module_quantizers, module_states,
                                        record_uncached_weight)
from jaxquant.layers.dense import runs_unquantized
from jaxquant.layers.einsum import ContractionPlan, UnsupportedEinsum, contract, plan_einsum
from jaxquant.recipes import Recipe
from jaxquant.roles import QuantizerRole


def plan_module_einsum(equation: Optional[str], input_ndim: int, kernel_ndim: int,
                       preferred_element_type=None
                       ) -> tuple[Optional[ContractionPlan], Optional[str]]:
  """(plan, None) when the quantized contraction computes `equation`, else (None, why not)."""
  if equation is None:
    return None, "no einsum_str given"
  if preferred_element_type is not None:
    return None, (f"preferred_element_type={jnp.dtype(preferred_element_type).name} (the "
                  "quantized GEMM returns the input's dtype)")
  try:
    return plan_einsum(equation, input_ndim, kernel_ndim), None
  except UnsupportedEinsum as e:
    return None, e.reason


def _kernel_terms(equation: str) -> tuple[str, str, str]:
  """(input, kernel, output) subscripts as written (an ellipsis only in input and output)."""
  operands, out = equation.replace(" ", "").split("->")
  x_term, k_term = operands.split(",")
  return x_term, k_term, out


def einsum_contraction(module: nn.Module, inputs: jax.Array, einsum_str: Optional[str],
                       recipe: Recipe, next_fun: Callable) -> jax.Array:
  """`flax.linen.Einsum.__call__` of `module` with the contraction quantized by `recipe`; an
  equation the quantized contraction cannot express runs Flax's own `__call__` (`next_fun`),
  recorded by `jaxquant.explain` with the reason; so does an all-Identity recipe (see
  `jaxquant.layers.dense.runs_unquantized`)."""
  if module.einsum_str is not None and einsum_str is not None:
    return next_fun(inputs, einsum_str)  # Flax raises its own error for the double equation
  equation = module.einsum_str if einsum_str is None else einsum_str
  plan, reason = plan_module_einsum(equation, inputs.ndim, len(module.shape),
                                    getattr(module, "preferred_element_type", None))
  quantizers = None if plan is None else module_quantizers(module, recipe=recipe)
  if quantizers is None:
    record(Decision(
        "gemm", QuantizerRole("linear", "", module_name(module), module_path(module)),
        f"nn.Einsum {equation!r}", "not-quantized", reason or "no recipe"))
  if runs_unquantized(quantizers, what=f"nn.Einsum {equation!r}"):  # Flax's own einsum
    return next_fun(inputs) if einsum_str is None else next_fun(inputs, einsum_str)

  x_term, k_term, out = _kernel_terms(equation)
  kernel = module.param("kernel", module.kernel_init, tuple(module.shape), module.param_dtype)
  # Flax's bias holds the kernel axes the output keeps, in the output's order; the contraction
  # adds it as [batch..., features...] in the kernel's order.
  bias_terms = "".join(c for c in out if c in k_term)
  bias = None
  if module.use_bias:
    bias = module.param("bias", module.bias_init,
                        [module.shape[k_term.index(c)] for c in bias_terms], module.param_dtype)
  # the kernel stays in param_dtype: quantized weights are read from it (jaxquant.dense)
  inputs, _, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  batch = [c for c in k_term if c in x_term and c in out]
  features = [c for c in k_term if c not in x_term]
  if bias is not None:
    bias = jnp.transpose(bias, tuple(bias_terms.index(c) for c in batch + features))
  batch_shape = tuple(module.shape[k_term.index(c)] for c in batch)
  states = module_states(module, quantizers, batch_shape=batch_shape)
  record_uncached_weight(module, quantizers, f"nn.Einsum {equation!r}")
  return contract(plan, inputs, kernel, bias, quantizers, key=module_key(module, quantizers),
                  states=states, precision=module.precision)
