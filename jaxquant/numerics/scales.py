"""Scale math shared by the formats (docs/design.md §5 "Numerics"), float32 throughout.

NaN policy (the C++ header mirrors it): amax reductions propagate NaN (`jnp.max` semantics) and
`min`/`max` here propagate NaN too, so a NaN in a tensor is never hidden by a clamp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant.numerics.division import ieee_div
from jaxquant.numerics.minifloat import E4M3, encode

FLT_MAX = float(jnp.finfo(jnp.float32).max)


def _bits(x):
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _from_bits(u):
  return lax.bitcast_convert_type(u.astype(jnp.uint32), jnp.float32)


# Each function is jitted (its float parameters static), so a trace records one call traced once
# per operand shape rather than its operations at every call site (see numerics/division.py).
@jax.jit
def exp2i(k: jnp.ndarray) -> jnp.ndarray:
  """2^k as float32 for integer k in [-149, 127], subnormals included."""
  k = jnp.asarray(k, jnp.int32)
  normal = (jnp.maximum(k, -126) + 127).astype(jnp.uint32) << 23
  subnormal = jnp.uint32(1) << jnp.clip(k + 149, 0, 22).astype(jnp.uint32)
  return _from_bits(jnp.where(k >= -126, normal, subnormal))


@functools.partial(jax.jit, static_argnames=("fmax", "pow2_scale", "amax_epsilon"))
def scale_from_amax(amax: jnp.ndarray, fmax: float, *, pow2_scale: bool = False,
                    amax_epsilon: float = 0.0) -> jnp.ndarray:
  """Encode scale of per-tensor current scaling and Float8Block (TE's compute_scale_from_amax).

  `a = max(amax, eps)`; if `a` is 0, inf or NaN the scale is 1; else `fmax / a`, clamped to
  FLT_MAX when that overflows; `pow2_scale` clears the mantissa (rounds down to a power of two).
  """
  a = jnp.maximum(amax.astype(jnp.float32), jnp.float32(amax_epsilon))
  scale = ieee_div(jnp.float32(fmax), a)
  scale = jnp.where(jnp.isinf(scale), jnp.float32(FLT_MAX), scale)
  scale = jnp.where((a == 0) | jnp.isinf(a) | jnp.isnan(a), jnp.float32(1.0), scale)
  if pow2_scale:
    scale = _from_bits(_bits(scale) & jnp.uint32(0xFF800000))
  return scale


@functools.partial(jax.jit, static_argnames="fmax")
def e8m0_from_amax(block_amax: jnp.ndarray, fmax: float) -> jnp.ndarray:
  """MXFP8 biased E8M0 exponent (uint32 in [0, 255]) of a block with amax `block_amax`.

  `s = amax * (1/fmax)`; the exponent field of `s`, plus one when its mantissa is non-zero
  (round up, so the block never saturates), capped at 254; s == 0 -> 0, inf -> 254, NaN -> 255.
  """
  s = block_amax.astype(jnp.float32) * jnp.float32(1.0 / fmax)
  bits = _bits(s)
  exponent = (bits >> 23) & 0xFF
  mantissa = bits & 0x7FFFFF
  e = jnp.minimum(exponent + (mantissa != 0).astype(jnp.uint32), jnp.uint32(254))
  e = jnp.where(s == 0, jnp.uint32(0), e)
  e = jnp.where(jnp.isinf(s), jnp.uint32(254), e)
  return jnp.where(jnp.isnan(s), jnp.uint32(255), e)


@jax.jit
def e8m0_decode_exponent(e: jnp.ndarray) -> jnp.ndarray:
  """2^(e - 127) as float32 (NaN for e == 255)."""
  e = e.astype(jnp.int32)
  return jnp.where(e == 255, jnp.float32(jnp.nan), exp2i(e - 127))


@jax.jit
def nvfp4_global_encode_scale(amax_g: jnp.ndarray) -> jnp.ndarray:
  """S_enc = min(448 * 6 / amax_g, FLT_MAX); 1 when amax_g == 0 or S_enc == 0 (NaN stays NaN)."""
  amax_g = amax_g.astype(jnp.float32)
  s_enc = jnp.minimum(ieee_div(jnp.float32(448.0 * 6.0), amax_g), jnp.float32(FLT_MAX))
  return jnp.where((amax_g == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


@jax.jit
def nvfp4_block_decode_scale(block_amax: jnp.ndarray, s_enc: jnp.ndarray) -> jnp.ndarray:
  """S_dec_b = e4m3_rne_satfinite(amax_b * (S_enc * (1/6))), as E4M3 codes (uint8)."""
  return encode(block_amax.astype(jnp.float32) * (s_enc * jnp.float32(1.0 / 6.0)), E4M3)


@jax.jit
def nvfp4_block_encode_scale(s_dec_b: jnp.ndarray, s_enc: jnp.ndarray) -> jnp.ndarray:
  """S_enc_b = 0 if S_dec_b == 0 else min(1 / (S_dec_b * (1 / S_enc)), FLT_MAX).

  `s_dec_b` is the float32 value of the stored E4M3 scale. A block whose scale rounds to zero
  gets a zero payload, which keeps quantize(dequantize(q)) == q.
  """
  inv = ieee_div(jnp.float32(1.0), s_dec_b * ieee_div(jnp.float32(1.0), s_enc))
  return jnp.where(s_dec_b == 0, jnp.float32(0.0), jnp.minimum(inv, jnp.float32(FLT_MAX)))
