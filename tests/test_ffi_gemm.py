"""The FFI GEMM (`jaxquant.backends.ffi.gemm`, targets jaxquant_gemm_fp8 /
jaxquant_gemm_dequant) against the reference GEMM, for every format pair, bias, output dtype and
NVFP4 row-scaling combination.

Operands are quantized by the reference quantizers (the spec), so only the GEMM is under test.
Inputs are fresh random matrices from the seeded `rng` fixture (seed printed, replay with
JAXQUANT_TEST_SEED); magnitudes spread over 2^-8..2^8 so many binades and FP8 subnormals occur.

Tolerance, per output element, between the FFI result and `jaxquant.ops.reference.gemm`:
  |got - ref| <= tol_acc * (|A| @ |B|^T) + 4 * 2^-24 * (|A| @ |B|^T + |bias|) + ulp_out(|ref|)
with |A|, |B| the magnitudes of the dequantized operands (NVFP4 factors included), ulp_out one
unit in the last place of the output dtype at |ref| (the two results may round to neighbours),
4 * 2^-24 for the float32 epilogue roundings (two factors, bias), and
  tol_acc = 2 * K * 2^-24          float32 accumulation in any order (both sides): the
                                   wgmma-dequant kernel (bf16 MMA, float32 accumulators), the
                                   CPU handlers, dequant-bf16 / dequant-f32, xla-dot;
  tol_acc = 2 * K * 2^-24 + 2^-9   cuBLASLt FP8 on a GPU with split accumulation: Hopper's FP8
                                   tensor cores add each MMA's products with reduced precision
                                   (~14 bits) before the float32 promotion; measured up to
                                   ~2^-10.7 at K = 256 (H100, cuBLASLt 13.1);
  tol_acc = 2 * K * 2^-24 + 2^-7   the same with fast accumulation (promotion only at the end).
NaN must appear exactly where the reference has NaN.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax  # noqa: F401  (jq.flax)
import oracle
from jaxquant.backends.ffi import gemm as ffi_gemm
from jaxquant.backends.reference import ops as reference
from jaxquant.state import init_state

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

QUANTIZERS = {
    "fp8": jq.Float8CurrentScalingQuantizer(),
    "fp8-e5m2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
    "fp8-delayed": jq.Float8DelayedScalingQuantizer(),
    "block-1x128": jq.Float8BlockQuantizer((1, 128)),
    "block-128x128": jq.Float8BlockQuantizer((128, 128)),
    "block-1x128-e5m2": jq.Float8BlockQuantizer((1, 128), jnp.float8_e5m2),
    "block-1x128-fp32": jq.Float8BlockQuantizer((1, 128), pow2_scale=False),
    "mxfp8": jq.MXFP8Quantizer(),
    "mxfp8-e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2),
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4-row": jq.NVFP4Quantizer(row_scaled=True),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
    "identity": jq.IdentityQuantizer(),
    "bf16": None,  # plain arrays
    "f32": None,
}

# (a format, b format) -> path; covers every family pair the recipes and factories produce,
# every cuBLASLt FP8 type and block-mode combination and every NVFP4 row-scaling combination.
PAIRS = {
    ("fp8", "fp8"): "cublaslt-fp8",
    ("fp8", "fp8-e5m2"): "cublaslt-fp8",
    ("fp8-e5m2", "fp8"): "cublaslt-fp8",
    ("fp8-delayed", "fp8"): "cublaslt-fp8",
    ("fp8-e5m2", "fp8-e5m2"): "dequant-bf16",
    ("block-1x128", "block-1x128"): "cublaslt-fp8-block",
    ("block-1x128", "block-128x128"): "cublaslt-fp8-block",
    ("block-128x128", "block-1x128"): "cublaslt-fp8-block",
    ("block-1x128-e5m2", "block-128x128"): "cublaslt-fp8-block",
    ("block-1x128-fp32", "block-1x128"): "cublaslt-fp8-block",
    ("block-128x128", "block-128x128"): "dequant-bf16",
    ("mxfp8", "mxfp8"): "wgmma-dequant-mxfp8",
    ("mxfp8-e5m2", "mxfp8"): "wgmma-dequant-mxfp8",
    ("mxfp8", "mxfp8-e5m2"): "wgmma-dequant-mxfp8",
    ("nvfp4", "nvfp4"): "wgmma-dequant-nvfp4",
    ("nvfp4", "nvfp4-2d"): "wgmma-dequant-nvfp4",
    ("nvfp4-row", "nvfp4-2d"): "wgmma-dequant-nvfp4",
    ("nvfp4-2d", "nvfp4-row"): "wgmma-dequant-nvfp4",
    ("nvfp4-row", "nvfp4-row"): "wgmma-dequant-nvfp4",
    ("mxfp8", "nvfp4-row"): "wgmma-dequant-mxfp8-nvfp4",
    ("nvfp4", "mxfp8-e5m2"): "wgmma-dequant-nvfp4-mxfp8",
    ("mxfp8", "fp8"): "dequant-bf16",
    ("fp8", "identity"): "dequant-bf16",
    ("nvfp4-row", "bf16"): "dequant-bf16",
    ("block-1x128-fp32", "block-128x128"): "cublaslt-fp8-block",
    ("block-1x128-fp32", "mxfp8"): "dequant-f32",
    ("f32", "mxfp8"): "dequant-f32",
    ("bf16", "identity"): "xla-dot",
}

M, N, K = 40, 48, 256  # N and K multiples of 16 (cuBLASLt FP8), K of 128 (block scaling)


# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _mxfp8_nvfp4_pairs_take_the_kernel(monkeypatch):
  """On CUDA, MXFP8/NVFP4 pairs default to dequant-bf16 (measured faster); these tests hold the
  wgmma-dequant kernel to the reference, so they select it (CPU: the kernel target anyway)."""
  monkeypatch.setenv("JAXQUANT_MX_GEMM", "wgmma-dequant")


def _platform_or_skip(platform: str) -> None:
  backend = jax.default_backend()
  if platform == "gpu" and backend != "gpu":
    pytest.skip("no GPU")
  if platform == "cpu" and backend != "cpu":
    pytest.skip("the CPU handlers are exercised on CPU-only machines (CI)")
  if not ffi_gemm._targets("cuda" if platform == "gpu" else "cpu"):
    pytest.skip("the jaxquant extension has no GEMM targets for this platform")


@functools.partial(jax.jit, static_argnames=("quantizer",))
def _quantize(x, quantizer):
  row, _ = reference.quantize_single(x, quantizer, rowwise=True, columnwise=False,
                                     orig_dtype=np.dtype(x.dtype), state=init_state(quantizer))
  return row


def _operand(rng, shape, name, spread=True):
  """A reference-quantized rowwise operand (Identity and plain arrays from bfloat16 inputs,
  except "f32")."""
  x = jnp.asarray(oracle.random_matrix(rng, shape, spread=spread), jnp.float32)
  q = QUANTIZERS[name]
  if q is None:
    return x.astype(jnp.bfloat16 if name == "bf16" else jnp.float32)
  if name == "identity":
    x = x.astype(jnp.bfloat16)
  return _quantize(x, q)


def _magnitudes(x) -> np.ndarray:
  v = x.dequantize(jnp.float32) if isinstance(x, jq.ScaledTensor) else x.astype(jnp.float32)
  return np.abs(np.asarray(v, np.float64))


def _ulp(values: np.ndarray, dtype) -> np.ndarray:
  info = jnp.finfo(dtype)
  mant = {np.dtype(jnp.bfloat16): 7, np.dtype(jnp.float16): 10, np.dtype(jnp.float32): 23}
  m = mant[np.dtype(dtype)]
  mag = np.maximum(np.abs(values), float(info.tiny))
  return np.exp2(np.floor(np.log2(mag)) - m)


def _assert_close(got, ref, a, b, bias=None, tol_acc=None):
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  ref_f = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
  assert got.shape == ref_f.shape
  np.testing.assert_array_equal(np.isnan(got), np.isnan(ref_f), err_msg="NaN positions differ")
  k = a.shape[1]
  mag = _magnitudes(a) @ _magnitudes(b).T
  bias_mag = 0.0 if bias is None else np.abs(np.asarray(bias.astype(jnp.float32), np.float64))
  tol_acc = 2 * k * 2.0**-24 if tol_acc is None else tol_acc
  tol = tol_acc * mag + 4 * 2.0**-24 * (mag + bias_mag) + _ulp(ref_f, ref.dtype) + 1e-30
  finite = ~np.isnan(ref_f)
  err = np.where(got == ref_f, 0.0, np.abs(got - ref_f))  # equal infinities match
  bad = finite & ~(err <= tol)
  assert not bad.any(), (f"{bad.sum()} of {bad.size} elements outside tolerance; worst "
                         f"err/tol = {np.max(np.where(finite, err / tol, 0)):.3g}")


def _tol_acc(a, b, platform, accumulation="split"):
  """tol_acc of the module docstring for the path this pair takes on `platform`."""
  k = a.shape[1]
  if platform == "gpu" and ffi_gemm.gemm_path(a, b).startswith("cublaslt"):
    return 2 * k * 2.0**-24 + (2.0**-7 if accumulation == "fast" else 2.0**-9)
  return 2 * k * 2.0**-24


def _run(platform, fn, *args):
  device = jax.devices("gpu" if platform == "gpu" else "cpu")[0]
  with jax.default_device(device):
    return jax.jit(fn)(*args)


# ----------------------------------------------------------------------------------------------
# Paths.
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", list(PAIRS), ids=[f"{a}x{b}" for a, b in PAIRS])
def test_each_pair_takes_its_documented_path(pair, rng):
  _platform_or_skip("cpu")
  a = _operand(rng, (M, K), pair[0])
  b = _operand(rng, (N, K), pair[1])
  path = ffi_gemm.gemm_path(a, b)
  want = PAIRS[pair]  # the CUDA path; on CPU the target's CPU handler runs instead
  cpu_names = {ffi_gemm.FP8_TARGET: "ffi-cpu gemm-fp8",
               ffi_gemm.DEQUANT_TARGET: "ffi-cpu gemm-dequant"}
  assert path == cpu_names.get(ffi_gemm._uses_target(want), want)
  assert "cublaslt" not in path and "wgmma" not in path  # neither runs on CPU
  assert ffi_gemm.gemm_unsupported(a, b) is None


def test_a_cuda_build_without_gemm_kernels_names_the_build_option(rng, monkeypatch):
  # As on a GPU machine whose extension was built with -DJAXQUANT_GEMM=OFF (no cuBLASLt): the
  # CUDA platform has no GEMM targets, and the reason says which option left them out.
  a, b = _operand(rng, (M, K), "fp8"), _operand(rng, (N, K), "fp8")
  monkeypatch.setattr(ffi_gemm, "_platform", lambda: "cuda")
  monkeypatch.setattr(ffi_gemm, "compute_capability", lambda: (9, 0))  # an H100
  monkeypatch.setattr(ffi_gemm, "_targets", lambda platform: frozenset())
  monkeypatch.setattr(ffi_gemm, "_built_without_gemm", lambda: False)
  assert ffi_gemm.gemm_unsupported(a, b) == (
      "the jaxquant extension has no GEMM targets for platform 'cuda'")
  monkeypatch.setattr(ffi_gemm, "_built_without_gemm", lambda: True)
  assert "built with -DJAXQUANT_GEMM=OFF (no cuBLASLt)" in ffi_gemm.gemm_unsupported(a, b)
  monkeypatch.setattr(ffi_gemm, "_targets", lambda platform: frozenset({ffi_gemm.DEQUANT_TARGET}))
  reason = ffi_gemm.gemm_unsupported(a, b)
  assert reason.startswith("target jaxquant_gemm_fp8 is not built for platform 'cuda'")
  assert "-DJAXQUANT_GEMM=OFF" in reason


def test_ops_gemm_reports_the_ffi_path_to_explain(rng, monkeypatch):
  _platform_or_skip("cpu")
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  a, b = _operand(rng, (M, K), "mxfp8"), _operand(rng, (N, K), "nvfp4-row")
  report = jq.explain(lambda a, b: jq.ops.gemm(a, b, out_dtype=jnp.float32), a, b)
  assert report.paths("gemm") == {"ffi-cpu gemm-dequant"}, str(report)
  assert [d.detail for d in report if d.op == "gemm"] == ["MXFP8 x NVFP4"], str(report)


def test_cpu_handlers_leave_large_problems_to_the_reference_visibly(rng):
  _platform_or_skip("cpu")
  a = jax.ShapeDtypeStruct((512, 512), jnp.float8_e4m3fn)
  t = jq.ScaledTensor(a, jnp.float32(1), jnp.float32(1), QUANTIZERS["fp8"], np.dtype(jnp.float32))
  reason = ffi_gemm.gemm_unsupported(t, t)
  assert reason is not None and "small problems" in reason


def test_mxfp8_nvfp4_default_on_cuda_is_the_measured_faster_path(rng, monkeypatch):
  _platform_or_skip("cpu")
  monkeypatch.setattr(ffi_gemm, "compute_capability", lambda: (9, 0))
  a, b = _operand(rng, (M, K), "mxfp8"), _operand(rng, (N, K), "nvfp4-row")
  monkeypatch.setenv("JAXQUANT_MX_GEMM", "auto")
  assert ffi_gemm._kernel_path(a, b, "cuda") == ("dequant-bf16", ffi_gemm.MX_GEMM_AUTO_REASON)
  assert ffi_gemm._kernel_path(a, b, "cpu") == ("wgmma-dequant-mxfp8-nvfp4", "")
  monkeypatch.setenv("JAXQUANT_MX_GEMM", "wgmma-dequant")
  assert ffi_gemm._kernel_path(a, b, "cuda") == ("wgmma-dequant-mxfp8-nvfp4", "")
  monkeypatch.setenv("JAXQUANT_MX_GEMM", "sometimes")
  with pytest.raises(ValueError, match="JAXQUANT_MX_GEMM"):
    ffi_gemm._kernel_path(a, b, "cuda")


def test_a_slower_path_says_why(rng):
  _platform_or_skip("cpu")
  a, b = _operand(rng, (M, K), "block-128x128"), _operand(rng, (N, K), "block-128x128")
  assert "128x128 x 128x128" in ffi_gemm.gemm_path_reason(a, b)


# ----------------------------------------------------------------------------------------------
# Numerics: every pair, then output dtypes x bias on one pair per kernel.
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pair", list(PAIRS), ids=[f"{a}x{b}" for a, b in PAIRS])
def test_ffi_gemm_matches_reference_for_every_pair(platform, pair, rng):
  _platform_or_skip(platform)
  a = _operand(rng, (M, K), pair[0])
  b = _operand(rng, (N, K), pair[1])
  bias = jnp.asarray(rng.standard_normal(N), jnp.float32)
  fn = lambda a, b, bias: ffi_gemm.gemm(a, b, out_dtype=jnp.float32, bias=bias,
                                         accumulation="split")
  got = _run(platform, fn, a, b, bias)
  ref = _run(platform, lambda a, b, bias: reference.gemm(a, b, out_dtype=jnp.float32, bias=bias),
             a, b, bias)
  _assert_close(got, ref, a, b, bias, tol_acc=_tol_acc(a, b, platform))


KERNEL_PAIRS = [("fp8", "fp8-e5m2"), ("block-1x128", "block-128x128"), ("mxfp8", "mxfp8"),
                ("nvfp4-row", "nvfp4-2d"), ("nvfp4", "mxfp8")]
OUT_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
BIASES = [None, jnp.bfloat16, jnp.float32]  # float16 bias: in the float16-output GPU run below


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("bias_dtype", BIASES, ids=lambda d: "nobias" if d is None else
                         np.dtype(d).name)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=[f"{a}x{b}" for a, b in KERNEL_PAIRS])
def test_ffi_gemm_output_dtype_and_bias(platform, pair, out_dtype, bias_dtype, rng):
  _platform_or_skip(platform)
  a = _operand(rng, (M, K), pair[0], spread=False)  # products well inside float16's range
  b = _operand(rng, (N, K), pair[1], spread=False)
  bias = None if bias_dtype is None else jnp.asarray(rng.standard_normal(N), bias_dtype)
  fn = lambda a, b, bias: ffi_gemm.gemm(a, b, out_dtype=out_dtype, bias=bias,
                                         accumulation="split")
  got = _run(platform, fn, a, b, bias)
  ref = _run(platform, lambda a, b, bias: reference.gemm(a, b, out_dtype=out_dtype, bias=bias),
             a, b, bias)
  assert got.dtype == np.dtype(out_dtype)
  _assert_close(got, ref, a, b, bias, tol_acc=_tol_acc(a, b, platform))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=[f"{a}x{b}" for a, b in KERNEL_PAIRS])
def test_ffi_gemm_float16_output_with_float16_bias(pair, rng):
  _platform_or_skip("gpu")
  a = _operand(rng, (M, K), pair[0], spread=False)
  b = _operand(rng, (N, K), pair[1], spread=False)
  bias = jnp.asarray(rng.standard_normal(N), jnp.float16)
  fn = lambda a, b, bias: ffi_gemm.gemm(a, b, out_dtype=jnp.float16, bias=bias,
                                         accumulation="split")
  got = _run("gpu", fn, a, b, bias)
  ref = _run("gpu", lambda a, b, bias: reference.gemm(a, b, out_dtype=jnp.float16, bias=bias),
             a, b, bias)
  _assert_close(got, ref, a, b, bias, tol_acc=_tol_acc(a, b, "gpu"))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4-row")],
                         ids=["mxfp8", "nvfp4"])
@pytest.mark.parametrize("k", [80, 40])
def test_contraction_lengths_that_need_padding(platform, pair, k, rng):
  """K not a multiple of the kernel's 16/32-element payload chunks: zero-padded, same result."""
  _platform_or_skip(platform)
  a, b = _operand(rng, (M, k), pair[0]), _operand(rng, (N, k), pair[1])
  got = _run(platform, lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32), a, b)
  ref = _run(platform, lambda a, b: reference.gemm(a, b, out_dtype=jnp.float32), a, b)
  _assert_close(got, ref, a, b)


# ----------------------------------------------------------------------------------------------
# The wgmma-dequant kernel on a GPU: tile tails, extreme block scales, NaN blocks, big shapes.
# ----------------------------------------------------------------------------------------------

SHAPES = [(1, 8, 32), (128, 256, 64), (300, 272, 1056), (257, 520, 4160), (2048, 2048, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("nvfp4-row", "nvfp4-2d"),
                                  ("mxfp8-e5m2", "nvfp4")], ids=["mxfp8", "nvfp4", "mixed"])
def test_dequant_kernel_tiles_and_tails(pair, shape, rng):
  _platform_or_skip("gpu")
  m, n, k = shape
  a, b = _operand(rng, (m, k), pair[0]), _operand(rng, (n, k), pair[1])
  got = _run("gpu", lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32), a, b)
  ref = _run("gpu", lambda a, b: reference.gemm(a, b, out_dtype=jnp.float32), a, b)
  _assert_close(got, ref, a, b)


STRESS_PAIRS = [("mxfp8-e5m2", "nvfp4"), ("mxfp8", "mxfp8"), ("nvfp4-row", "nvfp4-2d")]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", STRESS_PAIRS, ids=["mixed", "mxfp8", "nvfp4"])
def test_dequant_kernel_repeated_launches_are_bitwise_stable(pair, rng):
  """Races show up as launches that differ: the kernel's accumulation order is fixed, so every
  launch on the same inputs must give the same bits (and match the reference within the
  float32 accumulation tolerance). Fresh inputs per round; 2048^3 keeps every SM busy with
  several k-tiles in flight (the shape where a raw-slot refill race was seen on an H200)."""
  _platform_or_skip("gpu")
  m = n = k = 2048
  fn = jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32))
  for _ in range(2):
    a, b = _operand(rng, (m, k), pair[0]), _operand(rng, (n, k), pair[1])
    with jax.default_device(jax.devices("gpu")[0]):
      first = np.asarray(fn(a, b))
      differing = [i for i in range(1, 12)
                   if np.asarray(fn(a, b)).tobytes() != first.tobytes()]
      ref = _run("gpu", lambda a, b: reference.gemm(a, b, out_dtype=jnp.float32), a, b)
    assert not differing, f"launches {differing} of 11 differ bitwise from the first"
    _assert_close(first, ref, a, b)


# ----------------------------------------------------------------------------------------------
# CUDA graphs: both GEMM targets are command-buffer compatible.
# ----------------------------------------------------------------------------------------------

_GRAPH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxquant as jq
    from jaxquant.backends.ffi import gemm as ffi_gemm
    seed, out_path = int(sys.argv[1]), sys.argv[2]
    rng = np.random.default_rng(seed)
    bf16 = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((512, 1024)), bf16)
    w = jnp.asarray(rng.standard_normal((768, 1024)) * 0.05, bf16)
    bias = jnp.asarray(rng.standard_normal(768), bf16)
    PAIRS = [(jq.Float8CurrentScalingQuantizer(), jq.Float8CurrentScalingQuantizer(), "fast"),
             (jq.Float8CurrentScalingQuantizer(), jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
              "split"),
             (jq.Float8BlockQuantizer((1, 128)), jq.Float8BlockQuantizer((128, 128)), "split"),
             (jq.MXFP8Quantizer(), jq.MXFP8Quantizer(), "split"),
             (jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer(block_2d=True), "split")]
    def step(x, w, bias):
      outs = []
      for qa, qb, acc in PAIRS:
        a = jq.ops.quantize(x, qa, rowwise=True, columnwise=False).rowwise
        b = jq.ops.quantize(w, qb, rowwise=True, columnwise=False).rowwise
        outs.append(ffi_gemm.gemm(a, b, out_dtype=bf16, bias=bias, accumulation=acc))
        outs.append(ffi_gemm.gemm(a, b, out_dtype=jnp.float32, accumulation=acc))
      return outs
    f = jax.jit(step)
    runs = [[np.asarray(o) for o in f(x, w, bias)] for _ in range(3)]  # record, then replays
    for r in runs[1:]:
      assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0], r)), "replays differ"
    np.savez(out_path, *[o.view(np.uint8) if o.dtype != np.float32 else o for o in runs[0]])
    print("ok", jax.devices()[0].platform)
""")


def _captured_targets(stderr: str) -> dict:
  """{target: set of "capturing=" values} from the handlers' JAXQUANT_GEMM_TRACE lines."""
  seen = {}
  for line in stderr.splitlines():
    if line.startswith("[jaxquant gemm] "):
      target, *fields = line.split()[2:]
      state = next(f.split("=", 1)[1] for f in fields if f.startswith("capturing="))
      seen.setdefault(target, set()).add(state)
  return seen


@pytest.mark.gpu
def test_gemm_handlers_run_inside_cuda_graphs(rng, tmp_path):
  """The same jitted GEMMs with XLA command buffers (CUDA graphs) on and off, each in a fresh
  process: with them on, XLA must record both GEMM targets by stream capture (the handlers
  report it, JAXQUANT_GEMM_TRACE=1), replays must repeat the bits, and the results must equal
  the eager ones bitwise (JAXQUANT_GEMM_AUTOTUNE=0 in both, so both processes run cuBLASLt's
  first heuristic; the kernel path for MXFP8/NVFP4)."""
  _platform_or_skip("gpu")
  seed = int(rng.integers(1 << 30))
  results = {}
  for mode in ("graphs", "eager"):
    env = dict(os.environ, JAXQUANT_GEMM_AUTOTUNE="0", JAXQUANT_MX_GEMM="wgmma-dequant",
               JAXQUANT_GEMM_TRACE="1")
    flags = env.get("XLA_FLAGS", "")
    if mode == "graphs":
      flags += (" --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                " --xla_gpu_graph_min_graph_size=1")
    else:
      flags += " --xla_gpu_enable_command_buffer="
    env["XLA_FLAGS"] = flags.strip()
    path = tmp_path / f"{mode}.npz"
    out = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(seed), str(path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok gpu" in out.stdout, (out.stdout + out.stderr)[-3000:]
    results[mode] = (np.load(path), _captured_targets(out.stderr))
  (graphs, captured), (eager, uncaptured) = results["graphs"], results["eager"]
  targets = {ffi_gemm.FP8_TARGET, ffi_gemm.DEQUANT_TARGET}
  assert set(captured) == targets and all("yes" in v for v in captured.values()), captured
  assert set(uncaptured) == targets and all(v == {"no"} for v in uncaptured.values()), uncaptured
  assert sorted(graphs.files) == sorted(eager.files)
  for name in graphs.files:
    assert graphs[name].tobytes() == eager[name].tobytes(), f"output {name} differs"


def _wide_range_matrix(rng, shape, block=32):
  """Blocks whose magnitudes span 2^-100..2^60 (E8M0 exponents far from 127 on both sides),
  and elements within a block spread over 2^-14..1 of the block's largest (E4M3 subnormals)."""
  rows, cols = shape
  nb = -(-cols // block)
  scale = np.exp2(rng.integers(-100, 60, size=(rows, nb)).astype(np.float64))
  x = rng.standard_normal((rows, nb * block)) * np.exp2(rng.uniform(-14, 0, (rows, nb * block)))
  x = x * np.repeat(scale, block, axis=1)
  return np.asarray(x[:, :cols], np.float32)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8-e5m2"])
def test_dequant_mxfp8_extreme_block_scales_subnormals_and_nan_blocks(platform, fmt, rng):
  _platform_or_skip(platform)
  q = QUANTIZERS[fmt]
  xa, xb = _wide_range_matrix(rng, (M, K)), _wide_range_matrix(rng, (N, K))
  xa[3, 70] = np.nan  # row 3's block 2 becomes a NaN block (E8M0 255): row 3 of C is NaN
  a, b = _quantize(jnp.asarray(xa), q), _quantize(jnp.asarray(xb), q)
  got = _run(platform, lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32), a, b)
  ref = _run(platform, lambda a, b: reference.gemm(a, b, out_dtype=jnp.float32), a, b)
  assert np.isnan(np.asarray(ref)[3]).all()
  # Values whose decoded bf16 would be subnormal (below 2^-126) are outside the kernel's exact
  # range; the generator keeps every block above 2^-100.
  _assert_close(got, ref, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", ["0", "1"], ids=["first-heuristic", "autotuned"])
@pytest.mark.parametrize("accumulation", ["fast", "split"])
def test_cublaslt_fp8_accumulation_modes(accumulation, autotune, rng, monkeypatch):
  """Also with the opt-in algorithm timing (JAXQUANT_GEMM_AUTOTUNE=1, read per call)."""
  _platform_or_skip("gpu")
  monkeypatch.setenv("JAXQUANT_GEMM_AUTOTUNE", autotune)
  k = 4096
  a, b = _operand(rng, (256, k), "fp8"), _operand(rng, (272, k), "fp8-e5m2")
  got = _run("gpu", lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32,
                                               accumulation=accumulation), a, b)
  ref = _run("gpu", lambda a, b: reference.gemm(a, b, out_dtype=jnp.float32), a, b)
  _assert_close(got, ref, a, b, tol_acc=_tol_acc(a, b, "gpu", accumulation))


def test_default_accumulation_is_fast_forward_split_backward(monkeypatch):
  monkeypatch.delenv("JAXQUANT_FP8_ACCUMULATION", raising=False)
  assert ffi_gemm.fp8_accumulation(None, "linear/fc1/fprop", None) == "fast"
  assert ffi_gemm.fp8_accumulation(None, "linear/fc1/dgrad", None) == "split"
  assert ffi_gemm.fp8_accumulation(None, "linear/fc1/wgrad", None) == "split"
  assert ffi_gemm.fp8_accumulation(None, None, None) == "split"
  assert ffi_gemm.fp8_accumulation(None, "fprop", jax.lax.Precision.HIGHEST) == "split"
  monkeypatch.setenv("JAXQUANT_FP8_ACCUMULATION", "split")
  assert ffi_gemm.fp8_accumulation(None, "linear/fc1/fprop", None) == "split"
  monkeypatch.setenv("JAXQUANT_FP8_ACCUMULATION", "sometimes")
  with pytest.raises(ValueError, match="JAXQUANT_FP8_ACCUMULATION"):
    ffi_gemm.fp8_accumulation(None, "fprop", None)


# ----------------------------------------------------------------------------------------------
# Argument checking in the handlers, and the quantized Dense on the FFI GEMM.
# ----------------------------------------------------------------------------------------------

def test_handler_rejects_a_block_scale_in_the_wrong_layout(rng):
  _platform_or_skip("cpu")
  a = _operand(rng, (M, K), "block-1x128")
  bad_scale = a.scale_inv  # [M, K/128] row-major; cuBLASLt's layout is (K/128, round_up(M, 4))
  call = jax.ffi.ffi_call(ffi_gemm.FP8_TARGET, (jax.ShapeDtypeStruct((M, M), jnp.float32),
                                                jax.ShapeDtypeStruct((0,), jnp.uint8)),
                          vmap_method="sequential")
  with pytest.raises(Exception, match="a_scale is float32.*cuBLASLt's layout"):
    jax.block_until_ready(call(a.data, bad_scale, a.data, bad_scale, jnp.zeros((0,), jnp.float32),
                               a_scale_mode=np.int64(1), b_scale_mode=np.int64(1),
                               fast_accum=False))


def test_handler_rejects_payload_that_is_not_padded(rng):
  _platform_or_skip("cpu")
  a = _operand(rng, (M, 72), "mxfp8")
  call = jax.ffi.ffi_call(ffi_gemm.DEQUANT_TARGET, jax.ShapeDtypeStruct((M, M), jnp.float32),
                          vmap_method="sequential")
  empty = jnp.zeros((0,), jnp.float32)
  with pytest.raises(Exception, match="multiple of 16"):
    jax.block_until_ready(call(a.data, a.scale_inv, empty, a.data, a.scale_inv, empty, empty,
                               k=np.int64(72), a_scale_tile_rows=np.int64(1),
                               b_scale_tile_rows=np.int64(1)))


DENSE_RECIPES = [
    ("cpu", "Float8CurrentScaling"), ("cpu", "NVFP4BlockScaling"),
    *[pytest.param("gpu", r, marks=pytest.mark.gpu)
      for r in ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
                "NVFP4BlockScaling")]]


@pytest.mark.parametrize("platform,recipe", DENSE_RECIPES)
def test_quantized_dense_runs_its_gemms_on_the_ffi_path(platform, recipe, rng, monkeypatch):
  _platform_or_skip(platform)
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  kwargs = {"disable_stochastic_rounding": True} if recipe == "NVFP4BlockScaling" else {}
  model = jq.flax.Dense(128, recipe=getattr(jq.recipes, recipe)(**kwargs))
  x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
  device = jax.devices("gpu" if platform == "gpu" else "cpu")[0]
  with jax.default_device(device):
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
      return jnp.sum(model.apply(params, x, rngs={"quantize": jax.random.key(1)})
                     .astype(jnp.float32) ** 2)

    report = jq.explain(jax.grad(loss), params, x)
    grads = jax.jit(jax.grad(loss))(params, x)
  paths = report.paths("gemm")
  assert paths and not paths & {"reference"}, str(report)
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))


def test_ops_gemm_passes_the_direction_so_forward_fp8_uses_fast_accumulation(rng, monkeypatch):
  _platform_or_skip("cpu")
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  monkeypatch.delenv("JAXQUANT_FP8_ACCUMULATION", raising=False)
  a, b = _operand(rng, (M, K), "fp8"), _operand(rng, (N, K), "fp8")

  def hlo(role):
    fn = lambda a, b: jq.ops.gemm(a, b, out_dtype=jnp.bfloat16, role=role)
    return jax.jit(fn).lower(a, b).as_text()

  assert "fast_accum = true" in hlo("linear/fc1/fprop")
  assert "fast_accum = false" in hlo("linear/fc1/wgrad")
