"""Sharded quantized dense = single-device quantized dense.

For every layout (DP, FSDP, column- and row-parallel, sequence-sharded activations), every
built-in recipe and a hybrid zoo recipe, on the reference path and on the FFI path (its CPU
handlers in CI, the CUDA kernels on GPUs): the quantized storages of x, W^T and dy (bytes and
scales) equal the single-device ones bit for bit, and y, dx, dW, db equal them within float32
reduction-order tolerance (the sharded program sums K or the batch in another order).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
import jaxquant.backends.ffi.gemm
from helpers import assert_same_leaves
import sharded

BACKENDS = ("reference", "ffi")
_SINGLE: dict = {}  # (recipe, backend, shape) -> compiled single-device step


def _tolerance_check(name, got, want, backend):
  """float32 accumulation-order tolerance: |got - want| <= 1e-5 * max|want| + 1e-6.

  On CUDA the FFI's FP8 GEMMs run on tensor cores, which accumulate in reduced precision
  between float32 promotions (split accumulation; test_ffi_gemm.py uses the same 2^-9 bound),
  so the sum of two K halves differs from the whole by more than float32 reordering."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = float(np.max(np.abs(want))) or 1.0
  tensor_cores = backend == "ffi" and jax.default_backend() == "gpu"
  atol = (2.0**-9 if tensor_cores else 1e-5) * scale + 1e-6
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=name)


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


@pytest.mark.parametrize("backend,recipe_name", CASES, indirect=["backend"])
@pytest.mark.parametrize("layout_name", list(sharded.LAYOUTS))
def test_sharded_dense_matches_single_device(layout_name, recipe_name, backend, devices, rng):
  layout = sharded.LAYOUTS[layout_name]
  mesh = sharded.make_mesh(devices, layout.main)
  quantizers = sharded.quantizers_of(sharded.RECIPES[recipe_name]())
  states = sharded.delayed_states(quantizers)
  x, w, b, dy, key = sharded.inputs(rng, layout, mesh)

  cache_key = (recipe_name, backend, x.shape)
  if cache_key not in _SINGLE:
    _SINGLE[cache_key] = sharded.step_fn(quantizers, layout, None)
  want_storages, want = _SINGLE[cache_key](x, w, b, dy, key, states)

  got_storages, got = sharded.step_fn(quantizers, layout, mesh)(
      *sharded.put(mesh, layout, x, w, b, dy), key, states)

  for name, g, s in zip(("x", "W^T", "dy"), got_storages, want_storages):
    assert_same_leaves(jax.device_get(g), jax.device_get(s), f"{name} storage ({layout_name})")
  for name, g, s in zip(("y", "dx", "dW", "db"), got, want):
    _tolerance_check(f"{name} ({layout_name}, {recipe_name}, {backend})", g, s, backend)
  # The outputs keep the layout: y and dx like x's leading axes, dW like the kernel.
  y_spec = P(*(tuple(layout.x)[:2] + (None,) * 2)[:2], layout.kernel[1])
  for value, spec in ((got[0], y_spec), (got[1], layout.x), (got[2], layout.kernel)):
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), (
        value.sharding, spec)
