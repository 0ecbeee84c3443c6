"""Identity: the high-precision tensor itself (optionally cast), no scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats.base import Format, QuantizeContext, register
from jaxquant.quantizers import IdentityQuantizer
from jaxquant.tensors import ScaledTensor


def quantize(mat: jax.Array, quantizer: IdentityQuantizer, ctx: QuantizeContext) -> ScaledTensor:
  dtype = quantizer.dtype if quantizer.dtype is not None else ctx.orig_dtype
  return ScaledTensor(mat.astype(dtype), None, None, quantizer, ctx.orig_dtype, ctx.rht)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  return t.data.astype(jnp.float32)


register(IdentityQuantizer, Format("identity", quantize, dequantize_raw))
