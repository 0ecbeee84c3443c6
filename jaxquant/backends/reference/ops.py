"""The pure-JAX reference path of every op: it *is* the numerical specification.

`quantize_single` quantizes one 2-D matrix with one single-format quantizer in the requested
directions (the unit an FFI kernel replaces: one fused pass producing the rowwise copy and the
transposed columnwise copy). `gemm` multiplies two operands on the TN convention.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant.formats import QuantizeContext, format_of
from jaxquant.numerics import activations, rht16
from jaxquant.quantizers import Quantizer
from jaxquant.tensors import ScaledTensor

Operand = Union[ScaledTensor, jax.Array]


def quantize_single(x2d: jax.Array, quantizer: Quantizer, *, rowwise: bool, columnwise: bool,
                    orig_dtype: Any, row_key_words=None, col_key_words=None,
                    state=None) -> tuple[Optional[ScaledTensor], Optional[ScaledTensor]]:
  """(rowwise `[rows, cols]`, columnwise `[cols, rows]`) copies of `x2d`; None where not asked."""
  fmt = format_of(quantizer)
  row = col = None
  if rowwise:
    row = fmt.quantize(x2d, quantizer, QuantizeContext(orig_dtype, row_key_words, state))
  if columnwise:
    mat = x2d.T
    rht = fmt.uses_rht(quantizer, "columnwise")
    if rht:
      mat = rht16(mat)
    col = fmt.quantize(mat, quantizer, QuantizeContext(orig_dtype, col_key_words, state, rht))
  return row, col


def transpose(t: ScaledTensor) -> ScaledTensor:
  """The columnwise copy of a per-tensor FP8 matrix: same bytes transposed, same scale."""
  return ScaledTensor(t.data.T, t.scale_inv, t.amax, t.quantizer, t.orig_dtype, t.rht)


def is_transposable(t: ScaledTensor) -> bool:
  """Whether `t`'s format makes the columnwise copy from the same bytes (per-tensor FP8)."""
  return format_of(t.quantizer).transposable(t.quantizer)


def _raw(operand: Operand) -> tuple[jax.Array, Optional[jax.Array]]:
  if isinstance(operand, ScaledTensor):
    fmt = format_of(operand.quantizer)
    return fmt.dequantize_raw(operand), fmt.gemm_factor(operand)
  return operand.astype(jnp.float32), None


def _is_high_precision(operand: Operand) -> bool:
  return not isinstance(operand, ScaledTensor) or operand.scale_inv is None


def gemm(a: Operand, b: Operand, *, out_dtype, bias: Optional[jax.Array] = None,
         precision=None) -> jax.Array:
  """`C[m, n] = sum_k A[m, k] B[n, k]` (+ bias), float32 accumulation, cast to `out_dtype`.

  Quantized operands are dequantized exactly (blocks times block scales); NVFP4's per-tensor
  or per-row factors multiply the accumulator as an outer product. Two high-precision operands
  (plain arrays or Identity storages) take a plain `dot_general` in their own dtype, the same
  contraction `flax.linen.Dense` performs (`jaxquant.dense` arranges the operands so that an
  all-Identity recipe matches nn.Dense bit-for-bit under jit; tested in test_flax_dense.py).
  """
  if _is_high_precision(a) and _is_high_precision(b):
    lhs = a.data if isinstance(a, ScaledTensor) else a
    rhs = b.data if isinstance(b, ScaledTensor) else b
    out = lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), precision=precision)
    if bias is not None:
      out = out + bias.astype(out.dtype)
    return out.astype(out_dtype)
  lhs, lhs_factor = _raw(a)
  rhs, rhs_factor = _raw(b)
  # Keep XLA:GPU's GEMM rewriter from turning decode-then-dot back into its own FP8 cuBLASLt
  # call (which accumulates in reduced precision): the spec is an exact float32 product.
  lhs, rhs = lax.optimization_barrier((lhs, rhs))
  acc = lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
  if lhs_factor is not None:
    acc = acc * (lhs_factor[:, None] if lhs_factor.ndim else lhs_factor)
  if rhs_factor is not None:
    acc = acc * (rhs_factor[None, :] if rhs_factor.ndim else rhs_factor)
  if bias is not None:
    acc = acc + bias.astype(jnp.float32)
  return acc.astype(out_dtype)


def gemm_gelu(a: Operand, b: Operand, *, out_dtype, bias: Optional[jax.Array] = None,
              precision=None) -> tuple[jax.Array, jax.Array]:
  """`(gelu(h), h)`: `h = a b^T (+ bias)` in float32 (`gemm`'s arithmetic), then the spec's
  tanh-approximation gelu (`jaxquant.numerics.activations`) of the float32 `h`; each output
  rounded once to `out_dtype`, as the GEMM's epilogue writes them."""
  h = gemm(a, b, out_dtype=jnp.float32, bias=bias, precision=precision)
  return activations.activation("gelu", h).astype(out_dtype), h.astype(out_dtype)
