"""The shard-major relayout of a kernel whose sharded output axis is not the leading one
(jaxquant/layers/shard_major.py): which specs need it, that it is a permutation of each device's
own block with an exact inverse, and the errors for what it cannot serve. The sharded programs
themselves run in tests/multidevice (test_flax_sharding.py: no all-to-all of the gated kernel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant.sharding import DenseSharding
from jaxquant.layers.shard_major import shard_major

MESH = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))


def spec(kernel):
  return DenseSharding(x=P("dp"), kernel=kernel, mesh=MESH)


@pytest.mark.parametrize("kernel_spec, shape", [
    (None, (64, 2, 32)),  # nothing known
    (P(None, None, None), (64, 2, 32)),  # nothing sharded
    (P(None, "tp"), (64, 32)),  # one output axis
    (P(None, "tp", None), (64, 8, 16)),  # the leading output axis
    (P(None, None, "tp"), (64, 1, 32)),  # behind an axis of extent 1
    (P(None, None, "dp"), (64, 1, 32)),
])
def test_axes_that_flatten_locally_need_no_relayout(kernel_spec, shape):
  assert shard_major(spec(kernel_spec), shape, 1) is None


def test_inner_sharded_axis_is_moved_shard_first_as_each_devices_block(rng):
  k, gates, n = 6, 3, 16
  relayout = shard_major(spec(P(None, None, "tp")), (k, gates, n), 1)
  assert relayout is not None and relayout.shards == 4 and relayout.run == n // 4
  assert relayout.sharding.kernel == P(None, "tp")
  kernel = rng.standard_normal((k, gates, n)).astype(np.float32)
  flat = np.asarray(relayout.kernel(jnp.asarray(kernel), 1))
  # Device d's contiguous quarter of the flat axis is exactly its shard of the 3-D kernel.
  for d in range(4):
    local = kernel[:, :, d * n // 4:(d + 1) * n // 4]
    np.testing.assert_array_equal(flat[:, d * gates * n // 4:(d + 1) * gates * n // 4],
                                  local.reshape(k, -1))
  bias = rng.standard_normal((gates, n)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(relayout.bias(jnp.asarray(bias))), flat_bias(bias))
  # The output's inverse: x @ flat kernel, re-laid, is x @ kernel exactly (same products).
  x = rng.standard_normal((5, 7, k)).astype(np.float32)
  y = relayout.output(jnp.asarray(np.einsum("btk,kn->btn", x, flat)))
  np.testing.assert_array_equal(np.asarray(y), np.einsum("btk,kgn->btgn", x, kernel))
  assert relayout.bias(None) is None


def flat_bias(bias):
  gates, n = bias.shape
  return bias.reshape(gates, 4, n // 4).transpose(1, 0, 2).reshape(-1)


def test_middle_axis_with_trailing_axes_moves_runs_of_them(rng):
  relayout = shard_major(spec(P(None, None, "tp", None)), (3, 2, 8, 5), 1)
  assert relayout.axis == 1 and relayout.run == 2 * 5
  y = rng.standard_normal((4, 2 * 8 * 5)).astype(np.float32)
  back = np.asarray(relayout.output(jnp.asarray(y)))
  # output() inverts the kernel's permutation: re-laying the restored array gives y again.
  again = np.asarray(relayout.kernel(jnp.asarray(back), 1))
  np.testing.assert_array_equal(again, y)


def test_two_sharded_axes_behind_an_unsharded_one_are_rejected():
  with pytest.raises(ValueError, match=r"kernel: output axes \(1, 2\).*at most one"):
    shard_major(spec(P(None, None, "dp", "tp")), (64, 2, 4, 8), 1)


def test_axis_not_divisible_by_its_shards_is_rejected():
  with pytest.raises(ValueError, match="extent 6 is not a multiple of its 4 shards"):
    shard_major(spec(P(None, None, "tp")), (64, 2, 6), 1)


@pytest.mark.parametrize("recipe, n, ok", [
    (jq.Float8CurrentScaling(), 8, True),  # per-tensor: no block along N
    (jq.MXFP8BlockScaling(), 128, True),  # runs of 32: whole 32-blocks
    (jq.MXFP8BlockScaling(), 64, False),  # runs of 16 would split the 32-blocks
])
def test_runs_must_hold_whole_blocks_along_n(recipe, n, ok):
  quantizers = jq.DenseQuantizers.from_recipe(recipe, "linear", "fc1")
  relayout = shard_major(spec(P(None, None, "tp")), (128, 2, n), 1)
  if ok:
    relayout.check_blocks(quantizers, MESH)
  else:
    with pytest.raises(ValueError, match="kernel: the output features"):
      relayout.check_blocks(quantizers, MESH)
