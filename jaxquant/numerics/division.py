"""IEEE-754 float32 division, correctly rounded on every backend, as straight-line code.

XLA:GPU lowers float32 `a / b` to `div.full.f32` (up to 2 ulp off) and `1 / b` to
`rcp.approx.f32`, so `/` in the reference would give different scales on CPU and GPU. The
spec's divisions (scale = fmax / amax, scale_inv = 1 / scale, NVFP4's S_enc and S_enc_b, the
delayed-scaling scale) go through `ieee_div` instead. It divides the 24-bit integer mantissas
with unsigned 32-bit integer division, which is exact on every backend: one bit from the
mantissa comparison, then three 8-bit quotient digits (the remainder stays below the divisor,
so `remainder << 8` fits in 32 bits), and the last remainder gives the sticky bit; then
round-half-even, subnormal results and IEEE special cases. Only integer ops, selects and
bitcasts: no float arithmetic that a compiler could contract or approximate, and no loop (a
loop on scalars runs as a GPU while loop, one kernel launch per iteration). Kernels use IEEE
division (`__fdiv_rn` on the device, `/` on the host), which equals this bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_DIGIT_BITS = 8  # remainder < divisor < 2^24, so remainder << 8 fits in uint32
_DIGITS = 3  # 1 + 3 * 8 = 25 quotient bits: 24 mantissa bits and one guard bit


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


@jax.jit
def ieee_div(a, b) -> jnp.ndarray:
  """`a / b` in float32, rounded to nearest even, with IEEE special values.

  Jitted so that a trace records it as one call traced once per operand shape: the ~110
  operations took ~40 ms to trace at every call site (a layer's step has dozens)."""
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
  exponent = jnp.where(smaller, exponent - 1, exponent)
  # Zero, inf and NaN divisors have no mantissa; give them a harmless one (overridden below).
  b_mant = jnp.where(b_mant == 0, jnp.uint32(0x800000), b_mant)
  # a' = a_mant (or 2 a_mant) lies in [b_mant, 2 b_mant): the leading quotient bit is 1.
  remainder = jnp.where(smaller, a_mant << 1, a_mant) - b_mant
  quotient = jnp.ones_like(remainder)
  for _ in range(_DIGITS):
    shifted = remainder << _DIGIT_BITS
    quotient = (quotient << _DIGIT_BITS) | lax.div(shifted, b_mant)
    remainder = lax.rem(shifted, b_mant)
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
