"""ScaledTensor and QuantizedTensor are pytrees: arrays are leaves, the quantizer and flags are
static aux data, so they pass through jit, vmap, tree_map and buffer donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
from helpers import assert_same_leaves, data_codes, quantize

pytestmark = pytest.mark.usefixtures("core_backend")

HYBRID = jq.HybridQuantizer(jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer(rht=True))


def test_leaves_are_the_arrays_and_the_quantizer_is_static(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (16, 32)))
  qt = quantize(x, jq.Float8CurrentScalingQuantizer())
  leaves, treedef = jax.tree_util.tree_flatten(qt)
  assert [np.shape(leaf) for leaf in leaves] == [(16, 32), (), (), (32, 16), (), ()]
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert rebuilt.quantizer == qt.quantizer and rebuilt.rowwise.orig_dtype == np.float32
  # the quantizer is part of the tree structure: other formats give other treedefs
  other = quantize(x, jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2))
  assert jax.tree_util.tree_structure(other) != treedef


def test_identity_storage_has_only_data_leaves(rng):
  qt = quantize(jnp.asarray(oracle.random_matrix(rng, (4, 8))), jq.IdentityQuantizer())
  assert len(jax.tree_util.tree_leaves(qt)) == 2


def test_tree_map_rebuilds_an_equal_tensor_with_its_static_fields(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (32, 32)))
  qt = quantize(x, HYBRID)
  copy = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), qt)
  assert_same_leaves(copy, qt, "tree_map copy")
  assert copy.columnwise.rht and not copy.rowwise.rht and copy.quantizer == HYBRID
  same = jax.tree_util.tree_map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                                qt, copy)
  assert all(jax.tree_util.tree_leaves(same))


def test_quantized_tensor_passes_through_jit_unchanged(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (32, 32)))
  qt = quantize(x, HYBRID)
  out = jax.jit(lambda t: t)(qt)
  assert_same_leaves(out, qt, "jit identity")
  assert out.columnwise.rht and out.rowwise.quantizer == HYBRID.rowwise


def test_quantize_under_jit_equals_eager(rng):
  q = jq.Float8CurrentScalingQuantizer()
  x = jnp.asarray(oracle.random_matrix(rng, (8, 40)))
  assert_same_leaves(quantize(x, q), jq.ops.quantize(x, q), "jit vs eager")


def test_dequantize_under_jit_takes_a_quantized_tensor_argument(rng):
  x = jnp.asarray(oracle.random_matrix(rng, (32, 32)))
  qt = quantize(x, HYBRID)
  got = jax.jit(jq.ops.dequantize)(qt)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(qt.rowwise.dequantize()))


@pytest.mark.parametrize("q", [jq.Float8CurrentScalingQuantizer(), jq.NVFP4Quantizer(),
                               HYBRID], ids=["fp8", "nvfp4", "hybrid"])
def test_vmap_over_a_leading_batch_axis_quantizes_each_element_separately(rng, q):
  """Inside vmap each batch element is its own tensor (per-tensor amax per element)."""
  x = jnp.asarray(oracle.random_matrix(rng, (3, 32, 32)))
  batched = jax.jit(jax.vmap(lambda xb: jq.ops.quantize(xb, q)))(x)
  assert batched.rowwise.data.shape == (3, 32, 32)
  for b in range(3):
    one = quantize(x[b], q)
    assert_same_leaves(jax.tree_util.tree_map(lambda a: a[b], batched), one, f"batch {b}")


def test_jit_with_donation_accepts_a_quantized_tensor(rng):
  q = jq.MXFP8Quantizer()
  x = jnp.asarray(oracle.random_matrix(rng, (32, 64)))

  def requantize(t):
    return jq.ops.quantize(jq.ops.dequantize(t) * 2, q)

  expected = jax.jit(requantize)(quantize(x, q))
  donated = quantize(x, q)
  out = jax.jit(requantize, donate_argnums=0)(donated)
  assert_same_leaves(out, expected, "donated")
  # the donation was honoured: at least the payload buffers were given to the output
  assert any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(donated))
  np.testing.assert_array_equal(data_codes(out.rowwise), data_codes(expected.rowwise))
