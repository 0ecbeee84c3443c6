"""`ieee_div` (the spec's float32 division) is correctly rounded on every input class, and is
straight-line code (no loop in its compiled form).

Oracle: numpy's float32 division (IEEE-754, round-to-nearest-even on the host CPU). Where a
backend is a GPU (the suite run there), this holds XLA:GPU's compiled division to the host's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.numerics.division import ieee_div


def _random_float_bits(rng, n):
  return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _check(a, b):
  got = np.asarray(jax.jit(ieee_div)(a, b))
  with np.errstate(all="ignore"):
    want = np.asarray(a, np.float32) / np.asarray(b, np.float32)
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


def _edge_values():
  """Subnormals, powers of two, zeros, FLT_MAX, infinities, NaNs, the spec's constants, their
  neighbours one ulp away, and their negatives."""
  tiny, fmax = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  base = [0.0, 2.0**-149, 2.0**-148, 3 * 2.0**-149, tiny - 2.0**-149, tiny / 2, tiny, 1.0, 1.5,
          3.0, 6.0, 448.0, 57344.0, 2688.0, 1.0 / 3.0, 0.1, fmax, np.inf, np.nan]
  base += [2.0**k for k in range(-149, 128, 7)]
  values = np.asarray(base, np.float32)
  finite = values[np.isfinite(values)]
  with np.errstate(all="ignore"):
    neighbours = [np.nextafter(finite, np.float32(np.inf)),
                  np.nextafter(finite, np.float32(0.0))]
  values = np.concatenate([values, *neighbours])
  values = np.concatenate([values, -values, np.uint32([0x7F800001, 0xFFC00000]).view(np.float32)])
  return np.unique(values.view(np.uint32)).view(np.float32)


def test_ieee_div_every_pair_of_edge_values():
  values = _edge_values()
  a, b = np.meshgrid(values, values, indexing="ij")
  _check(a.ravel(), b.ravel())


def test_ieee_div_compiles_to_straight_line_code():
  """No `while` (a GPU while loop launches one kernel per iteration) in the compiled division."""
  x = jnp.ones((4,), jnp.float32)
  text = jax.jit(ieee_div).lower(x, x).compile().as_text()
  assert not re.search(r"\bwhile\(", text), text
