"""An einsum of an activation with a weight, as the TN quantized contraction (`jaxquant.dense`).

An equation `x,w->y` maps onto `jaxquant.dense` when every axis of the weight is either
contracted with the input (K), kept in the output (N), or shared by input, weight and output
(a batch axis G, e.g. per-head weights that the input also indexes), and every axis of the input
is contracted (K), kept (rows M) or a batch axis. Then

  x  -> [G..., M..., K...]    (transpose)
  w  -> [G..., K..., N...]    (transpose)
  y  =  dense(x, w) over K,   vmapped over G (each batch element its own quantized GEMM)
  y  -> the equation's output order (transpose)

so the TN storage convention holds (K flattened into the GEMM's contraction, M into its rows).
Anything else (an axis summed within one operand, a diagonal, an outer product, an ellipsis in
the weight) is not one quantized GEMM: `plan_einsum` raises `UnsupportedEinsum` naming the
equation and the axis. `ContractionPlan` also describes `LinearGeneral`'s contraction
(`plan_linear_general`), so both run through `contract`.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxquant import sharding as _sharding
from jaxquant.layers.dense import DenseQuantizers, dense


class UnsupportedEinsum(ValueError):
  """An einsum that is not one quantized contraction of the input with the weight."""

  def __init__(self, equation: str, reason: str):
    self.equation, self.reason = equation, reason
    super().__init__(f"einsum '{equation}' cannot run as a quantized contraction: {reason}")


@dataclasses.dataclass(frozen=True)
class ContractionPlan:
  """How `x` and `kernel` are transposed, contracted and laid out (static, hashable).

  Attributes:
    x_perm: input axes in the order `[batch..., rows..., contracted...]`.
    kernel_perm: kernel axes in the order `[batch..., contracted..., out...]`.
    out_perm: output axes taken from `[batch..., rows..., out...]` (None: already in order).
    n_batch: number of batch axes (each element its own quantized GEMM).
    n_contract: number of contracted axes.
    equation: what the plan was made from, for messages.
  """

  x_perm: tuple[int, ...]
  kernel_perm: tuple[int, ...]
  out_perm: Optional[tuple[int, ...]]
  n_batch: int
  n_contract: int
  equation: str = ""

  def batch_shape(self, kernel_shape: Sequence[int]) -> tuple[int, ...]:
    """The sizes of the batch axes (the leading shape of per-element states)."""
    return tuple(kernel_shape[a] for a in self.kernel_perm[:self.n_batch])

  def kernel_spec(self, spec: Optional[P], kernel_ndim: int) -> Optional[P]:
    """A kernel `PartitionSpec` moved to the transposed kernel's `[K..., N...]` order (None with
    batch axes: those run under `vmap`, and XLA propagation places them)."""
    if spec is None or self.n_batch:
      return None
    entries = tuple(spec) + (None,) * (kernel_ndim - len(tuple(spec)))
    return P(*(entries[a] for a in self.kernel_perm))


def _ellipsis_axes(x_term: str, x_ndim: int, free: list[str], equation: str) -> str:
  """The letters an ellipsis of the input stands for ("" without one)."""
  if "..." not in x_term:
    return ""
  n = x_ndim - (len(x_term) - 3)
  if n < 0:
    raise UnsupportedEinsum(equation, f"the input has rank {x_ndim}, fewer axes than "
                            f"'{x_term}' names")
  return "".join(free[:n])


def plan_einsum(equation: str, x_ndim: int, kernel_ndim: int) -> ContractionPlan:
  """The `ContractionPlan` of `equation` (`"input,kernel->output"`), or `UnsupportedEinsum`.

  Args:
    equation: an explicit two-operand einsum, the input first and the weight second; an
      ellipsis may stand for leading input axes that the output keeps.
    x_ndim, kernel_ndim: ranks of the operands.
  """
  eq = equation.replace(" ", "")
  if eq.count("->") != 1 or eq.split("->")[0].count(",") != 1:
    raise UnsupportedEinsum(equation, "expected an explicit 'input,weight->output' equation")
  operands, out = eq.split("->")
  x_term, k_term = operands.split(",")
  used = set(x_term + k_term + out)
  free = [c for c in string.ascii_letters if c not in used]
  if "..." in k_term:
    raise UnsupportedEinsum(equation, "an ellipsis in the weight operand is not supported; "
                            "name the weight's axes")
  if "..." in out and "..." not in x_term:
    raise UnsupportedEinsum(equation, "an ellipsis in the output needs one in the input")
  ellipsis = _ellipsis_axes(x_term, x_ndim, free, equation)
  x_term, out = x_term.replace("...", ellipsis), out.replace("...", ellipsis)
  for term, ndim, what in ((x_term, x_ndim, "input"), (k_term, kernel_ndim, "weight")):
    if len(term) != ndim:
      raise UnsupportedEinsum(equation, f"the {what} has rank {ndim} but '{term}' names "
                              f"{len(term)} axes")
  for term, what in ((x_term, "input"), (k_term, "weight"), (out, "output")):
    repeated = sorted({c for c in term if term.count(c) > 1})
    if repeated:
      raise UnsupportedEinsum(equation, f"axis '{repeated[0]}' repeats in the {what} (a "
                              "diagonal or trace)")
  for c in out:
    if c not in x_term and c not in k_term:
      raise UnsupportedEinsum(equation, f"output axis '{c}' is in neither operand")
  for c in k_term:
    if c not in x_term and c not in out:
      raise UnsupportedEinsum(equation, f"weight axis '{c}' is summed without the input (a "
                              "reduction of the weight, not a contraction with it)")
  for c in x_term:
    if c not in k_term and c not in out:
      raise UnsupportedEinsum(equation, f"input axis '{c}' is summed without the weight (a "
                              "reduction of the input, not a contraction with it)")
  batch = [c for c in k_term if c in x_term and c in out]
  # Contracted axes in letter order, as `jnp.einsum` orders its dot_general: the same
  # accumulation order, so an unquantized (Identity) contraction equals it bit for bit.
  contracted = sorted(c for c in k_term if c in x_term and c not in out)
  outputs = [c for c in k_term if c not in x_term]
  rows = [c for c in x_term if c not in k_term]
  if not contracted:
    raise UnsupportedEinsum(equation, "no axis of the input is contracted with the weight (an "
                            "outer or elementwise product)")
  y_term = batch + rows + outputs
  out_perm = tuple(y_term.index(c) for c in out)
  return ContractionPlan(
      x_perm=tuple(x_term.index(c) for c in batch + rows + contracted),
      kernel_perm=tuple(k_term.index(c) for c in batch + contracted + outputs),
      out_perm=None if out_perm == tuple(range(len(out))) else out_perm,
      n_batch=len(batch), n_contract=len(contracted), equation=equation)


def plan_linear_general(ndim: int, axis: Sequence[int], n_batch: int,
                        n_out: int) -> ContractionPlan:
  """The plan of `nnx.LinearGeneral`: contract the (sorted) input `axis` with the kernel's axes
  after its `n_batch` leading batch axes; the output is `[batch..., free..., out...]`."""
  contracted = tuple(sorted(a % ndim for a in axis))
  batch = tuple(range(n_batch))
  rows = tuple(a for a in range(ndim) if a not in contracted and a not in batch)
  n_contract = len(contracted)
  return ContractionPlan(x_perm=batch + rows + contracted,
                         kernel_perm=tuple(range(n_batch + n_contract + n_out)), out_perm=None,
                         n_batch=n_batch, n_contract=n_contract,
                         equation=f"LinearGeneral(axis={tuple(axis)}, batch_axes={n_batch})")


def _transpose(value, perm):
  return value if perm == tuple(range(value.ndim)) else value.transpose(perm)


def contract(plan: ContractionPlan, x: jax.Array, kernel: jax.Array,
             bias: Optional[jax.Array] = None, quantizers: Optional[DenseQuantizers] = None, *,
             key: Optional[jax.Array] = None, states: Optional[tuple] = None,
             precision: Any = None,
             sharding: Optional[_sharding.DenseSharding] = None) -> jax.Array:
  """`jaxquant.dense` of `x` and `kernel` as `plan` lays them out.

  Args:
    plan: from `plan_einsum` or `plan_linear_general`.
    x, kernel: the operands in their own layout (promoted to one dtype).
    bias: None, or `[batch..., out...]` added inside the GEMM (in `[batch..., rows..., out...]`
      order, before `plan.out_perm`).
    quantizers, precision: as `jaxquant.dense`.
    key: one key; with batch axes it is split into one per batch element.
    states: delayed-scaling states, with the batch shape leading every leaf.
    sharding: the `DenseSharding` of the transposed operands (only without batch axes).
  """
  x = _transpose(x, plan.x_perm)
  kernel = _transpose(kernel, plan.kernel_perm)

  def one(x, kernel, bias, key, states):
    return dense(x, kernel, bias, quantizers, key=key, states=states,
                 contracting_dims=plan.n_contract, precision=precision, sharding=sharding)

  if plan.n_batch:
    batch_shape = kernel.shape[:plan.n_batch]
    if key is not None and quantizers is not None:
      key = jax.random.split(key, batch_shape)
    for _ in range(plan.n_batch):
      one = jax.vmap(one)
  y = one(x, kernel, bias, key, states)
  return y if plan.out_perm is None else y.transpose(plan.out_perm)
