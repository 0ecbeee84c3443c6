"""`ieee_div` (the spec's float32 division) is correctly rounded on every input class.

Oracle: float64 division rounded to float32 (exact: a float64 quotient of float32 operands
carries enough bits that rounding it to float32 equals the correctly rounded float32 quotient).
"""

import jax
import numpy as np

from jaxquant.numerics.division import ieee_div


def _random_float_bits(rng, n):
  return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _check(a, b):
  got = np.asarray(jax.jit(ieee_div)(a, b))
  with np.errstate(all="ignore"):
    want = (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  bad = np.nonzero(~same)[0][:5]
  assert same.all(), [(a[i], b[i], got[i], want[i]) for i in bad]


def test_ieee_div_random_bit_patterns(rng):
  """Any float32 bit patterns: normals, subnormals, zeros, infinities, NaNs."""
  _check(_random_float_bits(rng, 200_000), _random_float_bits(rng, 200_000))


def test_ieee_div_scale_like_operands(rng):
  """The spec's actual uses: fmax / amax, 1 / scale, 2688 / amax over wide magnitudes."""
  amax = (np.abs(rng.standard_normal(100_000)) * 10.0**rng.uniform(-40, 38, 100_000))
  amax = amax.astype(np.float32)
  for numerator in (448.0, 57344.0, 2688.0, 1.0):
    _check(np.full_like(amax, numerator), amax)


def test_ieee_div_subnormal_results_and_ties(rng):
  """Quotients that land in the subnormal range or overflow, where rounding is most delicate."""
  a = (rng.uniform(1, 2, 50_000) * 2.0**rng.integers(-126, -100, 50_000)).astype(np.float32)
  b = (rng.uniform(1, 2, 50_000) * 2.0**rng.integers(0, 40, 50_000)).astype(np.float32)
  _check(a, b)
  _check(b * np.float32(2.0**80), a)  # overflow to inf
  exact = np.float32([6.0, 1.0, 3.0, 2.0**-149]), np.float32([3.0, 4.0, 1.5, 2.0])
  _check(*exact)  # exact quotients and a tie to even at the bottom of the subnormals
