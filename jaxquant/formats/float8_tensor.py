"""Per-tensor FP8: one float32 scale for the whole tensor (current or delayed scaling).

Current scaling computes the scale from this tensor's amax; delayed scaling quantizes with the
scale kept in its state (updated afterwards by `jaxquant.state.delayed_scaling_update`), or,
while the state has none yet, with the scale of this tensor's amax (`state.quantize_scale`). The
columnwise copy is the same bytes transposed, so `jaxquant.ops.transpose` can make it. A grouped
copy keeps one amax and one scale per group.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats.base import Format, QuantizeContext, register, tensor_amax
from jaxquant.formats.delayed import (DelayedScalingState, delayed_scaling_update, fresh_state,
                                      needs_current_amax, quantize_scale)
from jaxquant.formats.grouped import GroupedContext
from jaxquant.numerics import scale_from_amax, spec_for_dtype
from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.minifloat import cast_sat, decode
from jaxquant.quantizers import Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer
from jaxquant.tensors import ScaledTensor


def quantize_with_scale(mat: jax.Array, scale: jax.Array, amax: jax.Array, quantizer,
                        ctx: QuantizeContext) -> ScaledTensor:
  spec = spec_for_dtype(quantizer.dtype)
  data = cast_sat(mat.astype(jnp.float32) * scale, spec)
  scale_inv = ieee_div(jnp.float32(1.0), scale)
  return ScaledTensor(data, scale_inv, amax, quantizer, ctx.orig_dtype, ctx.rht)


def _grouped_with_scale(mat, q, ctx: GroupedContext, scale, amax):
  t = quantize_with_scale(mat, ctx.along_tokens(scale, 1.0), amax, q,
                          QuantizeContext(ctx.orig_dtype))
  return t.data, ieee_div(jnp.float32(1.0), scale), amax


class Float8TensorFormat(Format):
  """What per-tensor FP8 formats share: one `()` scale and amax, direction-free bytes."""

  def dequantize_raw(self, t: ScaledTensor) -> jax.Array:
    return decode(t.data) * t.scale_inv

  def blocks(self, quantizer) -> Optional[tuple[int, int]]:
    return None

  def scale_layout(self, quantizer) -> str:
    return "tensor"

  def amax_layout(self, quantizer) -> str:
    return "tensor"

  def scale_dtype(self, quantizer) -> np.dtype:
    return np.dtype(np.float32)

  def transposable(self, quantizer) -> bool:
    return True

  def xla_fused(self, quantizer) -> bool:
    return True

  def gemm_family(self, quantizer) -> str:
    return "fp8"

  def grouped_quantize_kernel(self, quantizer, direction: str):
    return "fp8", None

  def grouped_gemm_scaling(self, quantizer) -> int:
    return 0


class Float8CurrentFormat(Float8TensorFormat):
  name = "fp8-current"

  def quantize(self, mat, quantizer: Float8CurrentScalingQuantizer,
               ctx: QuantizeContext) -> ScaledTensor:
    amax = tensor_amax(mat)
    scale = scale_from_amax(amax, spec_for_dtype(quantizer.dtype).fmax,
                            pow2_scale=quantizer.pow2_scale,
                            amax_epsilon=quantizer.amax_epsilon)
    return quantize_with_scale(mat, scale, amax, quantizer, ctx)

  def grouped_quantize(self, mat, q: Float8CurrentScalingQuantizer, ctx: GroupedContext):
    amax = ctx.group_amax(mat)
    scale = scale_from_amax(amax, spec_for_dtype(q.dtype).fmax, pow2_scale=q.pow2_scale,
                            amax_epsilon=q.amax_epsilon)
    return _grouped_with_scale(mat, q, ctx, scale, amax)

  def quantize_kernel(self, quantizer) -> str:
    return "fp8-current"

  def variants(self):
    return (Float8CurrentScalingQuantizer(),
            Float8CurrentScalingQuantizer(jnp.float8_e5m2, pow2_scale=True))


class Float8DelayedFormat(Float8TensorFormat):
  name = "fp8-delayed"

  def quantize(self, mat, quantizer: Float8DelayedScalingQuantizer,
               ctx: QuantizeContext) -> ScaledTensor:
    if not isinstance(ctx.state, DelayedScalingState):
      raise ValueError("state: Float8DelayedScalingQuantizer needs its DelayedScalingState "
                       "(jaxquant.init_state(quantizer)); got "
                       f"{type(ctx.state).__name__}")
    amax = tensor_amax(mat)
    scale = quantize_scale(ctx.state.scale, amax, quantizer)
    return quantize_with_scale(mat, scale, amax, quantizer, ctx)

  def grouped_quantize(self, mat, q: Float8DelayedScalingQuantizer, ctx: GroupedContext):
    state = ctx.state
    if not isinstance(state, DelayedScalingState) or state.scale.shape != (ctx.groups,):
      got = (f"{type(state).__name__} with scale shape {tuple(state.scale.shape)}"
             if isinstance(state, DelayedScalingState) else type(state).__name__)
      raise ValueError(f"state: grouped Float8DelayedScalingQuantizer needs one "
                       f"DelayedScalingState per group (scale [{ctx.groups}], amax_history "
                       f"[{ctx.groups}, {q.amax_history_len}]; jaxquant.grouped.init_state); "
                       f"got {got}")
    amax = ctx.group_amax(mat)
    return _grouped_with_scale(mat, q, ctx, quantize_scale(state.scale, amax, q), amax)

  def init_state(self, quantizer: Float8DelayedScalingQuantizer) -> DelayedScalingState:
    return fresh_state(quantizer)

  def update_state(self, quantizer, state, amax):
    return delayed_scaling_update(state, amax, quantizer)

  def needs_current_amax(self, quantizer) -> bool:
    return needs_current_amax(quantizer)

  def state_update_kernel(self, quantizer) -> str:
    return "delayed-update"

  def quantize_kernel(self, quantizer) -> str:
    return "fp8-delayed"

  def variants(self):
    return (Float8DelayedScalingQuantizer(amax_history_len=4),
            Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=2, margin=1,
                                          amax_compute_algo="most_recent", first_scale="one"))


register(Float8CurrentScalingQuantizer, Float8CurrentFormat())
register(Float8DelayedScalingQuantizer, Float8DelayedFormat())
