"""MXFP8 copies written raw (design decision 47): where the grouped GEMMs read MXFP8 decoded to
bfloat16, `jaxquant_grouped_quantize_mxfp8` writes the copies `grouped_dense` makes for them as
their raw values (bfloat16 code x block scale) instead of the codes, so no decode pass runs.
NVFP4 likewise for its rowwise copies (design decision 53: `jaxquant_grouped_quantize_nvfp4`
with `raw`; the columnwise copies keep their codes).

The contract: a raw copy's data is bit for bit the decode of the codes the same call writes
without `raw` (scales and amax unchanged), and a GroupedDense step with raw copies is bit for
bit the step that decodes its codes (the bfloat16 GEMMs read the same values). CPU tests run the
CPU handlers (the `bf16_device` fixture lets the bfloat16 kernel's CPU handler stand in for the
CUDA kernel); `-m gpu` runs the CUDA kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import oracle
import test_grouped_bf16 as tgb
import test_grouped_ffi as tgf
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi import quantize as single
from jaxquant.backends.ffi.grouped import decode_kernel, decoded, support
from jaxquant.backends.ffi.grouped import quantize as grouped_quantize
from jaxquant.formats import format_of
from jaxquant.tensors import ScaledTensor

bf16_device = tgb.bf16_device
on_kernel = tgb.on_kernel
TARGET = "jaxquant_grouped_quantize_mxfp8"
BF16 = np.dtype(jnp.bfloat16)
PAYLOADS = {"e4m3": jq.MXFP8Quantizer(), "e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2)}
RAW_NOTE = "written as raw bfloat16 values"

needs_target = pytest.mark.skipif(TARGET not in registry.registered_targets("cpu"),
                                  reason=f"jaxquant FFI extension without {TARGET}")


def _offsets(sizes):
  return jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)


def _tokens(rng, tokens, cols, dtype, nan=False):
  """Random tokens spanning many binades (every block scale differs), one NaN on request."""
  spread = 4 if dtype == jnp.float16 else 20  # float16 keeps its range
  x = oracle.random_matrix(rng, (tokens, cols)) * np.exp2(rng.integers(-spread, spread,
                                                                       (tokens, 1)))
  if nan:
    x[5, 3] = np.nan
  return jnp.asarray(x, dtype)


def _assert_raw_is_the_decode(codes, raw):
  """`raw` (a raw copy) holds bit for bit the bfloat16 decode of `codes` (the same call's
  codes), with the same scales; a copy of one sign or all NaN would test little."""
  assert raw.data.dtype == BF16 and codes.data.dtype != BF16
  assert format_of(raw.quantizer).stores_raw(raw) and not format_of(codes.quantizer).stores_raw(
      codes)
  np.testing.assert_array_equal(np.asarray(raw.scale_inv).view(np.uint8),
                                np.asarray(codes.scale_inv).view(np.uint8))
  expected = np.asarray(jnp.asarray(format_of(codes.quantizer).dequantize_raw(codes)
                                    if codes.data.ndim == 2 else
                                    jax.vmap(lambda d, s: format_of(codes.quantizer).dequantize_raw(
                                        type(codes)(d, s, None, codes.quantizer)))(
                                            codes.data, codes.scale_inv), jnp.bfloat16))
  got = np.asarray(raw.data)
  nan = np.isnan(expected.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  mismatch = got.view(np.uint16)[~nan] != expected.view(np.uint16)[~nan]
  assert not mismatch.any(), f"{mismatch.sum()} raw values differ from the codes' decode"
  values = expected.astype(np.float32)[~nan]
  assert (values > 0).any() and (values < 0).any()


def _gathered(x, sizes, block, quantizer, raw, **kwargs):
  starts = _offsets(sizes)
  pstarts = _offsets(-(-np.asarray(sizes) // block) * block)
  length = int(pstarts[-1]) + block  # a spare block of no group at the end
  fn = lambda x: single.quantize_gathered(x, starts, pstarts, length, quantizer,
                                          orig_dtype=np.dtype(x.dtype), raw=raw, **kwargs)
  return jax.jit(fn)(x)


def check_token_copies(rng, name, tokens, cols, dtype, nan=False):
  """Both copies in one layout, and the packed rowwise copy beside a padded columnwise one."""
  x = _tokens(rng, tokens, cols, dtype, nan)
  sizes = tgf._sizes(rng, tokens, 5, (2,), 9)
  for row_packed in (False, True):
    kw = dict(rowwise=True, columnwise=True, row_packed=row_packed)
    codes = _gathered(x, sizes, 32, PAYLOADS[name], False, **kw)
    raw = _gathered(x, sizes, 32, PAYLOADS[name], True, **kw)
    for c, r in zip(codes, raw):
      _assert_raw_is_the_decode(c, r)
      assert float(c.amax) == float(r.amax) or (nan and np.isnan(float(r.amax)))


def _edge_weights(rng, groups, rows, cols, dtype):
  """Random weights whose 32-blocks (both directions) meet the block exponent's edges: a NaN
  (e = 255), infinities (e = 254, two factors), all zeros (e = 0), and float32 subnormals."""
  w = np.array(_tokens(rng, groups * rows, cols, jnp.float32), np.float32)
  w[3, 5] = np.nan
  w[40, 9], w[70, 33] = np.inf, -np.inf
  w[96:128, 0:32] = 0.0
  if dtype == jnp.float32:
    w[128:160, 32:40] *= np.float32(2.0**-140)
  return jnp.asarray(w, dtype)


def check_expert_copies(rng, name, groups, rows, cols, dtype, kind="binades"):
  """Expert weights read as they are: both copies from one launch (the columnwise copy
  `[G, cols, rows]`), either alone. `kind`: "binades" (rows 2^-20 .. 2^20 apart: most column
  blocks hold values below their normal FP8 range, mxfp8_x_layout_kernel's general path),
  "normal" (standard normal weights with 1% zeros, as initialized ones: its rounding path),
  "edges"."""
  if kind == "edges":
    w = _edge_weights(rng, groups, rows, cols, dtype)
  elif kind == "normal":  # with ~1% exact zeros, as a bfloat16 initializer draws them
    w = oracle.random_matrix(rng, (groups * rows, cols))
    w = jnp.asarray(np.where(rng.random(w.shape) < 0.01, 0.0, w), dtype)
  else:
    w = _tokens(rng, groups * rows, cols, dtype)
  starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
  for rowwise, columnwise in ((True, True), (False, True), (True, False)):
    fn = lambda w, raw: single.quantize_gathered(
        w, starts, starts, groups * rows, PAYLOADS[name], rowwise=rowwise, columnwise=columnwise,
        orig_dtype=np.dtype(w.dtype), expert_rows=rows, raw=raw)
    codes, raw = jax.jit(fn, static_argnums=1)(w, False), jax.jit(fn, static_argnums=1)(w, True)
    for c, r in zip(codes, raw):
      if c is not None:
        _assert_raw_is_the_decode(c, r)
    if columnwise and dtype == jnp.bfloat16:
      check_expert_copies_in_x_layout(w, starts, name, groups, rows, cols, rowwise, raw)
    elif columnwise:  # the kernel rounds bfloat16 bits
      with pytest.raises(ValueError, match="col_in_x_layout: needs raw copies of bfloat16"):
        single.quantize_gathered(w, starts, starts, groups * rows, PAYLOADS[name],
                                 rowwise=rowwise, columnwise=True, orig_dtype=np.dtype(w.dtype),
                                 expert_rows=rows, raw=True, col_in_x_layout=True)


def check_expert_copies_in_x_layout(w, starts, name, groups, rows, cols, rowwise, raw):
  """`col_in_x_layout` (design decision 49): the same raw copies, the columnwise one (data
  `[G, rows, cols]`, scales `[G, rows / 32, cols]`) each expert's `[cols, rows]` copy
  transposed, bit for bit; the rowwise copy and the amax unchanged."""
  fn = lambda w: single.quantize_gathered(
      w, starts, starts, groups * rows, PAYLOADS[name], rowwise=rowwise, columnwise=True,
      orig_dtype=np.dtype(w.dtype), expert_rows=rows, raw=True, col_in_x_layout=True)
  row, col = jax.jit(fn)(w)
  assert col.data.shape == (groups, rows, cols) and col.data.dtype == BF16
  assert col.scale_inv.shape == (groups, rows // 32, cols)
  swap = lambda a: np.swapaxes(np.asarray(a), 1, 2)
  np.testing.assert_array_equal(np.asarray(col.data).view(np.uint16),
                                swap(raw[1].data).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(col.scale_inv).view(np.uint8),
                                swap(raw[1].scale_inv).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(col.amax), np.asarray(raw[1].amax))  # NaN == NaN
  if rowwise:
    np.testing.assert_array_equal(np.asarray(row.data).view(np.uint16),
                                  np.asarray(raw[0].data).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(row.scale_inv).view(np.uint8),
                                  np.asarray(raw[0].scale_inv).view(np.uint8))


# --------------------------------------- the handlers -----------------------------------------

@needs_target
@pytest.mark.parametrize("name", sorted(PAYLOADS))
@pytest.mark.parametrize("cols,dtype", [(96, jnp.bfloat16), (72, jnp.float32), (44, jnp.float16)])
def test_cpu_raw_token_copies_are_the_decode_of_the_codes(rng, name, cols, dtype):
  check_token_copies(rng, name, 150, cols, dtype, nan=cols == 72)


@needs_target
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_cpu_raw_expert_copies_are_the_decode_of_the_codes(rng, name):
  for dtype in (jnp.float32, jnp.bfloat16):
    for kind in ("binades", "normal"):
      check_expert_copies(rng, name, 3, 64, 40, dtype, kind)


@needs_target
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cpu_raw_expert_copies_at_the_block_exponents_edges(rng, dtype):
  check_expert_copies(rng, "e4m3", 3, 64, 48, dtype, "edges")


@needs_target
def test_the_handler_names_a_bad_raw_argument(rng):
  """The handler's argument errors, on whichever platform runs the test (a CUDA handler's error
  surfaces when the result is waited for, so every call is waited for)."""
  x = jnp.ones((64, 32), jnp.bfloat16)
  starts = jnp.asarray([0, 64], jnp.int32)
  results = [jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),
             jax.ShapeDtypeStruct((64, 1), jnp.float8_e8m0fnu),
             jax.ShapeDtypeStruct((), jnp.float32)]
  common = dict(rowwise=True, columnwise=False, length=np.int64(64), expert_rows=np.int64(0),
                row_packed=False, col_in_x_layout=False, row_flags=False)
  with pytest.raises(Exception, match="raw_e5m2 is true without raw"):
    jax.block_until_ready(jax.jit(lambda x: calls.call(
        TARGET, results, x, starts, starts, raw=False, raw_e5m2=True, **common))(x))
  with pytest.raises(Exception, match="rowwise data is bfloat16.*; expected float8_e4m3fn or "
                                      "float8_e5m2"):
    jax.block_until_ready(jax.jit(lambda x: calls.call(  # bfloat16 data without raw
        TARGET, results, x, starts, starts, raw=False, raw_e5m2=False, **common))(x))
  common.update(col_in_x_layout=True)
  with pytest.raises(Exception, match="col_in_x_layout needs raw copies of bfloat16 expert "
                                      "weights with a columnwise copy"):
    jax.block_until_ready(jax.jit(lambda x: calls.call(  # tokens, rowwise only
        TARGET, results, x, starts, starts, raw=True, raw_e5m2=False, **common))(x))
  with pytest.raises(ValueError, match="col_in_x_layout: needs raw copies of bfloat16 expert"):
    single.quantize_gathered(x, starts, starts, 64, jq.MXFP8Quantizer(), rowwise=True,
                             columnwise=True, orig_dtype=np.dtype(jnp.bfloat16), raw=True,
                             col_in_x_layout=True)  # expert_rows = 0: tokens


def test_only_mxfp8_copies_are_written_raw(rng):
  x = jnp.ones((64, 256), jnp.bfloat16)
  starts = jnp.asarray([0, 64], jnp.int32)
  with pytest.raises(ValueError, match="raw: only MXFP8 copies are written raw"):
    single.quantize_gathered(x, starts, starts, 64, jq.Float8BlockQuantizer(), rowwise=True,
                             columnwise=False, orig_dtype=np.dtype(jnp.bfloat16), raw=True)
  assert support.raw_copies_reason(jq.NVFP4Quantizer()) == "nvfp4 keeps its codes"


# ------------------------------------- GroupedDense -------------------------------------------

RECIPES = {
    "MXFP8BlockScaling": jq.recipes.MXFP8BlockScaling,
    "moe_nvfp4_fwd_mxfp8_bwd": lambda: jq.CustomRecipe(
        jq.factories.moe_nvfp4_forward_mxfp8_backward),
}


def _raw_and_codes_steps(rng, recipe, monkeypatch, groups=4, tokens=96, k=64, n=64,
                         use_bias=True):
  """The GroupedDense step with raw copies and with the codes decoded, its explain report and
  its lowered program."""
  factory = {**RECIPES, **NVFP4_RECIPES}[recipe]
  step, args = tgf._grouped_step(factory(), groups, tokens, k, n, rng, use_bias=use_bias)
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  monkeypatch.delenv(support.RAW_COPIES_ENV, raising=False)
  report = jq.explain(step, *args)
  lower = lambda: jax.jit(lambda *a: step(*a)).lower(*args).as_text()  # a fresh trace
  text = lower()
  raw = tgf._on("auto", step, *args)
  monkeypatch.setenv(support.RAW_COPIES_ENV, "off")
  codes_text = lower()
  codes = tgf._on("auto", step, *args)
  monkeypatch.delenv(support.RAW_COPIES_ENV)
  return raw, codes, report, text, codes_text, (step, args)


def _assert_within_one_ulp(u, v):
  """The bias gradient, which no quantized copy feeds: GroupedDense sums dy a group in float32
  with XLA's segment_sum, whose scatter-add on a GPU adds in no fixed order (session 21, H200:
  the float32 sums differed from the first run's in 300 of 300 runs), so two runs of the same
  step may round a sum that sits at a bfloat16 boundary to neighbouring values (one element
  of 1536 in a GPU run of this test). Same sign, at most one bfloat16 ulp apart."""
  assert u.dtype == BF16, u.dtype  # the step's parameters are bfloat16 (_grouped_step)
  a, b = u.view(np.uint16).astype(np.int32), v.view(np.uint16).astype(np.int32)
  assert np.array_equal(a >> 15, b >> 15), "the bias gradients differ in sign"
  assert np.abs(a - b).max() <= 1, f"the bias gradients differ by {np.abs(a - b).max()} ulps"


ALONG_N_NOTE = "in the weights' own layout, read along N"


def check_layer(rng, recipe, monkeypatch, use_bias=True, **shape):
  """Raw copies against decoded codes, bit for bit. Without a bias, MXFP8's forward copy of the
  weights is written in their own layout and read along N (design decision 49): the codes step
  reads its transposed copy, so the forward GEMMs differ in layout, not in values."""
  raw, codes, report, text, codes_text, (step, args) = _raw_and_codes_steps(
      rng, recipe, monkeypatch, use_bias=use_bias, **shape)
  mxfp8 = [d for d in report if d.op == "grouped_quantize" and "MXFP8" in d.detail]
  assert mxfp8 and all(RAW_NOTE in d.detail for d in mxfp8), "\n".join(map(str, report))
  along_n = [d for d in report if ALONG_N_NOTE in d.detail]
  if recipe == "MXFP8BlockScaling" and not use_bias:
    assert len(along_n) == 1 and along_n[0].detail.startswith("columnwise"), along_n
    fprop = [d for d in report if d.op == "grouped_gemm" and "fprop" in str(d)]
    assert len(fprop) == 1 and "b read along N from its [G, K, N] copy" in fprop[0].detail
  else:  # a bias needs the K-major instances' float32 output; the hybrid's forward is NVFP4
    assert not along_n, along_n
  # The hybrid's NVFP4 copies: the experts' (grouped NVFP4 kernel) raw, the row-scaled tokens'
  # (the single-tensor kernel) codes.
  others = [d for d in report if d.op == "grouped_quantize" and "MXFP8" not in d.detail]
  for d in others:
    assert (RAW_NOTE in d.detail) == ("row_scaled=True" not in d.detail), str(d)
  assert decode_kernel.MXFP8_TARGET not in text and decode_kernel.MXFP8_TARGET in codes_text
  assert "raw = true" in text and "raw = true" not in codes_text
  raw_leaves, _ = jax.tree_util.tree_flatten_with_path(raw)
  for (path, u), v in zip(raw_leaves, jax.tree_util.tree_leaves(codes)):
    u, v = np.asarray(u), np.asarray(v)
    assert u.dtype == v.dtype
    if "bias" in jax.tree_util.keystr(path):
      _assert_within_one_ulp(u, v)
    else:
      np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))
  ref = tgf._on("reference", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(raw), jax.tree_util.tree_leaves(ref)):
    tgf._assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


@needs_target
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_grouped_dense_with_raw_copies_is_bit_for_bit_the_decoded_step(bf16_device, rng,
                                                                       monkeypatch, recipe,
                                                                       use_bias):
  check_layer(rng, recipe, monkeypatch, use_bias)


REFUSED_NOTE = "transposed, not in the weights' own layout as asked: "


def _weight_quantize_notes(rng, param_dtype):
  """The explain details of a no-bias MXFP8 GroupedDense step's weight quantizes, and its fprop."""
  model = jq.flax.GroupedDense(features=64, num_groups=4, recipe=jq.recipes.MXFP8BlockScaling(),
                               dtype=jnp.bfloat16, param_dtype=param_dtype, use_bias=False)
  x = jnp.asarray(oracle.random_matrix(rng, (96, 64)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (96, 64)), jnp.bfloat16)
  sizes = jnp.asarray(tgf._sizes(rng, 96, 4, (1,), 5))
  variables = tgf._on("reference", model.init, jax.random.PRNGKey(0), x, sizes)

  def step(variables, x, dy):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, sizes), variables, x)
    return y, vjp(dy)

  report = jq.explain(step, variables, x, dy)
  weights = [d.detail for d in report if d.op == "grouped_quantize" and "weight" in str(d)]
  fprop = [d.detail for d in report if d.op == "grouped_gemm" and "fprop" in str(d)]
  return weights, fprop


@needs_target
def test_explain_says_why_the_forward_copy_is_transposed(bf16_device, rng, monkeypatch):
  """Where grouped_dense asks for the forward copy in the weights' own layout and the kernel
  does not write it (float32 weights, or JAXQUANT_GROUPED_RAW_COPIES=transposed), the weights'
  columnwise quantize says so and why, and the fprop reads the transposed copy."""
  monkeypatch.delenv(support.RAW_COPIES_ENV, raising=False)
  weights, fprop = _weight_quantize_notes(rng, jnp.bfloat16)
  assert any(ALONG_N_NOTE in w for w in weights) and not any(REFUSED_NOTE in w for w in weights)
  weights, fprop = _weight_quantize_notes(rng, jnp.float32)
  refused = [w for w in weights if REFUSED_NOTE in w]
  assert len(refused) == 1 and refused[0].startswith("columnwise"), weights
  assert REFUSED_NOTE + "float32 weights: the kernel rounds bfloat16 bits" in refused[0]
  assert fprop and not any("read along N" in f for f in fprop), fprop
  monkeypatch.setenv(support.RAW_COPIES_ENV, "transposed")
  weights, _ = _weight_quantize_notes(rng, jnp.bfloat16)
  assert any(REFUSED_NOTE + f"{support.RAW_COPIES_ENV}=transposed" in w for w in weights), weights


@needs_target
def test_raw_copies_need_the_decoded_route_and_say_why_not(bf16_device, rng, monkeypatch):
  """With the mma.sync kernel chosen the copies keep their codes (the kernel reads codes), and
  a raw operand handed to a GEMM the bfloat16 kernel cannot serve goes to the reference with
  the reason, never to a kernel that reads codes."""
  leaf = jq.MXFP8Quantizer()
  assert support.raw_copies_reason(leaf) is None
  monkeypatch.setenv(decoded.KERNEL_ENV, "mma_sync")
  assert support.raw_copies_reason(leaf) == f"{decoded.KERNEL_ENV}=mma_sync: the GEMMs read codes"
  monkeypatch.delenv(decoded.KERNEL_ENV)
  shape, bf16 = (4, 64, 64), jnp.bfloat16
  assert support.experts_along_n(leaf, shape, True, bf16)
  assert not support.experts_along_n(leaf, shape, False, bf16)  # copies not for decoded GEMMs
  assert not support.experts_along_n(leaf, shape, True, jnp.float32)  # float32 weights
  assert support.along_n_reason(leaf, shape, True, jnp.float32).startswith(
      "float32 weights: the kernel rounds bfloat16 bits")
  assert support.along_n_reason(leaf, shape, False, bf16) == (
      "the copies feed no GEMM on decoded operands")
  hybrid = jq.HybridQuantizer(leaf, jq.MXFP8Quantizer(jnp.float8_e5m2))
  assert support.along_n_reason(hybrid, shape, True, bf16) == (
      "a Hybrid quantizes its two copies apart")
  assert support.forward_reads_along_n(leaf, bf16, bias=False)
  assert not support.forward_reads_along_n(leaf, bf16, bias=True)
  assert not support.forward_reads_along_n(leaf, jnp.float32, bias=False)
  monkeypatch.setenv(support.RAW_COPIES_ENV, "transposed")  # raw, as before decision 49
  assert support.raw_copies_reason(leaf) is None and not support.experts_along_n(leaf, shape, True,
                                                                                 bf16)
  assert support.along_n_reason(leaf, shape, True, bf16) == f"{support.RAW_COPIES_ENV}=transposed"
  monkeypatch.setenv(support.RAW_COPIES_ENV, "bogus")
  with pytest.raises(ValueError, match="JAXQUANT_GROUPED_RAW_COPIES='bogus'"):
    support.raw_copies_reason(leaf)
  monkeypatch.delenv(support.RAW_COPIES_ENV)
  a, e = tgb._tokens_and_experts(rng, leaf, leaf)
  raw_a = type(a)(jnp.asarray(format_of(leaf).dequantize_raw(a), jnp.bfloat16), a.scale_inv,
                  a.amax, a.group_sizes, a.quantizer, a.orig_dtype, a.rht, a.token_axis, a.layout)
  assert support.gemm_unsupported(raw_a, e, jnp.float32) is None
  monkeypatch.setattr(tgb.bf16, "device_reason", lambda platform=None: "no device here")
  reason = support.gemm_unsupported(raw_a, e, jnp.float32)
  assert reason.startswith("a holds raw MXFP8 values in bfloat16, which only the bfloat16 "
                           "CUTLASS kernel reads: no device here"), reason
  fn = lambda a, e: jq.grouped.gemm(a, e, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(tgf._on("auto", fn, raw_a, e)),
                                np.asarray(tgf._on("reference", fn, a, e)))


# ---------------------------------------- NVFP4 copies ----------------------------------------

NVFP4 = {"1x16": jq.NVFP4Quantizer(), "1x16-sr": jq.NVFP4Quantizer(stochastic_rounding=True),
         "rht-sr": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True),
         "16x16": jq.NVFP4Quantizer(block_2d=True)}
NVFP4_TARGET = support.QUANTIZE_NVFP4_TARGET


def _nvfp4_copies(rng, x, sizes, quantizer, expert_rows=0):
  """Both copies of x from `jaxquant_grouped_quantize_nvfp4`, as codes and raw (one set of
  stochastic-rounding words): tokens in a layout of 16-position blocks with a spare block of
  no group, or experts of `expert_rows` rows."""
  groups = len(sizes)
  starts = _offsets(sizes)
  if expert_rows:
    pstarts, length = starts, x.shape[0]
  else:
    pstarts = _offsets(-(-np.asarray(sizes) // 16) * 16)
    length = int(pstarts[-1]) + 16
  sr = quantizer.stochastic_rounding
  words = {d: jnp.asarray(rng.integers(0, 2**32, (groups, 2), dtype=np.uint64), jnp.uint32)
           if sr else None for d in ("rowwise", "columnwise")}
  out = []
  for raw in (False, True):
    fn = lambda x, raw=raw: grouped_quantize._nvfp4_call(
        x, starts, pstarts, quantizer, groups, length, True, True, words["rowwise"],
        words["columnwise"], expert_rows=expert_rows, raw=raw)
    copies = jax.jit(fn)(x)
    out.append({d: (ScaledTensor(data, scale_inv, None, quantizer, np.dtype(x.dtype), False),
                    amax) for d, (data, scale_inv, amax) in copies.items()})
  return out


def check_nvfp4_copies(rng, name, tokens, cols, dtype, groups=5, nan=False):
  """Tokens in ragged groups (1x16 blocks; stochastic rounding; RHT'd columnwise copy) or
  experts of 32 rows (16x16 blocks): each raw copy is bit for bit the decode of its codes, the
  block scales and the group amaxes the same."""
  q = NVFP4[name]
  x = _tokens(rng, tokens, cols, dtype, nan)
  if q.block_2d:
    sizes, rows = np.full(tokens // 32, 32, np.int32), 32
  else:
    sizes, rows = tgf._sizes(rng, tokens, groups, (2,), 7), 0
  codes, raw = _nvfp4_copies(rng, x, sizes, q, rows)
  for direction in ("rowwise", "columnwise"):
    _assert_raw_is_the_decode(codes[direction][0], raw[direction][0])
    np.testing.assert_array_equal(np.asarray(codes[direction][1]).view(np.uint32),
                                  np.asarray(raw[direction][1]).view(np.uint32))


@needs_target
@pytest.mark.parametrize("name", sorted(NVFP4))
@pytest.mark.parametrize("cols,dtype", [(96, jnp.bfloat16), (72, jnp.float32), (36, jnp.float16)])
def test_cpu_raw_nvfp4_copies_are_the_decode_of_the_codes(rng, name, cols, dtype):
  check_nvfp4_copies(rng, name, 192, cols, dtype, nan=cols == 72)


@needs_target
def test_the_nvfp4_handler_names_a_bad_raw_output(rng):
  """raw copies are bfloat16 data of the codes' shapes."""
  x = jnp.ones((64, 32), jnp.bfloat16)
  starts = jnp.asarray([0, 64], jnp.int32)
  key = jnp.zeros((1, 2), jnp.uint32)
  flags = dict(block_2d=False, rht=False, stochastic=False, length=np.int64(64),
               expert_rows=np.int64(0), raw=True, row_packed=False)
  scale_row = jax.ShapeDtypeStruct((64, 2), jnp.float8_e4m3fn)
  scale_col = jax.ShapeDtypeStruct((32, 4), jnp.float8_e4m3fn)
  amax = jax.ShapeDtypeStruct((1,), jnp.float32)
  for direction, data, scale in (("rowwise", (64, 32), scale_row),
                                 ("columnwise", (32, 64), scale_col)):
    results = [jax.ShapeDtypeStruct(data, jnp.float4_e2m1fn), scale, amax]
    with pytest.raises(Exception, match=f"{direction} raw values is float4_e2m1fn.*; expected "
                                        "bfloat16"):
      jax.block_until_ready(jax.jit(lambda x: calls.call(
          NVFP4_TARGET, results, x, starts, starts, key, key, rowwise=direction == "rowwise",
          columnwise=direction == "columnwise", **flags))(x))


def test_which_nvfp4_copies_are_written_raw(bf16_device, monkeypatch):
  """Copies of the grouped NVFP4 kernel for the decoded GEMMs; not row-scaled tokens' rowwise
  copy (the single-tensor kernel), not with the codes asked for."""
  for direction in ("rowwise", "columnwise"):
    assert support.nvfp4_raw_reason(jq.NVFP4Quantizer(block_2d=True), direction) is None
  assert "not written by the grouped NVFP4 kernel" in support.nvfp4_raw_reason(
      jq.NVFP4Quantizer(row_scaled=True), "rowwise")
  assert support.nvfp4_raw_reason(jq.MXFP8Quantizer()) == "mxfp8 is not NVFP4"
  monkeypatch.setenv(support.RAW_COPIES_ENV, "off")
  assert support.nvfp4_raw_reason(jq.NVFP4Quantizer()) == f"{support.RAW_COPIES_ENV}=off"


NVFP4_RECIPES = {"NVFP4BlockScaling": jq.recipes.NVFP4BlockScaling}


def check_nvfp4_layer(rng, monkeypatch, **shape):
  """The NVFP4 GroupedDense step with its copies raw (x, dy, both RHT'd wgrad copies, the
  experts' 16x16 copy) is bit for bit the step that decodes their codes, and runs no decode.
  x's and dy's two copies each come from one call (design decision 55)."""
  raw, codes, report, text, codes_text, (step, args) = _raw_and_codes_steps(
      rng, "NVFP4BlockScaling", monkeypatch, use_bias=False, **shape)
  quantize = [d for d in report if d.op == "grouped_quantize"]
  assert len(quantize) == 3 and all(RAW_NOTE in d.detail for d in quantize), "\n".join(
      map(str, report))
  assert sum("rowwise+columnwise" in d.detail for d in quantize) == 2, quantize
  assert "raw = true" in text and "raw = true" not in codes_text
  assert decode_kernel.NVFP4_TARGET not in text and decode_kernel.NVFP4_TARGET in codes_text
  for u, v in zip(jax.tree_util.tree_leaves(raw), jax.tree_util.tree_leaves(codes)):
    u, v = np.asarray(u), np.asarray(v)
    assert u.dtype == v.dtype
    np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))
  ref = tgf._on("reference", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(raw), jax.tree_util.tree_leaves(ref)):
    tgf._assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


@needs_target
def test_nvfp4_grouped_dense_with_raw_copies_is_bit_for_bit_the_decoded_step(
    bf16_device, rng, monkeypatch):
  check_nvfp4_layer(rng, monkeypatch)


# -------------------------------------------- GPU ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_gpu_raw_copies_are_the_decode_of_the_codes(on_kernel, rng, name):
  """Token copies (aligned and not: 16-byte stores and element stores, a NaN block) and expert
  weights of 8 experts of 256 x 1408 (more than one wave of tiles), of wide and of normal
  ranges, and at the block exponents' edges."""
  for cols, dtype in ((96, jnp.bfloat16), (72, jnp.float32), (44, jnp.float16)):
    check_token_copies(rng, name, 1500, cols, dtype, nan=cols == 72)
  for kind in ("binades", "normal"):
    check_expert_copies(rng, name, 8, 256, 1408, jnp.bfloat16, kind)
    for dtype in (jnp.float32, jnp.bfloat16):  # 40 columns: element stores, partial tiles
      check_expert_copies(rng, name, 3, 64, 40, dtype, kind)
  for dtype in (jnp.bfloat16, jnp.float32):  # mxfp8_x_layout_kernel's exponent edges
    check_expert_copies(rng, name, 3, 64, 48, dtype, "edges")


@pytest.mark.gpu
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_gpu_grouped_dense_with_raw_copies_is_bit_for_bit_the_decoded_step(
    on_kernel, rng, monkeypatch, recipe, use_bias):
  check_layer(rng, recipe, monkeypatch, use_bias, groups=8, tokens=1024, k=256, n=192)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(NVFP4))
def test_gpu_raw_nvfp4_copies_are_the_decode_of_the_codes(on_kernel, rng, name):
  """Rowwise 16-byte stores (96, 1408 columns; 72 = 4 x 16 + 8, a half block at each row's
  end) and element stores (36: rows not 16-byte aligned), columnwise 32-byte chunks, a NaN
  block, more than one wave of tiles."""
  for cols, dtype in ((96, jnp.bfloat16), (72, jnp.float32), (36, jnp.float16),
                      (1408, jnp.bfloat16)):
    check_nvfp4_copies(rng, name, 2048, cols, dtype, groups=9, nan=cols == 72)


@pytest.mark.gpu
def test_gpu_nvfp4_grouped_dense_with_raw_copies_is_bit_for_bit_the_decoded_step(
    on_kernel, rng, monkeypatch):
  check_nvfp4_layer(rng, monkeypatch, groups=8, tokens=1024, k=256, n=192)
