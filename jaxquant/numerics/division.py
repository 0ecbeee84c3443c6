"""IEEE-754 float32 division, correctly rounded on every backend.

XLA:GPU lowers float32 `a / b` to `div.full.f32` (up to 2 ulp off) and `1 / b` to
`rcp.approx.f32`, so `/` in the reference would give different scales on CPU and GPU. The
spec's divisions (scale = fmax / amax, scale_inv = 1 / scale, NVFP4's S_enc and S_enc_b, the
delayed-scaling scale) go through `ieee_div` instead: long division on the integer mantissas,
round-half-even with a sticky bit, subnormal results and IEEE special cases. It touches only
per-tensor or per-block scalars, so its cost is negligible. Kernels use IEEE division
(`__fdiv_rn` on the device, `/` on the host), which equals this bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_QUOTIENT_BITS = 25  # 24 mantissa bits and one guard bit; the remainder gives the sticky bit


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.uint32)


def _normalize(bits):
  """(mantissa in [2^23, 2^24), unbiased-exponent + 127) of a finite non-zero |float|."""
  exponent = ((bits >> 23) & 0xFF).astype(jnp.int32)
  fraction = bits & 0x7FFFFF
  shift = jnp.maximum(lax.clz(fraction).astype(jnp.int32) - 8, 0)  # subnormals only
  subnormal = exponent == 0
  mantissa = jnp.where(subnormal, fraction << shift.astype(jnp.uint32), fraction | 0x800000)
  exponent = jnp.where(subnormal, 1 - shift, exponent)
  return mantissa, exponent


def ieee_div(a, b) -> jnp.ndarray:
  """`a / b` in float32, rounded to nearest even, with IEEE special values."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  a, b = jnp.broadcast_arrays(a, b)
  a_bits, b_bits = _bits(a), _bits(b)
  sign = (a_bits ^ b_bits) & jnp.uint32(0x80000000)
  a_abs, b_abs = a_bits & 0x7FFFFFFF, b_bits & 0x7FFFFFFF
  a_mant, a_exp = _normalize(a_abs)
  b_mant, b_exp = _normalize(b_abs)
  exponent = a_exp - b_exp + 127
  smaller = a_mant < b_mant
  remainder = jnp.where(smaller, a_mant << 1, a_mant)
  exponent = jnp.where(smaller, exponent - 1, exponent)

  def step(_, carry):  # one quotient bit; remainder < 2 * b_mant < 2^25 throughout
    quotient, remainder = carry
    take = remainder >= b_mant
    return ((quotient << 1) | take.astype(jnp.uint32),
            jnp.where(take, remainder - b_mant, remainder) << 1)

  # A loop rather than 25 unrolled steps: these are per-block scalars, and the unrolled form
  # doubled the compile time of every quantize.
  quotient, remainder = lax.fori_loop(0, _QUOTIENT_BITS, step,
                                      (jnp.zeros_like(remainder), remainder))
  sticky = remainder != 0
  # quotient has 25 bits (leading one at bit 24). Drop `drop` low bits with RNE: one guard bit
  # for a normal result, more when the result is subnormal.
  drop = jnp.clip(2 - exponent, 1, 31).astype(jnp.uint32)
  kept = quotient >> drop
  dropped = quotient & ((jnp.uint32(1) << drop) - 1)
  half = jnp.uint32(1) << (drop - 1)
  round_up = (dropped > half) | ((dropped == half) & (sticky | ((kept & 1) == 1)))
  kept = kept + round_up.astype(jnp.uint32)
  normal = exponent >= 1
  # A normal mantissa that rounds up to 2^24 carries into the exponent; adding the fields does it.
  normal_bits = ((jnp.maximum(exponent, 1).astype(jnp.uint32) - 1) << 23) + kept
  magnitude = jnp.where(normal, normal_bits, kept)  # subnormal: exponent field 0 (or carry to 1)
  overflow = normal & ((exponent >= 255) | (normal_bits >= 0x7F800000))
  magnitude = jnp.where(overflow, jnp.uint32(0x7F800000), magnitude)
  # Special cases: NaN, inf and zero operands.
  inf = jnp.uint32(0x7F800000)
  a_nan, b_nan = a_abs > inf, b_abs > inf
  a_inf, b_inf = a_abs == inf, b_abs == inf
  a_zero, b_zero = a_abs == 0, b_abs == 0
  magnitude = jnp.where(a_zero | b_inf, jnp.uint32(0), magnitude)
  magnitude = jnp.where(a_inf | b_zero, inf, magnitude)
  result = lax.bitcast_convert_type(sign | magnitude, jnp.float32)
  is_nan = a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf)
  return jnp.where(is_nan, jnp.float32(jnp.nan), result)
