"""The FFI quantize kernels against the reference, bit for bit (data bytes, scales, amax).

Every format and option is quantized by the FFI target and by `ops.reference.quantize_single`
in one jitted program on fresh random inputs (the `rng` fixture records its seed), over awkward
shapes (rows not a multiple of 16/32/128, a single block of columns, odd lengths that make FP4
rows share bytes) and special values (zeros, subnormals, +-inf, NaN, outliers). The CPU handlers
run everywhere; the same tests run the CUDA kernels when a GPU is present (`-m gpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.explain import explain_recording
from jaxquant.backends.ffi import ops as ffi_bindings
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi import quantize as ffi_quantize
from jaxquant.numerics.random_bits import key_words
from jaxquant.backends.reference import ops as reference

pytestmark = pytest.mark.skipif(not registry.extension_built(),
                                reason="jaxquant FFI extension not built")

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _device(platform: str):
  if platform == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  return jax.devices(platform)[0]


CONFIGS = {
    "fp8_current_e4m3": jq.Float8CurrentScalingQuantizer(),
    "fp8_current_e5m2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
    "fp8_current_pow2_eps": jq.Float8CurrentScalingQuantizer(pow2_scale=True, amax_epsilon=0.5),
    "fp8_delayed_e4m3": jq.Float8DelayedScalingQuantizer(amax_history_len=4),
    "fp8_delayed_e5m2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=4),
    "mxfp8_e4m3": jq.MXFP8Quantizer(),
    "mxfp8_e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2),
    "block_1x128": jq.Float8BlockQuantizer(),
    "block_1x128_e5m2_nopow2_eps": jq.Float8BlockQuantizer(dtype=jnp.float8_e5m2,
                                                           pow2_scale=False, amax_epsilon=1e-3),
    "block_128x128": jq.Float8BlockQuantizer(block=(128, 128)),
    "block_128x128_nopow2": jq.Float8BlockQuantizer(block=(128, 128), pow2_scale=False),
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4_2d": jq.NVFP4Quantizer(block_2d=True),
    "nvfp4_row_scaled": jq.NVFP4Quantizer(row_scaled=True),
    "nvfp4_rht": jq.NVFP4Quantizer(rht=True),
    "nvfp4_sr": jq.NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4_2d_sr": jq.NVFP4Quantizer(block_2d=True, stochastic_rounding=True),
    "nvfp4_rht_sr_row_scaled": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True,
                                                 row_scaled=True),
}

# (rows, cols): rows not a multiple of 16/32/128, a single column block, odd lengths (NVFP4
# rows sharing bytes), one row, several tiles. RHT needs rows % 16 == 0 (its own list).
SHAPES = [(100, 72), (37, 33), (130, 257)]
RHT_SHAPES = [(96, 40), (16, 33), (144, 130)]
GPU_SHAPES = [(1000, 1536), (4096, 520), (80, 4096)]
RHT_GPU_SHAPES = [(1008, 1536), (4096, 520), (80, 4096)]


def _uses_rht(q) -> bool:
  return isinstance(q, jq.NVFP4Quantizer) and q.rht


def _random_matrix(rng, shape, dtype, special=False) -> np.ndarray:
  x = rng.standard_normal(shape).astype(np.float32)
  # Rows and blocks spanning several binades, so block scales differ.
  x *= np.exp2(rng.integers(-6, 7, size=(shape[0], 1))).astype(np.float32)
  x *= np.exp2(rng.integers(-3, 4, size=shape)).astype(np.float32)
  if special:
    tiny = {np.dtype(np.float32): 1e-39, np.dtype(jnp.bfloat16): 1e-39,
            np.dtype(np.float16): 3e-6}[np.dtype(dtype)]
    big = 6e4 if np.dtype(dtype) == np.dtype(np.float16) else 3e5
    values = np.array([0.0, -0.0, tiny, -tiny, np.inf, -np.inf, np.nan, big, -big, 448.0,
                       -6.0, 57344.0 if big > 6e4 else 5e4], np.float32)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 3 * values.size), replace=False)
    flat[idx] = np.resize(values, idx.size)
    if shape[0] > 2:  # a whole zero row and a whole subnormal row: zero-amax blocks
      x[1] = 0.0
      x[2] = tiny
  return x.astype(dtype)


def _state(q, rng):
  if not isinstance(q, jq.Float8DelayedScalingQuantizer):
    return None
  scale = np.float32(rng.uniform(0.5, 40.0))
  return jq.init_state(q).__class__(jnp.asarray(scale), jnp.zeros((q.amax_history_len,)))


def _keys(q, prng_key):
  if isinstance(q, jq.NVFP4Quantizer) and q.stochastic_rounding:
    return key_words(jax.random.fold_in(prng_key, 0)), key_words(jax.random.fold_in(prng_key, 1))
  return None, None


@functools.partial(jax.jit, static_argnames=("quantizer", "rowwise", "columnwise"))
def _both(x, row_words, col_words, state, *, quantizer, rowwise, columnwise):
  kw = dict(rowwise=rowwise, columnwise=columnwise, orig_dtype=x.dtype, row_key_words=row_words,
            col_key_words=col_words, state=state)
  return (reference.quantize_single(x, quantizer, **kw),
          ffi_quantize.quantize_single(x, quantizer, **kw))


def _bits(a: np.ndarray) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def assert_bitwise(ref, got, what: str):
  """Same tree, dtypes and shapes; every byte equal (float32 NaNs: any NaN equals any NaN)."""
  lr, tr = jax.tree_util.tree_flatten(ref)
  lg, tg = jax.tree_util.tree_flatten(got)
  assert tr == tg, f"{what}: trees differ:\n{tr}\n{tg}"
  for i, (r, g) in enumerate(zip(lr, lg)):
    r, g = np.asarray(r), np.asarray(g)
    assert (r.dtype, r.shape) == (g.dtype, g.shape), f"{what}: leaf {i} {g.dtype}{g.shape}, " \
        f"expected {r.dtype}{r.shape}"
    same = _bits(r) == _bits(g)
    if r.dtype == np.float32:
      same |= np.isnan(r) & np.isnan(g)
    if not same.all():
      bad = np.argwhere(~same)
      first = tuple(bad[0])
      raise AssertionError(f"{what}: leaf {i} ({r.dtype}{r.shape}) differs at {len(bad)} "
                           f"places, first {first}: got {g[first]!r} (bits {_bits(g)[first]}), "
                           f"expected {r[first]!r} (bits {_bits(r)[first]})")


def check(platform, rng, prng_key, name, shape, dtype=jnp.bfloat16, rowwise=True,
          columnwise=True, special=False):
  q = CONFIGS[name]
  device = _device(platform)
  x = jax.device_put(_random_matrix(rng, shape, dtype, special), device)
  row_words, col_words = _keys(q, prng_key)
  with jax.default_device(device):
    ref, got = _both(x, row_words, col_words, _state(q, rng), quantizer=q, rowwise=rowwise,
                     columnwise=columnwise)
  assert_bitwise(ref, got, f"{name} {shape} {np.dtype(dtype).name} on {platform}")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", CONFIGS)
def test_quantize_both_directions_matches_reference(platform, name, rng, prng_key):
  # On the CPU the two shapes of each list with odd and partial tiles (37 x 33, 130 x 257;
  # 16 x 33, 144 x 130 under RHT); the other tests of this file add their own shapes (67 x 160,
  # 64 x 200, single rows and odd row counts). The GPU takes all three and its large ones.
  shapes = RHT_SHAPES if _uses_rht(CONFIGS[name]) else SHAPES
  shapes = shapes[1:] if platform == "cpu" else shapes + (
      RHT_GPU_SHAPES if _uses_rht(CONFIGS[name]) else GPU_SHAPES)
  for shape in shapes:
    check(platform, rng, prng_key, name, shape)


# Whole 128 x 128 tiles, both copies: on the GPU the whole-tile kernels of the training step
# (ffi/quantize/fp8_block_1x128.cuh for bfloat16 1x128 blocks, fp8_block_128x128.cuh for float32
# and bfloat16 128x128 blocks, fp8_tensor_bf16.cuh / fp8_tensor_f32.cuh for bfloat16 / float32
# per-tensor FP8; they serve only these), with and without NaN, infinities, outliers, a zero
# row and a subnormal row among the random values.
WHOLE_TILE_SHAPES = {"cpu": [(128, 256)], "gpu": [(128, 128), (1024, 1536), (384, 4096)]}
WHOLE_TILE_CASES = [("block_1x128", jnp.bfloat16), ("block_1x128_e5m2_nopow2_eps", jnp.bfloat16),
                    ("block_128x128", jnp.float32), ("block_128x128", jnp.bfloat16),
                    ("block_128x128_nopow2", jnp.float32), ("fp8_current_e4m3", jnp.bfloat16),
                    ("fp8_current_pow2_eps", jnp.bfloat16), ("fp8_delayed_e5m2", jnp.bfloat16),
                    ("fp8_current_e4m3", jnp.float32), ("fp8_delayed_e5m2", jnp.float32)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name,dtype", WHOLE_TILE_CASES,
                         ids=[f"{n}-{np.dtype(d).name}" for n, d in WHOLE_TILE_CASES])
@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
def test_block_whole_tiles_match_reference(platform, name, dtype, special, rng, prng_key):
  for shape in WHOLE_TILE_SHAPES[platform]:
    check(platform, rng, prng_key, name, shape, dtype=dtype, special=special)


# Configs that differ from another one only in each element's arithmetic (E5M2, scales not
# powers of two, an epsilon): that arithmetic does not depend on the copies asked for, and each
# meets both directions and the special values in the tests around. On the CPU the single
# direction layouts take the other configs (~10 CPU-s less); the GPU takes every one.
ELEMENT_VARIANTS = ("fp8_current_e5m2", "fp8_current_pow2_eps", "fp8_delayed_e5m2", "mxfp8_e5m2",
                    "block_1x128_e5m2_nopow2_eps", "block_128x128_nopow2")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_quantize_one_direction_matches_reference(platform, name, direction, rng, prng_key):
  if platform == "cpu" and name in ELEMENT_VARIANTS:
    pytest.skip(f"{name}: another config's layouts (its arithmetic: the other tests)")
  if _uses_rht(CONFIGS[name]):
    shape = (16, 48) if direction == "rowwise" else (48, 130)
  else:  # a single row; an odd row count (odd FP4 rows of the transposed copy)
    shape = (1, 48) if direction == "rowwise" else (33, 130)
  check(platform, rng, prng_key, name, shape, rowwise=direction == "rowwise",
        columnwise=direction == "columnwise")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("name", ["fp8_current_e4m3", "mxfp8_e5m2", "block_1x128",
                                  "block_128x128", "nvfp4_rht", "nvfp4_2d_sr"])
def test_quantize_input_dtypes_match_reference(platform, dtype, name, rng, prng_key):
  shapes = [(64, 200)] + ([(1024, 1040)] if platform == "gpu" else [])
  for shape in shapes:
    check(platform, rng, prng_key, name, shape, dtype=dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_first_step_takes_the_current_amax_like_the_reference(platform, dtype, margin,
                                                                      rng, prng_key):
  """A fresh state (no scale yet): the scale comes from x's amax, computed before the kernel."""
  q = jq.Float8DelayedScalingQuantizer(dtype, amax_history_len=4, margin=margin)
  device = _device(platform)
  for shape in SHAPES + (GPU_SHAPES if platform == "gpu" else []):
    x = jax.device_put(_random_matrix(rng, shape, jnp.bfloat16), device)
    with jax.default_device(device):
      ref, got = _both(x, None, None, jq.init_state(q), quantizer=q, rowwise=True,
                       columnwise=True)
      if margin == 0:  # exactly current scaling's quantization
        current, _ = _both(x, None, None, None, quantizer=jq.Float8CurrentScalingQuantizer(dtype),
                           rowwise=True, columnwise=True)
        assert_bitwise([(t.data, t.scale_inv, t.amax) for t in current],
                       [(t.data, t.scale_inv, t.amax) for t in got], f"{shape} vs current")
    assert_bitwise(ref, got, f"fresh delayed {np.dtype(dtype).name} {shape} on {platform}")


# Every config with bfloat16 input; float16 / float32 (whose subnormals and overflow differ)
# for one config of each format.
SPECIAL_CASES = ([(name, jnp.bfloat16) for name in CONFIGS] +
                 [(name, dtype) for dtype in (jnp.float16, jnp.float32)
                  for name in ("fp8_current_pow2_eps", "fp8_delayed_e5m2", "mxfp8_e4m3",
                               "block_1x128_e5m2_nopow2_eps", "block_128x128",
                               "nvfp4_rht_sr_row_scaled", "nvfp4_2d")])


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name,dtype", SPECIAL_CASES,
                         ids=[f"{n}-{np.dtype(d).name}" for n, d in SPECIAL_CASES])
def test_quantize_special_values_match_reference(platform, dtype, name, rng, prng_key):
  shape = (64, 160) if _uses_rht(CONFIGS[name]) else (67, 160)
  check(platform, rng, prng_key, name, shape, dtype=dtype, special=True)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_mxfp8_block_exponents_at_their_edges_match_reference(platform, rng, name):
  """E8M0 exponents where the kernels' one-carry formula and their codes' branches turn
  (docs/design.md decision 48): 32 x 32 tiles whose diagonal holds each tile's block maximum,
  so every 32-wide row block and 32-tall column block of the tile has it as its amax, the rest
  random and smaller. The maxima: fmax x 2^k and one float32 ulp either side (amax / fmax with
  a zero mantissa or not), a subnormal amax / fmax, zero, the largest float32, infinity (e = 254,
  the two-factor scale) and NaN (e = 255, all-NaN codes). float32 input, both directions."""
  q = CONFIGS[name]
  fmax = float(jnp.finfo(q.dtype).max)
  maxima = [np.float32(fmax * 2.0**k) * np.float32(1.0 + d) for k in (-20, 0, 10)
            for d in (-2.0**-23, 0.0, 2.0**-23)]
  maxima += [1e-39, 0.0, np.finfo(np.float32).max, np.inf, np.nan]
  tiles = []
  for top in np.asarray(maxima, np.float32):
    finite_scale = top if np.isfinite(top) else 1.0
    tile = (rng.uniform(-1.0, 1.0, (32, 32)) * 0.9 * finite_scale).astype(np.float32)
    np.fill_diagonal(tile, top * rng.choice([-1.0, 1.0], 32).astype(np.float32))
    tiles.append(tile)
  x = np.concatenate(tiles, axis=1)
  device = _device(platform)
  with jax.default_device(device):
    ref, got = _both(jax.device_put(x, device), None, None, None, quantizer=q, rowwise=True,
                     columnwise=True)
  assert_bitwise(ref, got, f"{name} block-exponent edges on {platform}")
  rowwise, columnwise = ref
  for scales in (np.asarray(rowwise.scale_inv).view(np.uint8).reshape(32, -1),
                 np.asarray(columnwise.scale_inv).view(np.uint8).reshape(-1, 32).T):
    assert scales[0, -2] == 254 and scales[0, -1] == 255 and scales[0, -4] == 0  # inf NaN zero
    assert scales[0, -5] in (0, 1)  # subnormal amax / fmax: 1 in IEEE, 0 where it is flushed


@pytest.mark.parametrize("platform", PLATFORMS)
def test_stochastic_rounding_depends_on_key_words(platform, rng, prng_key):
  q = CONFIGS["nvfp4_sr"]
  device = _device(platform)
  x = jax.device_put(_random_matrix(rng, (32, 64), jnp.float32), device)
  codes = []
  for k in (prng_key, prng_key, jax.random.fold_in(prng_key, 7)):
    words = key_words(k)
    with jax.default_device(device):
      _, (row, _) = _both(x, words, words, None, quantizer=q, rowwise=True, columnwise=False)
    codes.append(np.asarray(row.data).view(np.uint8))
  np.testing.assert_array_equal(codes[0], codes[1])
  assert (codes[0] != codes[2]).mean() > 0.05


# ------------------------------------------ dispatch ------------------------------------------

def test_extension_serves_cpu_and_reports_path():
  assert ffi_bindings.available()
  assert "cpu" in registry.registered_platforms()
  if jax.default_backend() == "cpu":
    assert ffi_bindings.path_name() == "ffi-cpu"
  else:
    assert ffi_bindings.path_name() == "ffi-cuda"


@pytest.mark.parametrize("quantizer", [
    jq.MXFP8Quantizer(),
    jq.HybridQuantizer(rowwise=jq.MXFP8Quantizer(),
                       columnwise=jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)),
    jq.HybridQuantizer(rowwise=jq.Float8BlockQuantizer(),
                       columnwise=jq.Float8CurrentScalingQuantizer(),
                       columnwise_source="rowwise_dequantized"),
], ids=["mxfp8", "hybrid_mxfp8_nvfp4", "hybrid_block_from_rowwise"])
def test_public_quantize_takes_ffi_path_and_matches_reference(quantizer, rng, prng_key,
                                                              monkeypatch):
  x = jnp.asarray(_random_matrix(rng, (96, 48), jnp.bfloat16).reshape(3, 32, 48))
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  with explain_recording() as report:
    got = jax.jit(lambda x, k: jq.ops.quantize(x, quantizer, key=k))(x, prng_key)
  assert report.paths("quantize") == {ffi_bindings.path_name()}, str(report)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  ref = jax.jit(lambda x, k: jq.ops.quantize(x, quantizer, key=k))(x, prng_key)
  assert_bitwise(ref, got, str(quantizer))


def test_unserved_platform_takes_reference_path_visibly(monkeypatch):
  monkeypatch.setattr(registry, "registered_platforms", lambda: ("CUDA",))
  reason = ffi_bindings.quantize_unsupported(jnp.ones((4, 16)), jq.NVFP4Quantizer(),
                                             rowwise=True, columnwise=True)
  assert reason is not None and "no cpu handlers" in reason
  with explain_recording() as report:
    jq.ops.quantize(jnp.ones((4, 16)), jq.MXFP8Quantizer())
  assert report.paths("quantize") == {"reference"}
  assert "no cpu handlers" in report[0].reason
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  with pytest.raises(RuntimeError, match="no cpu handlers"):
    jq.ops.quantize(jnp.ones((4, 16)), jq.MXFP8Quantizer())


def test_unsupported_cases_give_reasons():
  q = jq.NVFP4Quantizer(rht=True)
  assert "multiple of 16" in ffi_quantize.unsupported(jnp.ones((20, 16)), q, rowwise=False,
                                                      columnwise=True)
  assert ffi_quantize.unsupported(jnp.ones((20, 16)), q, rowwise=True, columnwise=False) is None
  assert "non-empty" in ffi_quantize.unsupported(jnp.ones((0, 16)), q, rowwise=True,
                                                 columnwise=False)
  assert "IdentityQuantizer" in ffi_quantize.unsupported(jnp.ones((4, 16)), jq.IdentityQuantizer(),
                                                        rowwise=True, columnwise=True)


# -------------------------------------- argument checks ---------------------------------------

def _run(fn, *args):
  return jax.block_until_ready(jax.jit(fn)(*args))


def test_bad_result_shape_is_rejected_with_a_readable_message():
  x = jnp.ones((8, 32), jnp.bfloat16)
  bad = [jax.ShapeDtypeStruct((8, 31), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((8, 1), jnp.float8_e8m0fnu), jax.ShapeDtypeStruct((), jnp.float32)]
  with pytest.raises(Exception, match=r"jaxquant_quantize_mxfp8: rowwise data is "
                                      r"float8_e4m3fn\(8, 31\); expected .*\(8, 32\)"):
    _run(lambda x: calls.call("jaxquant_quantize_mxfp8", bad, x, rowwise=True, columnwise=False),
         x)


def test_bad_input_dtype_and_rank_are_rejected():
  results = [jax.ShapeDtypeStruct((), jnp.float32)]
  with pytest.raises(Exception, match="jaxquant_amax: x is uint8; expected bfloat16, float16 "
                                      "or float32"):
    _run(lambda x: calls.call("jaxquant_amax", results, x, outputs=np.int32(1)),
         jnp.ones((4, 4), jnp.uint8))
  with pytest.raises(Exception, match=r"jaxquant_amax: x must be a 2-D .* got shape \(2, 2, 2\)"):
    _run(lambda x: calls.call("jaxquant_amax", results, x, outputs=np.int32(1)),
         jnp.ones((2, 2, 2), jnp.float32))


def test_wrong_number_of_results_is_rejected():
  x = jnp.ones((16, 16), jnp.float32)
  two = [jax.ShapeDtypeStruct((), jnp.float32)] * 2
  with pytest.raises(Exception, match="jaxquant_amax: got 2 results; expected 1"):
    _run(lambda x: calls.call("jaxquant_amax", two, x, outputs=np.int32(1)), x)


def test_nvfp4_rht_with_unaligned_rows_is_rejected_by_the_kernel():
  x = jnp.ones((20, 16), jnp.float32)
  z = jnp.zeros((), jnp.float32)
  k = jnp.zeros((2,), jnp.uint32)
  results = [jax.ShapeDtypeStruct((16, 20), jnp.float4_e2m1fn),
             jax.ShapeDtypeStruct((16, 2), jnp.float8_e4m3fn)]
  with pytest.raises(Exception, match="jaxquant_quantize_nvfp4: rht .* got 20 rows"):
    _run(lambda x: calls.call("jaxquant_quantize_nvfp4", results, x, z, z, k, k, rowwise=False,
                              columnwise=True, row_scaled=False, block_2d=False, rht=True,
                              stochastic=False), x)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_gated_amax_runs_only_while_the_gate_is_zero(platform, rng):
  """`jaxquant_amax_gated` (a delayed-scaling state's just-in-time amax) equals the plain amax
  when the gate (the state's scale) is 0, and leaves every output 0 otherwise."""
  device = _device(platform)
  x = jax.device_put(_random_matrix(rng, (300, 260), jnp.bfloat16), device)
  outputs = calls.AMAX_TENSOR | calls.AMAX_ROWS | calls.AMAX_COLS
  with jax.default_device(device):
    plain = jax.jit(lambda x: calls.amax(x, outputs))(x)
    gated = jax.jit(lambda x, g: calls.amax(x, outputs, gate=g))
    opened = gated(x, jnp.float32(0.0))
    closed = gated(x, jnp.float32(rng.uniform(0.5, 100.0)))
  for want, got in zip(plain, opened):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got in closed:
    assert not np.asarray(got).any()
