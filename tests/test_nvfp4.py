"""NVFP4 (`NVFP4Quantizer`): E2M1 payload, E4M3 scale per 1x16 block or 16x16 tile, float32
second-level scale per tensor or per row; RHT of the columnwise copy; stochastic rounding
(docs/design.md §5 "Numerics")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import columnwise, data_codes, dequantize, quantize, rowwise, scale_bytes
from jaxquant.numerics import hadamard
from jaxquant.numerics.random_bits import key_words

pytestmark = pytest.mark.usefixtures("core_backend")

NV = jq.NVFP4Quantizer()
NV_2D = jq.NVFP4Quantizer(block_2d=True)
NV_ROW = jq.NVFP4Quantizer(row_scaled=True)
NV_RHT = jq.NVFP4Quantizer(rht=True)
NV_SR = jq.NVFP4Quantizer(stochastic_rounding=True)
VARIANTS = {"1d": NV, "2d": NV_2D, "row_scaled": NV_ROW}


def _unit(t: jq.ScaledTensor) -> np.ndarray:
  """float64 decode factor of every element: S_dec_b * amax / (6 * 448)."""
  block = (16, 16) if t.quantizer.block_2d else (1, 16)
  s_dec = oracle.expand(oracle.decode_codes(scale_bytes(t), oracle.E4M3), *block, t.shape)
  amax = np.asarray(t.amax, np.float64)
  amax = amax[:, None] if amax.ndim else amax
  return s_dec * amax / 2688.0


# ------------------------------------------------------------------------------------------------
# Hand-worked vectors


def test_1d_hand_bytes():
  # tensor amax 6 -> S_enc = 2688 / 6 = 448.
  # row 0, block 0 (amax 6): S_dec = e4m3(6 * (448 * fl(1/6))) = e4m3(448.00002) = 448 (0x7E),
  #   S_enc_b = 1 / (448 * fl(1/448)) = 1 / 1.0 = 1, so q = e2m1(x) with ties to even:
  #   6->7 3->5 -1.5->0xB .5->1 0->0 1->2 2->4 4->6 -6->0xF 2.5->4 (2) 5->6 (4) .25->0 (0)
  #   .75->2 (1.0) 1.25->2 (1.0) 1.75->4 (2.0) 3.5->6 (4.0)
  # row 0, block 1 (amax 0.75): S_dec = e4m3(56.000002) = 56 = 1.75 * 2^5 (0x66), S_enc_b =
  #   1 / (56 * fl(1/448)) = 8: .75 -> 6 (7), .375 -> 3 (5), -.0625 -> -.5 (0x9), .1875 -> 1.5 (3)
  # row 1, block 0: zeros -> S_dec = 0 (0x00), zero payload
  # row 1, block 1 (amax 0.001): S_dec = e4m3(0.0747) = 0.078125 = 1.25 * 2^-4 (0x1A),
  #   S_enc_b = 1 / (0.078125 / 448) = 5734.4: .001 -> 5.73 (quantum 2) -> 6 (7);
  #   -.0005 -> -2.87 (quantum 1) -> -3 (0xD)
  x = np.zeros((2, 32), np.float32)
  x[0, :16] = [6, 3, -1.5, .5, 0, 1, 2, 4, -6, 2.5, 5, .25, .75, 1.25, 1.75, 3.5]
  x[0, 16:20] = [.75, .375, -.0625, .1875]
  x[1, 16:18] = [.001, -.0005]
  t = rowwise(x, NV)
  want = np.zeros((2, 32), np.uint8)
  want[0, :16] = [7, 5, 0xB, 1, 0, 2, 4, 6, 0xF, 4, 6, 0, 2, 2, 4, 6]
  want[0, 16:20] = [7, 5, 0x9, 3]
  want[1, 16:18] = [7, 0xD]
  assert t.data.dtype == jnp.float4_e2m1fn and t.scale_inv.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(data_codes(t), want)
  assert scale_bytes(t).tolist() == [[0x7E, 0x66], [0x00, 0x1A]]
  assert t.amax.shape == () and float(t.amax) == 6.0
  # decode: x' = q * S_dec_b * amax / 2688
  q = oracle.decode_codes(want, oracle.E2M1)
  s = oracle.decode_codes(np.repeat(scale_bytes(t), 16, axis=1), oracle.E4M3)
  np.testing.assert_allclose(np.asarray(dequantize(t)), q * s * 6 / 2688, rtol=2.0**-21)


def test_2d_hand_bytes_one_scale_per_16x16_tile():
  # tensor amax 6 (S_enc 448); tile (0,0) amax 6 -> 0x7E, S_enc_b 1; tile (0,1) amax 0.75 ->
  # 0x66, S_enc_b 8; tile (1,0) zeros -> 0x00; tile (1,1) amax 3: S_dec = e4m3(224.00001) = 224
  # = 1.75 * 2^7 (0x76), S_enc_b = 1 / (224 * fl(1/448)) = 2: 3 -> 6 (7), -1 -> -2 (0xC),
  # 0.2 -> 0.4 (quantum 0.5) -> 0.5 (1). Values sit on different rows of each tile.
  x = np.zeros((32, 32), np.float32)
  x[0, 0], x[15, 3], x[7, 15] = 6, -1.5, 0.5
  x[2, 16], x[9, 31] = .75, -.0625
  x[16, 16], x[31, 17], x[20, 30] = 3, -1, 0.2
  t = rowwise(x, NV_2D)
  assert t.scale_inv.shape == (2, 2)
  assert scale_bytes(t).tolist() == [[0x7E, 0x66], [0x00, 0x76]]
  want = np.zeros((32, 32), np.uint8)
  want[0, 0], want[15, 3], want[7, 15] = 7, 0xB, 1
  want[2, 16], want[9, 31] = 7, 0x9
  want[16, 16], want[31, 17], want[20, 30] = 7, 0xC, 1
  np.testing.assert_array_equal(data_codes(t), want)


def test_row_scaled_hand_bytes_one_global_scale_per_row():
  # row 0 amax 6 -> S_enc 448 -> block S_dec 448 (0x7E), S_enc_b 1: 6 (7), -3 (0xD), 1.5 (3)
  # row 1 amax 12 -> S_enc 224 -> S_dec = e4m3(12 * (224 * fl(1/6))) = e4m3(448.00001) = 448,
  #   S_enc_b = 1 / (448 * fl(1/224)) = 1 / 2 = 0.5: 12 -> 6 (7), 6 -> 3 (5), -3 -> -1.5 (0xB),
  #   1 -> 0.5 (1)
  x = np.zeros((2, 16), np.float32)
  x[0, :3] = [6, -3, 1.5]
  x[1, :4] = [12, 6, -3, 1]
  t = rowwise(x, NV_ROW)
  assert data_codes(t)[:, :4].tolist() == [[7, 0xD, 3, 0], [7, 5, 0xB, 1]]
  assert scale_bytes(t).tolist() == [[0x7E], [0x7E]]
  assert t.amax.shape == (2,) and np.asarray(t.amax).tolist() == [6.0, 12.0]
  np.testing.assert_allclose(np.asarray(dequantize(t))[:, :4], [[6, -3, 1.5, 0], [12, 6, -3, 1]],
                             rtol=2.0**-21)


# ------------------------------------------------------------------------------------------------
# Random inputs


CASES = [("1d", (17, 33), jnp.float32), ("1d", (16, 64), jnp.bfloat16),
         ("2d", (17, 33), jnp.float16), ("2d", (32, 48), jnp.float32),
         ("row_scaled", (16, 64), jnp.float32), ("row_scaled", (5, 100), jnp.bfloat16)]


@pytest.mark.parametrize("variant,shape,in_dtype", CASES)
def test_matches_independent_oracle_bitwise_both_directions(rng, variant, shape, in_dtype):
  q = VARIANTS[variant]
  x = oracle.random_matrix(rng, shape, in_dtype)
  qt = quantize(jnp.asarray(x), q)
  for t, mat in ((qt.rowwise, x), (qt.columnwise, x.T)):
    codes, scales, amax, _ = oracle.nvfp4(mat, block_2d=q.block_2d, row_scaled=q.row_scaled)
    np.testing.assert_array_equal(data_codes(t), codes)
    np.testing.assert_array_equal(scale_bytes(t), scales)
    np.testing.assert_array_equal(np.asarray(t.amax), amax)
    block = (16, 16) if q.block_2d else (1, 16)
    assert t.scale_inv.shape == (-(-mat.shape[0] // block[0]), -(-mat.shape[1] // block[1]))


@pytest.mark.parametrize("variant,shape,in_dtype", CASES)
def test_dequantization_error_within_e2m1_bound_per_block(rng, variant, shape, in_dtype):
  """With unit = S_dec_b * amax / 2688 the block's decode factor and v = x / unit:
  |x' - x| <= (max(|v| / 4, 1/4) + max(|v| - 6, 0)) * unit (+ float32 slack): half an E2M1
  quantum (0.25 relative above 1, 0.25 absolute below), plus the clipping error when the E4M3
  rounding of S_dec_b pushed |v| above 6 (at most 6 / (1 - 2^-4) = 6.4 for a normal S_dec_b).
  The log-uniform magnitudes make tiny blocks (zero or subnormal E4M3 scales) common."""
  q = VARIANTS[variant]
  x = oracle.random_matrix(rng, shape, in_dtype)
  t = quantize(jnp.asarray(x), q).rowwise  # (the oracle test's compiled program)
  err = np.abs(np.asarray(dequantize(t), np.float64) - x.astype(np.float64))
  unit = _unit(t)
  # A block whose scale rounds to zero (amax_b * S_enc / 6 <= 2^-10, half the smallest E4M3
  # subnormal) is flushed: there |x| <= 6 * 2^-10 / S_enc = 6 * 2^-10 * amax / 2688.
  amax = np.asarray(t.amax, np.float64)
  flushed = 6 * 2.0**-10 * (amax[:, None] if amax.ndim else amax) / 2688 * (1 + 2.0**-20)
  with np.errstate(divide="ignore", invalid="ignore"):
    bound = np.where(unit > 0, oracle.rne_error_bound(x, unit, oracle.E2M1), flushed)
  assert np.all(err <= bound), np.max(err - bound)


def _all_block_scales_normal(t) -> bool:
  s = oracle.decode_codes(scale_bytes(t), oracle.E4M3)
  return bool(np.all(s >= 2.0**-6))


@pytest.mark.parametrize("variant", ["1d", "2d", "row_scaled"])
def test_requantizing_dequantized_values_is_bitwise_identity(rng, variant):
  """quantize(dequantize(q)) == q: data and E4M3 scales bitwise (amax only to float32 rounding:
  it is recomputed from q * S_dec_b * amax / 2688). Holds for blocks with a normal E4M3 scale:
  there the block maximum lands in (5, 6.4] and rounds to 6, so the requantized scale is again
  S_dec_b."""
  q = VARIANTS[variant]
  x = oracle.random_matrix(rng, (32, 64), spread=False)
  qt = quantize(jnp.asarray(x), q)
  for t in (qt.rowwise, qt.columnwise):
    assert _all_block_scales_normal(t)
    again = rowwise(dequantize(t), q)
    np.testing.assert_array_equal(data_codes(again), data_codes(t))
    np.testing.assert_array_equal(scale_bytes(again), scale_bytes(t))
    np.testing.assert_allclose(np.asarray(again.amax), np.asarray(t.amax), rtol=2.0**-21)


def test_row_scaled_rows_are_independent(rng):
  x = oracle.random_matrix(rng, (8, 48))
  y = x.copy()
  y[3] *= 1000.0
  y[5] = 0.0
  a, b = rowwise(x, NV_ROW), rowwise(y, NV_ROW)
  others = np.array([0, 1, 2, 4, 6, 7])
  np.testing.assert_array_equal(data_codes(a)[others], data_codes(b)[others])
  np.testing.assert_array_equal(scale_bytes(a)[others], scale_bytes(b)[others])
  np.testing.assert_array_equal(np.asarray(a.amax)[others], np.asarray(b.amax)[others])
  assert np.asarray(b.amax)[5] == 0 and np.all(data_codes(b)[5] == 0)


def test_row_scaled_power_of_two_row_scaling_changes_only_that_rows_amax(rng):
  # amax * 2^k makes S_enc * 2^-k and S_enc_b * 2^-k exactly, so the bytes are unchanged
  x = oracle.random_matrix(rng, (4, 32))
  y = x.copy()
  y[2] *= 2.0**-9
  a, b = rowwise(x, NV_ROW), rowwise(y, NV_ROW)
  np.testing.assert_array_equal(data_codes(a), data_codes(b))
  np.testing.assert_array_equal(scale_bytes(a), scale_bytes(b))
  assert float(b.amax[2]) == float(a.amax[2]) * 2.0**-9


def test_2d_rowwise_and_columnwise_share_tile_scales(rng):
  x = oracle.random_matrix(rng, (40, 56))
  qt = quantize(jnp.asarray(x), NV_2D)
  assert qt.columnwise.shape == (56, 40)
  np.testing.assert_array_equal(scale_bytes(qt.columnwise), scale_bytes(qt.rowwise).T)
  np.testing.assert_array_equal(data_codes(qt.columnwise), data_codes(qt.rowwise).T)


def test_cols_and_rows_not_multiple_of_16_are_zero_padded(rng):
  x = oracle.random_matrix(rng, (17, 33))
  padded = np.zeros((32, 48), np.float32)
  padded[:17, :33] = x
  for q in (NV, NV_2D):
    t, ref = rowwise(x, q), rowwise(padded, q)
    np.testing.assert_array_equal(data_codes(t), data_codes(ref)[:17, :33])
    rows = 2 if q.block_2d else 17
    np.testing.assert_array_equal(scale_bytes(t), scale_bytes(ref)[:rows])


# ------------------------------------------------------------------------------------------------
# Random Hadamard transform


def test_rht_applies_to_the_columnwise_copy_only(rng):
  x = oracle.random_matrix(rng, (32, 48))
  qt = quantize(jnp.asarray(x), NV_RHT)
  assert not qt.rowwise.rht and qt.columnwise.rht
  np.testing.assert_array_equal(data_codes(qt.rowwise), data_codes(rowwise(x, NV)))
  # columnwise = NVFP4 of rht16(x^T) (rht16 itself is checked against float64 in
  # test_numerics); the amax is the post-RHT one
  rotated = np.asarray(hadamard.rht16(jnp.asarray(x.T)))
  codes, scales, amax, _ = oracle.nvfp4(rotated)
  np.testing.assert_array_equal(data_codes(qt.columnwise), codes)
  np.testing.assert_array_equal(scale_bytes(qt.columnwise), scales)
  assert float(qt.columnwise.amax) == float(amax)


def test_rht_columnwise_dequantize_undoes_the_transform(rng):
  """dequantize() returns x^T: the error of each 16-chunk, rotated back by an orthogonal
  matrix, keeps its Euclidean norm, so ||x'_chunk - x_chunk||_2 <= ||bound in the rotated
  domain||_2 (+ 2^-18 of the chunk's L1 norm for the float32 forward and inverse butterflies)."""
  x = oracle.random_matrix(rng, (32, 48), spread=False)
  t = columnwise(x, NV_RHT)
  got = np.asarray(dequantize(t), np.float64)
  rotated = oracle.rht64(x.T)
  bound = oracle.rne_error_bound(rotated, _unit(t), oracle.E2M1)
  err_norm = np.linalg.norm((got - x.T).reshape(48, 2, 16), axis=-1)
  bound_norm = np.linalg.norm(bound.reshape(48, 2, 16), axis=-1)
  slack = 2.0**-18 * np.abs(x.T.astype(np.float64)).reshape(48, 2, 16).sum(-1)
  assert np.all(err_norm <= bound_norm + slack)


# ------------------------------------------------------------------------------------------------
# Stochastic rounding


def test_stochastic_rounding_draws_follow_fold_in_0_rowwise_and_fold_in_1_columnwise(
    rng, prng_key):
  """Each magnitude rounds up to lo + quantum iff u < (|v| - lo) / quantum, with u the
  documented counter-based draw seeded by fold_in(key, 0) (rowwise) / fold_in(key, 1)
  (columnwise); the scales are those of round-to-nearest quantization."""
  x = oracle.random_matrix(rng, (16, 32), spread=False)
  qt = quantize(jnp.asarray(x), NV_SR, key=prng_key)
  for t, mat, index in ((qt.rowwise, x, 0), (qt.columnwise, x.T, 1)):
    _, scales, _, s_enc_b = oracle.nvfp4(mat)
    np.testing.assert_array_equal(scale_bytes(t), scales)
    v = oracle.f32(mat) * s_enc_b
    a = np.minimum(np.abs(v).astype(np.float64), 6.0)
    lo, _ = oracle.e2m1_neighbours(a)
    quantum = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    k0, k1 = (int(w) for w in np.asarray(key_words(jax.random.fold_in(prng_key, index))))
    u = oracle.sr_uniform(k0, k1, *mat.shape)
    mag = np.where(u < (a - lo) / quantum, lo + quantum, lo)
    want = oracle.cast_codes(mag, oracle.E2M1) | np.where(np.signbit(v), 0x8, 0)
    np.testing.assert_array_equal(data_codes(t), want)


def test_stochastic_rounding_is_unbiased_over_keys(rng, prng_key):
  """The mean of N = 512 quantizations with independent keys converges to x: per element the
  draw is lo or hi (E2M1 neighbours of v = x / unit), variance (hi - v)(v - lo) unit^2, and we
  require |mean - x| <= 5 standard errors + 2^-20 |x| (float32 decode rounding) + 2^-24 (hi-lo)
  unit (24-bit draws). Elements whose |v| exceeds 6 clip (biased by design) and are excluded."""
  n = 512
  x = oracle.random_matrix(rng, (4, 32), spread=False)
  keys = jax.random.split(prng_key, n)
  draw = jax.jit(jax.vmap(lambda k: jq.ops.quantize(jnp.asarray(x), NV_SR, columnwise=False,
                                                    key=k).rowwise.dequantize()))
  mean = np.asarray(draw(keys), np.float64).mean(axis=0)
  unit = _unit(rowwise(x, NV))  # the scales do not depend on the key
  v = np.abs(x.astype(np.float64)) / unit
  keep = v <= 6
  assert keep.mean() > 0.8
  v = np.minimum(v, 6)
  lo, hi = oracle.e2m1_neighbours(v)
  std_err = np.sqrt((hi - v) * (v - lo) / n) * unit
  tol = 5 * std_err + 2.0**-20 * np.abs(x) + 2.0**-24 * (hi - lo) * unit
  err = np.abs(mean - x)
  assert np.all(err[keep] <= tol[keep]), np.max((err - tol)[keep])


def test_stochastic_rounding_is_deterministic_per_key_and_varies_across_keys(rng, prng_key):
  x = jnp.asarray(oracle.random_matrix(rng, (16, 32)))
  a = data_codes(rowwise(x, NV_SR, key=prng_key))
  b = data_codes(rowwise(x, NV_SR, key=prng_key))
  c = data_codes(rowwise(x, NV_SR, key=jax.random.fold_in(prng_key, 7)))
  np.testing.assert_array_equal(a, b)
  assert np.any(a != c)


# ------------------------------------------------------------------------------------------------
# Special values


@pytest.mark.parametrize("variant", ["1d", "2d", "row_scaled"])
def test_all_zeros_give_zero_scales_and_payload(variant):
  # amax 0 -> S_enc = 1; every block amax 0 -> S_dec = 0 -> S_enc_b = 0 -> zero payload
  t = rowwise(np.zeros((16, 32), np.float32), VARIANTS[variant])
  assert np.all(data_codes(t) == 0) and np.all(scale_bytes(t) == 0)
  assert np.all(np.asarray(t.amax) == 0) and np.all(np.asarray(dequantize(t)) == 0)


def test_subnormal_inputs_beside_normal_values_become_signed_zeros(rng):
  x = oracle.random_matrix(rng, (2, 16), spread=False)
  x[0, :2] = [1e-40, -1e-40]
  assert data_codes(rowwise(x, NV))[0, :2].tolist() == [0x0, 0x8]


def test_all_subnormal_tensor_dequantizes_within_flt_min():
  x = np.zeros((1, 16), np.float32)
  x[0, :3] = [1e-40, -2e-39, 5e-42]
  got = np.asarray(dequantize(rowwise(x, NV)), np.float64)
  assert np.all(np.abs(got - x.astype(np.float64)) <= 2.0**-126)


def test_block_whose_scale_rounds_to_zero_gets_a_zero_payload(rng):
  # a 1e30 outlier makes S_enc = 2688 / 1e30; every other block has amax_b * S_enc / 6 ~ 1e-27
  # < 2^-10, so S_dec_b = 0 and S_enc_b = 0: payload x * 0 = signed zero. The outlier's block:
  # S_dec = e4m3(1e30 * S_enc / 6) = 448, S_enc_b = 6e-30: outlier -> 6 (7), its neighbours ->
  # signed zeros.
  x = oracle.random_matrix(rng, (4, 32), spread=False)
  x[1, 5] = 1e30
  t = rowwise(x, NV)
  want = np.where(np.signbit(x), np.uint8(0x8), np.uint8(0))
  want[1, 5] = 0x7
  np.testing.assert_array_equal(data_codes(t), want)
  want_scales = np.zeros((4, 2), np.uint8)
  want_scales[1, 0] = 0x7E
  np.testing.assert_array_equal(scale_bytes(t), want_scales)


def test_row_scaled_outlier_only_affects_its_row(rng):
  x = oracle.random_matrix(rng, (4, 32), spread=False)
  y = x.copy()
  y[1, 5] = 1e30
  a, b = rowwise(x, NV_ROW), rowwise(y, NV_ROW)
  rows = [0, 2, 3]
  np.testing.assert_array_equal(data_codes(a)[rows], data_codes(b)[rows])
  np.testing.assert_array_equal(scale_bytes(a)[rows], scale_bytes(b)[rows])
  assert data_codes(b)[1, 5] == 0x7 and scale_bytes(b)[1, 0] == 0x7E


@pytest.mark.parametrize("variant", ["1d", "2d"])
def test_nan_makes_the_whole_per_tensor_quantization_nan(rng, variant):
  # amax NaN -> S_enc NaN -> every S_dec_b NaN (0x7F) -> S_enc_b NaN -> every payload NaN,
  # which E2M1 encodes as 0x7 (no NaN code); every decoded value is NaN
  x = oracle.random_matrix(rng, (16, 32))
  x[3, 9] = np.nan
  t = rowwise(x, VARIANTS[variant])
  assert np.all(data_codes(t) == 0x7) and np.all(scale_bytes(t) == 0x7F)
  assert np.isnan(float(t.amax)) and np.all(np.isnan(np.asarray(dequantize(t))))


def test_row_scaled_nan_stays_in_its_row(rng):
  x = oracle.random_matrix(rng, (4, 32))
  y = x.copy()
  y[2, 20] = np.nan
  a, b = rowwise(x, NV_ROW), rowwise(y, NV_ROW)
  assert np.all(data_codes(b)[2] == 0x7) and np.all(scale_bytes(b)[2] == 0x7F)
  rows = [0, 1, 3]
  np.testing.assert_array_equal(data_codes(a)[rows], data_codes(b)[rows])
  assert np.all(np.isfinite(np.asarray(dequantize(b))[rows]))


def test_infinity_saturates_its_block_and_makes_the_decode_factor_infinite():
  # amax = inf -> S_enc = 2688 / inf = 0 -> 1.
  # block 0 (+inf, -inf, 3): S_dec = e4m3(inf / 6) saturates to 448 (0x7E), S_enc_b = 1/448:
  #   +-inf -> +-6 (0x7, 0xF), 3 / 448 = 0.0067 -> 0.
  # block 1 (1, -0.5, 0.25): S_dec = e4m3(fl(1/6)) = 0.171875 = 1.375 * 2^-3 (0x23), S_enc_b =
  #   5.818: 1 -> 5.8 -> 6 (7), -0.5 -> -2.9 -> -3 (0xD), 0.25 -> 1.45 -> 1.5 (3).
  # Decode x' = q * S_dec_b * amax / 2688 with amax = inf: +-inf where q != 0, NaN (0 * inf)
  # where q == 0 -- the section 3 formula; a tensor holding inf does not decode to finite values.
  x = np.zeros((1, 32), np.float32)
  x[0, :3] = [np.inf, -np.inf, 3.0]
  x[0, 16:19] = [1.0, -0.5, 0.25]
  t = rowwise(x, NV)
  assert data_codes(t)[0, :3].tolist() == [0x7, 0xF, 0x0]
  assert data_codes(t)[0, 16:19].tolist() == [0x7, 0xD, 0x3]
  assert scale_bytes(t).tolist() == [[0x7E, 0x23]]
  got = np.asarray(dequantize(t))[0]
  assert got[0] == np.inf and got[1] == -np.inf and got[16] == np.inf and got[17] == -np.inf
  assert np.isnan(got[2]) and np.isnan(got[5])
