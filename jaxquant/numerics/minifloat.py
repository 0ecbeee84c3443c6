"""Round-to-nearest-even, saturating conversion of float32 to E4M3 / E5M2 / E2M1 codes.

`encode(v, spec)` returns the format's bit pattern (uint8) for float32 `v`:
  1. `a = |v|`; the quantum is `2^(max(exp(a), emin) - mbits)`;
  1b. `a` is first clamped to 2*fmax (saturation makes the exact value irrelevant above fmax);
  2. `a / quantum` is rounded half-to-even (exact: scaling by a power of two);
  3. the rounded magnitude is clamped to `fmax` (saturation; +-inf saturate too);
  4. the code is read off the rounded value; the sign bit is copied from `v`;
  5. NaN maps to `spec.nan_code` (E4M3/E5M2: 0x7F; E2M1 has no NaN: +6, code 0x7).
The same steps are written in C++ in `ffi/jaxquant_numerics.h`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class MinifloatSpec:
  name: str
  mbits: int  # mantissa bits
  emin: int  # smallest normal unbiased exponent
  bias: int
  fmax: float  # largest finite value
  nan_code: int
  dtype: np.dtype  # the JAX storage dtype

  @property
  def sign_bit(self) -> int:
    return 0x8 if self.name == "e2m1" else 0x80


E4M3 = MinifloatSpec("e4m3", 3, -6, 7, 448.0, 0x7F, np.dtype(jnp.float8_e4m3fn))
E5M2 = MinifloatSpec("e5m2", 2, -14, 15, 57344.0, 0x7F, np.dtype(jnp.float8_e5m2))
E2M1 = MinifloatSpec("e2m1", 1, 0, 1, 6.0, 0x7, np.dtype(jnp.float4_e2m1fn))

_BY_DTYPE = {s.dtype: s for s in (E4M3, E5M2, E2M1)}


def spec_for_dtype(dtype) -> MinifloatSpec:
  return _BY_DTYPE[np.dtype(dtype)]


def _bits(x: jnp.ndarray) -> jnp.ndarray:
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _pow2(k: jnp.ndarray) -> jnp.ndarray:
  """2^k as float32 for integer k in [-126, 127] (normal range only)."""
  return lax.bitcast_convert_type(((k + 127).astype(jnp.uint32) << 23), jnp.float32)


def round_to_grid(v: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """|v| rounded half-to-even onto the format's grid and clamped to fmax (float32, >= 0)."""
  # Anything above fmax saturates; clamping first keeps the scaling below finite (inf included).
  a = jnp.minimum(jnp.abs(v.astype(jnp.float32)), jnp.float32(2.0 * spec.fmax))
  exponent = ((_bits(a) >> 23) & 0xFF).astype(jnp.int32) - 127
  quantum_exp = jnp.maximum(exponent, spec.emin) - spec.mbits
  # Scaling by 2^-quantum_exp is exact (both factors normal; the product stays in range).
  steps = jnp.round(a * _pow2(-quantum_exp))  # jnp.round is half-to-even
  rounded = steps * _pow2(quantum_exp)
  return jnp.minimum(rounded, jnp.float32(spec.fmax))


def _code_from_magnitude(v: jnp.ndarray, mag: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """Code of the on-grid magnitude `mag` (float32, <= fmax) with the sign of `v`; NaN handled."""
  mag_bits = _bits(mag)
  mag_exp = ((mag_bits >> 23) & 0xFF).astype(jnp.int32) - 127
  normal_code = (((mag_exp + spec.bias).astype(jnp.uint32) << spec.mbits)
                 | ((mag_bits >> (23 - spec.mbits)) & ((1 << spec.mbits) - 1)))
  # Subnormal (and zero) codes count quanta of 2^(emin - mbits); exact integer in float32.
  subnormal_code = (mag * _pow2(jnp.int32(spec.mbits - spec.emin))).astype(jnp.uint32)
  code = jnp.where(mag < jnp.float32(2.0**spec.emin), subnormal_code, normal_code)
  code = code | jnp.where((_bits(v) >> 31) == 1, jnp.uint32(spec.sign_bit), jnp.uint32(0))
  code = jnp.where(jnp.isnan(v), jnp.uint32(spec.nan_code), code)
  return code.astype(jnp.uint8)


# The conversions are jitted (the spec static): a trace records each as one call, traced once per
# operand shape and spec, not its ~30 operations at every call site (see numerics/division.py).
@functools.partial(jax.jit, static_argnames="spec")
def encode(v: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """float32 -> format code (uint8), RNE with saturation; NaN -> `spec.nan_code`."""
  v = v.astype(jnp.float32)
  return _code_from_magnitude(v, round_to_grid(v, spec), spec)


@functools.partial(jax.jit, static_argnames="spec")
def encode_stochastic(v: jnp.ndarray, u: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """float32 -> code with stochastic rounding, saturating; `u` uniform in [0, 1).

  With `lo` the grid value at or below |v| (|v| first clamped to fmax) and `q` the grid step
  there, the magnitude rounds up to `lo + q` when `u < (|v| - lo) / q` (exact in float32), so
  E[decode(code)] = v for |v| <= fmax.
  """
  v = v.astype(jnp.float32)
  a = jnp.minimum(jnp.abs(v), jnp.float32(spec.fmax))
  exponent = ((_bits(a) >> 23) & 0xFF).astype(jnp.int32) - 127
  quantum_exp = jnp.maximum(exponent, spec.emin) - spec.mbits
  quantum = _pow2(quantum_exp)
  lo = jnp.floor(a * _pow2(-quantum_exp)) * quantum
  frac = (a - lo) * _pow2(-quantum_exp)
  mag = jnp.where(u.astype(jnp.float32) < frac, lo + quantum, lo)
  return _code_from_magnitude(v, mag, spec)


def to_storage(code: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """Reinterpret uint8 codes as the format's JAX dtype (E2M1 via a 4-bit integer)."""
  if spec is E2M1:
    return lax.bitcast_convert_type(code.astype(jnp.uint4), spec.dtype)
  return lax.bitcast_convert_type(code, spec.dtype)


def from_storage(data: jnp.ndarray) -> jnp.ndarray:
  """The uint8 codes of an FP8/FP4 array."""
  if data.dtype == jnp.float4_e2m1fn:
    return lax.bitcast_convert_type(data, jnp.uint4).astype(jnp.uint8)
  return lax.bitcast_convert_type(data, jnp.uint8)


def cast_sat(v: jnp.ndarray, spec: MinifloatSpec) -> jnp.ndarray:
  """RNE saturating cast of float32 `v` to the format's JAX dtype."""
  return to_storage(encode(v, spec), spec)


def decode(data: jnp.ndarray) -> jnp.ndarray:
  """Exact float32 values of an FP8/FP4 array (every code is representable in float32)."""
  return data.astype(jnp.float32)
