"""The bfloat16 grouped GEMM (`jaxquant_grouped_gemm_bf16`) and the routes that take it:
`GroupedDense` without a recipe, high-precision (Identity) operands, and quantized operands
decoded exactly to bfloat16 (MXFP8, NVFP4 row-scaled / 2-D / RHT, hybrids, mixed pairs).

Stated bound of the kernel against float64 math on its (exact) bfloat16 operands, per output
element, K terms summed (`_assert_within`):

    |out - exact| <= 4 K 2^-24 sum_k |alpha a_k b_k| + r |exact|,
    r = 2^-8 (bfloat16 out), 2^-22 (f32)

(float32 sums of K exact products in any order are within (K - 1) 2^-24 sum |a b|; the factor 4
leaves room for the tensor cores' alignment of a k-step's products; r: one rounding of the
output, plus alpha's product in float32.) A wrong group, layout or stride breaks it by orders
of magnitude: `oracle.random_matrix` spreads magnitudes over 2^-8..2^8.

Routes through `jaxquant.grouped.gemm` are compared with the reference (exact decode, float32
sums) as tests/test_grouped_ffi.py compares the other kernels: `2^-14 max |ref|` on the CPU
handler (float32 sums in both), `2^-10` on the GPU (XLA runs the reference's GEMM its own way),
plus one bfloat16 rounding (2^-8) for bfloat16 outputs.

CPU tests call the CPU handler (the CUDA kernel's contract in plain loops) directly, and check
the routing and `jaxquant.explain` with the kernel's device check passed (`bf16_device`: then
the CPU handler serves what the CUDA kernel would); `-m gpu` runs the CUTLASS kernel itself.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax  # noqa: F401
import jaxquant.grouped as jg
import oracle
import test_grouped_ffi as tgf
from jaxquant.backends.ffi import registry
from jaxquant.backends.ffi.grouped import bf16, decoded, sm90_configs
from jaxquant.backends.ffi.grouped import ops as grouped_kernels
from jaxquant.backends.ffi.grouped import support as kernels
from jaxquant.grouping import decode
from jaxquant.layers.dense import DenseQuantizers
from jaxquant.layers.grouped_dense import token_blocks

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
KERNEL = bf16.KERNEL  # "CUTLASS sm90 bf16 wgmma"
DECODED = KERNEL + " on operands decoded to bfloat16"
# (mode, layout, output): the instances of the default configuration
CASES = [(0, "TN", BF16), (0, "TN", F32), (0, "NN", BF16), (1, "TN", BF16), (1, "TN", F32),
         (1, "NT", BF16), (1, "NT", F32)]
K_MAJOR = {"TN": (True, True), "NN": (True, False), "NT": (False, False)}


def _cpu_handler() -> bool:
  return bf16.TARGET in registry.registered_targets("cpu")


needs_cpu_handler = pytest.mark.skipif(not _cpu_handler(),
                                       reason="jaxquant FFI extension without "
                                              "jaxquant_grouped_gemm_bf16")


@pytest.fixture
def bf16_device(monkeypatch):
  """The bfloat16 kernel's device check passed (the CPU handler serves what the CUDA kernel
  would), other backends' choices untouched; the default bfloat16 configuration forced, so the
  kernel names explain reports carry no configuration (the automatic choice by shape has its
  own test)."""
  if jax.default_backend() == "cpu":
    if not _cpu_handler():
      pytest.skip("jaxquant FFI extension without jaxquant_grouped_gemm_bf16")
    monkeypatch.setattr(bf16, "device_reason", lambda platform=None: None)
  elif bf16.device_reason() is not None:
    pytest.skip(bf16.device_reason())
  monkeypatch.setenv(sm90_configs.ENV, "bf16")
  monkeypatch.delenv(decoded.KERNEL_ENV, raising=False)


# ------------------------------------ the kernel's contract -----------------------------------

def _bf16(rng, shape):
  return np.asarray(jnp.asarray(oracle.random_matrix(rng, shape), jnp.bfloat16))


def _assert_within(out, exact, magnitude, k, out_dtype, msg):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  r = 2.0**-8 if np.dtype(out_dtype) == BF16 else 2.0**-22
  bound = 4 * k * 2.0**-24 * magnitude + r * np.abs(exact)
  err = np.abs(out - exact)
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err <= bound), (f"{msg}: |out - exact| {err[worst]:.3g} > bound "
                                f"{bound[worst]:.3g} at {worst}")


def check_kernel(rng, mode, layout, out_dtype, tokens, k_or_m, n, groups, empty, spare,
                 alpha=True, config=None):
  """One `bf16.gemm` call in `layout` against float64: uneven and empty groups, rows of no
  group. Mode 1 K-major operands use a token layout of block 8 (aligned group starts), the
  token-major NT layout the packed tokens (any group start)."""
  a_k, b_k = K_MAJOR[layout]
  sizes = tgf._sizes(rng, tokens, groups, empty, spare)
  block = 8 if mode == 1 and layout == "TN" else 1
  tl = jg.TokenLayout(tokens, groups, block)
  starts = np.asarray(bf16.group_starts(tl.extents(jnp.asarray(sizes))))
  alphas = rng.uniform(0.25, 4.0, groups).astype(np.float32) if alpha else np.ones(groups)
  if mode == 0:
    a = _bf16(rng, (tokens, k_or_m))
    w = _bf16(rng, (groups, n, k_or_m))  # [G, N, K] as math; NN stores [G, K, N]
    b = w if b_k else np.swapaxes(w, 1, 2)
    a64, w64 = a.astype(np.float64), w.astype(np.float64)
    exact, magnitude = np.zeros((tokens, n)), np.zeros((tokens, n))
    for g in range(groups):
      rows = slice(starts[g], starts[g + 1])
      exact[rows] = alphas[g] * (a64[rows] @ w64[g].T)
      magnitude[rows] = alphas[g] * (np.abs(a64[rows]) @ np.abs(w64[g]).T)
    k = k_or_m
  else:
    x, dy = _bf16(rng, (tokens, k_or_m)), _bf16(rng, (tokens, n))
    xl = np.asarray(tl.gather(jnp.asarray(x), jnp.asarray(sizes)))  # [L, M]
    dyl = np.asarray(tl.gather(jnp.asarray(dy), jnp.asarray(sizes)))
    a, b = (xl.T, dyl.T) if a_k else (xl, dyl)
    x64, dy64 = xl.astype(np.float64), dyl.astype(np.float64)
    exact, magnitude = np.zeros((groups, k_or_m, n)), np.zeros((groups, k_or_m, n))
    for g in range(groups):
      t = slice(starts[g], starts[g + 1])
      exact[g] = alphas[g] * (x64[t].T @ dy64[t])
      magnitude[g] = alphas[g] * (np.abs(x64[t]).T @ np.abs(dy64[t]))
    k = int(np.max(np.diff(starts), initial=1))
  reason = bf16.shape_reason(mode, a.shape, b.shape, a_dtype=a.dtype, b_dtype=b.dtype,
                             out_dtype=out_dtype, a_k_major=a_k, b_k_major=b_k,
                             token_block=block)
  assert reason is None, reason
  old = os.environ.get(sm90_configs.ENV)
  if config is not None:
    os.environ[sm90_configs.ENV] = config
  try:
    fn = jax.jit(lambda a, b, s, al: bf16.gemm(a, b, s, mode=mode, out_dtype=out_dtype,
                                               alpha=al if alpha else None, a_k_major=a_k,
                                               b_k_major=b_k))
    out = fn(jnp.asarray(a), jnp.asarray(b), jnp.asarray(starts, jnp.int32),
             jnp.asarray(alphas, jnp.float32))
  finally:
    if old is None:
      os.environ.pop(sm90_configs.ENV, None)
    else:
      os.environ[sm90_configs.ENV] = old
  assert np.dtype(out.dtype) == np.dtype(out_dtype) and out.shape == exact.shape
  _assert_within(out, exact, magnitude, k, out_dtype, f"mode {mode} {layout} -> {out_dtype}")
  out = np.asarray(jnp.asarray(out, jnp.float32))
  if mode == 0:
    assert np.all(out[starts[-1]:] == 0), "rows of no group must be zero"
  for g in np.flatnonzero(np.diff(starts) == 0):
    if mode == 1:
      assert np.all(out[g] == 0), f"empty group {g} must give zeros"
  if mode == 0 and layout == "NN":  # also against ragged_dot with float32 accumulation
    ref = jax.lax.ragged_dot(jnp.asarray(a), jnp.asarray(b),
                             jnp.asarray(np.diff(starts), jnp.int32),
                             preferred_element_type=jnp.float32) * jnp.asarray(
                                 np.repeat(np.append(alphas, 0.0), np.append(
                                     np.diff(starts), tokens - starts[-1])))[:, None]
    _assert_within(ref, exact, magnitude, k, F32, "ragged_dot (float32 accumulation)")
  return out


@needs_cpu_handler
@pytest.mark.parametrize("mode,layout,out_dtype", CASES)
def test_cpu_handler_matches_float64_in_every_layout(rng, mode, layout, out_dtype):
  """The CPU handler (the CUDA kernel's contract): each layout, per-group alpha, rows of no
  group, empty groups, unaligned packed group starts for the token-major wgrad."""
  check_kernel(rng, mode, layout, out_dtype, 150, 64 if mode == 0 else 40, 40, 5, empty=(2,),
               spare=9)


@needs_cpu_handler
def test_cpu_handler_without_alpha_and_with_all_groups_empty(rng):
  check_kernel(rng, 0, "TN", BF16, 64, 32, 16, 3, empty=(), spare=0, alpha=False)
  check_kernel(rng, 0, "NN", BF16, 64, 32, 16, 3, empty=(0, 1, 2), spare=0)
  check_kernel(rng, 1, "NT", BF16, 64, 16, 24, 3, empty=(0, 1, 2), spare=0)


@needs_cpu_handler
def test_the_handler_names_a_wrong_argument():
  starts = jnp.asarray([0, 4, 8], jnp.int32)
  cases = [
      (jnp.ones((8, 16), jnp.float16), jnp.ones((2, 8, 16), jnp.bfloat16), dict(mode=0),
       "a is float16; expected bfloat16"),
      (jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 8, 24), jnp.bfloat16), dict(mode=0),
       "b has shape"),
      (jnp.ones((16, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16),
       dict(mode=1, a_k_major=False, b_k_major=False), "b has shape"),
      (jnp.ones((16, 8), jnp.bfloat16), jnp.ones((8, 16), jnp.bfloat16),
       dict(mode=1, a_k_major=False, b_k_major=True), "no bfloat16 grouped GEMM instance"),
  ]
  for a, b, kw, match in cases:
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(bf16.gemm(a, b, starts, out_dtype=jnp.bfloat16, **kw))


def test_shape_reasons_say_what_no_instance_takes():
  bf, f32 = jnp.bfloat16, np.float32
  r = lambda *a, **kw: bf16.shape_reason(*a, **{"a_dtype": bf, "b_dtype": bf,
                                                "out_dtype": bf, **kw})
  assert r(0, (64, 64), (4, 32, 64)) is None
  assert r(0, (64, 64), (4, 64, 32), b_k_major=False) is None
  assert r(1, (64, 32), (64, 24), a_k_major=False, b_k_major=False) is None
  assert r(1, (32, 64), (24, 64), token_block=8) is None
  assert "float16" in r(0, (64, 64), (4, 32, 64), a_dtype=jnp.float16)
  assert "K = 60" in r(0, (64, 60), (4, 32, 60))
  assert "N = 36" in r(0, (64, 64), (4, 36, 64))
  assert r(0, (64, 64), (4, 36, 64), out_dtype=f32) is None  # float32 rows: 4-aligned
  assert "N = 36" in r(0, (64, 64), (4, 64, 36), b_k_major=False)
  assert "float32 output of layout NN" in r(0, (64, 64), (4, 64, 32), b_k_major=False,
                                            out_dtype=f32)
  assert r(1, (64, 32), (64, 24), a_k_major=False, b_k_major=False, out_dtype=f32) is None
  assert "M-major a with a K-major b" in r(1, (64, 32), (24, 64), a_k_major=False)
  assert "token layout block 1" in r(1, (32, 64), (24, 64), token_block=1)
  assert "token length L = 60" in r(1, (32, 60), (24, 60), token_block=4)
  assert "M = 30" in r(1, (64, 30), (64, 24), a_k_major=False, b_k_major=False)
  assert "empty GEMM" in r(0, (0, 64), (4, 32, 64))


def test_the_kernel_is_cuda_only_and_says_so():
  if jax.default_backend() == "cpu":
    assert "CUDA-only" in bf16.device_reason()


# ------------------------------------ configurations ------------------------------------------

def test_bf16_configurations_their_choice_and_errors(monkeypatch):
  """The bfloat16 configurations: automatic by direction and group size (a ragged-rows GEMM,
  forward NN or dgrad TN, "bf16" at every size: an H200 measurement on drawn group sizes; a
  wgrad of large groups "bf16_c2x1", an H100 one; float32 output only "bf16"), a forced one
  without an instance for the GEMM is an error naming the instances (FP8 configurations have
  none for bfloat16 and the reverse), explain labels."""
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  sel = sm90_configs.bf16_selection
  large = float(sm90_configs.BF16_LARGE_GROUP_TOKENS)
  # ragged rows (mode 0): no 2x1 cluster, which rounds a group's odd row-tile count up
  for tokens in (100.0, 256.0, large - 1, large, 8192.0):
    assert sel("NN", BF16, tokens).config.name == sel("TN", BF16, tokens).config.name == "bf16"
    assert sel("TN", BF16, tokens, row_scaled=True).config.name == "bf16"
    assert sel("TN", F32, tokens).config.name == "bf16"  # the only float32 TN instance
  # wgrads (layout NT is one whatever the caller says) of large groups: cluster 2x1
  assert sel("NT", BF16, large).config.name == "bf16_c2x1"
  assert sel("NT", BF16, 256.0).config.name == "bf16_kgrouped_pingpong"
  assert sel("TN", BF16, large, wgrad=True).config.name == "bf16_c2x1"
  # the float32 wgrad of float32 experts takes the bfloat16 wgrad's configuration
  assert sel("NT", F32, large).config.name == "bf16_c2x1"
  assert sel("NT", F32, 256.0).config.name == "bf16_kgrouped"  # pingpong: bfloat16 out only
  assert sel("NN", BF16, 256.0).is_default and not sel("NT", BF16, large).is_default
  # a wgrad (mode 1: given its output shape, or `wgrad`) of groups below the large size takes
  # the k-grouped kernel, whose instances serve wgrads only (its pingpong form when writing
  # bfloat16); large groups keep their choice
  for layout in ("NT", "TN"):
    for out, name in ((BF16, "bf16_kgrouped_pingpong"), (F32, "bf16_kgrouped")):
      assert sel(layout, out, 256.0, wgrad_mn=(2048, 1408)).config.name == name
      assert sel(layout, out, large - 1, wgrad=True).config.name == name
      assert "kgrouped" not in sel(layout, out, large, wgrad=True).config.name
  assert sel("NT", BF16, large, wgrad=True).config.name == "bf16_c2x1"
  assert "kgrouped" not in sel("NN", BF16, 256.0, wgrad=True).config.name  # no NN instance
  assert bf16.selection(1, (4096, 2048), 8, BF16, a_k_major=False,
                        b_k_major=False).config.name == "bf16_kgrouped_pingpong"
  assert bf16.selection(0, (4096, 2048), 8, BF16).config.name == "bf16"
  monkeypatch.setattr(sm90_configs, "KGROUPED_PINGPONG", False)
  assert sel("NT", BF16, 256.0).config.name == "bf16_kgrouped"
  assert sel("TN", BF16, 256.0, wgrad=True).config.name == "bf16_kgrouped"
  monkeypatch.setattr(sm90_configs, "KGROUPED_PINGPONG", True)
  monkeypatch.setattr(sm90_configs, "KGROUPED_WGRAD", False)
  # without it: a wgrad whose output the 256 x 128 tiles (cluster 2 x 1) cover with less
  # padding: N = 1408 is 5.5 tiles of 256 (6 under any cluster) and exactly 11 of 128; a tie
  # keeps the choice
  assert sm90_configs.padded_elements((2048, 1408), sm90_configs.CONFIGS["bf16"]) == 2048 * 1536
  assert sel("NT", BF16, 256.0, wgrad_mn=(2048, 1408)).config.name == "bf16_256x128"
  assert sel("NT", F32, 256.0, wgrad_mn=(2048, 1408)).config.name == "bf16_256x128"
  assert sel("TN", BF16, 256.0, wgrad_mn=(2048, 1408)).config.name == "bf16_256x128"
  assert sel("TN", F32, 256.0, wgrad_mn=(2048, 1408)).config.name == "bf16"  # no instance
  assert sel("NT", BF16, 256.0, wgrad_mn=(2048, 1536)).config.name == "bf16"
  assert sel("NT", BF16, large, wgrad_mn=(2048, 1408)).config.name == "bf16_c2x1"
  assert sel("NT", BF16, 256.0, wgrad_mn=(1408, 2048)).config.name == "bf16"  # 5.5 row tiles
  monkeypatch.setattr(sm90_configs, "WGRAD_BY_PADDING", False)
  assert sel("NT", BF16, 256.0, wgrad_mn=(2048, 1408)).config.name == "bf16"
  monkeypatch.setattr(sm90_configs, "WGRAD_BY_PADDING", True)
  monkeypatch.setattr(sm90_configs, "KGROUPED_WGRAD", True)
  auto, e4m3 = sm90_configs.automatic, sm90_configs.PER_TENSOR_E4M3_BF16
  assert auto(e4m3, True, 1408, 2048).config.name == "c2x1"  # 11 column tiles, no 12th
  assert auto(e4m3, True, 14336, 4096).config.name == "default"  # no padding either way
  assert auto(e4m3, True, 1408, 1408).config.name == "default"  # 11 row tiles: c2x1 pads
  assert auto(e4m3, True, 1408).config.name == "default"  # output shape not given
  assert auto("", True, 1408, 2048).config.name == "default"  # E5M2 or float32 out
  assert {c.ident for c in sm90_configs.CONFIGS.values()} == set(range(len(sm90_configs.CONFIGS)))
  assert "config bf16_kgrouped_pingpong" in bf16.kernel_label(1, (64, 512), 8, BF16,
                                                              a_k_major=False, b_k_major=False)
  assert bf16.kernel_label(0, (64, 512), 8, BF16) == KERNEL
  assert bf16.kernel_label(0, (2048, 64), 8, BF16) == KERNEL
  assert "config bf16_c2x1" in bf16.kernel_label(1, (8192, 64), 8, BF16, a_k_major=False,
                                                 b_k_major=False)
  monkeypatch.setenv(sm90_configs.ENV, "bf16_c2x1:rn")
  chosen = sel("NN", BF16, 9999.0)
  assert chosen.attributes() == {"config": 7, "raster_along_n": True}
  assert "cluster 2x1" in bf16.kernel_label(0, (64, 64), 1, BF16, b_k_major=False)
  with pytest.raises(ValueError, match="'bf16_c2x1' has instances for .* not bfloat16 TN -> "
                                       "float32"):
    sel("TN", F32, 10.0)
  monkeypatch.setenv(sm90_configs.ENV, "n176")
  with pytest.raises(ValueError, match="'n176' has instances for per-tensor FP8"):
    sel("TN", BF16, 10.0)
  monkeypatch.setenv(sm90_configs.ENV, "bf16")
  assert sel("TN", F32, 10.0).config.name == "bf16"
  # the k-grouped configuration serves wgrads of layouts NT and TN only
  monkeypatch.setenv(sm90_configs.ENV, "bf16_kgrouped")
  for layout in ("NT", "TN"):
    assert sel(layout, F32, 10.0, wgrad=True).config.name == "bf16_kgrouped"
    with pytest.raises(ValueError, match="'bf16_kgrouped' serves wgrads \\(mode 1\\) only"):
      sel(layout, BF16, 10.0)
  with pytest.raises(ValueError, match="'bf16_kgrouped' has instances for bfloat16 NT -> "
                                       "bfloat16, .* only, not bfloat16 NN"):
    sel("NN", BF16, 10.0, wgrad=True)
  # its pingpong form: layouts NT and TN writing bfloat16, wgrads only
  monkeypatch.setenv(sm90_configs.ENV, "bf16_kgrouped_pingpong")
  for layout in ("NT", "TN"):
    assert sel(layout, BF16, 10.0, wgrad=True).config.name == "bf16_kgrouped_pingpong"
    with pytest.raises(ValueError, match="'bf16_kgrouped_pingpong' has instances for bfloat16 "
                                         "NT -> bfloat16, bfloat16 TN -> bfloat16 only, not "
                                         f"bfloat16 {layout} -> float32"):
      sel(layout, F32, 10.0, wgrad=True)
  with pytest.raises(ValueError, match="'bf16_kgrouped_pingpong' serves wgrads \\(mode 1\\) "
                                       "only"):
    sel("TN", BF16, 10.0)


# -------------------------------------- routing -----------------------------------------------

def _tokens_and_experts(rng, qa, qw, tokens=150, k=64, n=40, groups=5):
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (groups, n, k)), jnp.bfloat16)
  sizes = jnp.asarray(tgf._sizes(rng, tokens, groups, (2,), 9))
  a = tgf._on("reference", lambda x, s: jg.quantize(x, s, qa, columnwise=False).rowwise, x,
              sizes)
  e = tgf._on("reference", lambda w: jg.quantize_experts(w, qw, columnwise=False).rowwise, w)
  return a, e


DECODED_RAGGED = [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("nvfp4-row", "nvfp4-2d"),
                  ("nvfp4-row", "nvfp4-row"), ("mxfp8", "fp8"), ("fp8", "nvfp4"),
                  ("block-1x128", "mxfp8"), ("fp8", "fp8")]
DECODED_WGRAD = [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("nvfp4-row", "mxfp8"),
                 ("fp8", "fp8"), ("fp8-e5m2", "nvfp4")]


# Each pair once, the output dtype alternating: the decode is the pair's and the output's
# rounding the dtype's, independent of each other (both dtypes for every pair took ~1.5
# CPU-minutes).
@pytest.mark.parametrize("pair,out_dtype", [(pair, (jnp.float32, jnp.bfloat16)[i % 2])
                                            for i, pair in enumerate(DECODED_RAGGED)])
def test_decoded_ragged_gemm_matches_the_reference(bf16_device, rng, pair, out_dtype):
  """fprop / dgrad of quantized pairs on the bfloat16 kernel (a bias too: added by XLA to a
  float32 output, as the reference adds it)."""
  rel = 2.0**-14 + (2.0**-8 if out_dtype == jnp.bfloat16 else 0.0)
  tgf.check_ragged(rng, pair, 150, 64, 40, 5, empty=(2,), spare=9, rel=rel,
                   out_dtype=out_dtype, kernel=DECODED)


@pytest.mark.parametrize("pair", DECODED_WGRAD)
def test_decoded_wgrad_gemm_matches_the_reference(bf16_device, rng, pair):
  """wgrad of quantized columnwise copies in a token layout of block >= 8 (per-(group, feature)
  row-scaled factors applied by XLA)."""
  tgf.check_wgrad(rng, pair, 150, 40, 24, 5, empty=(0, 3), spare=5, rel=2.0**-14, block=8,
                  kernel=DECODED)


ROWS_IN_EPILOGUE = KERNEL + " with per-row factors in the epilogue"


def check_rows_in_epilogue(rng, groups, tokens, k, n, out_dtype, kernel_config="",
                           forced: Optional[str] = None):
  """Row-scaled NVFP4 tokens x NVFP4 experts: the kernel applies the per-token factors in its
  epilogue (explain says so), bit for bit the float32 output XLA scaled before (same float32
  products, one rounding), and within the stated bound of the reference. `forced`: the
  configuration the row-scaled GEMM is traced under (JAXQUANT_SM90_CONFIG), the float32 GEMM
  it is compared with taking the automatic one."""
  a, e = _tokens_and_experts(rng, jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer(),
                             tokens=tokens, k=k, n=n, groups=groups)
  fn = lambda a, e: jg.gemm(a, e, out_dtype=out_dtype)
  if forced is not None:
    os.environ[sm90_configs.ENV] = forced
  try:
    assert tgf._gemm_kernels(fn, a, e) == {
        ROWS_IN_EPILOGUE + kernel_config + " on operands decoded to bfloat16"}
    ours = tgf._on("ffi", fn, a, e)
  finally:
    if forced is not None:
      del os.environ[sm90_configs.ENV]

  def xla_scaled(a, e):  # the kernel's float32 output, scaled by XLA as before
    da, db = decode.tokens(a), decode.experts(e)
    out = bf16.gemm(da.values, db.values, bf16.group_starts(a.layout.extents(a.group_sizes)),
                    mode=0, out_dtype=jnp.float32, alpha=decode.group_alpha(da, db))
    return (out * da.rows[:, None]).astype(out_dtype)

  theirs = tgf._on("ffi", xla_scaled, a, e)
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.dtype == np.dtype(out_dtype)
  assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8)), (
      f"{np.sum(ours != theirs)} elements differ from the float32 output scaled by XLA")
  rel = 2.0**-14 if jax.default_backend() == "cpu" else 2.0**-10
  rel += 2.0**-8 if out_dtype == jnp.bfloat16 else 0.0
  tgf._assert_close(ours, np.asarray(tgf._on("reference", fn, a, e)), rel, "rows in epilogue")


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_row_scaled_tokens_take_the_epilogue_bit_for_bit(bf16_device, rng, out_dtype):
  check_rows_in_epilogue(rng, 5, 150, 64, 40, out_dtype)


def test_row_scale_only_where_an_instance_applies_it(bf16_device, rng):
  """A bias, row-scaled experts or experts read along N keep XLA's float32 scaling; a wgrad
  cannot take row factors (an error naming the argument)."""
  qa = jq.NVFP4Quantizer(row_scaled=True)
  a, e = _tokens_and_experts(rng, qa, jq.NVFP4Quantizer(row_scaled=True))
  assert not decoded.rows_in_epilogue(a, e, jnp.bfloat16)
  a, e = _tokens_and_experts(rng, qa, jq.NVFP4Quantizer())
  assert decoded.rows_in_epilogue(a, e, jnp.bfloat16)
  assert not decoded.rows_in_epilogue(a, e, jnp.bfloat16, bias=jnp.zeros((5, 40)))
  assert not decoded.rows_in_epilogue(a, e, jnp.bfloat16, b_k_major=False)
  assert not decoded.rows_in_epilogue(a, e, jnp.float16)
  x = jnp.zeros((16, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"row_scale: per-row factors scale a ragged GEMM's rows"):
    bf16.gemm(x.T, x.T, jnp.asarray([0, 16], jnp.int32), mode=1, out_dtype=jnp.bfloat16,
              row_scale=jnp.ones((16,), jnp.float32))


def test_identity_operands_take_the_kernel_undecoded(bf16_device, rng, monkeypatch):
  """Identity (bfloat16) x Identity runs as it is, Identity x MXFP8 with the MXFP8 side decoded;
  both match the reference; the wgrad of packed Identity copies (group starts not 8-aligned)
  takes the reference, visibly."""
  ident = jq.IdentityQuantizer()
  bias = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)
  # two bfloat16 operands: ragged_dot's bfloat16 result (one rounding of float32 sums taken in
  # another order: 2^-8 apart at most) plus the bias in bfloat16 (another rounding)
  for qw, kernel, rel in ((ident, KERNEL, 2.0**-7), (jq.MXFP8Quantizer(), DECODED, 2.0**-14)):
    a, e = _tokens_and_experts(rng, ident, qw)
    fn = lambda a, e, b: jg.gemm(a, e, bias=b, out_dtype=jnp.float32)
    assert tgf._gemm_kernels(fn, a, e, bias) == {kernel}
    tgf._assert_close(tgf._on("ffi", fn, a, e, bias), tgf._on("reference", fn, a, e, bias), rel,
                      f"Identity x {qw}")
  x = jnp.asarray(oracle.random_matrix(rng, (64, 16)), jnp.bfloat16)
  sizes = jnp.asarray([20, 0, 35], jnp.int32)
  monkeypatch.setenv("JAXQUANT_BACKEND", "auto")
  col = lambda x: jg.quantize(x, sizes, ident, rowwise=False).columnwise
  report = jq.explain(lambda x: jg.gemm(col(x), col(x)), x)
  (gemm,) = [d for d in report if d.op == "grouped_gemm"]
  assert gemm.path == "reference" and "multiple of 8" in gemm.reason, str(report)


def test_mma_sync_can_be_selected_and_a_bad_choice_is_an_error(bf16_device, rng, monkeypatch):
  a, e = _tokens_and_experts(rng, jq.MXFP8Quantizer(), jq.MXFP8Quantizer())
  fn = lambda a, e: jg.gemm(a, e, out_dtype=jnp.float32)
  assert tgf._gemm_kernels(fn, a, e) == {DECODED}
  monkeypatch.setenv(decoded.KERNEL_ENV, "mma_sync")
  assert tgf._gemm_kernels(fn, a, e) == {"mma.sync"}
  (gemm,) = [d for d in tgf._paths(fn, a, e) if d.op == "grouped_gemm"]
  assert f"{decoded.KERNEL_ENV}=mma_sync" in gemm.reason
  tgf._assert_close(tgf._on("ffi", fn, a, e), tgf._on("reference", fn, a, e), 2.0**-14)
  ident = jq.IdentityQuantizer()
  a, e = _tokens_and_experts(rng, ident, ident)  # nothing to decode: still the bf16 kernel
  assert tgf._gemm_kernels(fn, a, e) == {KERNEL}
  monkeypatch.setenv(decoded.KERNEL_ENV, "fastest")
  with pytest.raises(ValueError, match="JAXQUANT_GROUPED_GEMM_KERNEL='fastest'"):
    tgf._gemm_kernels(fn, a, e)


def test_a_forced_fp8_configuration_is_an_error_for_a_decoded_gemm(bf16_device, rng,
                                                                   monkeypatch):
  a, e = _tokens_and_experts(rng, jq.MXFP8Quantizer(), jq.MXFP8Quantizer())
  monkeypatch.setenv(sm90_configs.ENV, "c1x1")
  with pytest.raises(ValueError, match="'c1x1' has instances for .* not bfloat16 TN"):
    tgf._gemm_kernels(lambda a, e: jg.gemm(a, e, out_dtype=jnp.float32), a, e)


def test_wgrad_token_block_aligns_bfloat16_group_starts(bf16_device, monkeypatch):
  """Where the bfloat16 kernel runs, GroupedDense pads the wgrad copies to 8 tokens (16-byte
  TMA group starts) unless the formats need more; per-tensor FP8 on the FP8 kernel to 16."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "auto")
  identity = DenseQuantizers.identity()
  assert token_blocks(identity) == (1, 1, 8)
  mx = DenseQuantizers.from_recipe(jq.recipes.MXFP8BlockScaling(), "grouped_linear", "e")
  assert token_blocks(mx) == (1, 1, 32)
  fp8 = DenseQuantizers.from_recipe(jq.recipes.Float8CurrentScaling(), "grouped_linear", "e")
  expected = 16 if kernels._sm90_device_reason() is None else 8
  assert token_blocks(fp8) == (1, 1, expected)
  monkeypatch.setattr(kernels, "_sm90_device_reason", lambda: None)
  assert token_blocks(fp8) == (1, 1, 16)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  assert token_blocks(identity) == (1, 1, 1)


# --------------------------------- GroupedDense without a recipe ------------------------------

def _plain_step(groups, tokens, k, n, rng, use_bias=True, param_dtype=jnp.bfloat16):
  model = jq.flax.GroupedDense(features=n, num_groups=groups, use_bias=use_bias,
                               dtype=jnp.bfloat16, param_dtype=param_dtype)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(tgf._sizes(rng, tokens, groups, (1,) if groups > 1 else (), 7))
  variables = model.init(jax.random.key(0), x, sizes)
  variables = jax.tree_util.tree_map(
      lambda v: jnp.asarray(oracle.random_matrix(rng, v.shape), v.dtype), variables)

  def step(variables, x, dy, sizes):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, sizes), variables, x)
    return y, vjp(dy)

  def plain(variables, x, dy, sizes):  # ragged_dot and its autodiff, the specification
    p = variables["params"]

    def f(p, x):
      y = jax.lax.ragged_dot(x, p["kernel"], sizes)
      if use_bias:
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(tokens), side="right")
        rows = jnp.concatenate([p["bias"], jnp.zeros((1, n), p["bias"].dtype)])
        rows = rows.astype(jnp.float32)[group]  # cast before the gather: dbias sums in float32
        y = (y.astype(jnp.float32) + rows).astype(y.dtype)
      return y

    y, vjp = jax.vjp(f, p, x)
    dp, dx = vjp(dy)
    return y, ({"params": dp}, dx)

  return step, plain, (variables, x, dy, sizes)


def check_plain_step(rng, groups, tokens, k, n, path):
  """A no-recipe GroupedDense step: three GEMM decisions on the kernel, values vs ragged_dot
  (bfloat16 outputs and gradients: both within one bfloat16 rounding of the float32 sums, so
  within 2^-7 of the largest element of each other)."""
  step, plain, args = _plain_step(groups, tokens, k, n, rng)
  report = jq.explain(step, *args)
  gemms = [d for d in report if d.op == "grouped_gemm"]
  assert [d.role for d in gemms] == ["fprop", "dgrad", "wgrad"], str(report)
  assert all(d.path == path and KERNEL in d.detail for d in gemms), str(report)
  ours, spec = jax.jit(step)(*args), jax.jit(plain)(*args)
  for u, v in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(spec)):
    u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
    np.testing.assert_allclose(u, v, rtol=0, atol=2**-7 * np.abs(v).max())
  y = np.asarray(ours[0], np.float32)
  assert np.all(y[int(np.sum(np.asarray(args[3]))):] == 0), "rows of no group must be zero"


def test_no_recipe_grouped_dense_on_the_kernel_contract(bf16_device, rng):
  check_plain_step(rng, 4, 96, 64, 48, "ffi-cpu" if jax.default_backend() == "cpu"
                   else "ffi-cuda")


def test_no_recipe_grouped_dense_says_why_ragged_dot_runs(rng, monkeypatch):
  """Where the kernel cannot run, ragged_dot (unchanged) and explain says why."""
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  step, _, args = _plain_step(3, 40, 16, 24, rng)
  (gemm,) = [d for d in jq.explain(step, *args) if d.op == "grouped_gemm"]
  assert gemm.path == "reference" and gemm.reason.startswith("jax.lax.ragged_dot")
  if bf16.device_reason() is not None:
    assert bf16.device_reason() in gemm.reason
  monkeypatch.setattr(bf16, "device_reason", lambda platform=None: None)
  step, _, args = _plain_step(3, 40, 12, 24, rng)  # K = 12: unaligned rows
  (gemm,) = [d for d in jq.explain(step, *args) if d.op == "grouped_gemm"]
  assert gemm.path == "reference" and "K = 12 is not a multiple of 8" in gemm.reason
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  step, _, args = _plain_step(3, 40, 16, 24, rng)
  (gemm,) = [d for d in jq.explain(step, *args) if d.op == "grouped_gemm"]
  assert "JAXQUANT_BACKEND=reference" in gemm.reason


def check_float32_kernel_step(rng, groups, tokens, k, n, path):
  """float32 parameters, bfloat16 compute: y, dx and dbias as ragged_dot on the kernel cast to
  bfloat16 (within one bfloat16 rounding, as `check_plain_step`), and the kernel's gradient
  float32 against float64 sums of the exact bfloat16 products within the kernel's float32
  bound (`_assert_within`). Most elements of a gradient that went through bfloat16 would
  equal the bfloat16 rounding of the exact sums; the last assert checks they do not."""
  step, plain, args = _plain_step(groups, tokens, k, n, rng, param_dtype=jnp.float32)
  variables, x, dy, sizes = args
  report = jq.explain(step, *args)
  gemms = [d for d in report if d.op == "grouped_gemm"]
  assert [d.path for d in gemms] == [path] * (3 if path != "reference" else 1), str(report)
  ours = jax.jit(step)(*args)
  cast = jax.tree_util.tree_map(lambda v: v.astype(jnp.bfloat16), variables)
  spec = jax.jit(plain)(cast, x, dy, sizes)
  y, (grads, dx) = ours
  assert grads["params"]["kernel"].dtype == jnp.float32
  for u, v in ((y, spec[0]), (dx, spec[1][1]),
               (grads["params"]["bias"], spec[1][0]["params"]["bias"])):
    u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
    np.testing.assert_allclose(u, v, rtol=0, atol=2**-7 * np.abs(v).max())
  ends = np.cumsum(np.asarray(sizes))
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  groups_of = list(zip(ends, np.asarray(sizes)))
  exact = np.stack([x64[e - c:e].T @ dy64[e - c:e] for e, c in groups_of])
  magnitude = np.stack([np.abs(x64[e - c:e]).T @ np.abs(dy64[e - c:e]) for e, c in groups_of])
  dw = np.asarray(grads["params"]["kernel"], np.float64)
  _assert_within(dw, exact, magnitude, int(np.max(np.asarray(sizes))), F32, "float32 wgrad")
  rounded = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)
  assert np.mean(dw != rounded) > 0.5, "the float32 gradient must not be rounded to bfloat16"


def test_float32_kernel_gradient_is_the_float32_sums(bf16_device, rng):
  check_float32_kernel_step(rng, 4, 96, 64, 48, "ffi-cpu" if jax.default_backend() == "cpu"
                            else "ffi-cuda")


def test_float32_kernel_reference_gives_the_same_sums(rng, monkeypatch):
  """The reference path (ragged_dot on the cast kernel, the gradient from ragged_dot_general)."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  check_float32_kernel_step(rng, 3, 80, 32, 24, "reference")


# ------------------------------------------- GPU ----------------------------------------------

@pytest.fixture
def on_kernel(monkeypatch):
  """The CUDA kernel (automatic configurations; `bf16_device` forces the default)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")
  reason = bf16.device_reason()
  if reason is not None:
    pytest.skip(reason)
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  monkeypatch.delenv(decoded.KERNEL_ENV, raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("mode,layout,out_dtype", CASES)
def test_gpu_bf16_gemm_is_within_the_bound(on_kernel, rng, groups, mode, layout, out_dtype):
  """The CUTLASS kernel, default configuration: ragged and empty groups, rows of no group,
  K / N not multiples of the tile, groups shorter than a k-tile (wgrad)."""
  empty = tuple(range(1, groups, 4)) if groups > 1 else ()
  check_kernel(rng, mode, layout, out_dtype, 1500 + 7 * groups, 328 if mode == 0 else 136, 200,
               groups, empty=empty, spare=11)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["bf16", "bf16_c2x1", "bf16_pingpong", "bf16_256x128",
                                    "bf16_128x128", "bf16_128x176", "bf16:rn"])
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("mode,layout", [(0, "TN"), (0, "NN"), (1, "TN"), (1, "NT")])
def test_gpu_bf16_configurations_are_within_the_bound(on_kernel, rng, config, groups, mode,
                                                      layout):
  empty = tuple(range(2, groups, 5)) if groups > 1 else ()
  check_kernel(rng, mode, layout, BF16, 1500 + 5 * groups, 328 if mode == 0 else 136, 200,
               groups, empty=empty, spare=7, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,layout,out_dtype", CASES)
def test_gpu_bf16_all_groups_empty_gives_zeros(on_kernel, rng, mode, layout, out_dtype):
  out = check_kernel(rng, mode, layout, out_dtype, 64, 64, 32, 3, empty=(0, 1, 2), spare=0)
  assert np.all(out == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("groups,tokens,k,n", [(8, 2048, 256, 512), (64, 4096, 128, 176)])
def test_gpu_no_recipe_grouped_dense_runs_on_the_kernel(on_kernel, rng, groups, tokens, k, n):
  check_plain_step(rng, groups, tokens, k, n, "ffi-cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("groups,tokens,k,n", [(8, 2048, 256, 512), (64, 4096, 128, 176)])
def test_gpu_float32_kernel_gradient_is_the_float32_sums(on_kernel, rng, groups, tokens, k, n):
  check_float32_kernel_step(rng, groups, tokens, k, n, "ffi-cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config,out_dtype", [
    ("bf16_kgrouped", BF16), ("bf16_kgrouped", F32), ("bf16_kgrouped:rn", BF16),
    ("bf16_kgrouped:rn", F32), ("bf16_kgrouped_pingpong", BF16),
    ("bf16_kgrouped_pingpong:rn", BF16)])
@pytest.mark.parametrize("groups,tokens", [(1, 1500), (8, 1540), (64, 1820), (64, 64 * 256),
                                           (130, 900)])
def test_gpu_kgrouped_wgrad_is_within_the_bound(on_kernel, rng, config, out_dtype, groups,
                                                 tokens):
  """The k-grouped wgrad (one descriptor per operand), cooperative and pingpong: groups that
  start at any token, end inside a 64-token block (the rows past them zeroed in shared memory),
  are shorter than one block or empty (zeros written by the kernel), the last one followed by
  rows of no group; M and N not multiples of the tile. Pingpong: a CTA's tiles alternate
  between its two warpgroups with different groups' block counts."""
  empty = tuple(range(2, groups, 5)) if groups > 1 else ()
  check_kernel(rng, 1, "NT", out_dtype, tokens, 136, 200, groups, empty=empty, spare=7,
               config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["bf16", "bf16_c2x1"])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_float32_wgrad_configurations_are_within_the_bound(on_kernel, rng, config, groups):
  empty = tuple(range(2, groups, 5)) if groups > 1 else ()
  check_kernel(rng, 1, "NT", F32, 1500 + 5 * groups, 136, 200, groups, empty=empty, spare=7,
               config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", DECODED_RAGGED)
def test_gpu_decoded_ragged_gemm_matches_the_reference(on_kernel, bf16_device, rng, groups,
                                                       pair):
  tgf.check_ragged(rng, pair, 1500 + 7 * groups, 320, 200, groups,
                   empty=tuple(range(1, groups, 4)), spare=11, rel=2.0**-10, kernel=DECODED)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", DECODED_WGRAD)
def test_gpu_decoded_wgrad_gemm_matches_the_reference(on_kernel, bf16_device, rng, groups,
                                                      pair):
  tgf.check_wgrad(rng, pair, 1500 + 5 * groups, 136, 200, groups,
                  empty=tuple(range(2, groups, 5)), spare=7, rel=2.0**-10, block=8,
                  kernel=DECODED)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [8, 64])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_row_scaled_tokens_take_the_epilogue_bit_for_bit(on_kernel, rng, monkeypatch, groups,
                                                             out_dtype):
  """The row-scaled instances (automatic configuration: the default) against XLA's scaling of
  the float32 output, bit for bit; and forced to bf16_c2x1, the other configuration with a
  row-scaled instance (bfloat16 out)."""
  tokens = 1500 + 7 * groups
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  check_rows_in_epilogue(rng, groups, tokens, 320, 200, out_dtype)
  if out_dtype == jnp.bfloat16:
    config = " [config bf16_c2x1: 128x256x64 tiles, cluster 2x1, cooperative, float32 " \
             "accumulation]"
    check_rows_in_epilogue(rng, groups, tokens, 320, 200, out_dtype, config, "bf16_c2x1")


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("nvfp4-row", "nvfp4")])
def test_gpu_mma_sync_stays_selectable(on_kernel, rng, monkeypatch, pair):
  monkeypatch.setenv(decoded.KERNEL_ENV, "mma_sync")
  tgf.check_ragged(rng, pair, 1500, 320, 200, 8, empty=(3,), spare=11, rel=2.0**-10,
                   kernel="mma.sync")


GPU_RECIPES = {
    "MXFP8BlockScaling": jq.recipes.MXFP8BlockScaling,
    "NVFP4BlockScaling": jq.recipes.NVFP4BlockScaling,
    "moe_nvfp4_fwd_mxfp8_bwd": lambda: jq.CustomRecipe(
        jq.factories.moe_nvfp4_forward_mxfp8_backward),
    "identity": lambda: jq.CustomRecipe(lambda role: jq.IdentityQuantizer()),
}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_grouped_dense_gemms_run_decoded_on_the_kernel(on_kernel, rng, recipe):
  """A GroupedDense step under each recipe: all three grouped GEMMs on the bfloat16 kernel
  (decoded, or as they are for Identity), and the step matches the reference (bfloat16
  outputs: 2^-7 of the largest element, as the other GroupedDense kernel tests)."""
  step, args = tgf._grouped_step(GPU_RECIPES[recipe](), 8, 512, 256, 128, rng)
  os.environ.pop("JAXQUANT_BACKEND", None)
  gemms = [d for d in jq.explain(step, *args) if d.op == "grouped_gemm"]
  assert len(gemms) == 3 and all(d.path == "ffi-cuda" and KERNEL in d.detail for d in gemms), \
      "\n".join(map(str, gemms))
  ffi, ref = tgf._on("auto", step, *args), tgf._on("reference", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(ffi), jax.tree_util.tree_leaves(ref)):
    tgf._assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


# ------------------------- 16x16 NVFP4 weights: one copy, read both ways ----------------------

def test_nvfp4_2d_weights_one_copy_read_along_n(bf16_device, rng, monkeypatch):
  """NVFP4BlockScaling's 16x16 weights: the dgrad copy [G, K, N] is the forward copy
  transposed, so GroupedDense quantizes only it and the forward GEMM reads its decoded values
  along N (explain says so). The step is bit for bit the one that quantizes both copies (the
  same decoded values, the same float32 sums), and both match the reference."""
  step, args = tgf._grouped_step(jq.NVFP4BlockScaling(), 4, 96, 64, 48, rng, use_bias=False)
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  report = jq.explain(step, *args)
  fprop, = [d for d in report if d.op == "grouped_gemm" and str(d.role).endswith("/fprop")]
  assert "b read along N from its [G, K, N] copy" in fprop.detail, str(report)
  weight_copies = [d.detail for d in report if d.op == "grouped_quantize" and
                   str(d.role).endswith("/weight")]
  assert weight_copies == [weight_copies[0]] and weight_copies[0].startswith("rowwise:"), \
      str(report)
  one_copy = tgf._on("auto", step, *args)
  monkeypatch.setattr(grouped_kernels, "experts_read_transposed", lambda *args: False)
  report = jq.explain(step, *args)
  fprop, = [d for d in report if d.op == "grouped_gemm" and str(d.role).endswith("/fprop")]
  assert "[G, K, N]" not in fprop.detail, str(report)
  two_copies = tgf._on("auto", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(one_copy), jax.tree_util.tree_leaves(two_copies)):
    assert np.asarray(u).tobytes() == np.asarray(v).tobytes()
  ref = tgf._on("reference", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(one_copy), jax.tree_util.tree_leaves(ref)):
    tgf._assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


def test_transposed_experts_materialize_as_the_other_copy(rng):
  """`TransposedExperts(w_kn).materialize()` is bit for bit the [G, N, K] copy quantizing the
  transposed weights gives, for the formats whose copies are each other's transposes; the
  reference GEMM takes either operand with the same result."""
  from jaxquant.grouping.tensors import TransposedExperts
  w = jnp.asarray(oracle.random_matrix(rng, (3, 64, 48)), jnp.bfloat16)  # [G, K, N]
  for q in (jq.NVFP4Quantizer(block_2d=True), jq.Float8CurrentScalingQuantizer()):
    assert jq.formats.format_of(q).columnwise_is_transposed_rowwise(q)
    kn = tgf._on("reference", lambda w: jg.quantize_experts(w, q, columnwise=False).rowwise, w)
    nk = tgf._on("reference", lambda w: jg.quantize_experts(jnp.swapaxes(w, 1, 2), q,
                                                             columnwise=False).rowwise, w)
    got = TransposedExperts(kn).materialize()
    for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(nk)):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes(), q
  for q in (jq.NVFP4Quantizer(), jq.NVFP4Quantizer(block_2d=True, stochastic_rounding=True),
            jq.MXFP8Quantizer()):
    assert not jq.formats.format_of(q).columnwise_is_transposed_rowwise(q), q
