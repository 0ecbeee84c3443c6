"""Sharded quantized dense = single-device quantized dense.

For every layout (DP, FSDP, column- and row-parallel, sequence-sharded activations), every
built-in recipe and a hybrid zoo recipe, on the reference path and on the FFI path (its CPU
handlers in CI, the CUDA kernels on GPUs): the quantized storages of x, W^T and dy (bytes and
scales) equal the single-device ones bit for bit, and y, dx, dW, db equal them within the
reordered-sum bound of `bounds.py` (the sharded program sums K or the batch in another order;
float32 partial sums here; the FP8 tensor-core term where a GEMM took a cuBLASLt path).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.backends.ffi.gemm
from helpers import assert_same_leaves
import bounds
import sharded

BACKENDS = ("reference", "ffi")
_SINGLE: dict = {}  # (recipe, backend, shape) -> (single-device step, its explain report)


def _assert_within_bound(layout_name, storages, got, want, report, mesh, b, dy):
  """y, dx, dW, db against `bounds.py`'s bound, M from the storages both programs multiplied."""
  xs, wts, dys = storages
  rows = sharded.ROWS
  sums = bounds.gemm_sums(report, (), mesh, {"fprop": sharded.K, "dgrad": sharded.N,
                                             "wgrad": rows})
  dy2d = np.abs(np.asarray(dy, np.float64)).reshape(rows, sharded.N)
  checks = (("y", bounds.gemm_magnitude(xs.rowwise, wts.rowwise), sums["fprop"], b),
            ("dx", bounds.gemm_magnitude(dys.rowwise, wts.columnwise), sums["dgrad"], 0.0),
            ("dW", bounds.gemm_magnitude(xs.columnwise, dys.columnwise), sums["wgrad"], 0.0),
            ("db", dy2d.sum(0), bounds.Sum(rows), 0.0))  # float32 rows of dy, XLA's sum
  for (name, magnitude, how, bias), g, w in zip(checks, got, want):
    w = np.asarray(w)
    bounds.assert_within(g, w, magnitude.reshape(w.shape), how, f"{name} ({layout_name})",
                         bias_magnitude=np.abs(np.asarray(bias, np.float64)))


@pytest.fixture
def backend(request, monkeypatch):
  name = request.param
  monkeypatch.setenv("JAXQUANT_BACKEND", name)
  # cuBLASLt's fast FP8 accumulation (the forward default) promotes to float32 only at the end:
  # not a float32 reduction, so these comparisons use split accumulation everywhere.
  monkeypatch.setenv("JAXQUANT_FP8_ACCUMULATION", "split")
  # The CPU GEMM handlers serve small problems only; these shapes are just above the default.
  monkeypatch.setattr(jaxquant.backends.ffi.gemm, "CPU_MAX_MACS", 1 << 26)
  return name


# The XLA-fused quantize serves per-tensor FP8 only (JAXQUANT_BACKEND=xla refuses the rest).
CASES = ([(b, r) for b in BACKENDS for r in sharded.RECIPES] +
         [("xla", r) for r in ("fp8_current", "fp8_delayed")])


# The reference and XLA backends under a mesh are jnp code that GSPMD partitions: a recipe's
# program goes through the same partitioner on every layout, so each recipe runs on the layouts
# below (per-tensor FP8 on all five between its two recipes, each block format on one where it
# passed before); the FFI backend, whose sharding is jaxquant's own (custom partitioning), takes
# every recipe on every layout. (A reference case compiled for 5-35 s on two CPU cores; on all
# layouts these were ~4 of the suite's ~30 minutes.) The hybrid zoo recipe quantizes with MXFP8
# and NVFP4, each partitioned as in its own recipe's case, so it runs on the FFI backend only
# (its reference case took ~16 CPU-s).
GSPMD_LAYOUTS = {
    "fp8_current": ("dp", "column_parallel", "row_parallel"),
    "fp8_delayed": ("fsdp", "sequence"),
    "fp8_block": ("row_parallel",),
    "mxfp8": ("dp",),
    "nvfp4": ("column_parallel",),
    "zoo:mxfp8_fwd_nvfp4_bwd": (),
}


@pytest.mark.parametrize("backend,recipe_name", CASES, indirect=["backend"])
@pytest.mark.parametrize("layout_name", list(sharded.LAYOUTS))
def test_sharded_dense_matches_single_device(layout_name, recipe_name, backend, devices, rng):
  if backend != "ffi" and layout_name not in GSPMD_LAYOUTS[recipe_name]:
    pytest.skip(f"{backend} {recipe_name} runs on {GSPMD_LAYOUTS[recipe_name] or 'no'} layouts")
  layout = sharded.LAYOUTS[layout_name]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(sharded.RECIPES[recipe_name]())
  states = sharded.delayed_states(quantizers)
  x, w, b, dy, key = sharded.inputs(rng, layout, mesh)

  cache_key = (recipe_name, backend, x.shape)
  if cache_key not in _SINGLE:
    single = sharded.step_fn(quantizers, layout, None)
    _SINGLE[cache_key] = single, jq.explain(single, x, w, b, dy, key, states)
  single, report = _SINGLE[cache_key]
  want_storages, want = single(x, w, b, dy, key, states)

  got_storages, got = sharded.step_fn(quantizers, layout, mesh)(
      *sharded.put(mesh, layout, x, w, b, dy), key, states)

  for name, g, s in zip(("x", "W^T", "dy"), got_storages, want_storages):
    assert_same_leaves(jax.device_get(g), jax.device_get(s), f"{name} storage ({layout_name})")
  _assert_within_bound(f"{layout_name}, {recipe_name}, {backend}", jax.device_get(want_storages),
                       got, want, report, mesh, b, dy)
  # The outputs keep the layout: y and dx like x's leading axes, dW like the kernel.
  y_spec = P(*(tuple(layout.x)[:2] + (None,) * 2)[:2], layout.kernel[1])
  for value, spec in ((got[0], y_spec), (got[1], layout.x), (got[2], layout.kernel)):
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), (
        value.sharding, spec)
