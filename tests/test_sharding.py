"""`jaxquant.sharding` and the partitioning layouts, on one device (abstract meshes): storage
specs per leaf, FSDP detection, block checks, Shardy rules, and the stochastic-rounding key
offset that gives each shard global (row, col) indices. The sharded programs themselves run in
tests/multidevice (8 host devices)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import jaxquant as jq
from jaxquant import sharding as jqs
from jaxquant.backends.ffi import partitioning
from jaxquant.numerics.random_bits import stochastic_round_bits

MESH = AbstractMesh((2, 2, 2), ("dp", "fsdp", "tp"))


def test_rowwise_follows_rows_cols_and_columnwise_follows_cols_rows():
  specs = jqs.storage_specs(jq.MXFP8Quantizer(), P("dp", None, "tp"))
  assert specs.rowwise.data == P(("dp",), "tp") or specs.rowwise.data == P("dp", "tp")
  assert specs.rowwise.scale_inv == specs.rowwise.data  # block scales follow their data axis
  assert specs.columnwise.data == P("tp", "dp") == specs.columnwise.scale_inv
  assert specs.rowwise.amax == P() == specs.columnwise.amax


def test_hybrid_halves_follow_their_own_formats():
  quantizer = jq.HybridQuantizer(jq.NVFP4Quantizer(row_scaled=True),
                                 jq.Float8CurrentScalingQuantizer())
  specs = jqs.storage_specs(quantizer, P(("dp", "fsdp"), "tp"))
  assert specs.rowwise.data == P(("dp", "fsdp"), "tp") == specs.rowwise.scale_inv
  assert specs.rowwise.amax == P(("dp", "fsdp"))  # one amax per row, sharded with the rows
  assert specs.columnwise.data == P("tp", ("dp", "fsdp"))
  assert specs.columnwise.scale_inv == P() == specs.columnwise.amax  # per tensor: replicated


def test_identity_storage_has_only_data():
  specs = jqs.storage_specs(jq.IdentityQuantizer(), P("dp", None), columnwise=False)
  assert specs.rowwise.data == P("dp", None) and specs.rowwise.scale_inv is None
  assert specs.columnwise is None


def test_block_split_is_rejected_naming_the_axis():
  with pytest.raises(ValueError, match=r"x: the rows of x \(256\) sharded over mesh axes "
                                       r"\('dp', 'tp'\) \(4 shards\) would split the 128-long"):
    jqs.check_blocks_fit(jq.Float8BlockQuantizer(), (256, 512), P(("dp", "tp"), None), MESH)
  jqs.check_blocks_fit(jq.Float8BlockQuantizer(), (512, 512), P(("dp", "tp"), None), MESH)
  # Rowwise-only never cuts the rows of 1x128 blocks.
  jqs.check_blocks_fit(jq.Float8BlockQuantizer(), (256, 512), P(("dp", "tp"), None), MESH,
                       directions=("rowwise",))


def test_nvfp4_rht_needs_whole_hadamard_chunks_per_shard():
  quantizer = jq.NVFP4Quantizer(rht=True)
  with pytest.raises(ValueError, match="16-long"):
    jqs.check_blocks_fit(quantizer, (8 * 3, 64), P(("dp", "fsdp", "tp"), None), MESH)


@pytest.mark.parametrize("quantizer, gather", [
    (jq.Float8CurrentScalingQuantizer(), "quantized"),
    (jq.MXFP8Quantizer(), "quantized"),
    (jq.Float8BlockQuantizer(block=(128, 128)), "high-precision"),  # 64 of K per shard
    (jq.IdentityQuantizer(), "high-precision"),
])
def test_fsdp_axes_are_kernel_axes_that_also_shard_the_rows(quantizer, gather):
  sharding = jqs.DenseSharding(P(("dp", "fsdp"), None, None), P("fsdp", "tp"), MESH)
  plan = jqs.plan_dense(sharding, (8, 32, 128), (128, 256), 1, quantizer,
                        ("rowwise", "columnwise"))
  assert plan.fsdp_axes == ("fsdp",) and plan.weight_gather == gather
  assert plan.weight == P("tp", "fsdp") and plan.weight_gathered == P("tp", None)
  assert plan.x2d == P(("dp", "fsdp"), None) and plan.y2d == P(("dp", "fsdp"), "tp")
  assert plan.kernel2d == P("fsdp", "tp")


def test_tensor_parallel_axes_are_kept():
  row_parallel = jqs.plan_dense(jqs.DenseSharding(P("dp", None, "tp"), P("tp", None), MESH),
                                (4, 32, 256), (256, 64), 1, jq.MXFP8Quantizer(),
                                ("rowwise", "columnwise"))
  assert row_parallel.fsdp_axes == () and row_parallel.weight_gather == "none"
  assert row_parallel.weight == row_parallel.weight_gathered == P(None, "tp")
  assert row_parallel.x2d == P("dp", "tp") and row_parallel.y2d == P("dp", None)


def test_rows_that_cannot_flatten_locally_are_reported():
  plan = jqs.plan_dense(jqs.DenseSharding(P("dp", "tp", None), P(), MESH), (4, 32, 64),
                        (64, 64), 1, jq.Float8CurrentScalingQuantizer(), ("rowwise",))
  assert "axis 0 before it holds 2 elements per shard" in plan.rows_note
  local = jqs.plan_dense(jqs.DenseSharding(P("dp", "tp", None), P(), MESH), (2, 32, 64),
                         (64, 64), 1, jq.Float8CurrentScalingQuantizer(), ("rowwise",))
  assert local.rows_note == ""


def test_sharding_rule_ties_block_scales_to_their_data_axis():
  layout = partitioning.Layout(
      operands=((("m", 1), ("k", 1)),),
      results=((("m", 1), ("k", 1)), (("m", 1), ("k", 32)), (("k", 1), ("m", 1)),
               (("k", 1), ("m", 32)), ()))
  rule, sizes, _ = partitioning.sharding_rule(layout, [(256, 512)],
                                              [(256, 512), (256, 16), (512, 256), (512, 8), ()])
  assert rule == ("(mq mr32) (kq kr32) -> (mq mr32) (kq kr32), (mq mr32) kq, "
                  "(kq kr32) (mq mr32), (kq kr32) mq, ")
  assert sizes == {"mr32": 32, "kr32": 32}
  # A length that is not whole blocks keeps its scales apart (they can never be sharded).
  rule, _, _ = partitioning.sharding_rule(layout, [(256, 100)],
                                          [(256, 100), (256, 4), (100, 256), (100, 8), ()])
  assert rule.split(" -> ")[1].startswith("(mq mr32) k, (mq mr32) kb32")


def test_offset_key_moves_the_stochastic_rounding_stream_to_a_shard_origin(rng):
  words = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
  row0, col0 = int(rng.integers(0, 2**31)), int(rng.integers(0, 2**31))
  shifted = partitioning.offset_key(words, jnp.uint32(row0), jnp.uint32(col0))
  np.testing.assert_array_equal(stochastic_round_bits(shifted, 8, 16),
                                stochastic_round_bits(words, 8, 16, row0, col0))
