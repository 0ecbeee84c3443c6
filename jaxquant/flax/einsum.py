"""`flax.linen.Einsum` as a quantized contraction, where its equation allows one.

`jaxquant.dense` contracts trailing input axes with leading kernel axes (the TN GEMM of
DESIGN.md section 2, after transposes). An `nn.Einsum` equation `lhs,rhs->out` is that
contraction when every kernel axis is either contracted with an input axis (and absent from the
output) or an output feature (absent from the input), every input axis is either contracted or
kept in the output, and no subscript repeats within an operand. Then the input is transposed to
`[free..., contracted...]`, the kernel to `[contracted..., features...]`, and the output of
`jaxquant.dense` back to `out`'s order. Other equations (batched kernels, traces, axes summed
within one operand, outer products) are left to Flax's own einsum, and `jaxquant.explain` says
why; the parameters are the same either way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.explain import Decision, record
from jaxquant.flax.quantization import module_name, module_path, quantized_contraction
from jaxquant.recipes import Recipe
from jaxquant.roles import QuantizerRole

_ELLIPSIS = "..."


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
  """The subscripts of an explicit two-operand equation, ellipsis expanded."""

  lhs: str
  rhs: str
  out: str

  @property
  def contracted(self) -> str:
    """Kernel subscripts contracted with input axes, in kernel order."""
    return "".join(c for c in self.rhs if c in self.lhs)

  @property
  def features(self) -> str:
    """Kernel subscripts that are output features, in kernel order."""
    return "".join(c for c in self.rhs if c not in self.lhs)

  @property
  def free(self) -> str:
    """Input subscripts kept in the output (the GEMM's rows), in input order."""
    return "".join(c for c in self.lhs if c not in self.rhs)

  def bias_subscripts(self) -> str:
    """Flax's bias axes: the kernel subscripts present in the output, in output order."""
    return "".join(c for c in self.out if c in self.rhs)

  def unsupported(self) -> Optional[str]:
    """Why `jaxquant.dense` cannot compute this equation, or None if it can."""
    for name, subs in (("input", self.lhs), ("kernel", self.rhs), ("output", self.out)):
      if len(set(subs)) != len(subs):
        return f"a subscript repeats within the {name} ({subs!r}: a trace or diagonal)"
    batched = [c for c in self.rhs if c in self.lhs and c in self.out]
    if batched:
      return (f"kernel axes {''.join(batched)!r} are shared with the input and kept in the "
              "output (a batched contraction)")
    summed_lhs = [c for c in self.lhs if c not in self.rhs and c not in self.out]
    if summed_lhs:
      return f"input axes {''.join(summed_lhs)!r} are summed without the kernel"
    summed_rhs = [c for c in self.rhs if c not in self.lhs and c not in self.out]
    if summed_rhs:
      return f"kernel axes {''.join(summed_rhs)!r} are summed without the input"
    if not self.contracted:
      return "no axis is contracted (an outer product)"
    return None


def parse_einsum(einsum_str: str, input_ndim: int) -> tuple[Optional[EinsumPlan], Optional[str]]:
  """(plan, None) for an explicit equation `lhs,rhs->out` (an ellipsis allowed in the input and
  output), else (None, why it is not one the quantized contraction can take)."""
  equation = einsum_str.replace(" ", "")
  if "->" not in equation or equation.count(",") != 1:
    return None, f"equation {einsum_str!r} is not explicit with two operands"
  operands, out = equation.split("->")
  lhs, rhs = operands.split(",")
  if _ELLIPSIS in rhs:
    return None, "an ellipsis in the kernel's subscripts"
  if _ELLIPSIS in lhs:
    named = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
             if c not in equation]
    count = input_ndim - (len(lhs) - len(_ELLIPSIS))
    if count < 0 or count > len(named):
      return None, f"the ellipsis of {einsum_str!r} does not fit an input of rank {input_ndim}"
    expanded = "".join(named[:count])
    lhs = lhs.replace(_ELLIPSIS, expanded)
    out = out.replace(_ELLIPSIS, expanded)
  if _ELLIPSIS in out or "." in lhs + rhs + out:
    return None, f"equation {einsum_str!r} has an ellipsis in the output only, or a stray '.'"
  plan = EinsumPlan(lhs, rhs, out)
  reason = plan.unsupported()
  return (None, reason) if reason else (plan, None)


def _permutation(source: str, target: str) -> tuple[int, ...]:
  return tuple(source.index(c) for c in target)


def einsum_contraction(module: nn.Module, inputs: jax.Array, einsum_str: Optional[str],
                       recipe: Recipe, next_fun: Callable) -> jax.Array:
  """`flax.linen.Einsum.__call__` of `module` with the contraction quantized by `recipe`; an
  equation the quantized contraction cannot express runs Flax's own `__call__` (`next_fun`),
  recorded by `jaxquant.explain` with the reason."""
  equation = module.einsum_str if einsum_str is None else einsum_str
  if module.einsum_str is not None and einsum_str is not None:
    return next_fun(inputs, einsum_str)  # Flax raises its own error for the double equation
  plan, reason = (None, "no einsum_str given") if equation is None else parse_einsum(
      equation, inputs.ndim)
  preferred = getattr(module, "preferred_element_type", None)
  if plan is not None and preferred is not None:
    plan, reason = None, (f"preferred_element_type={jnp.dtype(preferred).name} (the quantized "
                          "GEMM returns the input's dtype)")
  if plan is None:
    record(Decision(
        "gemm", QuantizerRole("linear", "", module_name(module), module_path(module)),
        f"nn.Einsum {equation!r}", "not-quantized", reason))
    return next_fun(inputs) if einsum_str is None else next_fun(inputs, einsum_str)

  if len(plan.rhs) != len(module.shape) or len(plan.lhs) != inputs.ndim:
    raise ValueError(f"einsum_str={equation!r} does not fit a kernel of shape "
                     f"{tuple(module.shape)} and an input of rank {inputs.ndim}")
  kernel = module.param("kernel", module.kernel_init, tuple(module.shape), module.param_dtype)
  bias = None
  bias_subs = plan.bias_subscripts()
  if module.use_bias:
    bias = module.param("bias", module.bias_init,
                        [module.shape[plan.rhs.index(c)] for c in bias_subs], module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  x = jnp.transpose(inputs, _permutation(plan.lhs, plan.free + plan.contracted))
  w = jnp.transpose(kernel, _permutation(plan.rhs, plan.contracted + plan.features))
  if bias is not None:  # Flax's bias follows the output's order; dense's the kernel's features
    bias = jnp.transpose(bias, _permutation(bias_subs, plan.features))
  y = quantized_contraction(module, x, w, bias, contracting_dims=len(plan.contracted),
                            precision=module.precision, recipe=recipe)
  return jnp.transpose(y, _permutation(plan.free + plan.features, plan.out))
