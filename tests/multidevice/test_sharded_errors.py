"""A shard boundary that would cut a scaling block is rejected with an error naming the axis,
the mesh axes and the block: by `jaxquant.dense` when it is traced (the specs are known), and by
the FFI ops' partitioners when sharding arrives by propagation (compile time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import sharded


def _mesh(devices):
  return sharded.make_mesh(devices, "tp")


def _axis(mesh):
  return "tp" if mesh.shape["tp"] > 1 else "dp"


def test_dense_rejects_rows_that_split_columnwise_blocks(devices):
  mesh = _mesh(devices)
  axis = _axis(mesh)
  x = jnp.ones((2, 64, 256), jnp.float32)  # 128 rows -> 64 per shard; 1x128 blocks along rows
  w = jnp.ones((256, 256), jnp.float32)
  quantizers = sharded.quantizers_of(jq.Float8BlockScaling())
  spec = jq.sharding.DenseSharding(P(None, axis, None), P(), mesh)
  with pytest.raises(ValueError, match=rf"x: the rows of x \(128\) sharded over mesh axes "
                                       rf"'{axis}' \(2 shards\) would split the 128-long"):
    jax.eval_shape(lambda x, w: jq.dense(x, w, None, quantizers, sharding=spec), x, w)


def test_dense_rejects_contraction_shards_that_split_blocks(devices):
  mesh = _mesh(devices)
  axis = _axis(mesh)
  x = jnp.ones((4, 32, 96), jnp.float32)  # K = 96 -> 48 per shard; MXFP8 blocks of 32
  w = jnp.ones((96, 64), jnp.float32)
  quantizers = sharded.quantizers_of(jq.MXFP8BlockScaling())
  spec = jq.sharding.DenseSharding(P(None, None, axis), P(axis, None), mesh)
  with pytest.raises(ValueError, match=rf"kernel: the input features \(K\) of kernel \(96\) "
                                       rf"sharded over mesh axes '{axis}' \(2 shards\) would "
                                       "split the 32-long"):
    jax.eval_shape(lambda x, w: jq.dense(x, w, None, quantizers, sharding=spec), x, w)


@pytest.mark.parametrize("backend", ["ffi"])
def test_partitioned_quantize_rejects_a_block_splitting_sharding(backend, devices, monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  mesh = _mesh(devices)
  axis = _axis(mesh)
  x = jax.device_put(np.ones((128, 256), np.float32), NamedSharding(mesh, P(axis, None)))
  quantize = jax.jit(lambda x: jq.ops.quantize(x, jq.Float8BlockQuantizer()))
  with pytest.raises(Exception, match=rf"jaxquant_quantize_fp8_block: the rows of x \(128\) "
                                      rf"sharded over mesh axes '{axis}'"):
    quantize(x)


def test_fsdp_split_blocks_is_gathered_in_high_precision_not_rejected(devices):
  """The one case handled by replication: an FSDP weight (see test_sharded_hlo)."""
  mesh = sharded.make_mesh(devices, "fsdp")
  plan = jq.sharding.plan_dense(
      jq.sharding.DenseSharding(P(("dp", "fsdp"), None), P("fsdp", None), mesh), (512, 128),
      (128, 256), 1, jq.Float8BlockQuantizer(block=(128, 128)), ("rowwise", "columnwise"))
  assert plan.fsdp_axes == ("fsdp",) and plan.weight_gather == "high-precision"
  assert plan.weight_gathered == P(None, None)


def test_rows_that_cannot_stay_local_are_reported_by_explain(devices):
  """[B, S, K] with S sharded and two sequences per shard of B: the flattened GEMM rows are not
  block-sharded, so XLA reshards x; explain says so instead of hiding the communication."""
  mesh = sharded.make_mesh(devices, "tp")
  axis = _axis(mesh)
  other = "dp" if axis == "tp" else "fsdp"
  x = jnp.ones((2 * mesh.shape[other], 64, 128), jnp.float32)
  w = jnp.ones((128, 128), jnp.float32)
  quantizers = sharded.quantizers_of(jq.Float8CurrentScaling())
  spec = jq.sharding.DenseSharding(P(other, axis, None), P(), mesh)
  report = jq.explain(lambda x, w: jq.dense(x, w, None, quantizers, sharding=spec), x, w)
  (decision,) = [d for d in report if d.op == "sharding"]
  assert decision.path == "reshard" and "2 elements per shard" in decision.reason
