"""MXFP8 (`MXFP8Quantizer`): 1x32 blocks along the contraction axis with E8M0 scales whose
exponent rounds amax/fmax up (docs/design.md §5 "Numerics")."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import data_codes, dequantize, quantize, rowwise, scale_bytes

pytestmark = pytest.mark.usefixtures("core_backend")

MX_E4M3 = jq.MXFP8Quantizer()
MX_E5M2 = jq.MXFP8Quantizer(jnp.float8_e5m2)


def test_e4m3_hand_bytes_including_exponent_round_up():
  # block 0, amax 3: s = 3 * fl(1/448) = 1.71 * 2^-8 -> field 119, mantissa != 0 -> e = 120
  #   (scale 2^7): 3 -> 384 = 1.5 * 2^8 -> 0x7C; 1 -> 128 -> 0x70; -1.5 -> -192 -> 0xF4;
  #   0.5 -> 64 -> 0x68; 0.1 -> 12.8 -> 13 = 1.625 * 2^3 -> 0x55
  # block 1, amax 449: s = 449/448 = 1.002 -> field 127 + round-up -> e = 128 (scale 2^-1):
  #   449 -> 224.5: quantum 16 -> 14.03 -> 14 -> 224 = 1.75 * 2^7 -> 0x76; 1 -> 0.5 -> 0x30
  # block 2, amax 448: s = 448 * fl(1/448) rounds to exactly 1.0 -> e = 127 (scale 1):
  #   448 -> 0x7E; -0.25 -> 1 0101 000 = 0xA8
  # row 1 is all zeros: s = 0 -> e = 0, zero payload
  x = np.zeros((2, 96), np.float32)
  x[0, :5] = [3.0, 1.0, -1.5, 0.5, 0.1]
  x[0, 32:34] = [449.0, 1.0]
  x[0, 64:66] = [448.0, -0.25]
  t = rowwise(x, MX_E4M3)
  want = np.zeros((2, 96), np.uint8)
  want[0, :5] = [0x7C, 0x70, 0xF4, 0x68, 0x55]
  want[0, 32:34] = [0x76, 0x30]
  want[0, 64:66] = [0x7E, 0xA8]
  np.testing.assert_array_equal(data_codes(t), want)
  assert t.scale_inv.dtype == jnp.float8_e8m0fnu and t.scale_inv.shape == (2, 3)
  assert scale_bytes(t).tolist() == [[120, 128, 127], [0, 0, 0]]
  # decode x' = q * 2^(e - 127)
  got = np.asarray(dequantize(t))
  assert got[0, :5].tolist() == [3.0, 1.0, -1.5, 0.5, 0.1015625]
  assert got[0, 32:34].tolist() == [448.0, 1.0] and got[0, 64:66].tolist() == [448.0, -0.25]


def test_e5m2_hand_bytes():
  # amax 1: s = fl(1/57344) = 1.14 * 2^-16 -> field 111 + 1 = 112 (scale 2^15):
  # 1 -> 32768 = 2^15 -> 0 11110 00 = 0x78; 0.3 -> 9830.4: quantum 2048 -> 4.8 -> 5 ->
  # 10240 = 1.25 * 2^13 -> 0 11100 01 = 0x71; -1 -> 0xF8
  x = np.zeros((1, 32), np.float32)
  x[0, :3] = [1.0, 0.3, -1.0]
  t = rowwise(x, MX_E5M2)
  assert data_codes(t)[0, :3].tolist() == [0x78, 0x71, 0xF8]
  assert scale_bytes(t).tolist() == [[112]]


SHAPES_DTYPES = [((17, 33), jnp.float32), ((4, 100), jnp.bfloat16), ((32, 64), jnp.float16)]


@pytest.mark.parametrize("shape,in_dtype", SHAPES_DTYPES)
@pytest.mark.parametrize("q", [MX_E4M3, MX_E5M2], ids=["e4m3", "e5m2"])
def test_matches_independent_oracle_bitwise_both_directions(rng, q, shape, in_dtype):
  fmt = oracle.fmt_of(q.dtype)
  x = oracle.random_matrix(rng, shape, in_dtype)
  qt = quantize(jnp.asarray(x), q)
  for t, mat in ((qt.rowwise, x), (qt.columnwise, x.T)):
    want_codes, want_e = oracle.mxfp8(mat, fmt)
    np.testing.assert_array_equal(data_codes(t), want_codes)
    np.testing.assert_array_equal(scale_bytes(t), want_e)
    assert t.scale_inv.shape == (mat.shape[0], -(-mat.shape[1] // 32))
    assert float(t.amax) == float(np.max(np.abs(oracle.f32(x))))


@pytest.mark.parametrize("shape,in_dtype", SHAPES_DTYPES)
@pytest.mark.parametrize("q", [MX_E4M3, MX_E5M2], ids=["e4m3", "e5m2"])
def test_dequantization_error_within_half_ulp_of_block_scale(rng, q, shape, in_dtype):
  """Per element: |x' - x| <= max(2^-(m+1) |x|, 2^(emin-m-1) * 2^(e-127)) (+ float32 slack),
  with 2^(e-127) the block's decode scale: the block never saturates, so RNE's half-ulp bound
  holds in the normal range and half the smallest subnormal below it."""
  fmt = oracle.fmt_of(q.dtype)
  x = oracle.random_matrix(rng, shape, in_dtype)
  t = quantize(jnp.asarray(x), q).rowwise  # (the oracle test's compiled program)
  unit = oracle.expand(oracle.e8m0_scale(scale_bytes(t)), 1, 32, shape)
  err = np.abs(np.asarray(dequantize(t), np.float64) - x.astype(np.float64))
  assert np.all(err <= oracle.rne_error_bound(x, unit, fmt))


@pytest.mark.parametrize("q", [MX_E4M3, MX_E5M2], ids=["e4m3", "e5m2"])
def test_finite_blocks_never_saturate_and_use_the_top_binade(rng, q):
  """v = x * 2^(127-e) satisfies max|v| <= fmax per finite block (up to the 2^-24 rounding of
  s = amax * fl(1/fmax); far below fmax + half a quantum, where RNE would clip), and
  max|v| > fmax/2 (rounding the exponent up wastes at most one binade, never more)."""
  fmt = oracle.fmt_of(q.dtype)
  x = oracle.random_matrix(rng, (16, 96))
  t = rowwise(x, q)
  v = x.astype(np.float64) / oracle.expand(oracle.e8m0_scale(scale_bytes(t)), 1, 32, x.shape)
  block_max = np.abs(v).reshape(16, 3, 32).max(-1)
  assert np.all(block_max <= fmt.fmax * (1 + 2.0**-22)), block_max.max()
  assert np.all(block_max > fmt.fmax / 2), block_max.min()


def _requantize(t):
  return rowwise(dequantize(t), t.quantizer)


@pytest.mark.parametrize("q", [MX_E4M3, MX_E5M2], ids=["e4m3", "e5m2"])
def test_requantizing_dequantized_values_is_bitwise_identity_for_blocks_above_half_fmax(rng, q):
  """quantize(dequantize(q)) == q (data and E8M0 scales) for every block whose largest code
  exceeds fmax/2. (A block whose values all round to <= fmax/2 is the exception: see the next
  test.)"""
  fmt = oracle.fmt_of(q.dtype)
  x = oracle.random_matrix(rng, (32, 64))
  t = rowwise(x, q)
  again = _requantize(t)
  codes, codes2 = data_codes(t), data_codes(again)
  block_max = np.abs(oracle.decode_codes(codes, fmt)).reshape(32, 2, 32).max(-1)
  keep = block_max > fmt.fmax / 2
  assert keep.mean() > 0.5  # the exception is rare (~5% of blocks)
  np.testing.assert_array_equal(scale_bytes(again)[keep], scale_bytes(t)[keep])
  np.testing.assert_array_equal(codes2.reshape(32, 2, 32)[keep], codes.reshape(32, 2, 32)[keep])
  np.testing.assert_array_equal(np.asarray(dequantize(again)), np.asarray(dequantize(t)))


def test_requantizing_a_block_whose_max_rounded_down_to_half_fmax_lowers_its_exponent():
  # amax 225 -> s = 225/448 -> field 126 + round-up -> e = 127; 225 rounds (quantum 16) to 224.
  # Dequantized, the block's amax is 224 = 448/2: s' = 0.5 exactly -> e' = 126, and every code
  # doubles (224 -> 448 = 0x7E, 1 -> 2 = 0x40). The decoded values are identical: this is
  # inherent to section 3's round-up rule, not a rounding error.
  x = np.zeros((1, 32), np.float32)
  x[0, :2] = [225.0, 1.0]
  t = rowwise(x, MX_E4M3)
  assert scale_bytes(t).tolist() == [[127]] and data_codes(t)[0, :2].tolist() == [0x76, 0x38]
  again = _requantize(t)
  assert scale_bytes(again).tolist() == [[126]] and data_codes(again)[0, :2].tolist() == [0x7E,
                                                                                            0x40]
  np.testing.assert_array_equal(np.asarray(dequantize(again)), np.asarray(dequantize(t)))


def test_columnwise_blocks_run_along_the_rows_of_x(rng):
  x = oracle.random_matrix(rng, (64, 40))
  qt = quantize(jnp.asarray(x), MX_E4M3)
  ref = rowwise(x.T.copy(), MX_E4M3)
  np.testing.assert_array_equal(data_codes(qt.columnwise), data_codes(ref))
  np.testing.assert_array_equal(scale_bytes(qt.columnwise), scale_bytes(ref))


# ------------------------------------------------------------------------------------------------
# Special values and shapes


def test_cols_not_multiple_of_32_are_padded_with_zeros(rng):
  x = oracle.random_matrix(rng, (17, 33))
  padded = np.zeros((17, 64), np.float32)
  padded[:, :33] = x
  t, ref = rowwise(x, MX_E4M3), rowwise(padded, MX_E4M3)
  assert t.shape == (17, 33) and t.scale_inv.shape == (17, 2)
  np.testing.assert_array_equal(data_codes(t), data_codes(ref)[:, :33])
  np.testing.assert_array_equal(scale_bytes(t), scale_bytes(ref))


def test_zeros_and_subnormals_give_zero_payload(rng):
  # row 0: zeros -> e = 0; row 1: subnormals beside a normal block amax -> signed zeros
  x = np.zeros((2, 32), np.float32)
  x[1, :4] = [1.0, 1e-40, -1e-40, -0.0]
  t = rowwise(x, MX_E4M3)
  assert scale_bytes(t)[0, 0] == 0 and np.all(data_codes(t)[0] == 0)
  assert data_codes(t)[1, :4].tolist() == [0x78, 0x00, 0x80, 0x80]  # 1 * 2^8 = 256 -> 0x78
  assert np.all(np.asarray(dequantize(t))[0] == 0)


def test_all_subnormal_block_dequantizes_within_flt_min():
  # IEEE: s = 1e-40 / 448 is subnormal -> e = 1; XLA:CPU flushes it to 0 -> e = 0. Either way
  # the decoded values are within 2^-126 of the inputs.
  x = np.zeros((1, 32), np.float32)
  x[0, :3] = [1e-40, -5e-39, 3e-42]
  got = np.asarray(dequantize(rowwise(x, MX_E4M3)), np.float64)
  assert np.all(np.abs(got - x.astype(np.float64)) <= 2.0**-126)


@pytest.mark.parametrize("q,pos,neg", [(MX_E4M3, 0x7E, 0xFE), (MX_E5M2, 0x7B, 0xFB)],
                         ids=["e4m3", "e5m2"])
def test_infinite_block_saturates_and_other_blocks_are_untouched(rng, q, pos, neg):
  # block 0 holds +inf, -inf, 1e38 and small values: s = inf -> e = 254 (scale 2^-127);
  # cast_sat(+-inf * 2^-127) = +-fmax; 1e38 * 2^-127 = 0.588: E4M3 quantum 2^-4 -> 9.4 -> 9 ->
  # 0.5625 = 1.125 * 2^-1 -> 0 0110 001 = 0x31 (E5M2 quantum 2^-3 -> 4.7 -> 5 -> 0.625 ->
  # 0 01110 01 = 0x39); the small values are < 2^-126 after scaling -> signed zeros.
  x = oracle.random_matrix(rng, (2, 64), spread=False)
  x[0, :3] = [np.inf, -np.inf, 1e38]
  t = rowwise(x, q)
  codes = data_codes(t)
  assert codes[0, :3].tolist() == [pos, neg, 0x31 if q is MX_E4M3 else 0x39]
  np.testing.assert_array_equal(codes[0, 3:32], np.where(np.signbit(x[0, 3:32]), 0x80, 0))
  assert scale_bytes(t)[0, 0] == 254
  rest = rowwise(x[:, 32:].copy(), q)
  np.testing.assert_array_equal(codes[:, 32:], data_codes(rest))
  np.testing.assert_array_equal(scale_bytes(t)[:, 1], scale_bytes(rest)[:, 0])
  got = np.asarray(dequantize(t))
  assert got[0, 0] == np.inf and got[0, 1] == -np.inf  # fmax * 2^127 overflows float32


def test_nan_block_is_all_nan_and_other_blocks_are_untouched(rng):
  # s = NaN -> e = 255 and the whole block's payload is NaN (0x7F); amax propagates NaN
  x = oracle.random_matrix(rng, (2, 64), spread=False)
  x[1, 40] = np.nan
  t = rowwise(x, MX_E4M3)
  assert scale_bytes(t)[1, 1] == 255 and np.all(data_codes(t)[1, 32:] == 0x7F)
  clean = x.copy()
  clean[1, 32:] = 0
  ref = rowwise(clean, MX_E4M3)
  np.testing.assert_array_equal(data_codes(t)[:, :32], data_codes(ref)[:, :32])
  np.testing.assert_array_equal(data_codes(t)[0], data_codes(ref)[0])
  assert np.isnan(float(t.amax))
  got = np.asarray(dequantize(t))
  assert np.all(np.isnan(got[1, 32:])) and np.all(np.isfinite(got[:, :32]))


def test_huge_outlier_only_changes_its_own_block(rng):
  # 1e30 / 448 = 1.8 * 2^90 -> e = 127 + 90 + 1 = 218 (scale 2^-91): 1e30 * 2^-91 = 403.9:
  # quantum 32 -> 12.6 -> 13 -> 416 = 1.625 * 2^8 -> 0 1111 101 = 0x7D; the rest of the block
  # scales below 2^-10 -> signed zeros
  x = oracle.random_matrix(rng, (3, 96), spread=False)
  x[2, 50] = 1e30
  t = rowwise(x, MX_E4M3)
  assert scale_bytes(t)[2, 1] == 218 and data_codes(t)[2, 50] == 0x7D
  others = np.delete(np.arange(32, 64), 50 - 32)
  np.testing.assert_array_equal(data_codes(t)[2, others], np.where(np.signbit(x[2, others]),
                                                                   0x80, 0))
  clean = x.copy()
  clean[2, 32:64] = 0
  ref = rowwise(clean, MX_E4M3)
  mask = np.ones((3, 3), bool)
  mask[2, 1] = False
  np.testing.assert_array_equal(scale_bytes(t)[mask], scale_bytes(ref)[mask])
  np.testing.assert_array_equal(np.delete(data_codes(t)[2], np.s_[32:64]),
                                np.delete(data_codes(ref)[2], np.s_[32:64]))
