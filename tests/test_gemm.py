"""`jaxquant.ops.gemm` (TN: C[m, n] = sum_k A[m, k] B[n, k]): every operand dequantized exactly,
float32 accumulation, NVFP4's per-tensor / per-row factors as an epilogue, bias, output dtype,
mixed format pairs, and the random Hadamard transform cancelling in the wgrad GEMM.

Tolerance for "equals the float64 product of the dequantized operands": float32 accumulation of
K products is within gamma_K = K * 2^-24 of sum_k |a_k| |b_k| (the classic dot-product bound),
plus a few roundings of the decode factors; with K <= 128 that is below 1e-5 * (|A| @ |B|^T), the
tolerance used throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import columnwise, data_codes, rowwise, scale_bytes

pytestmark = pytest.mark.usefixtures("core_backend")

RTOL = 1e-5
M, N, K = 16, 24, 96

FORMATS = {
    "fp8-e4m3": jq.Float8CurrentScalingQuantizer(),
    "fp8-e5m2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
    "mxfp8": jq.MXFP8Quantizer(),
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4-row": jq.NVFP4Quantizer(row_scaled=True),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
    "block-1x128": jq.Float8BlockQuantizer((1, 128)),
    "block-128x128": jq.Float8BlockQuantizer((128, 128)),
    "identity": jq.IdentityQuantizer(),
    "plain": None,  # a plain high-precision array
}
PAIRS = [("fp8-e4m3", "fp8-e4m3"), ("fp8-e4m3", "fp8-e5m2"), ("mxfp8", "mxfp8"),
         ("nvfp4", "nvfp4-2d"), ("nvfp4-row", "nvfp4-row"), ("block-1x128", "block-128x128"),
         ("mxfp8", "nvfp4"), ("nvfp4-row", "mxfp8"), ("identity", "block-1x128"),
         ("plain", "nvfp4-row"), ("fp8-e5m2", "plain")]


def _operand(x, name):
  q = FORMATS[name]
  return jnp.asarray(x) if q is None else rowwise(x, q)


def _values(operand) -> np.ndarray:
  if isinstance(operand, jq.ScaledTensor):
    return np.asarray(operand.dequantize(jnp.float32), np.float64)
  return np.asarray(operand, np.float64)


def _check_close(got, a64, b64):
  want = a64 @ b64.T
  tol = RTOL * (np.abs(a64) @ np.abs(b64).T) + 1e-30
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= tol), np.max(err / tol)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}x{b}" for a, b in PAIRS])
def test_gemm_equals_float64_product_of_the_dequantized_operands(rng, pair):
  a = _operand(oracle.random_matrix(rng, (M, K)), pair[0])
  b = _operand(oracle.random_matrix(rng, (N, K)), pair[1])
  got = jq.ops.gemm(a, b, out_dtype=jnp.float32)
  assert got.shape == (M, N) and got.dtype == jnp.float32
  _check_close(got, _values(a), _values(b))


def test_row_scaled_nvfp4_gemm_applies_the_outer_product_of_row_factors(rng):
  """C = (raw_a @ raw_b^T) * outer(amax_a / 2688, amax_b / 2688), with raw = q * S_dec_b decoded
  here from the stored bytes (no jaxquant decode involved)."""
  q = jq.NVFP4Quantizer(row_scaled=True)
  a = rowwise(oracle.random_matrix(rng, (M, K)), q)
  b = rowwise(oracle.random_matrix(rng, (N, K)), q)

  def raw(t):
    s = oracle.expand(oracle.decode_codes(scale_bytes(t), oracle.E4M3), 1, 16, t.shape)
    return oracle.decode_codes(data_codes(t), oracle.E2M1) * s

  fa = np.asarray(a.amax, np.float64) / 2688
  fb = np.asarray(b.amax, np.float64) / 2688
  assert fa.shape == (M,) and fb.shape == (N,)
  scale = np.outer(fa, fb)
  want = raw(a) @ raw(b).T * scale
  tol = RTOL * (np.abs(raw(a)) @ np.abs(raw(b)).T) * scale
  got = np.asarray(jq.ops.gemm(a, b, out_dtype=jnp.float32), np.float64)
  assert np.all(np.abs(got - want) <= tol)


def test_bias_is_added_once_in_float32_after_accumulation(rng):
  a = rowwise(oracle.random_matrix(rng, (M, K)), FORMATS["mxfp8"])
  b = rowwise(oracle.random_matrix(rng, (N, K)), FORMATS["nvfp4"])
  bias = jnp.asarray(oracle.random_matrix(rng, (N,), jnp.bfloat16))
  no_bias = jq.ops.gemm(a, b, out_dtype=jnp.float32)
  with_bias = jq.ops.gemm(a, b, out_dtype=jnp.float32, bias=bias)
  np.testing.assert_array_equal(np.asarray(with_bias),
                                np.asarray(no_bias) + np.asarray(bias, np.float32))
  in_bf16 = jq.ops.gemm(a, b, out_dtype=jnp.bfloat16, bias=bias)
  np.testing.assert_array_equal(np.asarray(in_bf16),
                                np.asarray((no_bias + bias.astype(jnp.float32))
                                           .astype(jnp.bfloat16)))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_out_dtype_is_the_float32_result_cast_once(rng, out_dtype):
  a = rowwise(oracle.random_matrix(rng, (M, K)), FORMATS["fp8-e4m3"])
  b = rowwise(oracle.random_matrix(rng, (N, K)), FORMATS["mxfp8"])
  f32 = jq.ops.gemm(a, b, out_dtype=jnp.float32)
  got = jq.ops.gemm(a, b, out_dtype=out_dtype)
  assert got.dtype == out_dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(f32.astype(out_dtype)))


def test_default_out_dtype_is_the_first_operands_original_dtype(rng):
  x = oracle.random_matrix(rng, (M, K), jnp.bfloat16)
  w = oracle.random_matrix(rng, (N, K), jnp.float32)
  a, b = rowwise(x, FORMATS["mxfp8"]), rowwise(w, FORMATS["mxfp8"])
  assert jq.ops.gemm(a, b).dtype == jnp.bfloat16
  assert jq.ops.gemm(b, a).dtype == jnp.float32
  assert jq.ops.gemm(jnp.asarray(w), a).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_two_high_precision_operands_multiply_in_their_own_dtype(rng, dtype):
  x = jnp.asarray(oracle.random_matrix(rng, (M, K), dtype))
  w = jnp.asarray(oracle.random_matrix(rng, (N, K), dtype))
  got = jq.ops.gemm(x, rowwise(w, FORMATS["identity"]))
  assert got.dtype == dtype
  if dtype == jnp.float32:  # (XLA does not document how it accumulates 16-bit dots)
    _check_close(got, np.asarray(x, np.float64), np.asarray(w, np.float64))


def test_gemm_under_jit_equals_eager(rng):
  a = rowwise(oracle.random_matrix(rng, (M, K)), FORMATS["nvfp4-row"])
  b = rowwise(oracle.random_matrix(rng, (N, K)), FORMATS["mxfp8"])
  bias = jnp.ones((N,), jnp.float32)
  jitted = jax.jit(lambda a, b: jq.ops.gemm(a, b, out_dtype=jnp.float32, bias=bias))(a, b)
  eager = jq.ops.gemm(a, b, out_dtype=jnp.float32, bias=bias)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The random Hadamard transform in the wgrad GEMM


def _wgrad_error_bound(x, dy, x_col, dy_col):
  """Elementwise bound on |gemm(x_col, dy_col) - x^T dy| for NVFP4 operands (RNE).

  Both columnwise operands hold A = T(x^T), B = T(dy^T) with T the RHT along the token axis (or
  the identity without RHT), and T is orthogonal, so x^T dy = A B^T. With |dA| <= bA and
  |dB| <= bB the per-element E2M1 bounds in that domain (`oracle.rne_error_bound`, plus 2^-20 of
  each chunk's L1 norm for the float32 butterfly): |A'B'^T - AB^T| <= |A| bB^T + bA |B|^T +
  bA bB^T; plus RTOL * |A'| |B'|^T for the float32 accumulation."""
  def rotated(mat, t):
    return oracle.rht64(mat) if t.rht else np.asarray(mat, np.float64)

  def unit(t):
    s = oracle.expand(oracle.decode_codes(scale_bytes(t), oracle.E4M3), 1, 16, t.shape)
    return s * float(t.amax) / 2688

  bounds = []
  for mat, t in ((x.T, x_col), (dy.T, dy_col)):
    rot = rotated(mat, t)
    l1 = np.repeat(np.abs(np.asarray(mat, np.float64)).reshape(mat.shape[0], -1, 16).sum(-1),
                   16, axis=1)
    bounds.append((rot, oracle.rne_error_bound(rot, unit(t), oracle.E2M1) + 2.0**-20 * l1))
  (a, ba), (b, bb) = bounds
  return np.abs(a) @ bb.T + ba @ np.abs(b).T + ba @ bb.T + RTOL * ((np.abs(a) + ba) @
                                                                   (np.abs(b) + bb).T)


@pytest.mark.parametrize("rht", [True, False], ids=["rht", "plain"])
def test_nvfp4_wgrad_gemm_is_within_the_quantization_bound_of_the_exact_product(rng, rht):
  tokens = 64
  x = oracle.random_matrix(rng, (tokens, 48), spread=False)
  dy = oracle.random_matrix(rng, (tokens, 24), spread=False)
  q = jq.NVFP4Quantizer(rht=rht)
  x_col, dy_col = columnwise(x, q), columnwise(dy, q)
  assert x_col.rht == rht and dy_col.rht == rht
  got = np.asarray(jq.ops.gemm(x_col, dy_col, out_dtype=jnp.float32), np.float64)
  exact = x.astype(np.float64).T @ dy.astype(np.float64)
  assert np.all(np.abs(got - exact) <= _wgrad_error_bound(x, dy, x_col, dy_col))
  # and, as a scale check, the relative Frobenius error is that of 4-bit operands (~0.1)
  assert np.linalg.norm(got - exact) <= 0.25 * np.linalg.norm(exact)


def test_rht_wgrad_gemm_agrees_with_the_plain_one_within_both_bounds(rng):
  x = oracle.random_matrix(rng, (64, 48), spread=False)
  dy = oracle.random_matrix(rng, (64, 24), spread=False)
  with_rht = [columnwise(m, jq.NVFP4Quantizer(rht=True)) for m in (x, dy)]
  plain = [columnwise(m, jq.NVFP4Quantizer()) for m in (x, dy)]
  c_rht = np.asarray(jq.ops.gemm(*with_rht, out_dtype=jnp.float32), np.float64)
  c_plain = np.asarray(jq.ops.gemm(*plain, out_dtype=jnp.float32), np.float64)
  bound = _wgrad_error_bound(x, dy, *with_rht) + _wgrad_error_bound(x, dy, *plain)
  assert np.all(np.abs(c_rht - c_plain) <= bound)


def test_rht_gemm_equals_the_product_of_the_dequantized_operands(rng):
  """dequantize() undoes the RHT, so the float64 product of the dequantized operands is the
  rotated-domain product the GEMM computes: the transforms cancel in pairs. Tolerance: RTOL of
  |A| |B|^T for the accumulation, plus the inverse float32 butterfly of dequantize(), which moves
  each element by at most 2^-23 of its 16-chunk's L1 norm: 2^-22 * sum_chunks L1(a) L1(b)."""
  x = oracle.random_matrix(rng, (64, 48))
  dy = oracle.random_matrix(rng, (64, 24))
  q = jq.NVFP4Quantizer(rht=True)
  a, b = columnwise(x, q), columnwise(dy, q)
  got = np.asarray(jq.ops.gemm(a, b, out_dtype=jnp.float32), np.float64)
  a64, b64 = _values(a), _values(b)
  rot_a, rot_b = np.abs(oracle.rht64(a64)), np.abs(oracle.rht64(b64))
  chunk_l1 = lambda r: r.reshape(r.shape[0], -1, 16).sum(-1)
  tol = RTOL * (rot_a @ rot_b.T) + 2.0**-22 * (chunk_l1(rot_a) @ chunk_l1(rot_b).T)
  assert np.all(np.abs(got - a64 @ b64.T) <= tol)
