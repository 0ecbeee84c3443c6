"""Per-tensor FP8: one float32 scale for the whole tensor (current or delayed scaling).

Current scaling computes the scale from this tensor's amax; delayed scaling quantizes with the
scale kept in its state (updated afterwards by `jaxquant.state.delayed_scaling_update`), or,
while the state has none yet, with the scale of this tensor's amax (`state.quantize_scale`). The
columnwise copy is the same bytes transposed, so `jaxquant.ops.transpose` can make it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats.base import Format, QuantizeContext, register, tensor_amax
from jaxquant.numerics import scale_from_amax, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.minifloat import cast_sat, decode
from jaxquant.quantizers import Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer
from jaxquant.state import DelayedScalingState, quantize_scale
from jaxquant.tensors import ScaledTensor


def quantize_with_scale(mat: jax.Array, scale: jax.Array, amax: jax.Array, quantizer,
                        ctx: QuantizeContext) -> ScaledTensor:
  spec = spec_for_dtype(quantizer.dtype)
  data = cast_sat(mat.astype(jnp.float32) * scale, spec)
  scale_inv = ieee_div(jnp.float32(1.0), scale)
  return ScaledTensor(data, scale_inv, amax, quantizer, ctx.orig_dtype, ctx.rht)


def quantize_current(mat: jax.Array, quantizer: Float8CurrentScalingQuantizer,
                     ctx: QuantizeContext) -> ScaledTensor:
  amax = tensor_amax(mat)
  scale = scale_from_amax(amax, spec_for_dtype(quantizer.dtype).fmax,
                          pow2_scale=quantizer.pow2_scale, amax_epsilon=quantizer.amax_epsilon)
  return quantize_with_scale(mat, scale, amax, quantizer, ctx)


def quantize_delayed(mat: jax.Array, quantizer: Float8DelayedScalingQuantizer,
                     ctx: QuantizeContext) -> ScaledTensor:
  if not isinstance(ctx.state, DelayedScalingState):
    raise ValueError("state: Float8DelayedScalingQuantizer needs its DelayedScalingState "
                     "(jaxquant.init_state(quantizer)); got "
                     f"{type(ctx.state).__name__}")
  amax = tensor_amax(mat)
  scale = quantize_scale(ctx.state.scale, amax, quantizer)
  return quantize_with_scale(mat, scale, amax, quantizer, ctx)


def dequantize_raw(t: ScaledTensor) -> jax.Array:
  return decode(t.data) * t.scale_inv


register(Float8CurrentScalingQuantizer, Format("fp8-current", quantize_current, dequantize_raw))
register(Float8DelayedScalingQuantizer, Format("fp8-delayed", quantize_delayed, dequantize_raw))
