"""HybridQuantizer: one format per direction ("hybrid storage"), and the columnwise copy built
from the dequantized rowwise one (`columnwise_source="rowwise_dequantized"`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import assert_same_leaves, data_codes, quantize

pytestmark = pytest.mark.usefixtures("core_backend")

PAIRS = {
    "mxfp8/nvfp4-rht": (jq.MXFP8Quantizer(), jq.NVFP4Quantizer(rht=True)),
    "nvfp4-rowscaled/mxfp8": (jq.NVFP4Quantizer(row_scaled=True), jq.MXFP8Quantizer()),
    "fp8-current/identity": (jq.Float8CurrentScalingQuantizer(), jq.IdentityQuantizer()),
    "fp8-block/fp8-e5m2": (jq.Float8BlockQuantizer(), jq.Float8CurrentScalingQuantizer(
        jnp.float8_e5m2)),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_each_half_comes_from_its_own_sub_quantizer(rng, pair):
  row_q, col_q = PAIRS[pair]
  x = jnp.asarray(oracle.random_matrix(rng, (32, 48), jnp.bfloat16))
  qt = quantize(x, jq.HybridQuantizer(rowwise=row_q, columnwise=col_q))
  assert qt.rowwise.quantizer == row_q and qt.columnwise.quantizer == col_q
  assert_same_leaves(qt.rowwise, quantize(x, row_q, columnwise=False).rowwise, "rowwise")
  assert_same_leaves(qt.columnwise, quantize(x, col_q, rowwise=False).columnwise, "columnwise")


def test_only_the_requested_direction_is_quantized(rng):
  row_q, col_q = PAIRS["mxfp8/nvfp4-rht"]
  hybrid = jq.HybridQuantizer(rowwise=row_q, columnwise=col_q)
  x = jnp.asarray(oracle.random_matrix(rng, (32, 48)))
  only_row = quantize(x, hybrid, columnwise=False)
  only_col = quantize(x, hybrid, rowwise=False)
  assert only_row.columnwise is None and only_col.rowwise is None
  assert only_col.shape == (32, 48) and only_col.columnwise.shape == (48, 32)
  assert_same_leaves(only_row.rowwise, quantize(x, row_q, columnwise=False).rowwise, "rowwise")


@pytest.mark.parametrize("row_q,col_q", [
    (jq.NVFP4Quantizer(), jq.MXFP8Quantizer()),
    (jq.Float8CurrentScalingQuantizer(), jq.NVFP4Quantizer(rht=True)),
], ids=["nvfp4->mxfp8", "fp8->nvfp4-rht"])
def test_rowwise_dequantized_source_feeds_exactly_the_dequantized_rowwise_copy(rng, row_q, col_q):
  x = jnp.asarray(oracle.random_matrix(rng, (32, 64)))
  hybrid = jq.HybridQuantizer(row_q, col_q, columnwise_source="rowwise_dequantized")
  qt = quantize(x, hybrid)
  direct = quantize(qt.rowwise.dequantize(jnp.float32), col_q, rowwise=False).columnwise
  assert_same_leaves(qt.columnwise, direct, "columnwise")
  # ... and it is really a different source than x (NVFP4 / FP8 errors change MXFP8 / NVFP4 bytes)
  from_x = quantize(x, col_q, rowwise=False).columnwise
  assert np.any(data_codes(qt.columnwise) != data_codes(from_x))


def test_rowwise_dequantized_source_is_used_even_when_rowwise_is_not_returned(rng):
  row_q, col_q = jq.NVFP4Quantizer(), jq.MXFP8Quantizer()
  hybrid = jq.HybridQuantizer(row_q, col_q, columnwise_source="rowwise_dequantized")
  x = jnp.asarray(oracle.random_matrix(rng, (16, 64)))
  qt = quantize(x, hybrid, rowwise=False)
  assert qt.rowwise is None
  assert_same_leaves(qt.columnwise, quantize(x, hybrid).columnwise, "columnwise")


def test_quantized_tensor_dequantize_prefers_rowwise_and_transposes_columnwise(rng):
  hybrid = jq.HybridQuantizer(jq.Float8CurrentScalingQuantizer(), jq.IdentityQuantizer())
  x = jnp.asarray(oracle.random_matrix(rng, (8, 24)))
  qt = quantize(x, hybrid)
  np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.asarray(qt.rowwise.dequantize()))
  col_only = quantize(x, hybrid, rowwise=False)
  np.testing.assert_array_equal(np.asarray(col_only.dequantize()), np.asarray(x))


def test_stochastic_rounding_half_is_deterministic_per_key(rng, prng_key):
  hybrid = jq.HybridQuantizer(jq.MXFP8Quantizer(),
                              jq.NVFP4Quantizer(rht=True, stochastic_rounding=True))
  x = jnp.asarray(oracle.random_matrix(rng, (32, 32)))
  a = quantize(x, hybrid, key=prng_key)
  b = quantize(x, hybrid, key=prng_key)
  c = quantize(x, hybrid, key=jax.random.fold_in(prng_key, 3))
  assert_same_leaves(a, b, "same key")
  assert np.any(data_codes(a.columnwise) != data_codes(c.columnwise))
  np.testing.assert_array_equal(data_codes(a.rowwise), data_codes(c.rowwise))  # MXFP8: no SR


def test_leaves_and_for_direction_name_the_halves():
  row_q, col_q = PAIRS["mxfp8/nvfp4-rht"]
  hybrid = jq.HybridQuantizer(rowwise=row_q, columnwise=col_q)
  assert hybrid.leaves() == (row_q, col_q)
  assert hybrid.for_direction("rowwise") is row_q and hybrid.for_direction("columnwise") is col_q
  assert row_q.for_direction("columnwise") is row_q and row_q.leaves() == (row_q,)
  assert not hybrid.stateful
  assert jq.HybridQuantizer(jq.Float8DelayedScalingQuantizer(), col_q).stateful
