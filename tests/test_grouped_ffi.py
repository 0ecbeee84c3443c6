"""The grouped FFI targets (ffi/grouped) against the reference (`jaxquant.grouped`).

Each check runs the same jitted function twice, with `JAXQUANT_BACKEND=ffi` (the kernels: the
CPU handlers here, the CUDA kernels under `-m gpu`) and `JAXQUANT_BACKEND=reference`:
quantized storages must be bitwise equal; GEMMs, float32 outputs, equal within float32
accumulation-order error (`2^-14 * max |out|` on CPU, where both sum in float32 in a different
order; `2^-10` on the GPU, where XLA may run the reference's decoded GEMM in its own way).
Inputs are fresh random draws; groups are uneven, include empty ones and rows of no group.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax  # noqa: F401
import jaxquant.grouped as jg
import oracle
from jaxquant.backends.ffi import quantize as single_ffi
from helpers import assert_same_leaves
from jaxquant.backends.ffi.grouped import sm90_configs
from jaxquant.backends.ffi.grouped import support as kernels

pytestmark = pytest.mark.skipif(
    not kernels._targets("cpu") and not kernels._targets("cuda"),
    reason="jaxquant FFI extension without the grouped targets")

# What `explain` names the grouped kernels on this machine's default backend.
FFI_PATH = "ffi-cuda" if jax.default_backend() == "gpu" else "ffi-cpu"
FP8 = jq.Float8CurrentScalingQuantizer()
TOKEN_QUANTIZERS = {
    "fp8-current": FP8,
    "fp8-current-pow2": jq.Float8CurrentScalingQuantizer(pow2_scale=True),
    "fp8-delayed-e5m2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=4),
    "mxfp8": jq.MXFP8Quantizer(),
    "fp8-block-1x128": jq.Float8BlockQuantizer((1, 128)),
    "fp8-block-128x128": jq.Float8BlockQuantizer((128, 128)),
    "nvfp4-row-scaled-rowwise": jq.NVFP4Quantizer(row_scaled=True),
    # one second-level scale per group (jaxquant_grouped_quantize_nvfp4): NVFP4BlockScaling's
    # input (RHT columnwise) and grad_output (SR, RHT columnwise), plain and 16x16 blocks
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4-rht": jq.NVFP4Quantizer(rht=True),
    "nvfp4-sr": jq.NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4-rht-sr": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
}
NVFP4_TOKENS = ["nvfp4", "nvfp4-rht", "nvfp4-sr", "nvfp4-rht-sr", "nvfp4-2d"]


def _sizes(rng, tokens, groups, empty=(), spare=0):
  weights = rng.uniform(0.2, 1.0, groups)
  weights[list(empty)] = 0.0
  if not weights.any():
    return np.zeros(groups, np.int32)
  total = tokens - spare
  sizes = np.floor(weights / weights.sum() * total).astype(np.int32)
  sizes[np.argmax(sizes)] += total - sizes.sum()
  return sizes


def _on(backend, fn, *args):
  old = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = backend
  try:
    return jax.jit(lambda *a: fn(*a))(*args)  # a fresh function: no trace shared across backends
  finally:
    if old is None:
      del os.environ["JAXQUANT_BACKEND"]
    else:
      os.environ["JAXQUANT_BACKEND"] = old


def _paths(fn, *args):
  old = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = "ffi"
  try:
    return jq.explain(fn, *args)
  finally:
    if old is None:
      del os.environ["JAXQUANT_BACKEND"]
    else:
      os.environ["JAXQUANT_BACKEND"] = old


def _random_state(rng, quantizer, groups):
  state = jg.init_state(quantizer, groups)
  if state is None:
    return None
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.uniform(0.5, 40.0, a.shape), jnp.float32), state)


def _group_keys(rng, quantizer, groups):
  """One fresh PRNG key per group when `quantizer` rounds stochastically, else None."""
  if not any(getattr(q, "stochastic_rounding", False) for q in quantizer.leaves()):
    return None
  return jax.random.split(jax.random.key(int(rng.integers(2**31))), groups)


def _check_quantize(rng, name, tokens, features, groups, dtype, empty, spare, row_block=None,
                    col_block=None):
  q = TOKEN_QUANTIZERS[name]
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, features)), dtype)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, empty, spare))
  state = _random_state(rng, q, groups)
  keys = _group_keys(rng, q, groups)
  columnwise = name != "nvfp4-row-scaled-rowwise"
  fn = lambda x, sizes, state, keys: jg.quantize(x, sizes, q, columnwise=columnwise,
                                                 state=state, row_block=row_block,
                                                 col_block=col_block, keys=keys)
  report = _paths(fn, x, sizes, state, keys)
  assert report.paths() == {FFI_PATH}, str(report)
  assert_same_leaves(_on("ffi", fn, x, sizes, state, keys),
                     _on("reference", fn, x, sizes, state, keys), name)


# Each quantizer once, the input dtype alternating: the handlers' loads by dtype are the same
# code for every format (both dtypes of every quantizer took ~1.5 CPU-minutes), and every
# format family meets both dtypes here.
@pytest.mark.parametrize("name,dtype", [(name, (jnp.bfloat16, jnp.float32)[i % 2])
                                        for i, name in enumerate(TOKEN_QUANTIZERS)])
def test_grouped_quantize_is_bitwise_the_reference(rng, name, dtype):
  _check_quantize(rng, name, 150, 72, 5, dtype, empty=(1,), spare=7)


@pytest.mark.parametrize("q", [jq.MXFP8Quantizer(), jq.Float8BlockQuantizer()],
                         ids=["mxfp8", "fp8-block-1x128"])
def test_packed_rowwise_block_copy_reads_rows_of_no_group_as_zeros(rng, q):
  """The packed rowwise copy of a one-row-block format is one gathered-kernel call on the packed
  layout (rows past sum(sizes) read as zeros): no select over the quantized rows and no zero-row
  launch in the lowered program, and bit for bit the reference with rows of no group."""
  x = jnp.asarray(oracle.random_matrix(rng, (200, 256)), jnp.bfloat16)
  sizes = jnp.asarray([60, 0, 77], jnp.int32)  # 63 rows of no group
  fn = lambda x, sizes: jg.quantize(x, sizes, q, columnwise=False)
  os.environ["JAXQUANT_BACKEND"] = "ffi"
  try:
    text = jax.jit(fn).lower(x, sizes).as_text()
  finally:
    del os.environ["JAXQUANT_BACKEND"]
  calls = [line.split("@")[1].split("(")[0] for line in text.splitlines()
           if "custom_call @" in line]
  assert sorted(calls) == ["jaxquant_grouped_amax", single_ffi.gathered_kernel(q)], calls
  assert "select" not in text
  assert_same_leaves(_on("ffi", fn, x, sizes), _on("reference", fn, x, sizes), str(q))


# Each padded layout once, the two FP8 quantizers taking turns (every pair took ~10 CPU-s more;
# both quantizers fill the same layouts through one handler).
@pytest.mark.parametrize("name,blocks", [("fp8-current", (1, 32)), ("fp8-delayed-e5m2", (32, 32)),
                                         ("fp8-current", (16, 128))])
def test_grouped_fp8_quantize_in_padded_layouts(rng, name, blocks):
  _check_quantize(rng, name, 133, 40, 4, jnp.bfloat16, empty=(0,), spare=3,
                  row_block=blocks[0], col_block=blocks[1])


@pytest.mark.parametrize("blocks", [(1, 1), (1, 16), (16, 16), (16, 32)])
def test_grouped_fp8_copies_share_one_call_when_the_rowwise_copy_is_packed(monkeypatch, blocks):
  """One read of x for both copies in one layout, or a packed rowwise copy beside a padded
  columnwise one (GroupedDense's x and dy under the CUTLASS wgrad's token block 16); two
  padded layouts of different blocks take one call per copy."""
  q = TOKEN_QUANTIZERS["fp8-current"]
  x = jnp.zeros((64, 32), jnp.bfloat16)
  sizes = jnp.asarray([20, 0, 30], jnp.int32)
  fn = lambda x, sizes: jg.quantize(x, sizes, q, row_block=blocks[0], col_block=blocks[1])
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  hlo = jax.jit(fn).lower(x, sizes).as_text()
  report = jq.explain(fn, x, sizes)
  calls = hlo.count("jaxquant_grouped_quantize_fp8")
  assert calls == (1 if blocks[0] == 1 or blocks[0] == blocks[1] else 2), hlo
  details = [d.detail for d in report if d.op == "grouped_quantize"]
  if blocks == (1, 16):
    assert len(details) == 1 and details[0].startswith(
        f"rowwise+columnwise: {q} [3 groups, rowwise packed, columnwise token block 16]"), details


@pytest.mark.parametrize("name,blocks", [("mxfp8", (1, 32)), ("mxfp8", (1, 64)),
                                         ("mxfp8", (32, 32)), ("fp8-block-1x128", (1, 128)),
                                         ("fp8-block-1x128", (1, 256)),
                                         ("fp8-block-128x128", (128, 128)),
                                         ("fp8-block-128x128", (128, 256))])
def test_block_format_copies_share_one_gathered_call(rng, name, blocks):
  """MXFP8 / Float8Block tokens: both copies from one gathered-kernel call (one read of x), the
  rowwise copy packed (`row_packed`: each position's codes at its source row, the rows of no
  group as zeros) beside the padded columnwise copy, or both in one layout; bit for bit the
  reference. Float8Block 128x128 tokens have no one-row rowwise blocks: one call for one layout,
  else one call per copy."""
  q = TOKEN_QUANTIZERS[name]
  _check_quantize(rng, name, 150, 72, 5, jnp.bfloat16, empty=(1,), spare=7,
                  row_block=blocks[0], col_block=blocks[1])
  x = jnp.asarray(oracle.random_matrix(rng, (96, 64)), jnp.bfloat16)
  sizes = jnp.asarray([20, 0, 30], jnp.int32)  # 46 rows of no group
  fn = lambda x, sizes: jg.quantize(x, sizes, q, row_block=blocks[0], col_block=blocks[1])
  os.environ["JAXQUANT_BACKEND"] = "ffi"
  try:
    text = jax.jit(fn).lower(x, sizes).as_text()
    report = jq.explain(fn, x, sizes)
  finally:
    del os.environ["JAXQUANT_BACKEND"]
  one_call = blocks[0] == 1 or blocks[0] == blocks[1]
  assert text.count(f"custom_call @{single_ffi.gathered_kernel(q)}") == (1 if one_call else 2)
  assert ("row_packed = true" in text) == (one_call and blocks[0] == 1), text[:3000]
  details = [d.detail for d in report if d.op == "grouped_quantize"]
  assert (len(details) == 1 and details[0].startswith("rowwise+columnwise")) == one_call, details


def test_row_packed_needs_one_row_blocks_of_tokens():
  x = jnp.zeros((256, 64), jnp.bfloat16)
  starts = jnp.asarray([0, 100, 200], jnp.int32)
  pstarts = jnp.asarray([0, 128, 256], jnp.int32)
  with pytest.raises(ValueError, match="row_packed: needs the rowwise copy of tokens in one-row"):
    single_ffi.quantize_gathered(x, starts, pstarts, 256, jq.Float8BlockQuantizer((128, 128)),
                                 rowwise=True, columnwise=True, orig_dtype=jnp.bfloat16,
                                 row_packed=True)
  with pytest.raises(ValueError, match="layout of at least 256 positions"):
    single_ffi.quantize_gathered(x, starts, pstarts, 128, jq.MXFP8Quantizer(), rowwise=True,
                                 columnwise=True, orig_dtype=jnp.bfloat16, row_packed=True)


@pytest.mark.parametrize("name", ["fp8-current", "nvfp4-rht-sr", "nvfp4-2d"])
def test_grouped_quantize_of_all_empty_groups(rng, name):
  _check_quantize(rng, name, 32, 16, 3, jnp.float32, empty=(0, 1, 2), spare=0)


# Each layout once on the CPU (every pair took ~15 CPU-s more; 2-D blocks take row_block >= 16,
# so (1, 32) would be (16, 32) for them); the GPU test below runs every pair.
@pytest.mark.parametrize("name,blocks", [("nvfp4-rht-sr", (1, 32)), ("nvfp4-2d", (16, 16)),
                                         ("nvfp4-rht-sr", (32, 64))])
def test_grouped_nvfp4_quantize_in_padded_layouts(rng, name, blocks):
  """Token blocks wider than the format needs (a wgrad layout shared with another operand)."""
  row_block = max(blocks[0], 16) if name == "nvfp4-2d" else blocks[0]
  _check_quantize(rng, name, 133, 40, 4, jnp.bfloat16, empty=(0,), spare=3,
                  row_block=row_block, col_block=blocks[1])


@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_nvfp4_one_group_and_one_token_groups(rng, groups):
  """Groups of a single token (a 16-position chunk of one token and 15 zeros), one group."""
  q = TOKEN_QUANTIZERS["nvfp4-rht-sr"]
  x = jnp.asarray(oracle.random_matrix(rng, (5, 32)), jnp.bfloat16)
  sizes = jnp.asarray(np.array([1, 1, 3][:groups] if groups > 1 else [4], np.int32))
  keys = _group_keys(rng, q, groups)
  fn = lambda x, sizes, keys: jg.quantize(x, sizes, q, keys=keys)
  assert _paths(fn, x, sizes, keys).paths() == {FFI_PATH}
  assert_same_leaves(_on("ffi", fn, x, sizes, keys), _on("reference", fn, x, sizes, keys))


def test_grouped_nvfp4_groups_of_different_ranges_keep_their_own_scales(rng):
  """Each group's second-level scale comes from its own amax: scaling one group's tokens by
  2^10 changes only that group's amax, and the other groups' payloads stay put."""
  q = jq.NVFP4Quantizer()
  x = jnp.asarray(oracle.random_matrix(rng, (96, 32)), jnp.float32)
  sizes = jnp.asarray(np.array([30, 0, 40, 26], np.int32))
  fn = lambda x: jg.quantize(x, sizes, q, columnwise=False).rowwise
  base = _on("ffi", fn, x)
  scaled = _on("ffi", fn, x.at[30:70].multiply(1024.0))
  np.testing.assert_array_equal(np.asarray(scaled.amax)[[0, 1, 3]],
                                np.asarray(base.amax)[[0, 1, 3]])
  assert float(scaled.amax[2]) == 1024.0 * float(base.amax[2])
  keep = np.r_[0:30, 70:96]  # the tokens of groups 0 and 3
  np.testing.assert_array_equal(np.asarray(scaled.data, np.float32)[keep],
                                np.asarray(base.data, np.float32)[keep])
  assert_same_leaves(scaled, _on("reference", fn, x.at[30:70].multiply(1024.0)))


@pytest.mark.parametrize("name", ["fp8-current", "fp8-delayed-e5m2"])
def test_expert_weights_fp8_is_bitwise_the_reference(rng, name):
  q = TOKEN_QUANTIZERS[name]
  w = jnp.asarray(oracle.random_matrix(rng, (3, 40, 24)), jnp.bfloat16)
  state = _random_state(rng, q, 3)
  fn = lambda w, state: jg.quantize_experts(w, q, state=state)
  assert _paths(fn, w, state).paths() == {FFI_PATH}
  assert_same_leaves(_on("ffi", fn, w, state), _on("reference", fn, w, state), name)


def _half_fresh_state(rng, quantizer, groups):
  """Random stored scales, except every other group has none yet (scale 0: first step)."""
  state = _random_state(rng, quantizer, groups)
  fresh = jnp.arange(groups) % 2 == 0
  return jq.DelayedScalingState(jnp.where(fresh, 0.0, state.scale), state.amax_history)


def test_grouped_delayed_first_step_is_bitwise_the_reference(rng):
  q = TOKEN_QUANTIZERS["fp8-delayed-e5m2"]
  x = jnp.asarray(oracle.random_matrix(rng, (150, 72)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, 150, 5, (1,), 7))
  state = _half_fresh_state(rng, q, 5)
  fn = lambda x, sizes, state: jg.quantize(x, sizes, q, state=state)
  assert _paths(fn, x, sizes, state).paths() == {FFI_PATH}
  assert_same_leaves(_on("ffi", fn, x, sizes, state), _on("reference", fn, x, sizes, state))
  w = jnp.asarray(oracle.random_matrix(rng, (3, 40, 24)), jnp.bfloat16)
  state = _half_fresh_state(rng, q, 3)
  fn = lambda w, state: jg.quantize_experts(w, q, state=state)
  assert_same_leaves(_on("ffi", fn, w, state), _on("reference", fn, w, state), "experts")


EXPERT_QUANTIZERS = {
    "mxfp8": jq.MXFP8Quantizer(),
    "mxfp8-e5m2": jq.MXFP8Quantizer(jnp.float8_e5m2),
    "fp8-block-1x128": jq.Float8BlockQuantizer((1, 128)),
    "fp8-block-128x128": jq.Float8BlockQuantizer((128, 128)),
    # the MoE zoo recipe's experts: row-scaled NVFP4 forward, MXFP8 backward
    "hybrid-nvfp4-row-mxfp8": jq.HybridQuantizer(jq.NVFP4Quantizer(row_scaled=True),
                                                 jq.MXFP8Quantizer()),
    "hybrid-fp8-mxfp8": jq.HybridQuantizer(FP8, jq.MXFP8Quantizer()),
    # one amax per expert (jaxquant_grouped_quantize_nvfp4): NVFP4BlockScaling's weights (16x16),
    # the MoE recipe's NVFP4 forward weights, mxfp8_fwd_nvfp4_bwd's and
    # nvfp4_fwd_mxfp8_bwd_from_fwd's experts
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
    "nvfp4-rht": jq.NVFP4Quantizer(rht=True),
    "hybrid-nvfp4-mxfp8": jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.MXFP8Quantizer()),
    "hybrid-mxfp8-nvfp4-2d": jq.HybridQuantizer(jq.MXFP8Quantizer(),
                                                jq.NVFP4Quantizer(block_2d=True)),
    "hybrid-nvfp4-2d-mxfp8-from-rowwise": jq.HybridQuantizer(
        jq.NVFP4Quantizer(block_2d=True), jq.MXFP8Quantizer(),
        columnwise_source="rowwise_dequantized"),
}


@pytest.mark.parametrize("name", sorted(EXPERT_QUANTIZERS))
def test_expert_weights_block_formats_are_bitwise_the_reference(rng, name, rows=128):
  """Block-scaled expert weights: one single-tensor launch per copy on `[G * rows, cols]`
  (blocks never span experts), regrouped; each expert bit-for-bit its own reference quantize,
  its tensor amax included. cols = 200: a partial last block per row."""
  q = EXPERT_QUANTIZERS[name]
  w = jnp.asarray(oracle.random_matrix(rng, (3, rows, 200)), jnp.bfloat16)
  w = w.at[1].multiply(64.0)  # experts of different ranges: their own scales and amaxes
  fn = lambda w: jg.quantize_experts(w, q)
  assert _paths(fn, w).paths() == {FFI_PATH}
  got, want = _on("ffi", fn, w), _on("reference", fn, w)
  assert_same_leaves(got, want, name)
  assert got.columnwise.data.shape == (3, 200, rows)


@pytest.mark.parametrize("name", ["mxfp8", "fp8-block-1x128", "fp8-block-128x128"])
@pytest.mark.parametrize("rowwise", [False, True])
def test_expert_weights_written_per_expert_in_one_call(rng, name, rowwise):
  """MXFP8 / Float8Block expert weights' copies come from one gathered-kernel call with
  expert_rows (each expert's columnwise [cols, rows] written on its own; the rowwise copy, when
  asked for too, from the same call and read of w): no transpose of a quantized copy in the
  lowered program, and bit for bit the reference with 2 and 3 experts."""
  q = EXPERT_QUANTIZERS[name]
  for groups in (2, 3):
    w = jnp.asarray(oracle.random_matrix(rng, (groups, 128, 256)), jnp.bfloat16)
    fn = lambda w: jg.quantize_experts(w, q, rowwise=rowwise)
    os.environ["JAXQUANT_BACKEND"] = "ffi"
    try:
      text = jax.jit(lambda w: fn(w)).lower(w).as_text()
    finally:
      del os.environ["JAXQUANT_BACKEND"]
    assert "expert_rows = 128" in text, text[:2000]
    assert text.count("custom_call @jaxquant_") == 1, text[:4000]
    assert "transpose" not in text, "the columnwise copy should not be regrouped by XLA"
    got, want = _on("ffi", fn, w), _on("reference", fn, w)
    assert (got.rowwise is None) == (not rowwise)
    assert_same_leaves(got, want, name)


def test_gathered_kernel_names_a_bad_expert_rows():
  x = jnp.zeros((256, 64), jnp.bfloat16)
  starts = jnp.asarray([0, 128, 256], jnp.int32)
  with pytest.raises(ValueError, match=r"expert_rows=128: needs a length \(200\) of whole "
                                       "experts"):
    single_ffi.quantize_gathered(x, starts, starts, 200, jq.MXFP8Quantizer(), rowwise=True,
                                 columnwise=False, orig_dtype=jnp.bfloat16, expert_rows=128)
  with pytest.raises(Exception, match=r"expert_rows=48 must be 0 \(tokens\) or length / G "
                                      r"\(= 48\) and a multiple of 32"):
    jax.jit(lambda x: single_ffi.quantize_gathered(
        x, starts, starts, 96, jq.MXFP8Quantizer(), rowwise=False, columnwise=True,
        orig_dtype=jnp.bfloat16, expert_rows=48))(x)


def test_expert_weights_nvfp4_stochastic_rounding_is_bitwise_the_reference(rng):
  """NVFP4 expert weights with stochastic rounding: each expert rounds with its own key."""
  q = jq.NVFP4Quantizer(stochastic_rounding=True)
  w = jnp.asarray(oracle.random_matrix(rng, (4, 48, 64)), jnp.bfloat16)
  keys = _group_keys(rng, q, 4)
  fn = lambda w, keys: jg.quantize_experts(w, q, keys=keys)
  assert _paths(fn, w, keys).paths() == {FFI_PATH}
  assert_same_leaves(_on("ffi", fn, w, keys), _on("reference", fn, w, keys))


NVFP4_EXPERTS = {"nvfp4": jq.NVFP4Quantizer(), "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
                 "nvfp4-rht": jq.NVFP4Quantizer(rht=True),
                 "nvfp4-rht-sr": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)}


def _check_nvfp4_experts_sharing_tiles(rng, name, groups, rows, cols=144):
  """NVFP4 expert weights whose experts share the kernel's 64-row tiles (rows per expert 16 or
  48): every row takes its own expert's amax, stochastic-rounding key and output matrix.
  Experts of ranges 2^-6 .. 2^6 apart; cols 144: a partial 128-column tile."""
  q = NVFP4_EXPERTS[name]
  w = oracle.random_matrix(rng, (groups, rows, cols)) * np.exp2(rng.integers(-6, 7, (groups, 1, 1)))
  w = jnp.asarray(w, jnp.bfloat16)
  keys = _group_keys(rng, q, groups)
  fn = lambda w, keys: jg.quantize_experts(w, q, keys=keys)
  assert _paths(fn, w, keys).paths() == {FFI_PATH}
  got = _on("ffi", fn, w, keys)
  assert_same_leaves(got, _on("reference", fn, w, keys), name)
  assert got.columnwise.data.shape == (groups, cols, rows)


SHARED_TILES = [(1, 48), (5, 16), (3, 48)]  # (experts, rows each)


@pytest.mark.parametrize("name", sorted(NVFP4_EXPERTS))
def test_expert_weights_nvfp4_experts_sharing_a_tile_are_bitwise_the_reference(rng, name):
  # Two of the three tilings per quantizer, in turn: each tiling meets at least two quantizers
  # (all three for each took ~10 CPU-s more; the GPU test below takes every one).
  skip = sorted(NVFP4_EXPERTS).index(name) % len(SHARED_TILES)
  for groups, rows in SHARED_TILES[:skip] + SHARED_TILES[skip + 1:]:
    _check_nvfp4_experts_sharing_tiles(rng, name, groups, rows)


def test_expert_weights_nvfp4_rows_not_a_multiple_of_16_take_the_reference(rng):
  """A columnwise / 16x16 NVFP4 block would span two experts: the reference, visibly."""
  q = jq.NVFP4Quantizer(block_2d=True)
  w = jnp.asarray(oracle.random_matrix(rng, (2, 40, 32)), jnp.bfloat16)
  os.environ.pop("JAXQUANT_BACKEND", None)
  report = jq.explain(lambda w: jg.quantize_experts(w, q), w)
  assert report.paths() == {"reference"}, str(report)
  assert all("multiple of 16" in d.reason for d in report)
  assert_same_leaves(_on("auto", lambda w: jg.quantize_experts(w, q), w),
                     _on("reference", lambda w: jg.quantize_experts(w, q), w))


@pytest.mark.parametrize("name,rows", [("mxfp8", 48), ("fp8-block-1x128", 64),
                                       ("fp8-block-128x128", 64)])
def test_expert_weights_whose_blocks_would_span_experts_take_the_reference(rng, name, rows):
  """Rows per expert not a multiple of the columnwise block: the single-tensor kernel would put
  two experts in one block, so the reference serves it, and explain says why."""
  q = EXPERT_QUANTIZERS[name]
  w = jnp.asarray(oracle.random_matrix(rng, (2, rows, 64)), jnp.bfloat16)
  os.environ.pop("JAXQUANT_BACKEND", None)  # auto: the kernels where they serve
  report = jq.explain(lambda w: jg.quantize_experts(w, q), w)
  columnwise = [d for d in report if d.detail.startswith("columnwise")]
  assert columnwise and all(d.path == "reference" for d in columnwise)
  assert all("would span two experts" in d.reason for d in columnwise)
  assert_same_leaves(_on("auto", lambda w: jg.quantize_experts(w, q), w),
                     _on("reference", lambda w: jg.quantize_experts(w, q), w), name)


# -------------------------------------------- GEMMs -------------------------------------------

GEMM_QUANTIZERS = {
    "fp8": FP8,
    "fp8-e5m2": jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2),
    "mxfp8": jq.MXFP8Quantizer(),
    "nvfp4": jq.NVFP4Quantizer(),
    "nvfp4-row": jq.NVFP4Quantizer(row_scaled=True),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
    "block-1x128": jq.Float8BlockQuantizer((1, 128)),
    "block-128x128": jq.Float8BlockQuantizer((128, 128)),
}
# Each format on each side where it was before, mixed pairs included. The CPU handler decodes
# each operand by its own format, so the same-format pairs (fp8, fp8), (mxfp8, mxfp8), (nvfp4,
# nvfp4) and (nvfp4-row, nvfp4-row) are one (nvfp4, nvfp4-row) and the others' halves here (~10
# CPU-s less; each format meets itself in the GPU tests).
RAGGED_PAIRS = [("fp8", "fp8-e5m2"), ("nvfp4", "nvfp4-row"), ("nvfp4-row", "nvfp4-2d"),
                ("mxfp8", "fp8"), ("fp8", "nvfp4"), ("block-1x128", "block-128x128"),
                ("block-1x128", "mxfp8")]
WGRAD_PAIRS = [("fp8-e5m2", "fp8"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"),
               ("nvfp4-row", "mxfp8"), ("block-1x128", "block-1x128")]  # (fp8, fp8): as e5m2's


def _assert_close(actual, expected, rel, msg=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, msg
  scale = max(np.abs(expected).max(initial=0.0), 1e-30)
  err = np.abs(actual - expected).max(initial=0.0)
  assert err <= rel * scale, f"{msg}: max error {err:.3g} > {rel:.3g} x {scale:.3g}"


def check_ragged(rng, pair, tokens, k, n, groups, empty, spare, rel, bias=True,
                 out_dtype=jnp.float32, kernel=None):
  qa, qb = (GEMM_QUANTIZERS[p] for p in pair)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (groups, n, k)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((groups, n)), jnp.float32) if bias else None
  sizes = jnp.asarray(_sizes(rng, tokens, groups, empty, spare))

  def fn(x, w, b, sizes):
    os.environ["JAXQUANT_BACKEND"] = "reference"  # same operands for both GEMMs
    a = jg.quantize(x, sizes, qa, columnwise=False).rowwise
    e = jg.quantize_experts(w, qb, columnwise=False).rowwise
    os.environ["JAXQUANT_BACKEND"] = backend
    return jg.gemm(a, e, bias=b, out_dtype=out_dtype)

  outs = {}
  for backend in ("ffi", "reference"):
    outs[backend] = _on(backend, fn, x, w, b, sizes)
  if kernel is not None:
    backend = "ffi"
    assert _gemm_kernels(fn, x, w, b, sizes) == {kernel}
  _assert_close(outs["ffi"], outs["reference"], rel, f"ragged {pair}")
  start = int(np.sum(np.asarray(sizes)))
  if pair[0] != "nvfp4-2d":
    assert np.all(np.asarray(outs["ffi"])[start:] == 0), "rows of no group must be zero"


def _gemm_kernels(fn, *args) -> set:
  """The grouped GEMM kernels `jaxquant.explain` reports for `fn` with JAXQUANT_BACKEND=ffi."""
  report = _paths(fn, *args)
  return {d.detail.rsplit("kernel: ", 1)[-1] for d in report if d.op == "grouped_gemm"}


def check_wgrad(rng, pair, tokens, m, n, groups, empty, spare, rel, block=1,
                out_dtype=jnp.float32, kernel=None):
  qa, qb = (GEMM_QUANTIZERS[p] for p in pair)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, m)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, empty, spare))
  need = max(jg.token_block(q, "columnwise") for q in (qa, qb))
  block = max(block, need)

  def fn(x, dy, sizes):
    os.environ["JAXQUANT_BACKEND"] = "reference"
    a = jg.quantize(x, sizes, qa, rowwise=False, col_block=block).columnwise
    b = jg.quantize(dy, sizes, qb, rowwise=False, col_block=block).columnwise
    os.environ["JAXQUANT_BACKEND"] = backend
    return jg.gemm(a, b, out_dtype=out_dtype)

  outs = {}
  for backend in ("ffi", "reference"):
    outs[backend] = _on(backend, fn, x, dy, sizes)
  if kernel is not None:
    backend = "ffi"
    assert _gemm_kernels(fn, x, dy, sizes) == {kernel}
  _assert_close(outs["ffi"], outs["reference"], rel, f"wgrad {pair}")
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert np.all(np.asarray(outs["ffi"])[g] == 0), f"empty group {g} must give zeros"


@pytest.mark.parametrize("pair", RAGGED_PAIRS)
def test_ragged_gemm_matches_the_reference(rng, pair):
  check_ragged(rng, pair, 150, 64, 40, 5, empty=(2,), spare=9, rel=2.0**-14)


@pytest.mark.parametrize("pair", WGRAD_PAIRS)
def test_wgrad_gemm_matches_the_reference(rng, pair):
  check_wgrad(rng, pair, 150, 40, 24, 5, empty=(0, 3), spare=5, rel=2.0**-14)


def test_explain_reports_the_grouped_kernels_and_the_reference_visibly(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "auto")
  role = jq.QuantizerRole("grouped_linear", "input", "experts")

  def f(x, sizes):
    a = jg.quantize(x, sizes, FP8, columnwise=False, role=role).rowwise
    b = jg.quantize_experts(jnp.ones((2, 8, 32)), FP8, columnwise=False)
    n = jg.quantize(x, sizes, jq.NVFP4Quantizer(row_scaled=True), rowwise=False).columnwise
    return jg.gemm(a, b.rowwise), n

  report = jq.explain(f, jax.ShapeDtypeStruct((64, 32), jnp.float32),
                      jax.ShapeDtypeStruct((2,), jnp.int32))
  by_path = {d.path for d in report}
  assert by_path == {FFI_PATH, "reference"}, str(report)
  nvfp4 = [d for d in report if "NVFP4" in d.detail]
  assert nvfp4 and all(d.path == "reference" and "(group, feature)" in d.reason for d in nvfp4)


def test_forcing_the_ffi_on_an_unserved_case_is_an_error(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  with pytest.raises(RuntimeError, match="grouped quantize"):
    jax.eval_shape(lambda x: jg.quantize(x, np.array([30, 34]), jq.NVFP4Quantizer(row_scaled=True)),
                   jax.ShapeDtypeStruct((64, 32), jnp.float32))


# The MoE hybrid recipe's GroupedDense step is test_no_recipe_of_the_zoo_..._reference's.
@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_grouped_dense_on_the_kernels_matches_the_reference(rng, recipe):
  """GroupedDense forward + backward with every grouped op the recipe can put on a kernel."""
  recipe = {"Float8CurrentScaling": jq.recipes.Float8CurrentScaling,
            "DelayedScaling": jq.recipes.DelayedScaling}[recipe]()
  groups, tokens, k, n = 4, 96, 64, 48
  model = jq.flax.GroupedDense(features=n, num_groups=groups, recipe=recipe, dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, (1,), 5))
  variables = _on("reference", model.init, jax.random.PRNGKey(0), x, sizes)

  def step(variables, x, dy, sizes):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, sizes), variables, x)
    return y, vjp(dy)

  ffi, ref = _on("auto", step, variables, x, dy, sizes), _on("reference", step, variables, x,
                                                           dy, sizes)
  for u, v in zip(jax.tree_util.tree_leaves(ffi), jax.tree_util.tree_leaves(ref)):
    _assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


ZOO_RECIPES = {"NVFP4BlockScaling": jq.recipes.NVFP4BlockScaling,
               **{name: (lambda f=f: jq.CustomRecipe(f)) for name, f in jq.factories.ZOO.items()}}


def _grouped_step(recipe, groups, tokens, k, n, rng, use_bias=True):
  model = jq.flax.GroupedDense(features=n, num_groups=groups, recipe=recipe, dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16, use_bias=use_bias)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, (1,), 5))
  variables = _on("reference", model.init, jax.random.PRNGKey(0), x, sizes)

  def step(variables, x, dy, sizes, key):
    apply = lambda v, x: model.apply(v, x, sizes, rngs={"quantize": key})
    y, vjp = jax.vjp(apply, variables, x)
    return y, vjp(dy)

  return step, (variables, x, dy, sizes, jax.random.key(int(rng.integers(2**31))))


@pytest.mark.parametrize("recipe", sorted(ZOO_RECIPES))
def test_no_recipe_of_the_zoo_quantizes_experts_on_the_reference(rng, recipe):
  """Every grouped quantize of a GroupedDense step (tokens, expert weights, gradients) under
  NVFP4BlockScaling and each zoo recipe runs on a grouped kernel, and the step matches the
  reference (float32 accumulation order apart)."""
  step, args = _grouped_step(ZOO_RECIPES[recipe](), 4, 96, 64, 64, rng)
  os.environ.pop("JAXQUANT_BACKEND", None)
  report = jq.explain(step, *args)
  quantizes = [d for d in report if d.op == "grouped_quantize" and "Identity" not in d.detail]
  assert quantizes and all(d.path == FFI_PATH for d in quantizes), str(report)
  ffi, ref = _on("auto", step, *args), _on("reference", step, *args)
  for u, v in zip(jax.tree_util.tree_leaves(ffi), jax.tree_util.tree_leaves(ref)):
    _assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


# --------------------------------------------- GPU --------------------------------------------

@pytest.fixture
def on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")

@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("name", ["fp8-current", "fp8-delayed-e5m2", "mxfp8", "fp8-block-1x128",
                                  "nvfp4-row-scaled-rowwise"] + NVFP4_TOKENS)
def test_gpu_grouped_quantize_is_bitwise_the_reference(on_gpu, rng, groups, name):
  _check_quantize(rng, name, 1000 + groups, 192, groups, jnp.bfloat16,
                  empty=tuple(range(0, groups, 3)) if groups > 1 else (), spare=13)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("name", ["fp8-current", "fp8-delayed-e5m2"])
@pytest.mark.parametrize("features", [192, 200])
def test_gpu_grouped_fp8_packed_rows_beside_padded_columns(on_gpu, rng, groups, name, features):
  """The one-call pair of a packed rowwise and a padded columnwise copy: rowwise bytes at the
  source rows, the rows of no group zeroed, 200 features for the kernel's unaligned stores."""
  for col_block in (16, 128):
    _check_quantize(rng, name, 1000 + groups, features, groups, jnp.bfloat16,
                    empty=tuple(range(0, groups, 3)) if groups > 1 else (), spare=13,
                    row_block=1, col_block=col_block)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("name", ["mxfp8", "fp8-block-1x128"])
@pytest.mark.parametrize("features", [192, 200])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_block_formats_packed_rows_beside_padded_columns(on_gpu, rng, groups, name,
                                                             features, dtype):
  """The gathered kernel's `row_packed` pair: rowwise codes and scales at the source rows (a
  position past starts[G] can hold a token and also write a row of no group), the rows of no
  group as zeros, 200 features for unaligned stores, float32 input (its own instance)."""
  block = 32 if name == "mxfp8" else 128
  for col_block in (block, 2 * block):
    _check_quantize(rng, name, 1000 + groups, features, groups, dtype,
                    empty=tuple(range(0, groups, 3)) if groups > 1 else (), spare=13,
                    row_block=1, col_block=col_block)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gpu_grouped_nvfp4_other_input_dtypes_and_ragged_features(on_gpu, rng, groups, dtype):
  """float32 / float16 tokens, 200 features (a partial 16-block and tile per row, unaligned
  rows: the kernel's scalar loads), empty groups and rows of no group."""
  for name in ("nvfp4-rht-sr", "nvfp4-2d"):
    _check_quantize(rng, name, 700 + 3 * groups, 200, groups, dtype,
                    empty=tuple(range(1, groups, 4)), spare=9)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4-rht-sr", "nvfp4-2d"])
def test_gpu_grouped_nvfp4_layouts_and_empty_groups(on_gpu, rng, name):
  for blocks in [(1, 32), (16, 16), (32, 64)]:
    test_grouped_nvfp4_quantize_in_padded_layouts(rng, name, blocks)
  test_grouped_quantize_of_all_empty_groups(rng, name)


@pytest.mark.gpu
def test_gpu_grouped_nvfp4_tiny_groups_and_own_scales(on_gpu, rng):
  for groups in (1, 3):
    test_grouped_nvfp4_one_group_and_one_token_groups(rng, groups)
  test_grouped_nvfp4_groups_of_different_ranges_keep_their_own_scales(rng)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("name", sorted(NVFP4_EXPERTS))
def test_gpu_expert_weights_nvfp4_experts_sharing_a_tile(on_gpu, rng, name, groups):
  """The grouped NVFP4 kernel finds a row's expert as row // rows (no lookup): 64-row tiles
  holding four experts (rows 16) or straddling two (rows 48)."""
  for rows in (16, 48):
    _check_nvfp4_experts_sharing_tiles(rng, name, groups, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NVFP4_TOKENS)
def test_gpu_grouped_nvfp4_many_small_groups_per_tile(on_gpu, rng, name):
  """300 groups of a few tokens each, every third empty: a 64-position tile of the layout
  spans many groups (rowwise) or several 16-position chunks of different groups (columnwise);
  each row looks its own group up."""
  _check_quantize(rng, name, 1200, 96, 300, jnp.bfloat16, empty=tuple(range(0, 300, 3)),
                  spare=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("name", ["fp8-current", "nvfp4", "nvfp4-2d"])
def test_gpu_grouped_amax_of_wide_rows(on_gpu, rng, name, dtype):
  """Rows of 2056 features: the grouped amax kernel's lanes read four 16-byte chunks at a time
  (1024 features a warp) and the rest one at a time; the group amaxes (and the scales they
  give) are the reference's."""
  _check_quantize(rng, name, 300, 2056, 8, dtype, empty=(2,), spare=5)


@pytest.mark.gpu
def test_gpu_expert_weights_nvfp4_stochastic_rounding(on_gpu, rng):
  test_expert_weights_nvfp4_stochastic_rounding_is_bitwise_the_reference(rng)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(ZOO_RECIPES))
def test_gpu_no_recipe_of_the_zoo_quantizes_experts_on_the_reference(on_gpu, rng, recipe):
  test_no_recipe_of_the_zoo_quantizes_experts_on_the_reference(rng, recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", [("fp8", "fp8"), ("mxfp8", "mxfp8"), ("nvfp4-row", "nvfp4"),
                                  ("nvfp4-row", "nvfp4-2d"), ("fp8-e5m2", "fp8"),
                                  ("block-1x128", "block-128x128")])
def test_gpu_ragged_gemm_matches_the_reference(on_gpu, rng, groups, pair):
  check_ragged(rng, pair, 1500 + 7 * groups, 320, 200, groups,
               empty=tuple(range(1, groups, 4)), spare=11, rel=2.0**-10)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", [("fp8", "fp8"), ("fp8-e5m2", "fp8"), ("mxfp8", "mxfp8"),
                                  ("nvfp4", "nvfp4"), ("block-1x128", "block-1x128")])
def test_gpu_wgrad_gemm_matches_the_reference(on_gpu, rng, groups, pair):
  check_wgrad(rng, pair, 1500 + 5 * groups, 136, 200, groups,
              empty=tuple(range(2, groups, 5)), spare=7, rel=2.0**-10)


@pytest.mark.gpu
def test_gpu_expert_weights_fp8(on_gpu, rng):
  test_expert_weights_fp8_is_bitwise_the_reference(rng, "fp8-current")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(EXPERT_QUANTIZERS))
def test_gpu_expert_weights_block_formats(on_gpu, rng, name):
  test_expert_weights_block_formats_are_bitwise_the_reference(rng, name, rows=256)


# ------------------------------- CUTLASS Hopper grouped GEMM ---------------------------------
# jaxquant_grouped_gemm_sm90 (per-tensor FP8 on sm_90): FP8 wgmma sums each 128-long k-block in
# the tensor cores' accumulator (narrower than float32) and promotes it to float32 between
# blocks; the stated bound vs the reference (exact decode, float32 sums) is 2^-10 x max |out|
# for float32 outputs, plus one bfloat16 rounding (2^-8) for bfloat16 outputs.

SM90 = "CUTLASS sm90 wgmma"


@pytest.fixture
def on_sm90(on_gpu):
  reason = kernels._sm90_device_reason()
  if reason is not None:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", [("fp8", "fp8"), ("fp8-e5m2", "fp8"), ("fp8", "fp8-e5m2")])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_sm90_ragged_gemm_matches_the_reference(on_sm90, rng, groups, pair, out_dtype):
  """Ragged rows x experts (fprop / dgrad) on the CUTLASS kernel: uneven groups, empty groups,
  rows of no group (zeros), K not a multiple of the 128 k-tile."""
  rel = 2.0**-10 if out_dtype == jnp.float32 else 2.0**-7
  check_ragged(rng, pair, 1500 + 7 * groups, 336, 200, groups,
               empty=tuple(range(1, groups, 4)), spare=11, rel=rel, bias=False,
               out_dtype=out_dtype, kernel=SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("pair", [("fp8", "fp8"), ("fp8", "fp8-e5m2")])
@pytest.mark.parametrize("block", [16, 128])
def test_gpu_sm90_wgrad_gemm_matches_the_reference(on_sm90, rng, groups, pair, block):
  """Per-group wgrad on the CUTLASS kernel: empty groups give zeros, token layouts whose group
  starts are 16-aligned (the block), groups shorter than one k-tile. Groups below the large
  group size take the k-grouped kernel (E4M3 x E4M3 and E4M3 x E5M2), larger ones the
  pointer-array default."""
  tokens = 1500 + 5 * groups
  small = tokens / groups < sm90_configs.BF16_LARGE_GROUP_TOKENS
  label = sm90_configs.kernel_label(sm90_configs.Selection(sm90_configs.CONFIGS["kgrouped"]))
  check_wgrad(rng, pair, tokens, 136, 200, groups,
              empty=tuple(range(2, groups, 5)) if groups > 1 else (), spare=7, rel=2.0**-10,
              block=block, kernel=SM90 + (label if small else ""))


@pytest.mark.gpu
def test_gpu_sm90_all_groups_empty_gives_zeros(on_sm90, rng):
  check_ragged(rng, ("fp8", "fp8"), 64, 64, 32, 3, empty=(0, 1, 2), spare=0, rel=0.0,
               bias=False, kernel=SM90)
  kgrouped = sm90_configs.kernel_label(sm90_configs.Selection(sm90_configs.CONFIGS["kgrouped"]))
  check_wgrad(rng, ("fp8", "fp8"), 64, 32, 24, 3, empty=(0, 1, 2), spare=0, rel=0.0, block=16,
              kernel=SM90 + kgrouped)  # small groups: the k-grouped kernel writes the zeros


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [jq.recipes.Float8CurrentScaling,
                                    jq.recipes.Float8BlockScaling])
def test_gpu_sm90_grouped_dense_runs_every_gemm_on_the_cutlass_kernel(on_sm90, rng, recipe):
  """GroupedDense fprop, dgrad and wgrad all on the CUTLASS kernel, and the step matches the
  reference: under Float8CurrentScaling (E4M3 forward, E5M2 gradients; the wgrad layout block
  is raised to 16 for it) and under Float8BlockScaling (x / dy 1x128, weights 128x128: the
  blockwise-scaled mainloop)."""
  groups, tokens, k, n = 8, 512, 256, 128
  model = jq.flax.GroupedDense(features=n, num_groups=groups, use_bias=False,
                               recipe=recipe(), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, (3,), 9))
  variables = _on("reference", model.init, jax.random.PRNGKey(0), x, sizes)

  def step(variables, x, dy, sizes):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x, sizes), variables, x)
    return y, vjp(dy)

  os.environ.pop("JAXQUANT_BACKEND", None)
  gemms = [d for d in jq.explain(step, variables, x, dy, sizes) if d.op == "grouped_gemm"]
  assert len(gemms) == 3 and all(d.path == "ffi-cuda" and SM90 in d.detail for d in gemms), \
      "\n".join(map(str, gemms))
  ffi, ref = _on("auto", step, variables, x, dy, sizes), _on("reference", step, variables, x,
                                                           dy, sizes)
  for u, v in zip(jax.tree_util.tree_leaves(ffi), jax.tree_util.tree_leaves(ref)):
    _assert_close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0**-7)


@pytest.mark.gpu
def test_gpu_sm90_explain_says_why_the_mma_sync_kernel_serves(on_sm90, rng, monkeypatch):
  """Block-scaled operands, a bias and a packed (unaligned) wgrad layout are not the FP8
  CUTLASS kernel's; with the bfloat16 decode route switched off (tests/test_grouped_bf16.py
  covers it) they run on the mma.sync kernel, and explain says why."""
  x = jnp.asarray(oracle.random_matrix(rng, (96, 64)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (2, 32, 64)), jnp.bfloat16)
  sizes = jnp.asarray([40, 50], jnp.int32)
  os.environ.pop("JAXQUANT_BACKEND", None)
  monkeypatch.setenv("JAXQUANT_GROUPED_GEMM_KERNEL", "mma_sync")

  def f(x, w, sizes):
    mx = jg.quantize(x, sizes, jq.MXFP8Quantizer(), columnwise=False).rowwise
    mw = jg.quantize_experts(w, jq.MXFP8Quantizer(), columnwise=False).rowwise
    fx = jg.quantize(x, sizes, FP8)
    fw = jg.quantize_experts(w, FP8, columnwise=False).rowwise
    return (jg.gemm(mx, mw), jg.gemm(fx.rowwise, fw, bias=jnp.ones((2, 32))),
            jg.gemm(fx.columnwise, fx.columnwise))

  gemms = [d for d in jq.explain(f, x, w, sizes) if d.op == "grouped_gemm"]
  assert [d.detail.rsplit("kernel: ", 1)[-1] for d in gemms] == ["mma.sync"] * 3
  assert "per-tensor FP8" in gemms[0].reason and "Float8Block" in gemms[0].reason
  assert "bias" in gemms[1].reason
  assert "multiples of 16" in gemms[2].reason


# ------------------------------ CUTLASS Hopper blockwise (Float8Block) ------------------------
# jaxquant_grouped_gemm_sm90 with Float8Block operands (a: 1x128 blocks; b: 128x128 expert tiles
# or 1x128 blocks): per 128-deep k-block the FP8 wgmma partial sums are multiplied by the two
# float32 block scales (powers of two: exact) and added in float32. Hopper's FP8 tensor cores
# add the 32 products of a k32 step aligned to the largest and keep ~13 fraction bits
# (truncating), so a step loses <= 31 x 2^-13 max|p| <= 2^-8 sum|p|, plus <= 2^-13 of the running
# sum per step (4 steps a block); float32 promotion over K/128 blocks adds <= (K/128) 2^-24 of
# sum |a||b|. The stated bound against float64 math on the exactly decoded operands, per output
# element:
#     |out - exact| <= 2^-7 sum_k |a_k b_k| + r |exact|,  r = 2^-8 (bfloat16 out) or 2^-23 (f32).
# A block scale applied to the wrong rows, columns or k-block breaks it by orders of magnitude:
# random_matrix spreads magnitudes over 2^-8..2^8, so neighbouring blocks' scales differ and one
# block's largest product is a sizeable part of sum |a||b|.

BLOCK_1x128 = jq.Float8BlockQuantizer((1, 128))
BLOCK_128x128 = jq.Float8BlockQuantizer((128, 128))


def _decode_block64(data, scale_inv, block) -> np.ndarray:
  """Float8Block storage decoded exactly in float64 (payload x its block's scale)."""
  values = np.asarray(jnp.asarray(data, jnp.float32), np.float64)
  scale = np.asarray(scale_inv, np.float64)
  scale = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
  return values * scale[..., :values.shape[-2], :values.shape[-1]]


def _assert_block_bound(out, exact, magnitude, out_dtype, msg):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  r = 2.0**-8 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else 2.0**-23
  bound = 2.0**-7 * magnitude + r * np.abs(exact)
  err = np.abs(out - exact)
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err <= bound), (f"{msg}: |out - exact| {err[worst]:.3g} > bound "
                                f"{bound[worst]:.3g} at {worst}")


def check_block_ragged(rng, w_quantizer, tokens, k, n, groups, empty, spare, out_dtype,
                       kernel=None):
  """Ragged rows x experts with Float8Block operands on the CUTLASS kernel (`kernel`, as explain
  names it; default: the default configuration) vs float64."""
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, k)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (groups, n, k)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, empty, spare))

  def fn(x, w, sizes):
    os.environ["JAXQUANT_BACKEND"] = "reference"
    a = jg.quantize(x, sizes, BLOCK_1x128, columnwise=False).rowwise
    e = jg.quantize_experts(w, w_quantizer, columnwise=False).rowwise
    os.environ["JAXQUANT_BACKEND"] = "ffi"
    return jg.gemm(a, e, out_dtype=out_dtype), (a.data, a.scale_inv, e.data, e.scale_inv)

  assert _gemm_kernels(lambda *v: fn(*v)[0], x, w, sizes) == {kernel or SM90}
  out, (ad, asc, ed, esc) = _on("ffi", fn, x, w, sizes)
  a64 = _decode_block64(ad, asc, BLOCK_1x128.block)
  e64 = _decode_block64(ed, esc, w_quantizer.block)
  starts = np.concatenate([[0], np.cumsum(np.asarray(sizes))])  # 1x128 rowwise: packed rows
  exact, magnitude = np.zeros((tokens, n)), np.zeros((tokens, n))
  for g in range(groups):
    rows = slice(starts[g], starts[g + 1])
    exact[rows] = a64[rows] @ e64[g].T
    magnitude[rows] = np.abs(a64[rows]) @ np.abs(e64[g]).T
  _assert_block_bound(out, exact, magnitude, out_dtype, f"ragged x {w_quantizer.block}")
  assert np.all(np.asarray(out)[starts[-1]:] == 0), "rows of no group must be zero"


def check_block_wgrad(rng, tokens, m, n, groups, empty, spare, out_dtype, kernel=None):
  """Per-group wgrad (contraction over each group's tokens, 1x128 blocks along the tokens) on
  the CUTLASS kernel vs float64; the token layout pads every group to 128 positions."""
  x = jnp.asarray(oracle.random_matrix(rng, (tokens, m)), jnp.bfloat16)
  dy = jnp.asarray(oracle.random_matrix(rng, (tokens, n)), jnp.bfloat16)
  sizes = jnp.asarray(_sizes(rng, tokens, groups, empty, spare))

  def fn(x, dy, sizes):
    os.environ["JAXQUANT_BACKEND"] = "reference"
    a = jg.quantize(x, sizes, BLOCK_1x128, rowwise=False).columnwise
    b = jg.quantize(dy, sizes, BLOCK_1x128, rowwise=False).columnwise
    assert a.layout.block == 128, a.layout
    os.environ["JAXQUANT_BACKEND"] = "ffi"
    return jg.gemm(a, b, out_dtype=out_dtype), (a.data, a.scale_inv, b.data, b.scale_inv)

  auto = sm90_configs.automatic(sm90_configs.FLOAT8BLOCK_1x128_BF16 if np.dtype(out_dtype) ==
                                np.dtype(jnp.bfloat16) else "", True, n)
  expected = kernel or SM90 + sm90_configs.kernel_label(auto)
  assert _gemm_kernels(lambda *v: fn(*v)[0], x, dy, sizes) == {expected}
  out, (ad, asc, bd, bsc) = _on("ffi", fn, x, dy, sizes)
  a64 = _decode_block64(ad, asc, BLOCK_1x128.block)
  b64 = _decode_block64(bd, bsc, BLOCK_1x128.block)
  layout = jg.TokenLayout(tokens, groups, 128)
  starts = np.asarray(layout.starts(sizes))
  extents = np.asarray(layout.extents(sizes))
  exact, magnitude = np.zeros((groups, m, n)), np.zeros((groups, m, n))
  for g in range(groups):
    cols = slice(starts[g], starts[g] + extents[g])
    exact[g] = a64[:, cols] @ b64[:, cols].T
    magnitude[g] = np.abs(a64[:, cols]) @ np.abs(b64[:, cols]).T
  _assert_block_bound(out, exact, magnitude, out_dtype, "wgrad 1x128")
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert np.all(np.asarray(out)[g] == 0), f"empty group {g} must give zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("w_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_sm90_block_ragged_gemm_is_within_the_bound(on_sm90, rng, groups, w_block,
                                                        out_dtype):
  """fprop / dgrad layout: uneven and empty groups, rows of no group, N = 200 (a partial
  128-row weight tile)."""
  check_block_ragged(rng, jq.Float8BlockQuantizer(w_block), 1500 + 7 * groups, 384, 200,
                     groups, empty=tuple(range(1, groups, 4)), spare=11, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_sm90_block_wgrad_gemm_is_within_the_bound(on_sm90, rng, groups, out_dtype):
  """wgrad: groups of ~20..1500 tokens (one to twelve k-tiles), empty groups give zeros."""
  check_block_wgrad(rng, 1500 + 5 * groups, 136, 200, groups,
                    empty=tuple(range(2, groups, 5)) if groups > 1 else (), spare=7,
                    out_dtype=out_dtype)


@pytest.mark.gpu
def test_gpu_sm90_block_all_groups_empty_gives_zeros(on_sm90, rng):
  check_block_ragged(rng, BLOCK_128x128, 64, 128, 32, 3, empty=(0, 1, 2), spare=0,
                     out_dtype=jnp.float32)
  check_block_wgrad(rng, 64, 32, 24, 3, empty=(0, 1, 2), spare=0, out_dtype=jnp.float32)


# ------------------------- CUTLASS Hopper alternative configurations -------------------------
# The kernel configurations of `sm90_configs` other than the default (JAXQUANT_SM90_CONFIG,
# read when the GEMM is traced; ":rn" orders the tiles along N), each on the types it has
# instances for (bfloat16 out). Split-accumulation configurations keep the default's bounds
# above; fast accumulation (no float32 promotion inside a group's K) gets the dense FP8 GEMM's
# stated fast bound, 2 K 2^-24 + 2^-7 of max |out| (tests/test_ffi_gemm.py; 2 K 2^-24 <= 2^-12
# for these K <= 2048), plus one bfloat16 rounding (2^-8).

SM90_FP8_CONFIGS = ["c1x1", "n176", "fast", "pingpong_fast", "c2x1", "wide_fast", "default:rn"]
SM90_FP8_WGRAD_CONFIGS = SM90_FP8_CONFIGS + ["kgrouped", "kgrouped:rn"]  # wgrads only
SM90_BLOCK_CONFIGS = ["c1x1", "c2x1", "default:rn"]


def _sm90_config(monkeypatch, config: str) -> tuple[str, float]:
  """Select `config` for the GEMMs traced next; (the kernel explain names, the bound on
  |ffi - reference| / max |reference| for bfloat16 out)."""
  monkeypatch.setenv(sm90_configs.ENV, config)
  selection = sm90_configs.parse(config)
  fast = selection.config.accumulation == "fast"
  extra = 2.0**-8 + 2.0**-12 if fast else 0.0
  return SM90 + sm90_configs.kernel_label(selection), 2.0**-7 + extra


@pytest.mark.gpu
@pytest.mark.parametrize("config", SM90_FP8_CONFIGS)
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_sm90_config_ragged_gemm_matches_the_reference(on_sm90, rng, monkeypatch, config,
                                                           groups):
  """Ragged rows x experts per configuration: uneven and empty groups, rows of no group, N = 200
  (a partial tile of every tile width), K = 336 (a partial 128 k-tile)."""
  kernel, rel = _sm90_config(monkeypatch, config)
  check_ragged(rng, ("fp8", "fp8"), 1500 + 7 * groups, 336, 200, groups,
               empty=tuple(range(1, groups, 4)), spare=11, rel=rel, bias=False,
               out_dtype=jnp.bfloat16, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SM90_FP8_WGRAD_CONFIGS)
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_sm90_config_wgrad_gemm_matches_the_reference(on_sm90, rng, monkeypatch, config,
                                                          groups):
  """Per-group wgrad per configuration: empty groups give zeros, 16-aligned group starts, groups
  shorter than one k-tile."""
  kernel, rel = _sm90_config(monkeypatch, config)
  check_wgrad(rng, ("fp8", "fp8"), 1500 + 5 * groups, 136, 200, groups,
              empty=tuple(range(2, groups, 5)) if groups > 1 else (), spare=7, rel=rel,
              block=16, out_dtype=jnp.bfloat16, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_sm90_n176_e5m2_dgrad_matches_the_reference(on_sm90, rng, monkeypatch, groups):
  """The "n176" instance of E5M2 x E4M3 -> bfloat16 (the HYBRID recipes' dgrad, the automatic
  choice from N 1408): ragged, uneven and empty groups, a partial tile of 176 columns."""
  kernel, rel = _sm90_config(monkeypatch, "n176")
  check_ragged(rng, ("fp8-e5m2", "fp8"), 1500 + 7 * groups, 336, 200, groups,
               empty=tuple(range(1, groups, 4)), spare=11, rel=rel, bias=False,
               out_dtype=jnp.bfloat16, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SM90_FP8_CONFIGS)
def test_gpu_sm90_config_all_groups_empty_gives_zeros(on_sm90, rng, monkeypatch, config):
  kernel, _ = _sm90_config(monkeypatch, config)
  check_ragged(rng, ("fp8", "fp8"), 64, 64, 32, 3, empty=(0, 1, 2), spare=0, rel=0.0,
               bias=False, out_dtype=jnp.bfloat16, kernel=kernel)
  check_wgrad(rng, ("fp8", "fp8"), 64, 32, 24, 3, empty=(0, 1, 2), spare=0, rel=0.0, block=16,
              out_dtype=jnp.bfloat16, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SM90_BLOCK_CONFIGS)
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_sm90_config_block_gemms_are_within_the_bound(on_sm90, rng, monkeypatch, config,
                                                          groups):
  """Float8Block 1x128 x 1x128 per configuration, both layouts: ragged rows x experts (uneven
  and empty groups, rows of no group, N = 200) and the wgrad (groups of ~20..1500 tokens)."""
  kernel, _ = _sm90_config(monkeypatch, config)
  check_block_ragged(rng, BLOCK_1x128, 1500 + 7 * groups, 384, 200, groups,
                     empty=tuple(range(1, groups, 4)), spare=11, out_dtype=jnp.bfloat16,
                     kernel=kernel)
  check_block_wgrad(rng, 1500 + 5 * groups, 136, 200, groups,
                    empty=tuple(range(2, groups, 5)) if groups > 1 else (), spare=7,
                    out_dtype=jnp.bfloat16, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SM90_BLOCK_CONFIGS)
def test_gpu_sm90_config_block_all_groups_empty_gives_zeros(on_sm90, rng, monkeypatch, config):
  kernel, _ = _sm90_config(monkeypatch, config)
  check_block_ragged(rng, BLOCK_1x128, 64, 128, 32, 3, empty=(0, 1, 2), spare=0,
                     out_dtype=jnp.bfloat16, kernel=kernel)
  check_block_wgrad(rng, 64, 32, 24, 3, empty=(0, 1, 2), spare=0, out_dtype=jnp.bfloat16,
                    kernel=kernel)


def test_sm90_config_selection_and_its_errors(monkeypatch, rng):
  """JAXQUANT_SM90_CONFIG: parsed names and the ":rn" order, errors naming the valid names, a
  configuration without an instance for the GEMM's types is an error naming its instances (never
  a silent substitute), and the labels explain appends (device check passed so this runs
  anywhere)."""
  monkeypatch.setattr(kernels, "_sm90_device_reason", lambda: None)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  assert sm90_configs.selected() is None
  assert sm90_configs.parse("fast:rn").attributes() == {"config": 3, "raster_along_n": True}
  assert sm90_configs.parse("default").attributes() == {"config": 0, "raster_along_n": False}
  for bad in ("nope", "fast:xx", "fast:rn:rn"):
    with pytest.raises(ValueError, match="expected <name>"):
      sm90_configs.parse(bad)
  assert {c.ident for c in sm90_configs.CONFIGS.values()} == set(range(len(sm90_configs.CONFIGS)))
  sizes = jnp.asarray([100, 0, 60], jnp.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (192, 256)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (3, 64, 256)), jnp.bfloat16)
  fp8 = _abstract(lambda x: jg.quantize(x, sizes, FP8, rowwise=True, columnwise=False).rowwise, x)
  fp8_w = _abstract(lambda w: jg.quantize_experts(w, FP8, columnwise=False).rowwise, w)
  e5m2_w = _abstract(lambda w: jg.quantize_experts(w, GEMM_QUANTIZERS["fp8-e5m2"],
                                                   columnwise=False).rowwise, w)
  block, block_w = _block_operands(x, w, sizes, BLOCK_1x128, BLOCK_128x128)
  _, block_w1 = _block_operands(x, w, sizes, BLOCK_1x128, BLOCK_1x128)
  sm90 = (kernels.GEMM_SM90_TARGET, "")

  # The automatic choice (no JAXQUANT_SM90_CONFIG): the measured winners only.
  w176 = jnp.asarray(oracle.random_matrix(rng, (3, 176, 256)), jnp.bfloat16)
  fp8_w176 = _abstract(lambda w: jg.quantize_experts(w, FP8, columnwise=False).rowwise, w176)
  assert kernels.sm90_kernel_label(fp8, fp8_w, jnp.bfloat16) == ""  # N 64: the default
  assert "config n176" in kernels.sm90_kernel_label(fp8, fp8_w176, jnp.bfloat16)
  assert kernels.sm90_kernel_label(fp8, fp8_w176, jnp.float32) == ""  # no n176 f32 instance
  e5m2_w176 = _abstract(lambda w: jg.quantize_experts(w, GEMM_QUANTIZERS["fp8-e5m2"],
                                                      columnwise=False).rowwise, w176)
  assert kernels.sm90_kernel_label(fp8, e5m2_w176, jnp.bfloat16) == ""
  assert "config c1x1" in kernels.sm90_kernel_label(block.columnwise, block.columnwise,
                                                    jnp.bfloat16)
  assert kernels.sm90_kernel_label(block.columnwise, block.columnwise, jnp.float32) == ""
  assert kernels.sm90_kernel_label(block.rowwise, block_w1, jnp.bfloat16) == ""
  assert kernels.gemm_kernel(fp8, fp8_w176, jnp.bfloat16) == sm90
  # a per-tensor FP8 wgrad of small groups takes the k-grouped kernel, E5M2 dy and float32 out
  # included; a Float8Block one does not, nor large groups
  dy = jnp.asarray(oracle.random_matrix(rng, (192, 64)), jnp.bfloat16)
  cols = lambda v, q: _abstract(  # noqa: E731
      lambda v: jg.quantize(v, sizes, q, rowwise=False, columnwise=True, col_block=16).columnwise,
      v)
  x_t, dy_t = cols(x, FP8), cols(dy, FP8)
  dy_t5 = cols(dy, GEMM_QUANTIZERS["fp8-e5m2"])
  for b_t, out in ((dy_t, jnp.bfloat16), (dy_t5, jnp.bfloat16), (dy_t5, jnp.float32)):
    assert "config kgrouped" in kernels.sm90_kernel_label(x_t, b_t, out)
  assert "kgrouped" not in kernels.sm90_kernel_label(block.columnwise, block.columnwise,
                                                     jnp.bfloat16)
  assert sm90_configs.automatic(sm90_configs.PER_TENSOR_E4M3_BF16, True, 1408, 2048,
                                tokens_per_group=2048.0, kgrouped=True).config.name == "c2x1"
  assert sm90_configs.kgrouped_reason(fp8, fp8_w, False) == "not a wgrad (mode 1)"

  monkeypatch.setenv(sm90_configs.ENV, "kgrouped")
  assert kernels.gemm_kernel(x_t, dy_t5, jnp.float32) == sm90
  with pytest.raises(ValueError, match="'kgrouped' serves per-tensor FP8 wgrads .* not not a "
                                       "wgrad"):
    kernels.gemm_kernel(fp8, fp8_w, jnp.bfloat16)
  with pytest.raises(ValueError, match="not Float8Block operands"):
    kernels.gemm_kernel(block.columnwise, block.columnwise, jnp.bfloat16)

  monkeypatch.setenv(sm90_configs.ENV, "fast")
  assert kernels.gemm_kernel(fp8, fp8_w, jnp.bfloat16) == sm90
  assert "fast accumulation" in kernels.sm90_kernel_label(fp8, fp8_w, jnp.bfloat16)
  with pytest.raises(ValueError, match="'fast' has instances for .* not per-tensor FP8 "
                                       "float8_e4m3fn x float8_e5m2 -> bfloat16"):
    kernels.gemm_kernel(fp8, e5m2_w, jnp.bfloat16)
  with pytest.raises(ValueError, match="-> float32"):
    kernels.gemm_kernel(fp8, fp8_w, jnp.float32)
  with pytest.raises(ValueError, match="not Float8Block"):
    kernels.gemm_kernel(block.rowwise, block_w1, jnp.bfloat16)

  monkeypatch.setenv(sm90_configs.ENV, "c2x1")
  assert kernels.gemm_kernel(block.rowwise, block_w1, jnp.bfloat16) == sm90
  assert kernels.gemm_kernel(block.columnwise, block.columnwise, jnp.bfloat16) == sm90
  with pytest.raises(ValueError, match=r"\(1, 128\) x \(128, 128\)"):
    kernels.gemm_kernel(block.rowwise, block_w, jnp.bfloat16)
  assert kernels.gemm_kernel(fp8, fp8_w, jnp.bfloat16) == sm90  # E4M3 x E4M3 -> bf16 too
  with pytest.raises(ValueError, match="not per-tensor FP8 float8_e4m3fn x float8_e5m2"):
    kernels.gemm_kernel(fp8, e5m2_w, jnp.bfloat16)

  monkeypatch.setenv(sm90_configs.ENV, "default:rn")  # the default instances serve every type
  assert kernels.gemm_kernel(fp8, e5m2_w, jnp.float32) == sm90
  assert kernels.gemm_kernel(block.rowwise, block_w, jnp.float32) == sm90
  assert "tiles ordered along N" in kernels.sm90_kernel_label(fp8, e5m2_w, jnp.float32)


def _abstract(fn, *args):
  """`fn(*args)`'s storages, shapes and dtypes only: the kernel choice reads no values (quantized
  eagerly, op by op, these two tests took ~20 CPU-s)."""
  return jax.eval_shape(fn, *args)


def _block_operands(x, w, sizes, qa, qw):
  """Quantized operands (under the caller's backend), abstract: tokens (both copies), expert
  rowwise."""
  return _abstract(lambda x, w: (jg.quantize(x, sizes, qa),
                                 jg.quantize_experts(w, qw, columnwise=False).rowwise), x, w)


def test_sm90_routing_of_float8_block_pairs(monkeypatch, rng):
  """Which Float8Block pairs the CUTLASS kernel takes and why not (`sm90_unsupported`, with the
  device check passed so this runs anywhere): 1x128 x 128x128 / 1x128 with K a multiple of 128
  and a 128-token wgrad layout; else the mma.sync kernel with the reason."""
  monkeypatch.setattr(kernels, "_sm90_device_reason", lambda: None)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  sizes = jnp.asarray([100, 0, 60], jnp.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (192, 256)), jnp.bfloat16)
  w = jnp.asarray(oracle.random_matrix(rng, (3, 64, 256)), jnp.bfloat16)
  a, e = _block_operands(x, w, sizes, BLOCK_1x128, BLOCK_128x128)
  assert kernels.sm90_unsupported(a.rowwise, e, jnp.bfloat16) is None
  assert kernels.sm90_unsupported(a.columnwise, a.columnwise, jnp.float32) is None
  assert kernels.sm90_block_scale_floats(a.rowwise, e) == 192 * 2 + 3 * 1 * 2
  assert kernels.sm90_block_scale_floats(a.columnwise, a.columnwise) == \
      (256 + 256) * a.columnwise.shape[1] // 128
  assert "bias" in kernels.sm90_unsupported(a.rowwise, e, jnp.bfloat16, jnp.ones((3, 64)))
  _, e1 = _block_operands(x, w, sizes, BLOCK_1x128, BLOCK_1x128)
  assert kernels.sm90_unsupported(a.rowwise, e1, jnp.float32) is None
  a2, _ = _block_operands(x, w, sizes, BLOCK_128x128, BLOCK_128x128)
  assert "1, 128" in kernels.sm90_unsupported(a2.rowwise, e, jnp.float32)
  a_short, e_short = _block_operands(x[:, :192], w[:, :, :192], sizes, BLOCK_1x128,
                                     BLOCK_128x128)
  assert "not a multiple of 128" in kernels.sm90_unsupported(a_short.rowwise, e_short)
  e5m2 = jq.Float8BlockQuantizer((1, 128), dtype=jnp.float8_e5m2)
  a5, _ = _block_operands(x, w, sizes, e5m2, BLOCK_128x128)
  assert "E4M3 x E4M3" in kernels.sm90_unsupported(a5.rowwise, e)
  fp8_w = _block_operands(x, w, sizes, BLOCK_1x128, FP8)[1]
  assert "Float8Block" in kernels.sm90_unsupported(a.rowwise, fp8_w)


def test_explain_names_the_grouped_gemm_kernel(monkeypatch):
  """Every FFI grouped GEMM decision names its kernel; off Hopper (here: CPU) the mma.sync
  kernel, with why not the CUTLASS one."""
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  if kernels._sm90_device_reason() is None:
    pytest.skip("this device runs the CUTLASS kernel (see the gpu tests)")

  def f(x, sizes):
    a = jg.quantize(x, sizes, FP8, columnwise=False).rowwise
    b = jg.quantize_experts(jnp.ones((2, 8, 32)), FP8, columnwise=False)
    return jg.gemm(a, b.rowwise)

  report = jq.explain(f, jax.ShapeDtypeStruct((64, 32), jnp.float32),
                      jax.ShapeDtypeStruct((2,), jnp.int32))
  gemms = [d for d in report if d.op == "grouped_gemm"]
  assert gemms and all(d.detail.endswith("kernel: mma.sync") for d in gemms)
  assert all(d.reason.startswith("mma.sync grouped kernel: ") for d in gemms)


# ------------------------ weights quantized as stored: Hybrid halves swapped -------------------

@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_hybrid_of_swappable_halves_quantizes_the_weights_as_stored(rng, backend):
  """Hybrid(A, B) of W^T is Hybrid(B, A) of W with its copies swapped when each half's copies
  swap and nothing ties the halves: bit for bit, so GroupedDense quantizes the stored kernel
  [G, K, N] instead of an XLA transpose of it. A Hybrid with a dequantized columnwise source, a
  stateful or stochastic half has no such quantizer."""
  q = jq.HybridQuantizer(rowwise=jq.NVFP4Quantizer(), columnwise=jq.MXFP8Quantizer())
  swapped = jq.formats.format_of(q).transposed_quantizer(q)
  assert swapped == jq.HybridQuantizer(rowwise=jq.MXFP8Quantizer(),
                                       columnwise=jq.NVFP4Quantizer())
  w = jnp.asarray(oracle.random_matrix(rng, (3, 64, 96)), jnp.bfloat16)  # [G, K, N]
  want = _on(backend, lambda w: jg.quantize_experts(jnp.swapaxes(w, 1, 2), q), w)
  got = _on(backend, lambda w: jg.quantize_experts(w, swapped), w)
  assert_same_leaves(got.rowwise, want.columnwise, "rowwise of the swapped hybrid")
  assert_same_leaves(got.columnwise, want.rowwise, "columnwise of the swapped hybrid")
  for tied in (jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.MXFP8Quantizer(),
                                  columnwise_source="rowwise_dequantized"),
               jq.HybridQuantizer(jq.Float8DelayedScalingQuantizer(),
                                  jq.Float8CurrentScalingQuantizer()),
               jq.HybridQuantizer(jq.MXFP8Quantizer(),
                                  jq.NVFP4Quantizer(stochastic_rounding=True))):
    assert jq.formats.format_of(tied).transposed_quantizer(tied) is None, tied


def test_grouped_dense_hybrid_weights_need_no_transpose(rng, monkeypatch):
  """The MoE hybrid recipe's GroupedDense step quantizes the stored kernel (no transpose of it
  in the lowered step) and gives bit for bit the step that quantizes the transposed kernel."""
  step, args = _grouped_step(ZOO_RECIPES["moe_nvfp4_fwd_mxfp8_bwd"](), 4, 96, 64, 96, rng)
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  kernel_shape = args[0]["params"]["kernel"].shape
  hlo = jax.jit(lambda *a: step(*a)).lower(*args).as_text()  # fresh traces: no jit cache
  transposes = [line for line in hlo.splitlines() if "stablehlo.transpose" in line
                and "x".join(map(str, kernel_shape)) + "xbf16>" in line.split("->")[0]]
  as_stored = jax.jit(lambda *a: step(*a))(*args)
  monkeypatch.setattr(jq.formats.hybrid.HybridFormat, "transposed_quantizer",
                      lambda self, q: None)
  hlo_before = jax.jit(lambda *a: step(*a)).lower(*args).as_text()
  transposed = jax.jit(lambda *a: step(*a))(*args)
  before = [line for line in hlo_before.splitlines() if "stablehlo.transpose" in line
            and "x".join(map(str, kernel_shape)) + "xbf16>" in line.split("->")[0]]
  assert not transposes and before, (transposes, before)
  for u, v in zip(jax.tree_util.tree_leaves(as_stored), jax.tree_util.tree_leaves(transposed)):
    assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


@pytest.mark.parametrize("name, rowwise", [("mxfp8", False), ("fp8-block-1x128", False),
                                           ("fp8-block-128x128", True)])
def test_block_formats_read_their_token_layout_through_the_offsets(monkeypatch, name, rowwise):
  """A padded token layout of MXFP8 / Float8Block is quantized by the grouped twin of the
  single-tensor target, which reads x's rows through the group offsets: the lowered program
  has no single-tensor call on an XLA-gathered copy (bit-exactness: the tests above)."""
  q = TOKEN_QUANTIZERS[name] if name in TOKEN_QUANTIZERS else jq.Float8BlockQuantizer((128, 128))
  x = jnp.zeros((300, 256), jnp.bfloat16)
  sizes = jnp.asarray([100, 0, 150], jnp.int32)
  fn = lambda x, sizes: jg.quantize(x, sizes, q, rowwise=rowwise, columnwise=not rowwise,
                                    row_block=128 if rowwise else None)
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  hlo = jax.jit(fn).lower(x, sizes).as_text()
  fmt = "mxfp8" if name == "mxfp8" else "fp8_block"
  assert f"jaxquant_grouped_quantize_{fmt}" in hlo and f"jaxquant_quantize_{fmt}" not in hlo


def test_sm90_forward_takes_fast_accumulation_as_the_dense_forward(monkeypatch, rng):
  """A grouped GEMM's FP8 accumulation follows the dense FP8 GEMM's per-direction convention
  (`fp8_accumulation`: fast for fprop, split for dgrad and wgrad): the forward of per-tensor
  E4M3 operands takes a fast configuration ("wide_fast" where N is a multiple of 256, else
  "pingpong_fast"), the same GEMM labelled dgrad keeps the split one, and
  JAXQUANT_FP8_ACCUMULATION=split or FAST_FORWARD off bring the split choice back (lowered
  only: the device check is patched)."""
  monkeypatch.setattr(kernels, "_sm90_device_reason", lambda: None)
  monkeypatch.delenv(sm90_configs.ENV, raising=False)
  monkeypatch.delenv("JAXQUANT_FP8_ACCUMULATION", raising=False)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  sizes = jnp.asarray([100, 0, 60], jnp.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (192, 256)), jnp.bfloat16)
  w256 = jnp.asarray(oracle.random_matrix(rng, (3, 256, 256)), jnp.bfloat16)
  w176 = jnp.asarray(oracle.random_matrix(rng, (3, 176, 256)), jnp.bfloat16)
  fp8 = jg.quantize(x, sizes, FP8, rowwise=True, columnwise=False).rowwise
  fp8_w256 = jg.quantize_experts(w256, FP8, columnwise=False).rowwise
  fp8_w176 = jg.quantize_experts(w176, FP8, columnwise=False).rowwise
  e5m2_w = jg.quantize_experts(w256, GEMM_QUANTIZERS["fp8-e5m2"], columnwise=False).rowwise

  # the rule, on the abstract operands
  def label(b, out=jnp.bfloat16, acc="fast"):
    return kernels.sm90_kernel_label(fp8, b, out, acc)

  assert "config wide_fast" in label(fp8_w256) and "fast accumulation" in label(fp8_w256)
  assert "config pingpong_fast:" in label(fp8_w176)  # 176 columns: no whole 256-wide tile
  assert label(fp8_w176, acc="split") == " [config n176: 128x176x128 tiles, cluster 1x1, " \
                                         "cooperative, split accumulation]"
  assert label(e5m2_w) == ""  # no fast instance for E5M2 experts: the default, split
  assert label(fp8_w256, jnp.float32) == ""
  # split ragged GEMMs of E4M3 or E5M2 (the HYBRID dgrad's gradients) x E4M3 take "n176" at N a
  # multiple of 176 or >= N176_MIN_N
  dy5 = jg.quantize(x, sizes, GEMM_QUANTIZERS["fp8-e5m2"], rowwise=True, columnwise=False).rowwise
  w1408 = _abstract(lambda w: jg.quantize_experts(w, FP8, columnwise=False).rowwise,
                    jax.ShapeDtypeStruct((3, sm90_configs.N176_MIN_N, 256), jnp.bfloat16))
  for a in (fp8, dy5):
    assert "config n176" in kernels.sm90_kernel_label(a, fp8_w176, jnp.bfloat16, "split")
    assert "config n176" in kernels.sm90_kernel_label(a, w1408, jnp.bfloat16, "split")
    assert kernels.sm90_kernel_label(a, fp8_w256, jnp.bfloat16, "split") == ""  # N 256
  assert "config n176" in kernels.sm90_kernel_label(dy5, fp8_w176, jnp.bfloat16, "fast")
  assert kernels.sm90_kernel_label(dy5, fp8_w176, jnp.float32, "split") == ""
  assert sm90_configs.fast_forward(14336) == "wide_fast"
  assert sm90_configs.fast_forward(1408) == "pingpong_fast"

  # what the ops-level GEMM passes for each direction (its role label's last component)
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")

  def config_of(role):
    fn = lambda a, b: jg.gemm(a, b, out_dtype=jnp.bfloat16, role=role)  # noqa: E731
    text = jax.jit(fn).lower(fp8, fp8_w256).as_text()
    found = [int(v) for v in __import__("re").findall(r"config = (\d+) : i32", text)]
    assert len(found) == 1, text[-2000:]
    return found[0]

  wide = sm90_configs.CONFIGS["wide_fast"].ident
  assert config_of("moe/fc1/fprop") == wide
  assert config_of("moe/fc1/dgrad") == sm90_configs.DEFAULT.ident
  monkeypatch.setenv("JAXQUANT_FP8_ACCUMULATION", "split")
  assert config_of("moe/fc1/fprop") == sm90_configs.DEFAULT.ident
  monkeypatch.delenv("JAXQUANT_FP8_ACCUMULATION")
  monkeypatch.setattr(sm90_configs, "FAST_FORWARD", False)
  assert config_of("moe/fc1/fprop") == sm90_configs.DEFAULT.ident
