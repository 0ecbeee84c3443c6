"""Independent re-derivations of docs/design.md §5 "Numerics", used as test oracles.

Nothing here calls jaxquant's numerics: the element casts come from `ml_dtypes` (RNE; saturation
is obtained by clipping to +-fmax first, and NaN is mapped to the format's NaN code by hand), the
scale arithmetic is numpy float32 (IEEE, round-to-nearest-even, no flush-to-zero), powers of two
come from `np.frexp`/`np.ldexp`, and error bounds are evaluated in float64.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxquant.numerics.minifloat import from_storage

FLT_MAX = np.float32(np.finfo(np.float32).max)
NVFP4_GLOBAL = np.float32(6.0 * 448.0)  # 2688


class Fmt:
  def __init__(self, name, ml_dtype, fmax, mbits, emin, nan_code, sign_bit):
    self.name, self.ml_dtype, self.fmax = name, ml_dtype, fmax
    self.mbits, self.emin, self.nan_code, self.sign_bit = mbits, emin, nan_code, sign_bit

  # Worst-case RNE error of one element, in units of the format's own grid: half a quantum,
  # i.e. 2^-(m+1) relative for normal values and 2^(emin-m-1) absolute in the subnormal range.
  @property
  def rel_half_ulp(self) -> float:
    return 2.0**-(self.mbits + 1)

  @property
  def subnormal_half_quantum(self) -> float:
    return 2.0**(self.emin - self.mbits - 1)


E4M3 = Fmt("e4m3", ml_dtypes.float8_e4m3fn, 448.0, 3, -6, 0x7F, 0x80)
E5M2 = Fmt("e5m2", ml_dtypes.float8_e5m2, 57344.0, 2, -14, 0x7F, 0x80)
E2M1 = Fmt("e2m1", ml_dtypes.float4_e2m1fn, 6.0, 1, 0, 0x7, 0x8)

_BY_DTYPE = {np.dtype(jnp.float8_e4m3fn): E4M3, np.dtype(jnp.float8_e5m2): E5M2,
             np.dtype(jnp.float4_e2m1fn): E2M1}

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fmt_of(dtype) -> Fmt:
  return _BY_DTYPE[np.dtype(dtype)]


def codes(data) -> np.ndarray:
  """uint8 codes of an FP8 / FP4 / E8M0 array (FP4 through jaxquant's `from_storage`)."""
  if np.dtype(data.dtype) == np.dtype(jnp.float4_e2m1fn):
    return np.asarray(from_storage(data))
  return np.asarray(data).view(np.uint8)


def cast_codes(v, fmt: Fmt) -> np.ndarray:
  """RNE saturating cast of float32 values to `fmt` codes; NaN -> the format's NaN code."""
  v = np.asarray(v, np.float32)
  with np.errstate(invalid="ignore"):
    clipped = np.clip(v, -fmt.fmax, fmt.fmax).astype(np.float32)
  out = clipped.astype(fmt.ml_dtype).view(np.uint8)
  return np.where(np.isnan(v), np.uint8(fmt.nan_code), out).astype(np.uint8)


def decode_codes(c, fmt: Fmt) -> np.ndarray:
  """float64 values of `fmt` codes."""
  c = np.asarray(c, np.uint8)
  if fmt is E2M1:
    mag = E2M1_VALUES[c & 0x7]
    return np.where(c & 0x8, -mag, mag)
  return c.view(fmt.ml_dtype).astype(np.float64)


def e8m0_scale(e) -> np.ndarray:
  """float64 value 2^(e - 127) of E8M0 bytes (NaN for 255)."""
  e = np.asarray(e).astype(np.int64)
  return np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))


def f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


def pad(x: np.ndarray, block_rows: int, block_cols: int) -> np.ndarray:
  rows, cols = x.shape
  return np.pad(x, [(0, -rows % block_rows), (0, -cols % block_cols)])


def blocks_amax(x: np.ndarray, block_rows: int, block_cols: int) -> np.ndarray:
  """Max |x| per block of a padded matrix (NaN propagates)."""
  rows, cols = x.shape
  v = np.abs(x).reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
  return np.max(v, axis=(1, 3))


def expand(per_block: np.ndarray, block_rows: int, block_cols: int, shape) -> np.ndarray:
  out = np.repeat(np.repeat(per_block, block_rows, axis=0), block_cols, axis=1)
  return out[:shape[0], :shape[1]]


def scale_from_amax(amax, fmax, pow2_scale=False, amax_epsilon=0.0) -> np.ndarray:
  """float32 encode scale of section 3 (TransformerEngine's compute_scale_from_amax)."""
  with np.errstate(all="ignore"):
    a = np.maximum(f32(amax), np.float32(amax_epsilon))
    scale = np.float32(fmax) / a
    scale = np.where(np.isinf(scale), FLT_MAX, scale)
    scale = np.where((a == 0) | np.isinf(a) | np.isnan(a), np.float32(1.0), scale)
    scale = f32(scale)
    if pow2_scale:
      _, exponent = np.frexp(scale)  # scale = m * 2^exponent, m in [0.5, 1)
      scale = f32(np.ldexp(np.float32(1.0), exponent - 1))
  return scale


def fp8_current(x, fmt: Fmt, pow2_scale=False, amax_epsilon=0.0):
  """(codes, scale_inv, amax) of per-tensor current scaling."""
  x = f32(x)
  amax = np.max(np.abs(x))
  scale = scale_from_amax(amax, fmt.fmax, pow2_scale, amax_epsilon)
  with np.errstate(all="ignore"):
    return cast_codes(x * scale, fmt), np.float32(1.0) / scale, amax


def fp8_block(x, block, fmt: Fmt, pow2_scale=True, amax_epsilon=0.0):
  """(codes, scale_inv [nbr, nbc], amax) of Float8Block."""
  x = f32(x)
  xp = pad(x, *block)
  scale = scale_from_amax(blocks_amax(xp, *block), fmt.fmax, pow2_scale, amax_epsilon)
  with np.errstate(all="ignore"):
    v = x * expand(scale, *block, x.shape)
  return cast_codes(v, fmt), np.float32(1.0) / scale, np.max(np.abs(x))


def e8m0_exponent(block_amax, fmax) -> np.ndarray:
  """MXFP8 biased exponent: exponent field of s = amax * (1/fmax), +1 if s has a mantissa."""
  with np.errstate(all="ignore"):
    s = f32(block_amax) * np.float32(1.0 / fmax)
    mant, exp = np.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
  normal = s >= np.float32(2.0**-126)
  field = np.where(normal, exp + 126, 0)
  has_mantissa = np.where(normal, mant != 0.5, s > 0)
  e = np.minimum(field + has_mantissa, 254)
  e = np.where(s == 0, 0, e)
  e = np.where(np.isinf(s), 254, e)
  return np.where(np.isnan(s), 255, e).astype(np.uint8)


def mxfp8(x, fmt: Fmt):
  """(codes, E8M0 bytes [rows, ceil(cols/32)]) of MXFP8."""
  x = f32(x)
  e = e8m0_exponent(blocks_amax(pad(x, 1, 32), 1, 32), fmt.fmax)
  e_full = expand(e, 1, 32, x.shape).astype(np.int64)
  with np.errstate(all="ignore"):
    v = f32(np.ldexp(x.astype(np.float64), 127 - np.minimum(e_full, 254)))
  c = cast_codes(v, fmt)
  return np.where(e_full == 255, np.uint8(fmt.nan_code), c).astype(np.uint8), e


def nvfp4_global_scale(amax) -> np.ndarray:
  with np.errstate(all="ignore"):
    s_enc = np.minimum(NVFP4_GLOBAL / f32(amax), FLT_MAX)
  return f32(np.where((f32(amax) == 0) | (s_enc == 0), np.float32(1.0), s_enc))


def nvfp4(x, block_2d=False, row_scaled=False):
  """(codes, E4M3 scale codes, amax, encode scale per element) of NVFP4 with RNE."""
  x = f32(x)
  block = (16, 16) if block_2d else (1, 16)
  xp = pad(x, *block)
  if row_scaled:
    amax = np.max(np.abs(x), axis=1)
    s_enc = nvfp4_global_scale(amax)[:, None]
  else:
    amax = np.max(np.abs(x))
    s_enc = nvfp4_global_scale(amax)
  with np.errstate(all="ignore"):
    t = blocks_amax(xp, *block) * (s_enc * np.float32(1.0 / 6.0))
    scale_codes = cast_codes(t, E4M3)
    s_dec = f32(decode_codes(scale_codes, E4M3))
    inv = np.minimum(np.float32(1.0) / (s_dec * (np.float32(1.0) / s_enc)), FLT_MAX)
    s_enc_b = f32(np.where(s_dec == 0, np.float32(0.0), inv))
    per_element = expand(s_enc_b, *block, x.shape)
    data = cast_codes(x * per_element, E2M1)
  return data, scale_codes, amax, per_element


def rne_error_bound(x, unit, fmt: Fmt) -> np.ndarray:
  """Largest |dequantize(quantize(x)) - x| allowed for an element quantized with decode scale
  `unit` (float64): half a quantum of the format at v = |x| / unit (2^-(m+1) |v| for normal v,
  2^(emin-m-1) in the subnormal range), plus the saturation error max(|v| - fmax, 0), times
  `unit`; plus 2^-20 relative slack for the few float32 roundings in x * scale and q * scale_inv.
  """
  x = np.abs(np.asarray(x, np.float64))
  unit = np.asarray(unit, np.float64)
  v = x / unit
  half_q = np.maximum(fmt.rel_half_ulp * v, fmt.subnormal_half_quantum)
  return (half_q + np.maximum(v - fmt.fmax, 0.0)) * unit * (1 + 2.0**-20) + 2.0**-20 * x


def hadamard16() -> np.ndarray:
  """Sylvester Hadamard matrix of order 16 from its closed form H[i, j] = (-1)^popcount(i & j)."""
  i = np.arange(16)
  parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
  return np.where(parity == 1, -1.0, 1.0)


RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def rht_matrix64() -> np.ndarray:
  """diag(signs) @ H16 / 4 in float64 (docs/design.md §5 "Numerics")."""
  return np.diag(RHT_SIGNS) @ hadamard16() / 4.0


def rht64(x) -> np.ndarray:
  """Apply the RHT along the last axis in float64."""
  x = np.asarray(x, np.float64)
  *lead, n = x.shape
  return (x.reshape(*lead, n // 16, 16) @ rht_matrix64()).reshape(*lead, n)


def random_matrix(rng, shape, dtype=np.float32, spread=True) -> np.ndarray:
  """Gaussian values, optionally with a log-uniform magnitude spread over ~2^-8..2^8 so that
  many binades (and both normal and subnormal FP8 ranges after scaling) are exercised."""
  x = rng.standard_normal(shape)
  if spread:
    x = x * np.exp2(rng.uniform(-8, 8, size=shape))
  return np.array(jnp.asarray(x, dtype))  # a writable copy


def lowbias32(x) -> np.ndarray:
  """The "lowbias32" integer hash of jaxquant.numerics.random_bits' docstring, in numpy."""
  x = np.asarray(x).astype(np.uint64) & 0xFFFFFFFF
  x ^= x >> 16
  x = (x * 0x7FEB352D) & 0xFFFFFFFF
  x ^= x >> 15
  x = (x * 0x846CA68B) & 0xFFFFFFFF
  return x ^ (x >> 16)


def sr_uniform(k0: int, k1: int, rows: int, cols: int, row_offset=0, col_offset=0):
  """The documented counter-based draws u[row, col] in [0, 1) (float64, exact)."""
  r = (np.arange(rows, dtype=np.uint64) + row_offset)[:, None]
  c = (np.arange(cols, dtype=np.uint64) + col_offset)[None, :]
  h = lowbias32((r * 0x9E3779B9 + k0) & 0xFFFFFFFF)
  h = lowbias32(h ^ ((c * 0x85EBCA6B + k1) & 0xFFFFFFFF))
  return (h >> 8).astype(np.float64) * 2.0**-24


def e2m1_neighbours(a) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi): the E2M1 grid values at or below and at or above |a| <= 6 (float64)."""
  a = np.abs(np.asarray(a, np.float64))
  lo = E2M1_VALUES[np.searchsorted(E2M1_VALUES, a, side="right") - 1]
  hi = E2M1_VALUES[np.minimum(np.searchsorted(E2M1_VALUES, a, side="left"), 7)]
  return lo, hi
