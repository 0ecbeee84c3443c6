"""`bounds.py` on sums whose orders are known: reordered float32 sums and bf16 partial sums stay
inside the bound, and a sum that lost a shard's partial does not."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import bounds


def _terms(rng, rows=64, n=512):
  return (rng.standard_normal((rows, n)) * np.exp2(rng.integers(-8, 8, (rows, n)))).astype(
      np.float32)


def _sequential(terms, dtype=np.float32):
  acc = np.zeros(terms.shape[0], dtype)
  for i in range(terms.shape[1]):
    acc = (acc + terms[:, i].astype(dtype)).astype(dtype)
  return acc


def _sharded(terms, shards, reduce_dtype):
  """Each shard's float32 sum (last term first), rounded to `reduce_dtype`, then added."""
  parts = [_sequential(p[:, ::-1]).astype(reduce_dtype)
           for p in np.split(terms, shards, axis=1)]
  return _sequential(np.stack(parts, 1).astype(np.float32), reduce_dtype).astype(np.float32)


@pytest.mark.parametrize("shards", [2, 8])
def test_reordered_float32_sums_are_within_the_bound(shards, rng):
  terms = _terms(rng)
  magnitude = np.abs(terms.astype(np.float64)).sum(1)
  how = bounds.Sum(terms.shape[1], shards)
  bounds.assert_within(_sharded(terms, shards, np.float32), _sequential(terms), magnitude, how)
  lost = _sharded(terms[:, terms.shape[1] // shards:], shards - 1, np.float32)  # one shard less
  with pytest.raises(AssertionError, match="past the reordered-sum bound"):
    bounds.assert_within(lost, _sequential(terms), magnitude, how)


def test_bf16_partial_sums_need_their_shards_term(rng):
  terms, shards = _terms(rng), 8
  magnitude = np.abs(terms.astype(np.float64)).sum(1)
  got = _sharded(terms, shards, jnp.bfloat16)
  bounds.assert_within(got, _sequential(terms), magnitude,
                       bounds.Sum(terms.shape[1], shards, jnp.bfloat16))
  with pytest.raises(AssertionError, match="past the reordered-sum bound"):
    bounds.assert_within(got, _sequential(terms), magnitude, bounds.Sum(terms.shape[1], shards))


def test_the_coefficient_is_the_derived_one():
  u = 2.0**-24
  assert bounds.Sum(257).coefficient() == pytest.approx(2 * 256 * u / (1 - 256 * u), rel=1e-12)
  bf16 = bounds.Sum(257, 4, jnp.bfloat16, tensor_core=2.0**-9).coefficient()
  assert bf16 == pytest.approx(2 * 256 * u / (1 - 256 * u) + 4 * 2.0**-8 * (1 + 4 * 2.0**-8)
                               + 2 * 2.0**-9, rel=1e-12)
