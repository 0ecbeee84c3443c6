"""Float32 products and square roots that round the same way on every backend and in the kernels.

The fused producers (normalization and activation kernels that write quantized copies,
`ffi/fused`) must equal a pure-JAX composition bit for bit, so this module pins down the two
things XLA does not:

* **Products that feed an addition.** XLA:CPU (at its default optimization level) and LLVM on
  GPUs may contract `a * b + c` into one fused multiply-add, which rounds once instead of twice,
  and whether they do depends on the fusion and the flags. `mul_rn(a, b)` returns the product
  plus a zero that only exists at run time (`runtime_zero`): a compiler may fuse the multiply
  with *that* addition (rounding `a*b + 0` once is rounding `a*b`), never with the next one.
  A literal `+ 0.0` would not do: XLA folds it away. The value equals `a * b` except that a
  product of -0 becomes +0; the kernels compute `a * b + 0.0f` (compiled without contraction),
  which is the same value for every input.
* **Square roots.** `ieee_sqrt` is the correctly rounded float32 square root built from integer
  operations (no float arithmetic a backend could approximate), as `division.ieee_div` is for
  division; the kernels use the IEEE instructions (`__fsqrt_rn` on the device, the same integer
  routine on the host).

Additions, subtractions and products that do not feed an addition need nothing: IEEE-754
rounds them identically everywhere, and XLA never reassociates float arithmetic.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def runtime_zero(v: jnp.ndarray) -> jnp.ndarray:
  """+0 for every finite or infinite `v`, NaN for NaN: `min(|v|, 1) * 0`, which no compiler may
  fold to a constant (the NaN case keeps it a run-time value)."""
  return jnp.minimum(jnp.abs(v), jnp.float32(1.0)) * jnp.float32(0.0)


def mul_rn(a, b) -> jnp.ndarray:
  """`a * b` rounded to float32 on its own, whatever the consumer (an addition included); a
  product of -0 gives +0. The kernels' `jq::mul_rn`."""
  p = jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32)
  return p + runtime_zero(p)


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.uint32)


def ieee_sqrt(x) -> jnp.ndarray:
  """Correctly rounded float32 square root (IEEE-754; subnormals included), integer ops only.

  The significand `m` (24 bits, subnormals normalized) and the unbiased exponent `E` are made
  even-exponent (`m` doubled when `E` is odd); then 25 steps of the digit-by-digit square root
  of `m * 2^25` (two radicand bits a step; the remainder stays below 2^28) give 24 significand
  bits and a guard bit, the final remainder the sticky bit. Round half to even (a square root
  is never exactly halfway, so this is round to nearest). sqrt(-0) = -0, sqrt(+inf) = +inf,
  NaN and negative inputs give NaN. `jq::sqrt_f32` mirrors it on the host.
  """
  x = jnp.asarray(x, jnp.float32)
  bits = _bits(x)
  magnitude = bits & 0x7FFFFFFF
  exponent = ((magnitude >> 23) & 0xFF).astype(jnp.int32)
  fraction = magnitude & 0x7FFFFF
  shift = jnp.maximum(lax.clz(fraction).astype(jnp.int32) - 8, 0)  # subnormals only
  subnormal = exponent == 0
  mantissa = jnp.where(subnormal, fraction << shift.astype(jnp.uint32), fraction | 0x800000)
  unbiased = jnp.where(subnormal, 1 - shift, exponent) - 127
  odd = (unbiased & 1) == 1
  mantissa = jnp.where(odd, mantissa << 1, mantissa)  # [2^23, 2^25)
  half_exponent = (unbiased - odd.astype(jnp.int32)) >> 1
  root = jnp.zeros_like(mantissa)
  remainder = jnp.zeros_like(mantissa)
  for step in range(24, -1, -1):  # radicand m * 2^25: bit pairs (2 step + 1, 2 step)
    offset = 2 * step - 25
    pair = (mantissa >> offset) & 3 if offset >= 0 else (mantissa << -offset) & 3
    remainder = (remainder << 2) | pair
    trial = (root << 2) | 1
    take = remainder >= trial
    remainder = jnp.where(take, remainder - trial, remainder)
    root = (root << 1) | take.astype(jnp.uint32)
  guard = root & 1
  kept = root >> 1  # 24 bits, leading one at bit 23
  round_up = (guard == 1) & ((remainder != 0) | ((kept & 1) == 1))
  kept = kept + round_up.astype(jnp.uint32)
  # The leading one adds 1 to the exponent field; a carry to 2^24 adds one more.
  result = ((half_exponent + 126).astype(jnp.uint32) << 23) + kept
  out = lax.bitcast_convert_type(result, jnp.float32)
  inf = jnp.uint32(0x7F800000)
  out = jnp.where(magnitude == inf, x, out)
  out = jnp.where(magnitude == 0, x, out)  # +-0
  negative = ((bits >> 31) == 1) & (magnitude != 0)
  return jnp.where((magnitude > inf) | negative, jnp.float32(jnp.nan), out)
