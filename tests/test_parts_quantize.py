"""The column-parts producer (a packed projection's dq, dk and dv quantized where they lie)
against the reference composition, bit for bit.

`jaxquant.ops.fused.parts_quantize` quantizes `[p0 | p1 | ...]` without joining the parts: the
FFI kernels read each tile from the part holding it. Each case compares the FFI target with the
reference (`jnp.concatenate`, then the reference quantize) in one jitted program, copies, scales,
amax and per-tile column sums (a bias gradient), on fresh random parts with special values. The
CPU handlers run everywhere; `-m gpu` runs the CUDA kernels: the whole-tile bfloat16 kernels
where every part's columns are a multiple of 128 (with their column sums), the general tile
kernels elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.backends.ffi import fused as ffi_fused
from jaxquant.backends.producers import Inputs, Producer
from jaxquant.backends.reference import fused as ref_fused
from jaxquant.numerics.reductions import column_tile_sums, pairwise_sum
from jaxquant.ops import fused as fused_ops
from test_fused_producers import (F32, P, PLATFORMS, PRODUCER_ATTRS, QUANTIZERS, _device,
                                  _raw_call, _state, assert_bitwise, pytestmark)  # noqa: F401

# (rows, columns of a part, parts): whole tiles (the GPU's whole-tile kernels, 3 parts as
# q, k, v), partial tiles, parts not a multiple of 8 columns (8 columns straddle two parts).
CPU_CASES = [(256, 128, 3), (37, 40, 2), (20, 13, 3)]
GPU_CASES = CPU_CASES + [(2048, 512, 3), (4096, 256, 2), (384, 1024, 3), (130, 200, 3)]


def _parts(rng, rows, cols, count, dtype):
  parts = []
  for i in range(count):
    p = rng.standard_normal((rows, cols)).astype(np.float32)
    p *= np.exp2(rng.integers(-6, 7, size=(rows, 1))).astype(np.float32) * (i + 1)
    if rows > 4:
      p[1] = 0.0  # a zero row
      p[2, rng.integers(cols)] = 2e4 + i  # an outlier
    parts.append(p.astype(dtype))
  return parts


def _both(parts, state, *, quantizer, rowwise, columnwise):
  producer = Producer("parts", parts[0].dtype)
  inputs = Inputs(parts[0], more=tuple(parts[1:]))
  out = []
  for impl in (ref_fused, ffi_fused):
    fused = impl.fused_quantize(producer, inputs, quantizer, rowwise=rowwise,
                                columnwise=columnwise, orig_dtype=producer.out_dtype,
                                state=state, col_sums=True)
    out.append((fused.rowwise, fused.columnwise, fused.col_sums))
  return out


_both_jit = jax.jit(_both, static_argnames=("quantizer", "rowwise", "columnwise"))


def check(platform, rng, name, case, *, dtype=jnp.bfloat16, rowwise=True, columnwise=True,
          special=True):
  q = QUANTIZERS[name]
  device = _device(platform)
  rows, cols, count = case
  if name == "block_128x128" and (rows % 128 or (cols * count) % 128):
    pytest.skip("128x128 blocks: whole-block cases only here")
  parts = _parts(rng, rows, cols, count, dtype)
  if special and rows > 4:
    parts[-1][3, 0] = np.nan
    parts[0][4, -1] = np.inf
  with jax.default_device(device):
    ref, got = _both_jit([jax.device_put(p, device) for p in parts], _state(name, q, rng),
                         quantizer=q, rowwise=rowwise, columnwise=columnwise)
  assert_bitwise(ref, got, f"parts {name} {case} {np.dtype(dtype).name} on {platform}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_parts_quantize_matches_reference(platform, name, rng):
  for case in (GPU_CASES if platform == "gpu" else CPU_CASES):
    check(platform, rng, name, case)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", ["fp8_delayed", "block_1x128"])
def test_parts_without_special_values_match_reference(platform, name, rng):
  # Finite parts: the column sums are finite numbers, compared bit for bit (NaN hides them).
  for case in [(256, 128, 3)] + ([(2048, 512, 3)] if platform == "gpu" else []):
    check(platform, rng, name, case, special=False)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_parts_input_dtypes_match_reference(platform, dtype, rng):
  for name in ("fp8_current", "mxfp8"):
    check(platform, rng, name, (130, 128, 3), dtype=dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_parts_one_direction_matches_reference(platform, direction, rng):
  for case in [(256, 128, 3), (37, 40, 2)]:
    check(platform, rng, "fp8_delayed", case, rowwise=direction == "rowwise",
          columnwise=direction == "columnwise")


def test_parts_quantize_equals_the_joined_quantize_and_its_bias_gradient(rng):
  """`parts_quantize` (the op the dense backward calls) quantizes the joined matrix as
  `jaxquant.quantize` does, and its bias gradient is the float32 column sums within float32
  summation order (float64 sums)."""
  q = jq.Float8CurrentScalingQuantizer()
  parts = [jnp.asarray(p) for p in _parts(rng, 256, 128, 3, jnp.bfloat16)]
  qt, dbias = jax.jit(lambda ps: fused_ops.parts_quantize(ps, quantizer=q, dbias=True))(parts)
  joined = jnp.concatenate(parts, axis=1)
  expect = jq.ops.quantize(joined, q)
  assert_bitwise((expect.rowwise, expect.columnwise), (qt.rowwise, qt.columnwise), "joined")
  exact = np.asarray(joined, np.float64).sum(axis=0)
  scale = np.abs(np.asarray(joined, np.float64)).sum(axis=0)
  np.testing.assert_array_less(np.abs(np.asarray(dbias, np.float64) - exact),
                               256 * 2.0**-23 * scale + 1e-30)
  np.testing.assert_array_equal(
      np.asarray(dbias), np.asarray(pairwise_sum(column_tile_sums(joined), axis=0)))


def _fp8_call(a, more, cols: int, producer: int):
  """jaxquant_fused_quantize_fp8 on `a` and the operands `more` after its own, rowwise only."""
  results = [jax.ShapeDtypeStruct((a.shape[0], cols), jnp.float8_e4m3fn), F32(())]
  return _raw_call("jaxquant_fused_quantize_fp8", results, a, P(), P(), P(), P(), P(), P(), *more,
                   **PRODUCER_ATTRS, producer=np.int32(producer), write_y=False, col_sums=False,
                   rowwise=True, columnwise=False, delayed=False, pow2_scale=False,
                   amax_epsilon=np.float32(0))


def test_parts_of_different_shapes_are_an_error():
  a = jnp.ones((8, 16), jnp.bfloat16)
  with pytest.raises(Exception, match=r"part 1 is bfloat16\(8, 8\); every part is the first's "
                                      r"dtype and shape, bfloat16\(8, 16\)"):
    _fp8_call(a, [jnp.ones((8, 8), jnp.bfloat16)], 32, producer=5)


def test_extra_operands_for_another_producer_are_an_error():
  h = jnp.ones((8, 16), jnp.bfloat16)
  with pytest.raises(Exception, match=r"1 operands after the target's own; only a parts "
                                      r"producer \(producer=5\) takes more"):
    _fp8_call(h, [h], 16, producer=3)


def test_unsupported_parts_are_named():
  a = jnp.ones((8, 16), jnp.bfloat16)
  many = ffi_fused.unsupported(Producer("parts", jnp.bfloat16), Inputs(a, more=(a,) * 8),
                               jq.MXFP8Quantizer(), "cpu")
  assert "at most 8 parts; got 9" in many
  mixed = ffi_fused.unsupported(Producer("parts", jnp.bfloat16),
                                Inputs(a, more=(a.astype(jnp.float32),)), jq.MXFP8Quantizer(),
                                "cpu")
  assert "the parts differ in shape or dtype" in mixed
  with pytest.raises(ValueError, match="quantizer: no fused kernel quantizes NVFP4Quantizer"):
    fused_ops.parts_quantize([a, a], quantizer=jq.NVFP4Quantizer())
