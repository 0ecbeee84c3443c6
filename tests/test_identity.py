"""Identity (`IdentityQuantizer`): the high-precision tensor itself, optionally cast."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import dequantize, quantize

pytestmark = pytest.mark.usefixtures("core_backend")


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_passthrough_keeps_every_bit_in_both_directions(rng, in_dtype):
  x = oracle.random_matrix(rng, (17, 33), in_dtype)
  x[0, :5] = [np.inf, -np.inf, np.nan, -0.0, 1e-40]  # (1e-40: a subnormal, or 0 in 16 bits)
  qt = quantize(jnp.asarray(x), jq.IdentityQuantizer())
  np.testing.assert_array_equal(np.asarray(qt.rowwise.data).view(np.uint8), x.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(qt.columnwise.data).view(np.uint8),
                                np.ascontiguousarray(x.T).view(np.uint8))
  for t in (qt.rowwise, qt.columnwise):
    assert t.scale_inv is None and t.amax is None and t.data.dtype == np.dtype(in_dtype)
  assert jax.tree_util.tree_leaves(qt) == [qt.rowwise.data, qt.columnwise.data]


def test_cast_to_bfloat16_is_round_to_nearest_even(rng):
  x = oracle.random_matrix(rng, (16, 40))
  x[0, :3] = [np.inf, np.nan, 1e-40]
  t = quantize(jnp.asarray(x), jq.IdentityQuantizer(jnp.bfloat16), columnwise=False).rowwise
  assert t.data.dtype == jnp.bfloat16 and t.orig_dtype == np.float32
  want = x.astype(ml_dtypes.bfloat16)
  got = np.asarray(t.data)
  # XLA:CPU flushes the float32 subnormal 1e-40 to zero; ml_dtypes keeps the bfloat16 subnormal
  np.testing.assert_array_equal(got.view(np.uint16)[:, 3:], want.view(np.uint16)[:, 3:])
  np.testing.assert_array_equal(got.view(np.uint16)[1:], want.view(np.uint16)[1:])
  assert got[0, 0] == np.inf and np.isnan(np.float32(got[0, 1]))
  assert abs(float(got[0, 2])) <= 1e-40


def test_dequantize_returns_the_values_in_float32(rng):
  x = oracle.random_matrix(rng, (5, 100), jnp.bfloat16)
  qt = quantize(jnp.asarray(x), jq.IdentityQuantizer())
  np.testing.assert_array_equal(np.asarray(dequantize(qt.rowwise)), x.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(qt.dequantize()), x.astype(np.float32))
  assert qt.rowwise.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


def test_zeros_stay_zeros():
  x = jnp.zeros((3, 7), jnp.float32).at[1, 2].set(-0.0)
  t = quantize(x, jq.IdentityQuantizer(), columnwise=False).rowwise
  np.testing.assert_array_equal(np.asarray(t.data).view(np.uint32), np.asarray(x).view(np.uint32))
