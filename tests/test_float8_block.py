"""Float8Block (`Float8BlockQuantizer`, DeepSeek-V3 style): FP8 with a float32 scale per (1, 128)
block or (128, 128) tile, computed like per-tensor current scaling (docs/design.md §5
"Numerics")."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import data_codes, dequantize, quantize, rowwise

pytestmark = pytest.mark.usefixtures("core_backend")

B1D = jq.Float8BlockQuantizer((1, 128))
B2D = jq.Float8BlockQuantizer((128, 128))


def _hand_matrix(rows_per_block: int) -> np.ndarray:
  """Block 0 holds amax 3, block 1 amax 448, block 2 zeros, block 3 amax 1000; with 1x128 the
  blocks are (row 0, cols 0-127), (row 0, cols 128-255), (row 1, ...), (row 1, ...); with
  128x128 the same values sit in the four tiles of a 256x256 matrix."""
  r = rows_per_block
  x = np.zeros((2 * r, 256), np.float32)
  x[0, :5] = [3.0, 1.0, -1.5, 0.5, 0.1]
  x[r - 1, 128:130] = [448.0, 0.3]
  x[2 * r - 1, 128:130] = [1000.0, -4.0]
  return x


def _hand_expectations(rows_per_block: int):
  # pow2 scales: amax 3 -> 448/3 = 149.3 -> 128 (scale_inv 2^-7): 3 -> 384 (0x7C), 1 -> 128 (0x70),
  #   -1.5 -> -192 (0xF4), 0.5 -> 64 (0x68), 0.1 -> 12.8 -> 13 (0x55)
  # amax 448 -> scale 1: 448 -> 0x7E, 0.3 -> 0.3125 (0x2A)
  # zeros -> scale 1 (amax 0), zero payload
  # amax 1000 -> 0.448 -> 0.25 (scale_inv 4): 1000 -> 250: quantum 16 -> 15.6 -> 16 -> 256
  #   (0 1111 000 = 0x78); -4 -> -1 (1 0111 000 = 0xB8)
  r = rows_per_block
  want = np.zeros((2 * r, 256), np.uint8)
  want[0, :5] = [0x7C, 0x70, 0xF4, 0x68, 0x55]
  want[r - 1, 128:130] = [0x7E, 0x2A]
  want[2 * r - 1, 128:130] = [0x78, 0xB8]
  return want, [[2.0**-7, 1.0], [1.0, 4.0]]


@pytest.mark.parametrize("q,rows_per_block", [(B1D, 1), (B2D, 128)], ids=["1x128", "128x128"])
def test_hand_bytes_with_power_of_two_scales(q, rows_per_block):
  t = rowwise(_hand_matrix(rows_per_block), q)
  want, scale_inv = _hand_expectations(rows_per_block)
  np.testing.assert_array_equal(data_codes(t), want)
  assert t.scale_inv.dtype == jnp.float32 and np.asarray(t.scale_inv).tolist() == scale_inv
  assert float(t.amax) == 1000.0


def test_hand_bytes_without_power_of_two_scale():
  # scale = fl(448/3) exactly as per-tensor current scaling: 3 -> 448 (0x7E), 1 -> 144 (0x71)
  t = rowwise(_hand_matrix(1), jq.Float8BlockQuantizer((1, 128), pow2_scale=False))
  assert data_codes(t)[0, :2].tolist() == [0x7E, 0x71]
  assert float(t.scale_inv[0, 0]) == float(np.float32(1) / (np.float32(448) / np.float32(3)))
  assert float(t.scale_inv[1, 1]) == float(np.float32(1) / (np.float32(448) / np.float32(1000)))


def test_amax_epsilon_rescues_a_zero_block():
  # a = max(0, 1) = 1 -> scale 448 -> pow2 256 -> scale_inv 2^-8
  t = rowwise(np.zeros((1, 128), np.float32), jq.Float8BlockQuantizer(amax_epsilon=1.0))
  assert float(t.scale_inv[0, 0]) == 2.0**-8 and np.all(data_codes(t) == 0)


CASES = [(B1D, True, jnp.float8_e4m3fn, (17, 300), jnp.float32),
         (B1D, False, jnp.float8_e5m2, (8, 256), jnp.bfloat16),
         (B2D, True, jnp.float8_e4m3fn, (130, 129), jnp.float16),
         (B2D, False, jnp.float8_e5m2, (130, 129), jnp.float32)]
IDS = ["1x128-pow2-e4m3", "1x128-e5m2", "128x128-pow2-e4m3", "128x128-e5m2"]


@pytest.mark.parametrize("block_q,pow2,fp8,shape,in_dtype", CASES, ids=IDS)
def test_matches_independent_oracle_bitwise_both_directions(rng, block_q, pow2, fp8, shape,
                                                            in_dtype):
  q = jq.Float8BlockQuantizer(block_q.block, fp8, pow2_scale=pow2)
  x = oracle.random_matrix(rng, shape, in_dtype)
  qt = quantize(jnp.asarray(x), q)
  for t, mat in ((qt.rowwise, x), (qt.columnwise, x.T)):
    codes, scale_inv, amax = oracle.fp8_block(mat, q.block, oracle.fmt_of(fp8), pow2)
    np.testing.assert_array_equal(data_codes(t), codes)
    np.testing.assert_array_equal(np.asarray(t.scale_inv), scale_inv)
    assert float(t.amax) == float(amax)


@pytest.mark.parametrize("block_q,pow2,fp8,shape,in_dtype", CASES, ids=IDS)
def test_dequantization_error_within_half_ulp_of_block_scale(rng, block_q, pow2, fp8, shape,
                                                             in_dtype):
  """|x' - x| <= max(2^-(m+1) |x|, 2^(emin-m-1) * scale_inv_block) (+ float32 slack): the block
  scale maps the block amax to at most fmax (exactly fmax, or down to fmax/2 with pow2), so no
  element saturates."""
  q = jq.Float8BlockQuantizer(block_q.block, fp8, pow2_scale=pow2)
  x = oracle.random_matrix(rng, shape, in_dtype)
  t = quantize(jnp.asarray(x), q).rowwise  # (the oracle test's compiled program)
  unit = oracle.expand(np.asarray(t.scale_inv, np.float64), *q.block, shape)
  err = np.abs(np.asarray(dequantize(t), np.float64) - x.astype(np.float64))
  assert np.all(err <= oracle.rne_error_bound(x, unit, oracle.fmt_of(fp8)))


def test_128x128_columnwise_shares_the_transposed_tile_scales(rng):
  x = oracle.random_matrix(rng, (130, 129))
  qt = quantize(jnp.asarray(x), B2D)
  np.testing.assert_array_equal(np.asarray(qt.columnwise.scale_inv),
                                np.asarray(qt.rowwise.scale_inv).T)
  np.testing.assert_array_equal(data_codes(qt.columnwise), data_codes(qt.rowwise).T)


@pytest.mark.parametrize("q,padded_shape", [(B1D, (17, 384)), (B2D, (256, 384))],
                         ids=["1x128", "128x128"])
def test_shapes_not_multiple_of_the_block_are_zero_padded(rng, q, padded_shape):
  x = oracle.random_matrix(rng, (17, 300))
  padded = np.zeros(padded_shape, np.float32)
  padded[:17, :300] = x
  t, ref = rowwise(x, q), rowwise(padded, q)
  np.testing.assert_array_equal(data_codes(t), data_codes(ref)[:17, :300])
  rows = 1 if q.block == (128, 128) else 17
  assert t.scale_inv.shape == (rows, 3)
  np.testing.assert_array_equal(np.asarray(t.scale_inv), np.asarray(ref.scale_inv)[:rows])


# ------------------------------------------------------------------------------------------------
# Special values


def test_zeros_and_subnormals_beside_normals(rng):
  x = np.zeros((2, 128), np.float32)
  x[1, :3] = [1.0, 1e-40, -1e-40]
  t = rowwise(x, B1D)
  assert np.all(data_codes(t)[0] == 0) and float(t.scale_inv[0, 0]) == 1.0
  # amax 1 -> scale 448 -> pow2 256: 1 -> 256 (0x78); subnormals -> signed zeros
  assert data_codes(t)[1, :3].tolist() == [0x78, 0x00, 0x80]


def test_all_subnormal_block_dequantizes_within_flt_min():
  x = np.zeros((1, 128), np.float32)
  x[0, :2] = [3e-39, -1e-40]
  got = np.asarray(dequantize(rowwise(x, B1D)), np.float64)
  assert np.all(np.abs(got - x.astype(np.float64)) <= 2.0**-126)


def test_infinite_block_gets_unit_scale_and_others_are_untouched(rng):
  # block amax inf -> scale 1: +-inf saturate (0x7E / 0xFE), 3 -> 0x44, the rest cast as is
  x = oracle.random_matrix(rng, (2, 256), spread=False)
  x[0, :3] = [np.inf, -np.inf, 3.0]
  t = rowwise(x, B1D)
  assert data_codes(t)[0, :3].tolist() == [0x7E, 0xFE, 0x44]
  np.testing.assert_array_equal(data_codes(t)[0, 3:128],
                                oracle.cast_codes(x[0, 3:128], oracle.E4M3))
  assert float(t.scale_inv[0, 0]) == 1.0
  ref = rowwise(x[1:].copy(), B1D)
  np.testing.assert_array_equal(data_codes(t)[1], data_codes(ref)[0])
  ref0 = rowwise(x[:1, 128:].copy(), B1D)
  np.testing.assert_array_equal(data_codes(t)[0, 128:], data_codes(ref0)[0])


def test_nan_block_gets_unit_scale_and_nan_stays_in_its_element(rng):
  # block amax NaN -> scale 1: NaN -> 0x7F, the block's other values cast with scale 1
  x = oracle.random_matrix(rng, (1, 256), spread=False)
  x[0, 200] = np.nan
  t = rowwise(x, B1D)
  assert float(t.scale_inv[0, 1]) == 1.0 and np.isnan(float(t.amax))
  want = oracle.cast_codes(x[0, 128:], oracle.E4M3)
  np.testing.assert_array_equal(data_codes(t)[0, 128:], want)
  assert want[72] == 0x7F
  ref = rowwise(x[:, :128].copy(), B1D)
  np.testing.assert_array_equal(data_codes(t)[0, :128], data_codes(ref)[0])


@pytest.mark.parametrize("q", [B1D, B2D], ids=["1x128", "128x128"])
def test_huge_outlier_only_changes_its_own_block(rng, q):
  # the outlier's block: scale = 448 / 1e30 -> pow2 2^-91 (1e30 * 2^-91 = 403.9 -> 416, 0x7D);
  # every other element of that block scales below 2^-10 -> signed zero
  x = oracle.random_matrix(rng, (130, 256), spread=False)
  x[5, 140] = 1e30
  t = rowwise(x, q)
  clean = x.copy()
  clean[5, 140] = 0
  ref = rowwise(clean, q)
  in_block = np.zeros(x.shape, bool)
  if q.block == (1, 128):
    in_block[5, 128:] = True
  else:
    in_block[:128, 128:] = True
  codes = data_codes(t)
  assert codes[5, 140] == 0x7D
  others = in_block.copy()
  others[5, 140] = False
  np.testing.assert_array_equal(codes[others], np.where(np.signbit(x[others]), 0x80, 0))
  np.testing.assert_array_equal(codes[~in_block], data_codes(ref)[~in_block])
