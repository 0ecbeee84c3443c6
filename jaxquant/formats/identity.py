"""Identity: the high-precision tensor itself (optionally cast), no scales.

Nothing is computed, so no kernel serves it: every path takes the reference's cast, and a GEMM
with Identity operands is the high-precision contraction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats.base import Format, QuantizeContext, no_grouped_kernel, register
from jaxquant.quantizers import IdentityQuantizer
from jaxquant.tensors import ScaledTensor


def quantize(mat: jax.Array, quantizer: IdentityQuantizer, ctx: QuantizeContext) -> ScaledTensor:
  dtype = quantizer.dtype if quantizer.dtype is not None else ctx.orig_dtype
  return ScaledTensor(mat.astype(dtype), None, None, quantizer, ctx.orig_dtype, ctx.rht)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  return t.data.astype(jnp.float32)


def grouped_quantize(mat: jax.Array, quantizer: IdentityQuantizer, ctx) -> tuple:
  return mat.astype(quantizer.dtype if quantizer.dtype is not None else ctx.orig_dtype), None, None


class IdentityFormat(Format):
  name = "identity"
  high_precision = True

  def quantize(self, mat, quantizer, ctx):
    return quantize(mat, quantizer, ctx)

  def dequantize_raw(self, t):
    return dequantize_raw(t)

  def grouped_quantize(self, mat, quantizer, ctx):
    return grouped_quantize(mat, quantizer, ctx)

  def blocks(self, quantizer):
    return None

  def scale_layout(self, quantizer) -> str:
    return "none"

  def amax_layout(self, quantizer) -> str:
    return "none"

  def scale_dtype(self, quantizer):
    return None

  def quantize_kernel(self, quantizer):
    return None

  def gemm_family(self, quantizer) -> str:
    return "hp"

  def grouped_quantize_kernel(self, quantizer, direction: str):
    return no_grouped_kernel(quantizer)

  def grouped_gemm_scaling(self, quantizer):
    return None

  def grouped_gemm_operand(self, quantizer) -> str:
    return "a high-precision operand"

  def copies_swap_with_transpose(self, quantizer) -> bool:
    return False  # no bytes to share: the transpose stays

  def variants(self):
    return (IdentityQuantizer(), IdentityQuantizer(jnp.bfloat16))


register(IdentityQuantizer, IdentityFormat())
