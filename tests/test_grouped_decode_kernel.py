"""`jaxquant_grouped_decode_nvfp4` / `_mxfp8`: NVFP4 and MXFP8 storages decoded to bfloat16 for
the grouped GEMMs on decoded operands, bit for bit XLA's decode (`dequantize_raw`, then a
bfloat16 cast: any difference is a wrong code, scale, block or nibble).

CPU tests run the CPU handlers and the routing; `-m gpu` runs the CUDA kernels on the same
storages (token copies of every NVFP4 option and both MXFP8 payloads, expert weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.grouped as jg
import oracle
import test_grouped_bf16 as tgb
import test_grouped_ffi as tgf
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi.grouped import decode_kernel
from jaxquant.grouping import decode

bf16_device = tgb.bf16_device  # the fixture: the bfloat16 kernel's route on the CPU handler

QUANTIZERS = {"1x16": jq.NVFP4Quantizer(), "16x16": jq.NVFP4Quantizer(block_2d=True),
              "row": jq.NVFP4Quantizer(row_scaled=True), "rht": jq.NVFP4Quantizer(rht=True),
              "sr": jq.NVFP4Quantizer(stochastic_rounding=True),
              "mxfp8": jq.MXFP8Quantizer(), "mxfp8-e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2)}
EXPERT_NAMES = ("1x16", "16x16", "mxfp8", "mxfp8-e5m2")

needs_target = pytest.mark.skipif(
    decode_kernel.MXFP8_TARGET not in registry.registered_targets("cpu"),
    reason=f"jaxquant FFI extension without {decode_kernel.MXFP8_TARGET}")


def _token_copies(rng, quantizer, tokens=150, k=96, groups=5, nan=False):
  """Both grouped copies of random tokens (one group empty, rows of no group at the end)."""
  x = oracle.random_matrix(rng, (tokens, k))
  if nan:
    x[7, 20] = np.nan
  sizes = jnp.asarray(tgf._sizes(rng, tokens, groups, (2,), 9))
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), groups)
  q = tgf._on("reference", lambda x, s, k: jg.quantize(x, s, quantizer, keys=k),
              jnp.asarray(x, jnp.bfloat16), sizes, keys)
  return q.rowwise, q.columnwise


def _experts(rng, quantizer, groups=3, n=48, k=80):
  w = jnp.asarray(oracle.random_matrix(rng, (groups, n, k)), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), groups)
  return tgf._on("reference", lambda w, k: jg.quantize_experts(w, quantizer, keys=k).rowwise,
                 w, keys)


def _assert_decodes_like_xla(storage, experts=False):
  xla = (decode.experts(storage) if experts else decode.tokens(storage)).values
  kernel = jax.jit(decode_kernel.raw_bf16)(storage)
  xla, kernel = np.asarray(xla), np.asarray(kernel)
  assert kernel.dtype == xla.dtype == np.dtype(jnp.bfloat16)
  assert kernel.shape == xla.shape == tuple(storage.data.shape)
  nan = np.isnan(xla.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(kernel.astype(np.float32)), nan)
  assert np.array_equal(kernel.view(np.uint16)[~nan], xla.view(np.uint16)[~nan]), (
      "kernel decode differs from XLA's at "
      f"{np.argwhere(kernel.view(np.uint16) != xla.view(np.uint16))[:5].tolist()}")
  values = xla.astype(np.float32)[~nan]
  assert (values > 0).any() and (values < 0).any(), "a decode of one sign tests little"


def _check_all(rng, name):
  rowwise, columnwise = _token_copies(rng, QUANTIZERS[name])
  _assert_decodes_like_xla(rowwise)
  _assert_decodes_like_xla(columnwise)
  if name in EXPERT_NAMES:
    _assert_decodes_like_xla(_experts(rng, QUANTIZERS[name]), experts=True)


@needs_target
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_cpu_handler_decodes_like_xla(rng, name):
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU handler runs where the default backend is the CPU")
  _check_all(rng, name)


@needs_target
def test_a_nan_block_decodes_to_nans_like_xla(rng):
  rowwise, columnwise = _token_copies(rng, QUANTIZERS["1x16"], nan=True)
  for storage in (rowwise, columnwise):
    assert np.isnan(np.asarray(storage.scale_inv, np.float32)).any()
    _assert_decodes_like_xla(storage)


@needs_target
def test_the_handler_names_a_bad_argument():
  data = jnp.zeros((1, 4, 24), jnp.float4_e2m1fn)
  scales = jnp.zeros((1, 4, 1), jnp.float8_e4m3fn)
  out = [jax.ShapeDtypeStruct((1, 4, 24), jnp.bfloat16)]
  with pytest.raises(Exception, match="cols=24 must be a multiple of 16"):
    jax.jit(lambda d, s: calls.call(decode_kernel.NVFP4_TARGET, out, d, s,
                                    block_rows=np.int64(1)))(data, scales)
  data = jnp.zeros((1, 4, 32), jnp.float4_e2m1fn)
  out = [jax.ShapeDtypeStruct((1, 4, 32), jnp.bfloat16)]
  with pytest.raises(Exception, match="block_rows=3; expected 1"):
    jax.jit(lambda d, s: calls.call(decode_kernel.NVFP4_TARGET, out, d, s,
                                    block_rows=np.int64(3)))(data, jnp.zeros((1, 2, 2),
                                                                              jnp.float8_e4m3fn))
  with pytest.raises(Exception, match=r"scales is float8_e4m3fn\(1, 2, 2\); expected "
                                      r"float8_e4m3fn\(1, 4, 2\)"):
    jax.jit(lambda d, s: calls.call(decode_kernel.NVFP4_TARGET, out, d, s,
                                    block_rows=np.int64(1)))(data, jnp.zeros((1, 2, 2),
                                                                              jnp.float8_e4m3fn))


@needs_target
def test_the_mxfp8_handler_names_a_bad_argument():
  data = jnp.zeros((1, 4, 24), jnp.float8_e4m3fn)
  out = [jax.ShapeDtypeStruct((1, 4, 24), jnp.bfloat16)]
  with pytest.raises(Exception, match="cols=24 must be a multiple of 16"):
    jax.jit(lambda d, s: calls.call(decode_kernel.MXFP8_TARGET, out, d, s))(
        data, jnp.zeros((1, 4, 1), jnp.float8_e8m0fnu))
  data = jnp.zeros((1, 4, 64), jnp.float8_e4m3fn)
  out = [jax.ShapeDtypeStruct((1, 4, 64), jnp.bfloat16)]
  with pytest.raises(Exception, match=r"scales is float8_e8m0fnu\(1, 4, 1\); expected "
                                      r"float8_e8m0fnu\(1, 4, 2\)"):
    jax.jit(lambda d, s: calls.call(decode_kernel.MXFP8_TARGET, out, d, s))(
        data, jnp.zeros((1, 4, 1), jnp.float8_e8m0fnu))


def test_other_formats_and_partial_chunks_stay_with_xla_and_explain_says_why(rng):
  q = jq.Float8BlockQuantizer((1, 128))
  a, _ = tgb._tokens_and_experts(rng, q, q)
  assert decode_kernel.reason(a) == f"{jq.formats.format_of(q).name} is decoded by XLA"
  assert decode_kernel.raw_bf16(a) is None
  assert decode_kernel.slower_note(a) == ""  # no kernel planned: nothing slower
  a, e = tgb._tokens_and_experts(rng, jq.NVFP4Quantizer(), jq.NVFP4Quantizer(), k=72)
  if registry.unserved_reason("cpu") is None and jax.default_backend() == "cpu":
    assert decode_kernel.reason(a) == "72 columns are not whole chunks of 16"
    assert decode_kernel.slower_note(a, e) == (
        f"NVFP4 operand (150, 72) decoded by XLA, not {decode_kernel.NVFP4_TARGET}: 72 columns "
        f"are not whole chunks of 16; NVFP4 operand (5, 40, 72) decoded by XLA, not "
        f"{decode_kernel.NVFP4_TARGET}: 72 columns are not whole chunks of 16")


@needs_target
@pytest.mark.parametrize("qa,qw,target", [
    (jq.NVFP4Quantizer(), jq.NVFP4Quantizer(block_2d=True), decode_kernel.NVFP4_TARGET),
    (jq.MXFP8Quantizer(), jq.MXFP8Quantizer(), decode_kernel.MXFP8_TARGET)])
def test_decoded_gemms_call_the_kernel_and_match_the_reference(bf16_device, rng, monkeypatch,
                                                               qa, qw, target):
  """The forward GEMM of NVFP4 / MXFP8 tokens and experts: one decode call per operand in the
  lowered program, the reference's result (float32 sums in both), no slower-path reason."""
  a, e = tgb._tokens_and_experts(rng, qa, qw)
  fn = lambda a, e: jg.gemm(a, e, out_dtype=jnp.float32)
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  text = jax.jit(lambda *args: fn(*args)).lower(a, e).as_text()
  monkeypatch.delenv("JAXQUANT_BACKEND")
  assert text.count(target) == 2, "one kernel decode per operand"
  report = tgf._paths(fn, a, e)
  gemm = [d for d in report if d.op == "grouped_gemm"]
  assert len(gemm) == 1 and gemm[0].detail.endswith(tgb.DECODED) and gemm[0].reason == ""
  ffi = tgf._on("ffi", fn, a, e)
  ref = tgf._on("reference", fn, a, e)
  scale = float(np.max(np.abs(np.asarray(ref))))
  np.testing.assert_allclose(np.asarray(ffi), np.asarray(ref), rtol=0, atol=2.0**-14 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_gpu_kernel_decodes_like_xla(rng, name):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")
  reason = decode_kernel.reason(_experts(rng, QUANTIZERS["1x16"]))
  if reason is not None:
    pytest.skip(reason)
  _check_all(rng, name)


@pytest.mark.gpu
def test_gpu_kernel_decodes_large_experts_like_xla(rng):
  """Eight experts of 256 x 1408 (more than one grid wave, 16x16 and 1x16 blocks)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")
  for q in (QUANTIZERS["1x16"], QUANTIZERS["16x16"]):
    _assert_decodes_like_xla(_experts(rng, q, groups=8, n=256, k=1408), experts=True)
