"""Grouped FP8 delayed scaling without an amax pass (the grouped FFI kernels).

Under delayed scaling `jaxquant_grouped_quantize_fp8` takes its scales from the state and
reduces each group's amax (the history entry it records) from the values its quantize launch
loads; the just-in-time first scale reads the amax from `jaxquant_grouped_amax_gated`, which
gives zeros without reading x when every group already has a scale. Checked here: the recorded
amax and every quantized byte equal the reference (`JAXQUANT_BACKEND=reference`) and an
independent numpy amax, with ragged, empty and tiny groups, rows of no group, NaN / inf inputs,
every copy and layout; and the gated amax's two answers. The CPU handlers run in CI; the CUDA
kernels under `-m gpu` (larger shapes, G = 1 / 8 / 64).
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.grouped as jg
import oracle
from helpers import assert_same_leaves
from jaxquant.backends.ffi import calls
from jaxquant.backends.ffi.grouped import support as kernels

pytestmark = pytest.mark.skipif(
    kernels.AMAX_GATED_TARGET not in kernels._targets("cpu") | kernels._targets("cuda"),
    reason="jaxquant FFI extension without jaxquant_grouped_amax_gated")

DELAYED = {"e4m3": jq.Float8DelayedScalingQuantizer(amax_history_len=4),
           "e5m2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=4)}
FFI_PATH = "ffi-cuda" if jax.default_backend() == "gpu" else "ffi-cpu"


@contextlib.contextmanager
def _backend(name: str):
  old = os.environ.get("JAXQUANT_BACKEND")
  os.environ["JAXQUANT_BACKEND"] = name
  try:
    yield
  finally:
    if old is None:
      del os.environ["JAXQUANT_BACKEND"]
    else:
      os.environ["JAXQUANT_BACKEND"] = old


def _on(backend: str, fn, *args):
  with _backend(backend):
    return jax.jit(lambda *a: fn(*a))(*args)  # a fresh function: no trace shared across backends


def _sizes(rng, tokens: int, groups: int, spare: int) -> np.ndarray:
  """Ragged sizes summing to `tokens - spare`: the first group and about a quarter of the others
  empty, about a tenth of one token (a warp of the quantize kernel, 8 positions, then holds rows
  of several groups)."""
  total = tokens - spare
  if groups == 1:
    return np.array([total], np.int32)
  weights = rng.uniform(0.2, 1.0, groups) * (rng.uniform(size=groups) > 0.35)
  weights[0] = 0.0
  if not weights.any():
    weights[-1] = 1.0
  one = (weights == 0) & (rng.uniform(size=groups) < 0.3)
  one[0] = False
  sizes = np.floor(weights / weights.sum() * (total - one.sum())).astype(np.int32)
  sizes[one] = 1
  sizes[np.argmax(weights)] += total - sizes.sum()
  return sizes


def _tokens(rng, tokens: int, features: int, dtype, specials: bool) -> np.ndarray:
  """Random float32 values spread over many binades (as `dtype` would hold them); with
  `specials`, a few NaN, +-inf and -0 scattered over all rows (rows of no group included)."""
  x = oracle.random_matrix(rng, (tokens, features), np.float32)
  if specials:
    for value in (np.nan, np.inf, -np.inf, -0.0):
      count = max(1, tokens * features // 2000)
      x.reshape(-1)[rng.integers(0, x.size, count)] = value
  return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def _assert_same_quantized(got, want, msg: str) -> None:
  """Every leaf bit for bit, except that a NaN amax may carry any NaN bits: XLA:GPU's max
  reduction (the reference on a GPU) returns 0x7FFFFFFF where the kernels and numpy keep the
  input's NaN; the FP8 bytes and scales are still compared by bits."""
  canonical = lambda leaf: (np.where(np.isnan(leaf), np.float32(np.nan), leaf)
                            if np.asarray(leaf).dtype == np.float32 else leaf)
  assert_same_leaves(jax.tree.map(lambda leaf: canonical(np.asarray(leaf)), got),
                     jax.tree.map(lambda leaf: canonical(np.asarray(leaf)), want), msg)


def _amax_oracle(x: np.ndarray, sizes: np.ndarray) -> np.ndarray:
  """Each group's max |x| as float32 bit patterns (NaN above inf), 0 for an empty group."""
  bits = np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
  ends = np.cumsum(sizes)
  out = np.zeros(len(sizes), np.uint32)
  for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
    if hi > lo:
      out[g] = bits[lo:hi].max()
  return out


def _state(rng, quantizer, groups: int, fresh: str):
  """Random stored scales; `fresh` = "none" (every group has one), "some" (every third group
  has none yet: scale 0) or "all"."""
  state = jg.init_state(quantizer, groups)
  scale = rng.uniform(0.5, 40.0, groups).astype(np.float32)
  if fresh == "some":
    scale[::3] = 0.0
  elif fresh == "all":
    scale[:] = 0.0
  history = rng.uniform(0.0, 8.0, state.amax_history.shape).astype(np.float32)
  return jq.DelayedScalingState(jnp.asarray(scale), jnp.asarray(history))


def _check_tokens(rng, name: str, tokens: int, features: int, groups: int, dtype, fresh: str,
                  specials: bool, spare: int, **copies):
  q = DELAYED[name]
  xf = _tokens(rng, tokens, features, dtype, specials)
  x = jnp.asarray(xf, dtype)
  sizes = _sizes(rng, tokens, groups, spare)
  state = _state(rng, q, groups, fresh)
  fn = lambda x, sizes, state: jg.quantize(x, sizes, q, state=state, **copies)
  with _backend("ffi"):
    report = jq.explain(fn, x, jnp.asarray(sizes), state)
  assert report.paths() == {FFI_PATH}, str(report)
  got = _on("ffi", fn, x, jnp.asarray(sizes), state)
  want = _on("reference", fn, x, jnp.asarray(sizes), state)
  _assert_same_quantized(got, want, f"{name} G={groups} {np.dtype(dtype).name} {copies}")
  amax = _amax_oracle(xf, sizes)
  for copy in (got.rowwise, got.columnwise):
    if copy is not None:
      np.testing.assert_array_equal(np.asarray(copy.amax).view(np.uint32), amax)


def _check_experts(rng, name: str, groups: int, rows: int, cols: int, dtype, fresh: str,
                   **copies):
  q = DELAYED[name]
  wf = _tokens(rng, groups * rows, cols, dtype, specials=True)
  w = jnp.asarray(wf.reshape(groups, rows, cols), dtype)
  state = _state(rng, q, groups, fresh)
  fn = lambda w, state: jg.quantize_experts(w, q, state=state, **copies)
  got = _on("ffi", fn, w, state)
  _assert_same_quantized(got, _on("reference", fn, w, state), f"experts G={groups} {copies}")
  amax = _amax_oracle(wf, np.full(groups, rows))
  for copy in (got.rowwise, got.columnwise):
    if copy is not None:
      np.testing.assert_array_equal(np.asarray(copy.amax).view(np.uint32), amax)


def _gated(x, starts, gate):
  return calls.call(kernels.AMAX_GATED_TARGET,
                    [jax.ShapeDtypeStruct((gate.shape[0],), np.float32)], x, starts, gate)[0]


def _check_gated(rng, tokens: int, features: int, groups: int, dtype):
  xf = _tokens(rng, tokens, features, dtype, specials=True)
  sizes = _sizes(rng, tokens, groups, spare=5)
  starts = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
  x = jnp.asarray(xf, dtype)
  gated = jax.jit(_gated)
  scales = rng.uniform(0.5, 40.0, groups).astype(np.float32)
  scales[rng.integers(0, groups)] = -scales[0]  # any nonzero scale closes the gate
  closed = np.asarray(gated(x, starts, jnp.asarray(scales)))
  np.testing.assert_array_equal(closed.view(np.uint32), np.zeros(groups, np.uint32))
  amax = _amax_oracle(xf, sizes)
  for zero in (0.0, -0.0):
    for g in sorted({0, groups - 1, int(rng.integers(0, groups))}):
      gate = scales.copy()
      gate[g] = zero  # one group without a scale: every group's amax, exactly
      opened = np.asarray(gated(x, starts, jnp.asarray(gate)))
      np.testing.assert_array_equal(opened.view(np.uint32), amax, f"gate[{g}] = {zero}")
  plain = jax.jit(lambda x, s: calls.call(kernels.AMAX_TARGET, [
      jax.ShapeDtypeStruct((groups,), np.float32)], x, s)[0])(x, starts)
  np.testing.assert_array_equal(np.asarray(plain).view(np.uint32), amax)


# ------------------------------------ CPU (CI) and any backend --------------------------------

# The input dtype (the handler's loads) and fresh groups (the gate) are independent: each value
# once, in two cases (all four pairs took ~9 CPU-s more; the GPU test below takes both dtypes).
@pytest.mark.parametrize("dtype,fresh", [(jnp.bfloat16, "none"), (jnp.float32, "some")])
def test_delayed_grouped_quantize_records_the_reference_amax(rng, dtype, fresh):
  for groups in (1, 5):
    _check_tokens(rng, "e4m3", 90, 40, groups, dtype, fresh, specials=True, spare=6)
  _check_tokens(rng, "e5m2", 90, 40, 5, dtype, fresh, specials=False, spare=0,
                columnwise=False)
  _check_tokens(rng, "e4m3", 90, 40, 5, dtype, fresh, specials=True, spare=3,
                rowwise=False, col_block=32)
  _check_experts(rng, "e4m3", 3, 24, 16, dtype, fresh)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_amax_gated_is_zero_or_the_exact_amax(rng, dtype):
  _check_gated(rng, 70, 24, 6, dtype)


def test_delayed_grouped_quantize_runs_no_amax_pass():
  """The program of a delayed grouped quantize calls the gated amax (first_scale="current")
  or no amax target at all (first_scale="one"), never the plain amax pass; `explain` says
  which launches run."""
  x = jnp.zeros((64, 32), jnp.bfloat16)
  sizes = jnp.asarray([20, 0, 30], jnp.int32)
  for first_scale, gated in (("current", True), ("one", False)):
    q = jq.Float8DelayedScalingQuantizer(first_scale=first_scale)
    state = jg.init_state(q, 3)
    fn = lambda x, s, st: jg.quantize(x, s, q, state=st)
    with _backend("ffi"):
      hlo = jax.jit(fn).lower(x, sizes, state).as_text()
      report = jq.explain(fn, x, sizes, state)
    targets = set(re.findall(r"custom_call @(\w+)\(", hlo))
    want = {kernels.QUANTIZE_FP8_TARGET} | ({kernels.AMAX_GATED_TARGET} if gated else set())
    assert targets == want, (first_scale, targets)
    details = [d.detail for d in report if d.op == "grouped_quantize"]
    assert details and all("no amax pass" in d for d in details), details
    assert all((kernels.AMAX_GATED_TARGET in d) == gated for d in details), details
  with _backend("ffi"):
    report = jq.explain(lambda x, s: jg.quantize(x, s, jq.Float8CurrentScalingQuantizer()),
                        x, sizes)
  details = [d.detail for d in report if d.op == "grouped_quantize"]
  assert details and all("an amax pass, then" in d for d in details), details


def _check_boundaries(rng, groups: int, dtype, descending: bool):
  """Tiny ragged groups (0..13 rows: the quantize kernel's 8-position warps and 64-position
  tiles hold rows of several groups) whose magnitudes step by 2 binades a group, so any value
  of one group counted in another's amax changes that amax. Both orders: a leak from the
  tile's first group into later ones shows with descending magnitudes, the reverse with
  ascending ones."""
  sizes = rng.integers(0, 14, groups).astype(np.int32)
  sizes[rng.integers(0, groups)] = 1
  spare = 7
  tokens = int(sizes.sum()) + spare
  step = np.arange(groups + 1, dtype=np.float64)  # group g's binade; rows of no group: g = G
  binade = 2.0 * (groups - step if descending else step) - groups
  row_binade = np.repeat(binade, np.append(sizes, spare))
  xf = rng.uniform(1.0, 2.0, (tokens, 72)) * rng.choice([-1.0, 1.0], (tokens, 72))
  xf = np.asarray(jnp.asarray(xf * np.exp2(row_binade)[:, None], dtype).astype(jnp.float32))
  x = jnp.asarray(xf, dtype)
  amax = _amax_oracle(xf, sizes)
  q = DELAYED["e4m3"]
  state = _state(rng, q, groups, "some")
  for copies in ({}, {"rowwise": False, "col_block": 32}):
    fn = lambda x, sizes, state: jg.quantize(x, sizes, q, state=state, **copies)
    got = _on("ffi", fn, x, jnp.asarray(sizes), state)
    _assert_same_quantized(got, _on("reference", fn, x, jnp.asarray(sizes), state),
                           f"G={groups} descending={descending} {copies}")
    for copy in (got.rowwise, got.columnwise):
      if copy is not None:
        np.testing.assert_array_equal(np.asarray(copy.amax).view(np.uint32), amax,
                                      f"G={groups} descending={descending} {copies}")


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_delayed_grouped_amax_keeps_groups_sharing_a_warp_apart(rng, dtype, descending):
  """Each group's recorded amax counts its own rows only where groups share a warp and a tile
  of the quantize kernel (on GPU: the CTA-reduced first group and the warp-reduced later ones)."""
  if jax.default_backend() == "cpu" and (dtype == jnp.bfloat16) != descending:
    # The CPU handler takes each order and each input dtype once (all four pairs took ~10
    # CPU-s more): the order shows a leak either way through one group lookup for both dtypes.
    pytest.skip("on the CPU: bfloat16 descending and float32 ascending")
  for groups in (8, 64):
    _check_boundaries(rng, groups, dtype, descending)


# --------------------------------------------- GPU --------------------------------------------

@pytest.fixture
def on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the default JAX backend is not gpu)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_delayed_grouped_quantize_records_the_reference_amax(on_gpu, rng, groups, dtype):
  """The quantize kernel's own amax (warp-reduced atomics; a warp's 8 positions straddling
  groups when groups are tiny) and bytes: both copies in one call, each copy alone (the load
  phase runs for a columnwise-only call too), a padded layout, 200 features (a partial
  feature tile, scalar loads), every scale stored or some not yet; expert weights."""
  tokens = 1500 + 7 * groups
  for fresh in ("none", "some"):
    _check_tokens(rng, "e4m3", tokens, 256, groups, dtype, fresh, specials=True, spare=11)
  _check_tokens(rng, "e5m2", tokens, 200, groups, dtype, "none", specials=True, spare=0,
                columnwise=False)
  _check_tokens(rng, "e4m3", tokens, 192, groups, dtype, "some", specials=False, spare=5,
                rowwise=False, col_block=32)
  _check_tokens(rng, "e4m3", tokens, 136, groups, dtype, "all", specials=True, spare=5,
                row_block=16, col_block=16)
  for rows in (40, 128):
    _check_experts(rng, "e4m3", groups, rows, 200, dtype, "some")
  _check_experts(rng, "e5m2", groups, 64, 256, dtype, "none", rowwise=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_gpu_grouped_amax_gated_is_zero_or_the_exact_amax(on_gpu, rng, groups, dtype):
  _check_gated(rng, 1200 + 3 * groups, 264, groups, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tokens,features,groups", [(4000, 1408, 64), (600, 36000, 8),
                                                    (3001, 1412, 16), (5000, 8, 3)])
def test_gpu_grouped_amax_spans_inside_and_across_groups(on_gpu, rng, tokens, features, groups,
                                                         dtype):
  """The span kernel (features a multiple of 8): ~64 KB spans of whole rows read flat inside
  one group and a row a warp across a group start (groups of ~60 rows; 8-feature rows whose
  4096-row spans hold whole groups), rows longer than a span; 1412 features take the warp-a-row
  kernel. Plain and gated amaxes are numpy's, bit for bit (NaN, inf, rows of no group)."""
  _check_gated(rng, tokens, features, groups, dtype)
