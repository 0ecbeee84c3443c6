"""What the compiled sharded programs communicate (collectives counted in the compiled HLO).

- Sharded activations are never all-gathered: outside FSDP a quantized dense step (forward and
  backward) has no all-gather or all-to-all at all, only all-reduces (the scalar amax `pmax`es,
  the K-sharded GEMMs' `psum`s and the gradient reductions).
- A K-sharded GEMM (row-parallel forward) has exactly one all-reduce of its output, in float32.
- FSDP all-gathers the weight's quantized bytes (1 byte per FP8 element, plus block scales)
  where the format allows it, and the high-precision weight where a shard would split blocks;
  `jaxquant.explain` says which.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.backends.ffi.gemm
import sharded

BACKENDS = ("reference", "ffi")


@pytest.fixture(autouse=True)
def _small_cpu_gemms(monkeypatch):
  monkeypatch.setattr(jaxquant.backends.ffi.gemm, "CPU_MAX_MACS", 1 << 26)


def _compiled(layout, mesh, quantizers, rng, *, backward=True, kernel_shape=None):
  x, w, b, dy, key = sharded.inputs(rng, layout, mesh)
  if kernel_shape is not None:
    w = w[:kernel_shape[0], :kernel_shape[1]]
    x, b, dy = x[..., :kernel_shape[0]], b[:kernel_shape[1]], dy[..., :kernel_shape[1]]
  sharding = jq.sharding.DenseSharding(layout.x, layout.kernel, mesh)

  def step(x, w, b, dy):
    fwd = lambda x, w, b: jq.dense(x, w, b, quantizers, key=key, sharding=sharding)
    if not backward:
      return fwd(x, w, b)
    y, vjp = jax.vjp(fwd, x, w, b)
    return y, vjp(dy)

  args = sharded.put(mesh, layout, x, w, b, dy)
  report = jq.explain(step, *args)
  return sharded.collectives(jax.jit(step).lower(*args).compile().as_text()), report, x.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout_name", ["dp", "column_parallel", "row_parallel", "sequence"])
def test_sharded_activations_are_never_all_gathered(layout_name, backend, devices, rng,
                                                    monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  layout = sharded.LAYOUTS[layout_name]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(jq.MXFP8BlockScaling())
  found, _, _ = _compiled(layout, mesh, quantizers, rng)
  moved = [c for c in found if c.op in ("all-gather", "all-to-all", "collective-permute")]
  assert not moved, f"{layout_name}/{backend}: activations moved: {moved}"
  assert any(c.op == "all-reduce" for c in found)  # the program is really partitioned


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_sharded_gemm_has_one_float32_all_reduce_of_its_output(backend, devices, rng,
                                                                 monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  layout = sharded.LAYOUTS["row_parallel"]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(jq.Float8CurrentScaling())
  found, _, x_shape = _compiled(layout, mesh, quantizers, rng, backward=False)
  rows = math.prod(x_shape[:-1]) // mesh.shape["dp"]
  # (XLA:GPU flattens an all-reduce's operand to 1-D and combines small ones: count elements.)
  outputs = [c for c in found if c.op in ("all-reduce", "reduce-scatter")
             and any(math.prod(shape) > 16 for _, shape in c.arrays)]
  assert len(outputs) == 1, found
  assert [(t, math.prod(s)) for t, s in outputs[0].arrays] == [("f32", rows * sharded.N)], found
  # The others are the amax pmaxes of x and W^T (both K-sharded): a few scalars.
  assert sum(math.prod(s) for c in found if c not in outputs for _, s in c.arrays) <= 4, found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe_name, scale_bytes", [("fp8_current", 0), ("mxfp8", 1 / 32)])
def test_fsdp_all_gathers_the_quantized_weight_bytes(recipe_name, scale_bytes, backend, devices,
                                                     rng, monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  layout = sharded.LAYOUTS["fsdp"]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(sharded.RECIPES[recipe_name]())
  found, report, _ = _compiled(layout, mesh, quantizers, rng)
  gathers = [c for c in found if c.op == "all-gather"]
  # W_row (forward) and W_col (backward): one byte per element plus one E8M0 byte per block.
  weight = sharded.K * sharded.N
  assert sum(c.bytes for c in gathers) == pytest.approx(2 * weight * (1 + scale_bytes))
  assert {t for c in gathers for t, _ in c.arrays} == {"u8"}
  assert [(d.op, d.path) for d in report if d.op == "fsdp-gather"] == [("fsdp-gather",
                                                                          "quantized")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_gathers_high_precision_where_a_shard_would_split_blocks(backend, devices, rng,
                                                                      monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  layout = sharded.LAYOUTS["fsdp"]
  mesh = sharded.make_mesh(devices, layout.main)
  # 128x128 weight tiles; K = 128 over 2 FSDP shards leaves 64 rows of W per shard.
  quantizers = sharded.quantizers_of(jq.Float8BlockScaling())
  found, report, _ = _compiled(layout, mesh, quantizers, rng, kernel_shape=(128, sharded.N))
  (decision,) = [d for d in report if d.op == "fsdp-gather"]
  assert decision.path == "high-precision"
  assert "128-long scaling blocks" in decision.reason and "'fsdp'" in decision.reason
  gathers = [c for c in found if c.op == "all-gather"]
  assert gathers and {t for c in gathers for t, _ in c.arrays} == {"f32"}
  assert sum(c.bytes for c in gathers) == 4 * 128 * sharded.N  # the weight, once


def test_storages_keep_the_spec_of_their_data(devices, rng):
  """Block scales are sharded with their data axis; per-tensor scales are replicated."""
  mesh = sharded.make_mesh(devices, "tp")
  axis = "tp" if mesh.shape["tp"] > 1 else "dp"
  x = jax.device_put(rng.standard_normal((256, 512)).astype(np.float32),
                     NamedSharding(mesh, P(axis, "dp" if axis == "tp" else None)))
  quantizer = jq.HybridQuantizer(jq.MXFP8Quantizer(), jq.Float8CurrentScalingQuantizer())
  q = jax.jit(lambda x: jq.ops.quantize(x, quantizer))(x)
  want = jq.sharding.storage_specs(quantizer, x.sharding.spec)
  for got_leaf, want_spec in zip(jax.tree.leaves(q), jax.tree.leaves(
      want, is_leaf=lambda s: isinstance(s, P))):
    assert got_leaf.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), got_leaf.ndim)


def test_unknown_input_spec_is_left_to_propagation(devices, rng, monkeypatch):
  """Only the kernel's spec given (e.g. an intercepted nn.Dense with a boxed kernel_init): the
  batch-sharded input must not be constrained (and so gathered) to a guessed spec."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  layout = sharded.LAYOUTS["column_parallel"]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(jq.Float8CurrentScaling())
  x, w, b, dy, key = sharded.inputs(rng, layout, mesh)
  only_kernel = jq.sharding.DenseSharding(None, layout.kernel, mesh)

  def step(x, w, b, dy):
    y, vjp = jax.vjp(lambda x, w, b: jq.dense(x, w, b, quantizers, sharding=only_kernel),
                     x, w, b)
    return y, vjp(dy)

  hlo = jax.jit(step).lower(*sharded.put(mesh, layout, x, w, b, dy)).compile().as_text()
  assert not [c for c in sharded.collectives(hlo) if c.op in ("all-gather", "all-to-all")]
