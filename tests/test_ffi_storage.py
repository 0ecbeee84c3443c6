"""FFI storage facts and the smaller targets: FP4 packing, fast encoders, amax, FP8 transpose.

These pin down what the quantize kernels rely on: XLA stores `float4_e2m1fn` packed two codes a
byte (first element in the low nibble, rows contiguous in nibbles) and hands the handler that
packed buffer; the fast encoders equal the spec-form encoders of `ffi/jaxquant_numerics.h`
(sampled on the CPU, all 2^32 float32 inputs on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.formats.base import abs_max
from jaxquant.backends.ffi import calls, debug, registry
from jaxquant.backends.ffi import quantize as ffi_quantize
from jaxquant.backends.ffi import transpose as ffi_transpose
from jaxquant.numerics import rht16
from jaxquant.numerics.minifloat import E2M1, from_storage, to_storage
from jaxquant.backends.reference import ops as reference

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


def _pack_linear(codes: np.ndarray) -> np.ndarray:
  """XLA's FP4 layout of a row-major code matrix: nibble i = element i, low nibble first."""
  flat = codes.reshape(-1).astype(np.uint8)
  if flat.size % 2:
    flat = np.append(flat, np.uint8(0))
  return flat[0::2] | (flat[1::2] << 4)


# ------------------------------------------- FP4 ----------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(3, 5), (4, 16), (1, 7)])
def test_fp4_arrays_are_packed_two_per_byte_low_nibble_first(platform, shape, rng):
  codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
  device = _device(platform)
  nbytes = -(-codes.size // 2)
  with jax.default_device(device):
    f4 = jax.jit(lambda c: to_storage(c, E2M1))(jax.device_put(codes, device))
    raw = jax.jit(lambda a: debug.raw_bytes(a, nbytes))(f4)
  expected = _pack_linear(codes)
  got = np.asarray(raw)
  # An odd element count leaves the last high nibble unspecified (padding).
  if codes.size % 2:
    got, expected = got.copy(), expected.copy()
    got[-1] &= 0x0F
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(6, 33), (5, 32), (16, 17)])
def test_nvfp4_kernel_writes_xlas_packed_layout(platform, shape, rng):
  """The kernel's FP4 bytes are exactly XLA's packing of the reference codes (odd rows too)."""
  q = jq.NVFP4Quantizer()
  device = _device(platform)
  x = jax.device_put(rng.standard_normal(shape).astype(np.float32), device)
  with jax.default_device(device):
    row, col = jax.jit(lambda x: ffi_quantize.quantize_single(
        x, q, rowwise=True, columnwise=True, orig_dtype=x.dtype))(x)
    ref_row, ref_col = jax.jit(lambda x: reference.quantize_single(
        x, q, rowwise=True, columnwise=True, orig_dtype=x.dtype))(x)
    for got, ref in ((row, ref_row), (col, ref_col)):
      n = got.data.size
      raw = np.asarray(jax.jit(lambda a: debug.raw_bytes(a, -(-n // 2)))(got.data))
      expected = _pack_linear(np.asarray(jax.jit(from_storage)(ref.data)))
      np.testing.assert_array_equal(raw, expected)


# ------------------------------------------ encoders ------------------------------------------

def _assert_no_mismatch(result: np.ndarray, what: str):
  names = ("E4M3", "E5M2", "E2M1")
  bad = {names[k]: (int(result[k]), hex(int(result[3 + k]))) for k in range(3) if result[k]}
  assert not bad, f"{what}: fast encoders differ from the spec form (count, an input): {bad}"


def test_fast_encoders_match_spec_form_on_cpu_samples():
  with jax.default_device(jax.devices("cpu")[0]):
    # A spread over all float32 bit patterns, then every 3rd pattern of [0.125, 8) where the
    # E2M1 rounding boundaries lie, then both signs' NaN/inf/huge range.
    _assert_no_mismatch(debug.encoder_mismatches(0, 1 << 22, 1021), "spread")
    _assert_no_mismatch(debug.encoder_mismatches(0x3E000000, 0x3000000 // 3, 3), "[0.125, 8)")
    _assert_no_mismatch(debug.encoder_mismatches(0x7F000000, 1 << 21, 1), "huge/inf/NaN")
    _assert_no_mismatch(debug.encoder_mismatches(0xFF000000, 1 << 21, 1), "-huge/-inf/-NaN")


@pytest.mark.gpu
def test_fast_encoders_match_spec_form_on_every_float32_on_gpu():
  _device("gpu")
  _assert_no_mismatch(debug.encoder_mismatches(0, 1 << 32, 1), "all 2^32 inputs")


def test_fast_e2m1_encoder_matches_spec_form_around_its_ties():
  with jax.default_device(jax.devices("cpu")[0]):
    # 0.25 0.75 1.25 1.75 2.5 3.5 5.0 and 6.0: every pattern within 256 ulps, both signs.
    for bits in (0x3E800000, 0x3F400000, 0x3FA00000, 0x3FE00000, 0x40200000, 0x40600000,
                 0x40A00000, 0x40C00000):
      for sign in (0, 0x80000000):
        _assert_no_mismatch(debug.encoder_mismatches((bits | sign) - 256, 513, 1), hex(bits))


# -------------------------------------------- amax --------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("with_nan", [False, True])
def test_amax_target_matches_reference_reductions(platform, dtype, with_nan, rng):
  device = _device(platform)
  shapes = [(48, 40), (16, 1), (160, 300)] + ([(4096, 2056)] if platform == "gpu" else [])
  for shape in shapes:
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-8, 8, size=shape))
    if with_nan:
      x[rng.integers(shape[0]), rng.integers(shape[1])] = np.nan
      x[rng.integers(shape[0]), rng.integers(shape[1])] = -np.inf
    x = jax.device_put(x.astype(dtype), device)
    mask = (calls.AMAX_TENSOR | calls.AMAX_TENSOR_RHT | calls.AMAX_ROWS | calls.AMAX_COLS |
            calls.AMAX_COLS_RHT)

    def both(x):
      t = rht16(x.T)
      ref = [abs_max(x), abs_max(t), abs_max(x, axis=1), abs_max(x, axis=0), abs_max(t, axis=1)]
      return ref, calls.amax(x, mask)

    with jax.default_device(device):
      ref, got = jax.jit(both)(x)
    for k, (r, g) in enumerate(zip(ref, got)):
      r, g = np.asarray(r), np.asarray(g)
      same = (r.view(np.uint32) == g.view(np.uint32)) | (np.isnan(r) & np.isnan(g))
      assert same.all(), f"output {k} of shape {shape}: got {g}, expected {r}"


# ------------------------------------------ transpose -----------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_transpose_moves_bytes(platform, dtype, rng):
  device = _device(platform)
  shapes = [(37, 33), (1, 16), (128, 256)] + ([(3000, 4104), (64, 70)] if platform == "gpu" else [])
  q = jq.Float8CurrentScalingQuantizer(dtype)
  for shape in shapes:
    x = jax.device_put(rng.standard_normal(shape).astype(np.float32), device)
    with jax.default_device(device):
      row, _ = jax.jit(lambda x: reference.quantize_single(
          x, q, rowwise=True, columnwise=False, orig_dtype=x.dtype))(x)
      got = jax.jit(ffi_transpose.transpose)(row)
      ref = jax.jit(reference.transpose)(row)
    np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8),
                                  np.asarray(ref.data).view(np.uint8))
    assert got.quantizer == ref.quantizer and float(got.scale_inv) == float(ref.scale_inv)


def test_public_transpose_takes_ffi_path(monkeypatch):
  from jaxquant.explain import explain_recording
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  t = jq.ops.quantize(jnp.ones((8, 16)), jq.Float8CurrentScalingQuantizer(),
                      columnwise=False).rowwise
  with explain_recording() as report:
    jq.ops.transpose(t)
  assert report.paths("transpose") == {"ffi-cpu" if jax.default_backend() == "cpu"
                                       else "ffi-cuda"}


def test_transpose_rejects_non_fp8_data():
  results = [jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)]
  with pytest.raises(Exception, match="jaxquant_transpose_fp8: data is bfloat16"):
    jax.block_until_ready(jax.jit(lambda d: calls.call("jaxquant_transpose_fp8", results, d))(
        jnp.ones((8, 4), jnp.bfloat16)))


# ------------------------------------- CUDA graph capture -------------------------------------

_GRAPH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jaxquant as jq
    from jaxquant.backends.ffi import quantize as fq
    from jaxquant.backends.reference import ops as reference
    qs = [jq.Float8CurrentScalingQuantizer(), jq.MXFP8Quantizer(), jq.Float8BlockQuantizer(),
          jq.NVFP4Quantizer(rht=True), jq.NVFP4Quantizer(row_scaled=True)]
    def step(x):
      outs = []
      for q in qs:
        kw = dict(rowwise=True, columnwise=True, orig_dtype=x.dtype)
        outs.append((fq.quantize_single(x, q, **kw), reference.quantize_single(x, q, **kw)))
      return outs
    f = jax.jit(step)
    x = jax.random.normal(jax.random.key(0), (512, 384), jnp.bfloat16)
    for _ in range(3):
      outs = f(x)
    for got, ref in outs:
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.tobytes() == b.tobytes() or np.allclose(a, b, equal_nan=True)
    print("ok", jax.devices()[0].platform)
""")


@pytest.mark.gpu
def test_handlers_run_inside_cuda_graphs():
  _device("gpu")
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,"
                      "CUSTOM_CALL --xla_gpu_graph_min_graph_size=1").strip()
  out = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and "ok gpu" in out.stdout, out.stderr[-3000:]
