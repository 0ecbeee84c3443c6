"""Per-tensor FP8 with current scaling (`Float8CurrentScalingQuantizer`), docs/design.md §5
"Numerics" (scale from amax): hand-worked bytes, properties on random inputs, special values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import data_codes, dequantize, quantize, rowwise

pytestmark = pytest.mark.usefixtures("core_backend")

E4M3 = jq.Float8CurrentScalingQuantizer(jnp.float8_e4m3fn)
E5M2 = jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2)

# Columns of the hand-worked vector below.
HAND_X = [[3.0, 1.0, -1.5, 0.0], [0.5, -3.0, 2.0, 0.1]]


def test_e4m3_amax_3_hand_bytes():
  # scale = fl(448/3) = 149.33332824707031 (= 149 + 21845/2^16, just below 448/3)
  #  3.0 -> 3 * scale = 448 - 2^-16, a float32 tie that rounds to even 448 -> 0 1111 110 = 0x7E
  #  1.0 -> 149.33: quantum 16 in [128, 256) -> 9.33 -> 9 -> 144 = 1.125 * 2^7 -> 0 1110 001 = 0x71
  # -1.5 -> -224 = 1.75 * 2^7 -> 1 1110 110 = 0xF6;  0.0 -> 0x00
  #  0.5 -> 74.67: quantum 8 -> 9.33 -> 9 -> 72 = 1.125 * 2^6 -> 0 1101 001 = 0x69
  # -3.0 -> 0xFE;  2.0 -> 298.7: quantum 32 -> 9.33 -> 9 -> 288 = 1.125 * 2^8 -> 0x79
  #  0.1 -> 14.93: quantum 1 -> 15 = 1.875 * 2^3 -> 0 1010 111 = 0x57
  t = rowwise(jnp.array(HAND_X, jnp.float32), E4M3)
  assert data_codes(t).tolist() == [[0x7E, 0x71, 0xF6, 0x00], [0x69, 0xFE, 0x79, 0x57]]
  assert t.scale_inv.shape == () and t.scale_inv.dtype == jnp.float32
  assert float(t.scale_inv) == float(np.float32(1) / (np.float32(448) / np.float32(3)))
  assert float(t.amax) == 3.0


def test_e5m2_amax_3_hand_bytes():
  # scale = fl(57344/3) = 19114.666
  #  3.0 -> 57344 = 1.75 * 2^15 -> 0 11110 11 = 0x7B;  -3.0 -> 0xFB
  #  1.0 -> 19114.7: quantum 4096 -> 4.67 -> 5 -> 20480 = 1.25 * 2^14 -> 0 11101 01 = 0x75
  # -1.5 -> -28672 = -1.75 * 2^14 -> 1 11101 11 = 0xF7
  #  0.5 -> 9557.3: quantum 2048 -> 4.67 -> 5 -> 10240 = 1.25 * 2^13 -> 0 11100 01 = 0x71
  #  2.0 -> 38229: quantum 8192 -> 4.67 -> 5 -> 40960 = 1.25 * 2^15 -> 0 11110 01 = 0x79
  #  0.1 -> 1911.5: quantum 256 -> 7.47 -> 7 -> 1792 = 1.75 * 2^10 -> 0 11001 11 = 0x67
  t = rowwise(jnp.array(HAND_X, jnp.float32), E5M2)
  assert data_codes(t).tolist() == [[0x7B, 0x75, 0xF7, 0x00], [0x71, 0xFB, 0x79, 0x67]]
  assert float(t.scale_inv) == float(np.float32(1) / (np.float32(57344) / np.float32(3)))


def test_e4m3_pow2_scale_hand_bytes():
  # scale 149.33 rounded down to 128 (scale_inv 2^-7):
  # 3 -> 384 = 1.5 * 2^8 -> 0x7C; 1 -> 128 -> 0 1110 000 = 0x70; -1.5 -> -192 = -1.5 * 2^7 -> 0xF4;
  # 0.5 -> 64 -> 0 1101 000 = 0x68; -3 -> 0xFC; 2 -> 256 -> 0 1111 000 = 0x78;
  # 0.1 -> 12.8: quantum 1 -> 13 = 1.625 * 2^3 -> 0 1010 101 = 0x55
  t = rowwise(jnp.array(HAND_X, jnp.float32), jq.Float8CurrentScalingQuantizer(pow2_scale=True))
  assert data_codes(t).tolist() == [[0x7C, 0x70, 0xF4, 0x00], [0x68, 0xFC, 0x78, 0x55]]
  assert float(t.scale_inv) == 2.0**-7


def test_e4m3_amax_epsilon_floors_the_amax_hand_bytes():
  # amax 1e-3 < eps 0.5, so scale = 448 / 0.5 = 896 (scale_inv 1/896):
  #  1e-3   -> 0.896: quantum 2^-4 -> 14.3 -> 14 -> 0.875 = 1.75 * 2^-1 -> 0 0110 110 = 0x36
  # -2.5e-4 -> -0.224: quantum 2^-6 -> 14.3 -> 14 -> 1.75 * 2^-3 -> 1 0100 110 = 0xA6
  #  5e-4   -> 0.448: quantum 2^-5 -> 14.3 -> 14 -> 1.75 * 2^-2 -> 0 0101 110 = 0x2E
  q = jq.Float8CurrentScalingQuantizer(amax_epsilon=0.5)
  t = rowwise(jnp.array([[1e-3, -2.5e-4, 0.0, 5e-4]], jnp.float32), q)
  assert data_codes(t).tolist() == [[0x36, 0xA6, 0x00, 0x2E]]
  assert float(t.scale_inv) == float(np.float32(1) / np.float32(896))
  assert float(t.amax) == float(np.float32(1e-3))  # amax is the tensor's, not the floored one


def test_amax_epsilon_below_amax_changes_nothing(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (8, 40)))
  eps = float(jnp.max(jnp.abs(x))) / 2
  plain = rowwise(x, E4M3)
  floored = rowwise(x, jq.Float8CurrentScalingQuantizer(amax_epsilon=eps))
  np.testing.assert_array_equal(data_codes(plain), data_codes(floored))
  assert float(plain.scale_inv) == float(floored.scale_inv)


CASES = [(jnp.float8_e4m3fn, False, 0.0, jnp.float32, (1, 7)),
         (jnp.float8_e4m3fn, True, 0.0, jnp.bfloat16, (16, 32)),
         (jnp.float8_e4m3fn, False, 1e-2, jnp.float16, (17, 100)),
         (jnp.float8_e5m2, False, 0.0, jnp.bfloat16, (17, 33)),
         (jnp.float8_e5m2, True, 0.0, jnp.float16, (1, 7)),
         (jnp.float8_e5m2, False, 1e-2, jnp.float32, (16, 32))]


@pytest.mark.parametrize("fp8,pow2,eps,in_dtype,shape", CASES)
def test_matches_independent_oracle_bitwise(rng, fp8, pow2, eps, in_dtype, shape):
  q = jq.Float8CurrentScalingQuantizer(fp8, pow2_scale=pow2, amax_epsilon=eps)
  x = oracle.random_matrix(rng, shape, in_dtype)
  qt = quantize(jnp.asarray(x), q)
  want_codes, want_scale_inv, want_amax = oracle.fp8_current(x, oracle.fmt_of(fp8), pow2, eps)
  np.testing.assert_array_equal(data_codes(qt.rowwise), want_codes)
  np.testing.assert_array_equal(data_codes(qt.columnwise), want_codes.T)
  for t in (qt.rowwise, qt.columnwise):
    assert np.asarray(t.scale_inv) == want_scale_inv and np.asarray(t.amax) == want_amax
    assert t.orig_dtype == np.dtype(in_dtype) and t.data.dtype == np.dtype(fp8)


@pytest.mark.parametrize("fp8,pow2,eps,in_dtype,shape", CASES)
def test_dequantization_error_within_half_ulp_bound(rng, fp8, pow2, eps, in_dtype, shape):
  """|x' - x| <= max(2^-(m+1) |x|, 2^(emin-m-1) * scale_inv) (+ float32 slack): half an ulp
  relative (E4M3 2^-4, E5M2 2^-3) in the normal range of the scaled value, half the smallest
  subnormal (E4M3 2^-10, E5M2 2^-17) in scaled units below it; no saturation since the scale
  maps amax to at most fmax (pow2 and epsilon only make it smaller)."""
  fmt = oracle.fmt_of(fp8)
  x = oracle.random_matrix(rng, shape, in_dtype)
  q = jq.Float8CurrentScalingQuantizer(fp8, pow2_scale=pow2, amax_epsilon=eps)
  t = quantize(jnp.asarray(x), q).rowwise  # (the oracle test's compiled program)
  got = np.asarray(dequantize(t), np.float64)
  x64 = x.astype(np.float64)
  bound = oracle.rne_error_bound(x64, float(t.scale_inv), fmt)
  worst = np.argmax(np.abs(got - x64) - bound)
  assert np.all(np.abs(got - x64) <= bound), (x64.flat[worst], got.flat[worst], bound.flat[worst])


def test_columnwise_is_the_transposed_bytes_and_ops_transpose_makes_it(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (12, 40)))
  qt = quantize(x, E4M3)
  np.testing.assert_array_equal(data_codes(qt.columnwise), data_codes(qt.rowwise).T)
  transposed = jq.ops.transpose(qt.rowwise)
  np.testing.assert_array_equal(data_codes(transposed), data_codes(qt.columnwise))
  assert float(transposed.scale_inv) == float(qt.columnwise.scale_inv)


def test_leading_axes_are_flattened_into_rows(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (2, 3, 33)))
  qt = quantize(x, E4M3)
  assert qt.rowwise.shape == (6, 33) and qt.columnwise.shape == (33, 6)
  flat = quantize(x.reshape(6, 33), E4M3)
  np.testing.assert_array_equal(data_codes(qt.rowwise), data_codes(flat.rowwise))


# ------------------------------------------------------------------------------------------------
# Special values


@pytest.mark.parametrize("q", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_all_zeros_give_zero_payload_and_unit_scale(q):
  t = rowwise(jnp.zeros((3, 5), jnp.float32).at[0, 1].set(-0.0), q)
  want = np.zeros((3, 5), np.uint8)
  want[0, 1] = 0x80  # -0.0 keeps its sign
  np.testing.assert_array_equal(data_codes(t), want)
  assert float(t.scale_inv) == 1.0 and float(t.amax) == 0.0  # amax 0 -> scale 1


def test_subnormal_inputs_beside_normal_values_become_signed_zeros(rng):
  # amax ~ 1 so scale <= 448 * 2^8; |1e-40 * scale| < 2^-10 (half the smallest E4M3
  # subnormal): the IEEE result is a signed zero (and so is the flushed one)
  x = oracle.random_matrix(rng, (4, 16), spread=False)
  x[0, :4] = [1e-40, -1e-40, 1.4e-45, -3e-39]
  t = rowwise(x, E4M3)
  assert data_codes(t)[0, :4].tolist() == [0x00, 0x80, 0x00, 0x80]
  y = x.copy()
  y[0, :4] = [0.0, -0.0, 0.0, -0.0]
  np.testing.assert_array_equal(data_codes(t)[1:], data_codes(rowwise(y, E4M3))[1:])


def test_all_subnormal_tensor_dequantizes_within_flt_min():
  # Under IEEE, amax 1e-40 gives scale FLT_MAX and a tiny scale_inv; XLA:CPU flushes float32
  # subnormals to zero (amax 0 -> scale 1, zero payload). Either way x' is within 2^-126 of x.
  x = jnp.array([[1e-40, -2e-40, 3e-41, 0.0]], jnp.float32)
  got = np.asarray(dequantize(rowwise(x, E4M3)), np.float64)
  assert np.all(np.abs(got - np.asarray(x, np.float64)) <= 2.0**-126)
  assert np.all(np.signbit(got[0, :2]) == [False, True])


@pytest.mark.parametrize("q,codes", [(E4M3, [0x7E, 0xFE, 0x44, 0x38, 0x2A]),
                                     (E5M2, [0x7B, 0xFB, 0x42, 0x3C, 0x35])],
                         ids=["e4m3", "e5m2"])
def test_infinite_amax_gives_unit_scale_and_saturated_infinities(q, codes):
  # amax = inf -> scale 1: +-inf saturate to +-fmax, finite values are cast as they are:
  # E4M3: 3 = 1.5 * 2 -> 0 1000 100 = 0x44; 1 -> 0 0111 000 = 0x38; 0.3 -> 0x2A (1.25 * 2^-2)
  # E5M2: 3 -> 0 10000 10 = 0x42; 1 -> 0 01111 00 = 0x3C; 0.3: quantum 2^-4 -> 4.8 -> 5 ->
  #       1.25 * 2^-2 -> 0 01101 01 = 0x35
  t = rowwise(jnp.array([[np.inf, -np.inf, 3.0, 1.0, 0.3]], jnp.float32), q)
  assert data_codes(t)[0].tolist() == codes
  assert float(t.scale_inv) == 1.0 and float(t.amax) == np.inf


@pytest.mark.parametrize("q", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_nan_propagates_to_amax_and_its_own_element_only(q):
  # amax is NaN -> scale 1; the NaN element gets code 0x7F, the others are cast with scale 1
  x = jnp.array([[1.0, np.nan, -3.0, 0.0]], jnp.float32)
  t = rowwise(x, q)
  finite = oracle.cast_codes(np.array([1.0, -3.0, 0.0], np.float32), oracle.fmt_of(q.dtype))
  assert data_codes(t)[0].tolist() == [finite[0], 0x7F, finite[1], finite[2]]
  assert np.isnan(float(t.amax)) and float(t.scale_inv) == 1.0
  got = np.asarray(dequantize(t))
  assert np.isnan(got[0, 1]) and got[0, [0, 2, 3]].tolist() == [1.0, -3.0, 0.0]


def test_single_huge_outlier_takes_fmax_and_flushes_the_rest(rng):
  # scale = 448 / 1e30: the outlier maps to 448 (0x7E); |other| * scale < 1e-26 << 2^-10, so
  # every other element becomes a signed zero
  x = oracle.random_matrix(rng, (8, 24), spread=False)
  x[3, 5] = 1e30
  t = rowwise(x, E4M3)
  want = np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
  want[3, 5] = 0x7E
  np.testing.assert_array_equal(data_codes(t), want)
  assert abs(float(dequantize(t)[3, 5]) - 1e30) <= 1e30 * 2.0**-20
