"""The scalar numerics of docs/design.md §5 "Numerics" (`jaxquant.numerics`) against
hand-derived values
and independent numpy / ml_dtypes / float64 oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from jaxquant.numerics import hadamard, minifloat, random_bits, scales

SPECS = {"e4m3": (minifloat.E4M3, oracle.E4M3), "e5m2": (minifloat.E5M2, oracle.E5M2),
         "e2m1": (minifloat.E2M1, oracle.E2M1)}

_encode = jax.jit(minifloat.encode, static_argnums=1)
_encode_stochastic = jax.jit(minifloat.encode_stochastic, static_argnums=2)
_rht16 = jax.jit(hadamard.rht16)
_rht16_inverse = jax.jit(hadamard.rht16_inverse)


def _all_finite_magnitudes(fmt: oracle.Fmt) -> np.ndarray:
  """Every finite non-negative value of the format, ascending (from its codes)."""
  n = 8 if fmt is oracle.E2M1 else 128
  values = oracle.decode_codes(np.arange(n, dtype=np.uint8), fmt)
  return np.unique(values[np.isfinite(values)])


# ------------------------------------------------------------------------------------------------
# minifloat.encode: RNE, saturating, NaN code


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_encode_matches_ml_dtypes_rne_with_saturation(name, rng):
  spec, fmt = SPECS[name]
  # magnitudes over the whole range of the format and beyond fmax (saturation), both signs
  v = rng.standard_normal(4096) * np.exp2(rng.uniform(-14, np.log2(fmt.fmax) + 3, 4096))
  v = v.astype(np.float32)
  got = np.asarray(_encode(jnp.asarray(v), spec))
  want = oracle.cast_codes(v, fmt)
  bad = np.flatnonzero(got != want)
  assert bad.size == 0, f"{name}: v={v[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_encode_rounds_exact_midpoints_to_even(name):
  spec, fmt = SPECS[name]
  grid = _all_finite_magnitudes(fmt)
  mid = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # exact in float32
  got = np.asarray(_encode(jnp.asarray(np.concatenate([mid, -mid])), spec))
  # the even neighbour is the one whose code has a zero last mantissa bit
  lo_codes = oracle.cast_codes(grid[:-1], fmt)
  hi_codes = oracle.cast_codes(grid[1:], fmt)
  even = np.where(lo_codes % 2 == 0, lo_codes, hi_codes)
  want = np.concatenate([even, even | fmt.sign_bit]).astype(np.uint8)
  np.testing.assert_array_equal(got, want)


def test_encode_hand_vectors_e4m3():
  # 448 = 1.75 * 2^8 -> 0 1111 110 = 0x7E; 464 is the midpoint 448|480 -> saturates to 0x7E;
  # 1e30, +inf -> 0x7E; -inf -> 0xFE; NaN -> 0x7F; 2^-9 (min subnormal) -> 0x01;
  # 2^-10 is the midpoint 0|2^-9 -> even -> 0x00; 1.5 * 2^-10 rounds up -> 0x01;
  # 0.3 -> 0.3 / 2^-5 = 9.6 quanta -> 10 -> 1.25 * 2^-2 -> 0 0101 010 = 0x2A; -0.0 -> 0x80.
  v = jnp.array([448, 464, 1e30, np.inf, -np.inf, np.nan, 2**-9, 2**-10, 1.5 * 2**-10, 0.3,
                 -0.0], jnp.float32)
  want = [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x01, 0x00, 0x01, 0x2A, 0x80]
  assert np.asarray(_encode(v, minifloat.E4M3)).tolist() == want


def test_encode_hand_vectors_e5m2():
  # 57344 = 1.75 * 2^15 -> 0 11110 11 = 0x7B; +inf saturates -> 0x7B; NaN -> 0x7F;
  # 2^-16 (min subnormal) -> 0x01; 3.0 = 1.5 * 2 -> 0 10000 10 = 0x42; -1.0 -> 1 01111 00 = 0xBC.
  v = jnp.array([57344, np.inf, np.nan, 2**-16, 3.0, -1.0], jnp.float32)
  assert np.asarray(_encode(v, minifloat.E5M2)).tolist() == [0x7B, 0x7B, 0x7F, 0x01, 0x42, 0xBC]


def test_encode_hand_vectors_e2m1():
  # grid 0, .5, 1, 1.5, 2, 3, 4, 6 = codes 0..7; ties to even code: 0.25 -> 0, 0.75 -> 1.0 (2),
  # 1.25 -> 1.0 (2), 1.75 -> 2.0 (4), 2.5 -> 2.0 (4), 3.5 -> 4.0 (6), 5 -> 4.0 (6);
  # 7, inf -> 6 (7); -6 -> 0xF; NaN -> 0x7 (E2M1 has no NaN: +6).
  v = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, np.inf, -6.0, np.nan], jnp.float32)
  assert np.asarray(_encode(v, minifloat.E2M1)).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 0xF, 0x7]


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_decode_of_every_code_matches_ml_dtypes(name):
  spec, fmt = SPECS[name]
  n = 16 if fmt is oracle.E2M1 else 256
  all_codes = np.arange(n, dtype=np.uint8)
  got = np.asarray(minifloat.decode(minifloat.to_storage(jnp.asarray(all_codes), spec)))
  want = oracle.decode_codes(all_codes, fmt)
  np.testing.assert_array_equal(got.astype(np.float64), want)


# ------------------------------------------------------------------------------------------------
# encode_stochastic


@pytest.mark.parametrize("name", ["e2m1", "e4m3"])
def test_encode_stochastic_with_extreme_draws_gives_ceil_and_floor(name, rng):
  spec, fmt = SPECS[name]
  grid = _all_finite_magnitudes(fmt)
  v = (rng.uniform(0, fmt.fmax, 512) * rng.choice([-1, 1], 512)).astype(np.float32)
  a = np.abs(v).astype(np.float64)
  idx = np.searchsorted(grid, a)  # grid[idx] >= a
  ceil = grid[np.minimum(idx, len(grid) - 1)]
  floor = np.where(grid[np.minimum(idx, len(grid) - 1)] == a, a, grid[np.maximum(idx - 1, 0)])
  sign = np.where(v < 0, fmt.sign_bit, 0)
  up = np.asarray(_encode_stochastic(jnp.asarray(v), jnp.zeros(512), spec))
  down = np.asarray(_encode_stochastic(jnp.asarray(v), jnp.full(512, 1 - 2.0**-24),
                                             spec))
  # u = 0 rounds up whenever |v| is off the grid; u = 1 - 2^-24 rounds down unless |v| is
  # within 2^-24 of a quantum below the next grid point (does not happen for these draws).
  np.testing.assert_array_equal(up, oracle.cast_codes(ceil, fmt) | sign)
  np.testing.assert_array_equal(down, oracle.cast_codes(floor, fmt) | sign)


def test_encode_stochastic_saturates_and_keeps_nan():
  spec = minifloat.E2M1
  v = jnp.array([7.0, -100.0, np.inf, np.nan], jnp.float32)
  got = np.asarray(_encode_stochastic(v, jnp.zeros(4), spec))
  assert got.tolist() == [0x7, 0xF, 0x7, 0x7]


def test_encode_stochastic_is_unbiased(rng):
  """Mean of N draws converges to v: each draw is lo or hi = lo + q with P(hi) = (|v|-lo)/q,
  so its variance is (hi-|v|)(|v|-lo); we require |mean - v| <= 5 standard errors + 2^-24 q
  (the 24-bit draws quantize the probability)."""
  spec, fmt = SPECS["e2m1"]
  n = 4096
  v = rng.uniform(-fmt.fmax, fmt.fmax, 64).astype(np.float32)
  u = rng.integers(0, 2**24, size=(n, 64)).astype(np.float32) * np.float32(2.0**-24)
  draws = oracle.decode_codes(np.asarray(_encode_stochastic(
      jnp.broadcast_to(jnp.asarray(v), (n, 64)), jnp.asarray(u), spec)), fmt)
  grid = _all_finite_magnitudes(fmt)
  a = np.abs(v).astype(np.float64)
  hi = grid[np.searchsorted(grid, a)]
  lo = grid[np.searchsorted(grid, a, side="right") - 1]
  std_err = np.sqrt((hi - a) * (a - lo) / n)
  err = np.abs(draws.mean(axis=0) - v)
  assert np.all(err <= 5 * std_err + 2.0**-24 * (hi - lo)), (v, err, std_err)


# ------------------------------------------------------------------------------------------------
# scales


def test_scale_from_amax_hand_values():
  f = lambda amax, **kw: float(scales.scale_from_amax(jnp.float32(amax), 448.0, **kw))
  assert f(3.0) == float(np.float32(448) / np.float32(3))  # IEEE float32 division
  assert f(7.0) == 64.0
  assert f(0.0) == 1.0 and f(np.inf) == 1.0 and f(np.nan) == 1.0  # degenerate amax -> 1
  assert f(3.0, pow2_scale=True) == 128.0  # 149.33 rounded down to a power of two
  assert f(1e-3, amax_epsilon=0.5) == 896.0  # a = max(amax, eps) = 0.5
  assert f(0.0, amax_epsilon=0.5) == 896.0  # eps also rescues an all-zero tensor
  assert f(1e-37) == float(oracle.FLT_MAX)  # 448 / 1e-37 overflows -> FLT_MAX
  assert f(1e-37, pow2_scale=True) == 2.0**127


def test_e8m0_from_amax_hand_values():
  f = lambda amax, fmax=448.0: int(scales.e8m0_from_amax(jnp.float32(amax), fmax))
  # 448 * fl(1/448) = 1 + 4.5e-8 rounds to exactly 1.0 -> field 127, no mantissa -> 127
  assert f(448.0) == 127
  # 449/448 = 1.002: field 127, mantissa != 0 -> round up to 128 (scale 2^-1)
  assert f(449.0) == 128
  # 1/448 = 1.14 * 2^-9: field 118 + 1 = 119 (x * 2^8 -> 256 <= 448)
  assert f(1.0) == 119
  # E5M2: 1/57344 = 1.14 * 2^-16 -> 111 + 1 = 112
  assert f(1.0, 57344.0) == 112
  # FLT_MAX / 448 = 1.49 * 2^119 -> 246 + 1 = 247 (the largest finite block)
  assert f(oracle.FLT_MAX) == 247
  assert f(0.0) == 0 and f(np.inf) == 254 and f(np.nan) == 255


def test_exp2i_matches_ldexp_including_subnormals():
  k = np.arange(-149, 128)
  got = np.asarray(scales.exp2i(jnp.asarray(k)))
  np.testing.assert_array_equal(got, np.ldexp(np.float32(1), k).astype(np.float32))


def test_nvfp4_scale_functions_hand_values():
  s_enc = jax.jit(scales.nvfp4_global_encode_scale)(jnp.array([6.0, 12.0, 0.0, np.inf, np.nan]))
  # 2688/6 = 448, 2688/12 = 224; amax 0 -> 1; 2688/inf = 0 -> 1; NaN stays NaN
  np.testing.assert_array_equal(np.asarray(s_enc), [448.0, 224.0, 1.0, 1.0, np.nan])
  # amax_b 6 with S_enc 448: 6 * (448 * fl(1/6)) = 448.00002 -> E4M3 448 = 0x7E;
  # amax_b 0.75: 56.000002 -> 56 = 1.75 * 2^5 -> 0 1100 110 = 0x66;
  # amax_b 0.001: 0.0747 -> 0.0747 / 2^-7 = 9.56 quanta -> 10 -> 1.25 * 2^-4 -> 0 0011 010 = 0x1A
  dec = jax.jit(scales.nvfp4_block_decode_scale)(jnp.array([6.0, 0.75, 0.001]),
                                                 jnp.float32(448.0))
  assert np.asarray(dec).tolist() == [0x7E, 0x66, 0x1A]
  # S_enc_b = 1 / (S_dec_b * (1/448)): 448 * fl(1/448) rounds to 1 -> 1; 56 * fl(1/448) -> 1/8
  # -> 8; S_dec_b == 0 -> 0 (zero payload)
  enc = jax.jit(scales.nvfp4_block_encode_scale)(jnp.array([448.0, 56.0, 0.0]),
                                                 jnp.float32(448.0))
  np.testing.assert_array_equal(np.asarray(enc), [1.0, 8.0, 0.0])


# ------------------------------------------------------------------------------------------------
# The random Hadamard transform


def test_rht_matrix_is_signed_sylvester_hadamard_over_four():
  np.testing.assert_array_equal(hadamard.rht_matrix(), oracle.rht_matrix64())
  np.testing.assert_array_equal(hadamard.RHT_SIGNS, oracle.RHT_SIGNS)


def test_rht_matrix_is_orthogonal():
  m = oracle.rht_matrix64()
  np.testing.assert_array_equal(m @ m.T, np.eye(16))  # entries are +-1/4: sums are exact


def test_rht16_matches_float64_matrix_product(rng):
  """rht16 is four float32 butterfly stages (then an exact /4); each stage adds at most 2^-24 of
  the chunk's L1 norm, so |error| <= 4 * 2^-24 * L1 / 4 = 2^-24 * L1; we allow 2^-21 * L1."""
  x = oracle.random_matrix(rng, (8, 64))
  got = np.asarray(_rht16(jnp.asarray(x)), np.float64)
  want = oracle.rht64(x)
  l1 = np.repeat(np.abs(x.astype(np.float64)).reshape(8, 4, 16).sum(-1), 16, axis=1)
  assert np.all(np.abs(got - want) <= 2.0**-21 * l1)


def test_rht16_inverse_undoes_rht16_and_is_the_transpose(rng):
  x = oracle.random_matrix(rng, (4, 32))
  y = _rht16(jnp.asarray(x))
  l1 = np.repeat(np.abs(x.astype(np.float64)).reshape(4, 2, 16).sum(-1), 16, axis=1)
  back = np.asarray(_rht16_inverse(y), np.float64)
  assert np.all(np.abs(back - x) <= 2.0**-20 * l1)
  inv64 = (np.asarray(y, np.float64).reshape(4, 2, 16) @ oracle.rht_matrix64().T).reshape(4, 32)
  assert np.all(np.abs(back - inv64) <= 2.0**-20 * l1)


def test_rht16_preserves_the_euclidean_norm_per_chunk(rng):
  x = oracle.random_matrix(rng, (4, 48), spread=False).astype(np.float64)
  y = np.asarray(_rht16(jnp.asarray(x, jnp.float32)), np.float64)
  np.testing.assert_allclose(np.linalg.norm(y.reshape(4, 3, 16), axis=-1),
                             np.linalg.norm(x.reshape(4, 3, 16), axis=-1), rtol=1e-6)


def test_rht16_rejects_length_not_multiple_of_16():
  with pytest.raises(ValueError, match="last axis has length 20.*multiple of 16"):
    hadamard.rht16(jnp.ones((2, 20)))


# ------------------------------------------------------------------------------------------------
# Counter-based random bits


def test_stochastic_round_bits_follow_the_documented_hash(prng_key):
  words = random_bits.key_words(prng_key)
  k0, k1 = (int(w) for w in np.asarray(words))
  rows, cols, r0, c0 = 5, 7, 3, 11
  got = np.asarray(random_bits.stochastic_round_bits(words, rows, cols, r0, c0))
  want = oracle.sr_uniform(k0, k1, rows, cols, r0, c0)
  np.testing.assert_array_equal(got.astype(np.float64), want)
  assert np.all((got >= 0) & (got < 1))


def test_key_words_are_the_first_two_words_of_the_key_data(prng_key):
  want = np.asarray(jax.random.key_data(prng_key)).reshape(-1)[:2]
  np.testing.assert_array_equal(np.asarray(random_bits.key_words(prng_key)), want)
