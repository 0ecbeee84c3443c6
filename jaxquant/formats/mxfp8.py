"""MXFP8: blocks of 32 along the contraction axis, each with an E8M0 power-of-two scale.

The block exponent rounds `amax / fmax` up to a power of two, so a finite block never
saturates; a block holding NaN gets exponent 255 and an all-NaN payload. Scales are block-local,
so a grouped copy is the single-matrix reference on the padded token layout. A grouped copy
may hold its raw values in bfloat16 instead of the codes (`stores_raw`), for the grouped GEMMs
that read decoded operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import numpy as np

from jaxquant.formats.base import (Format, QuantizeContext, block_amax, expand_blocks,
                                   pad_to_blocks, register, tensor_amax)
from jaxquant.formats.grouped import block_local
from jaxquant.numerics import e8m0_decode_exponent, e8m0_from_amax, exp2i, spec_for_dtype
from jaxquant.numerics.minifloat import decode, encode, to_storage
from jaxquant.quantizers import MXFP8Quantizer
from jaxquant.tensors import ScaledTensor

BLOCK = 32


def quantize(mat: jax.Array, quantizer: MXFP8Quantizer, ctx: QuantizeContext) -> ScaledTensor:
  spec = spec_for_dtype(quantizer.dtype)
  rows, cols = mat.shape
  x = pad_to_blocks(mat.astype(jnp.float32), 1, BLOCK)
  exponent = e8m0_from_amax(block_amax(x, 1, BLOCK), spec.fmax)  # [rows, nblocks] uint32
  e = expand_blocks(exponent, 1, BLOCK)
  # x * 2^(127 - e) as two normal power-of-two factors: 2^-127 (e = 254, a block holding inf) is
  # subnormal, and backends that flush subnormal operands (XLA:CPU) would turn inf * 0 into NaN.
  k = 127 - jnp.minimum(e, 254).astype(jnp.int32)
  code = encode(x * exp2i(jnp.maximum(k, -126)) * exp2i(jnp.minimum(k + 126, 0)), spec)
  code = jnp.where(e == 255, jnp.uint8(spec.nan_code), code)
  data = to_storage(code, spec)[:rows, :cols]
  scale_inv = lax.bitcast_convert_type(exponent.astype(jnp.uint8), jnp.float8_e8m0fnu)
  return ScaledTensor(data, scale_inv, tensor_amax(mat), quantizer, ctx.orig_dtype, ctx.rht)


def block_exponents(t: ScaledTensor) -> jax.Array:
  return lax.bitcast_convert_type(t.scale_inv, jnp.uint8)


def stores_raw(t: ScaledTensor) -> bool:
  """Whether `t.data` holds the raw values (code x 2^(e - 127) rounded once to bfloat16) rather
  than the codes: bfloat16 data, a grouped FFI copy written for the GEMMs that read decoded
  operands. Equal to the codes' decode wherever that is exact in bfloat16 (above 2^-126)."""
  return np.dtype(t.data.dtype) == np.dtype(jnp.bfloat16)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  if stores_raw(t):
    return t.data.astype(jnp.float32)
  rows, cols = t.shape
  scale = expand_blocks(e8m0_decode_exponent(block_exponents(t)), 1, BLOCK)[:, :cols]
  return decode(t.data) * scale


class MXFP8Format(Format):
  name = "mxfp8"

  def quantize(self, mat, quantizer, ctx):
    return quantize(mat, quantizer, ctx)

  def dequantize_raw(self, t):
    return dequantize_raw(t)

  def stores_raw(self, t) -> bool:
    return stores_raw(t)

  def grouped_quantize(self, mat, quantizer, ctx):
    return block_local(self, mat, quantizer, ctx)

  def blocks(self, quantizer) -> tuple[int, int]:
    return (1, BLOCK)

  def scale_layout(self, quantizer) -> str:
    return "block"

  def amax_layout(self, quantizer) -> str:
    return "tensor"

  def scale_dtype(self, quantizer) -> np.dtype:
    return np.dtype(jnp.float8_e8m0fnu)

  def quantize_kernel(self, quantizer) -> str:
    return "mxfp8"

  def gemm_family(self, quantizer) -> str:
    return "mxfp8"

  def grouped_quantize_kernel(self, quantizer, direction: str):
    return "single", None

  def expert_rows_multiple(self, quantizer, direction: str) -> int:
    return 1 if direction == "rowwise" else BLOCK

  def grouped_gemm_scaling(self, quantizer) -> int:
    return 1

  def variants(self):
    return (MXFP8Quantizer(), MXFP8Quantizer(jnp.float8_e5m2))


register(MXFP8Quantizer, MXFP8Format())
