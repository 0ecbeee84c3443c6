"""Grouped ops (`jaxquant.grouped`): every group is quantized exactly as it would be alone, the
ragged GEMMs equal per-group GEMMs, and shapes stay static while `group_sizes` is traced.

Groups are uneven and include empty ones; the reference for group `g` is `jaxquant.ops.quantize`
of its rows zero-padded to the copy's token block (`GroupedScaledTensor.group(g)` covers that
extent), with the group's own key and state.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.grouped as jg
from jaxquant.grouping.tensors import row_scaled, scale_blocks
import oracle
from helpers import assert_same_leaves

# Under JAXQUANT_BACKEND=ffi a case without a grouped kernel is an error by design (never a silent
# fallback); those cases are expected to raise that RuntimeError, every other case must pass.
pytestmark = [pytest.mark.usefixtures("core_backend"),
              pytest.mark.xfail(os.environ.get("JAXQUANT_BACKEND") == "ffi", raises=RuntimeError,
                                strict=False,
                                reason="no grouped kernel for this case (ffi forced)")]

T, C, G = 96, 48, 5
FP8 = jq.Float8CurrentScalingQuantizer()
QUANTIZERS = {
    "fp8-current": FP8,
    "fp8-delayed-e5m2": jq.Float8DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=4),
    "mxfp8": jq.MXFP8Quantizer(),
    "fp8-block-128x128": jq.Float8BlockQuantizer((128, 128)),
    "nvfp4-2d": jq.NVFP4Quantizer(block_2d=True),
    "nvfp4-rht-sr": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True),
    "identity": jq.IdentityQuantizer(),
    # Row-scaled NVFP4 as this Hybrid's rowwise half; its stochastic rounding (a per-group key,
    # as nvfp4-rht-sr's) was a case of its own (~20 CPU-s, the slowest here).
    "hybrid-moe-input": jq.HybridQuantizer(jq.NVFP4Quantizer(row_scaled=True),
                                           jq.MXFP8Quantizer()),
    "hybrid-from-rowwise": jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.NVFP4Quantizer(
        rht=True, stochastic_rounding=True), columnwise_source="rowwise_dequantized"),
}


def _sizes(rng, tokens=T, groups=G, empty=(1,)):
  """Uneven random sizes summing to `tokens`, with the groups in `empty` empty."""
  weights = rng.uniform(0.2, 1.0, groups)
  weights[list(empty)] = 0.0
  sizes = np.floor(weights / weights.sum() * tokens).astype(np.int32)
  sizes[np.argmax(sizes)] += tokens - sizes.sum()
  return sizes


def _starts(sizes):
  return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)


def _group_keys(key, groups=G):
  return jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(groups))


def _random_state(rng, quantizer, groups=G):
  state = jg.init_state(quantizer, groups)
  if state is None:
    return None
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.uniform(0.5, 40.0, a.shape), jnp.float32), state)


@functools.partial(jax.jit, static_argnames=("quantizer",))
def _grouped(x, sizes, quantizer, keys, state):
  return jg.quantize(x, sizes, quantizer, keys=keys, state=state)


@functools.partial(jax.jit, static_argnames=("quantizer", "rowwise", "columnwise"))
def _single(x, quantizer, key, state, rowwise, columnwise):
  return jq.ops.quantize(x, quantizer, rowwise=rowwise, columnwise=columnwise, key=key,
                         state=state)


def _padded_rows(x, start, size, extent):
  return jnp.zeros((extent, x.shape[1]), x.dtype).at[:size].set(x[start:start + size])


@functools.partial(jax.jit, static_argnames=("quantizer", "groups"))
def _grouped_and_alone(x, sizes, quantizer, keys, state, groups):
  """Grouped quantization with traced `sizes`, and per direction every non-empty group
  quantized alone by `ops.quantize` (`groups` holds the same sizes, static). Each group alone
  is zero-padded to the longest extent and the groups run under one `vmap`, so the whole check
  is one compilation per quantizer."""
  qt = jg.quantize(x, sizes, quantizer, keys=keys, state=state)
  nonempty = [g for g, n in enumerate(groups) if n]
  starts = _starts(groups)
  alone = {}
  for direction in ("rowwise", "columnwise"):
    extent = max(e for _, e in getattr(qt, direction).layout.group_slices(groups))
    xs = jnp.stack([_padded_rows(x, starts[g], groups[g], extent) for g in nonempty])
    pick = lambda tree: jax.tree_util.tree_map(lambda a: a[jnp.asarray(nonempty)], tree)
    one = lambda xg, key, st, d=direction: getattr(jq.ops.quantize(
        xg, quantizer, rowwise=d == "rowwise", columnwise=d == "columnwise", key=key,
        state=st), d)
    alone[direction] = jax.vmap(one)(xs, pick(keys), pick(state))
  return qt, alone


def _cut(stored: jq.ScaledTensor, extent: int, direction: str) -> jq.ScaledTensor:
  """A group quantized alone at the longest extent, cut to its own extent (zero padding past
  it is all the difference)."""
  axis = 0 if direction == "rowwise" else 1
  cut = lambda a, n: a[:n] if axis == 0 else a[:, :n]
  scale_inv, amax = stored.scale_inv, stored.amax
  blocks = scale_blocks(stored.quantizer)
  if blocks is not None:
    scale_inv = cut(scale_inv, -(-extent // blocks[axis]))
  if axis == 0 and row_scaled(stored.quantizer):
    amax = amax[:extent]
  return jq.ScaledTensor(cut(stored.data, extent), scale_inv, amax, stored.quantizer,
                         stored.orig_dtype, stored.rht)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_each_group_is_quantized_exactly_as_alone(rng, prng_key, name):
  quantizer = QUANTIZERS[name]
  sizes = _sizes(rng)
  x = jnp.asarray(oracle.random_matrix(rng, (T, C), jnp.bfloat16))
  qt, alone = _grouped_and_alone(x, jnp.asarray(sizes), quantizer, _group_keys(prng_key),
                                 _random_state(rng, quantizer), tuple(int(n) for n in sizes))
  for direction in ("rowwise", "columnwise"):
    copy = getattr(qt, direction)
    assert copy.quantizer == quantizer.for_direction(direction)
    nonempty = 0
    for g in range(G):
      view = copy.group(g)
      if sizes[g] == 0:
        assert view.data.size == 0
        if view.amax is not None and view.amax.ndim == 0:
          assert float(view.amax) == 0.0, "an empty group has amax 0"
        continue
      extent = view.data.shape[0 if direction == "rowwise" else 1]
      expected = jax.tree_util.tree_map(lambda a: a[nonempty], alone[direction])
      assert_same_leaves(view, _cut(expected, extent, direction),
                         f"{name} {direction} group {g}")
      nonempty += 1


def test_a_padded_group_equals_the_unpadded_group_for_block_formats(rng):
  """Zero padding to the token block is invisible: the columnwise MXFP8 copy of a group of 37
  tokens, cut back to 37 columns, is `ops.quantize` of the 37 rows themselves."""
  sizes = np.array([37, 0, 59], np.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (96, 64)))
  mx = jq.MXFP8Quantizer()

  @jax.jit
  def both(x, sizes):
    return (jg.quantize(x, sizes, mx, rowwise=False).columnwise,
            [jq.ops.quantize(x[s:s + n], mx, rowwise=False).columnwise for s, n in ((0, 37),
                                                                                 (37, 59))])

  col, alone = both(x, jnp.asarray(sizes))
  assert col.layout.block == 32 and col.shape == (64, col.layout.length)
  for g, one in zip((0, 2), alone):
    n = int(sizes[g])
    view = col.group(g)
    np.testing.assert_array_equal(oracle.codes(view.data[:, :n]), oracle.codes(one.data))
    np.testing.assert_array_equal(oracle.codes(view.scale_inv), oracle.codes(one.scale_inv))
    assert float(view.amax) == float(one.amax)


@pytest.mark.parametrize("name", ["fp8-current", "nvfp4-2d"])
def test_groups_are_independent(rng, name):
  """Scaling one group's tokens by 2^10 leaves every other group's bytes unchanged (a shared
  per-tensor scale, or a block straddling two groups, would change them)."""
  quantizer = QUANTIZERS[name]
  sizes = jnp.asarray([40, 7, 0, 49], jnp.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (96, 48)))
  loud = x.at[40:47].multiply(1024.0)
  base = _grouped(x, sizes, quantizer, None, None)
  changed = _grouped(loud, sizes, quantizer, None, None)
  for direction in ("rowwise", "columnwise"):
    for g in (0, 3):
      assert_same_leaves(getattr(base, direction).group(g), getattr(changed, direction).group(g),
                         f"{direction} group {g}")
    with pytest.raises(AssertionError):  # ... while the loud group's own storage changed
      assert_same_leaves(getattr(base, direction).group(1),
                         getattr(changed, direction).group(1))


def test_columnwise_copies_start_every_group_on_a_block_boundary(rng):
  sizes = np.array([5, 0, 33, 17, 41], np.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (96, 32), spread=False))
  hybrid = jq.HybridQuantizer(jq.NVFP4Quantizer(), jq.Float8BlockQuantizer())
  qt = _grouped(x, jnp.asarray(sizes), hybrid, None, None)
  assert qt.rowwise.layout.block == 1 and qt.rowwise.shape == (96, 32)  # rowwise stays packed
  col = qt.columnwise
  assert col.layout.block == 128 and col.layout.length == 128 * ((96 + 5 * 127) // 128)
  assert col.shape == (32, col.layout.length)
  assert [s for s, _ in col.layout.group_slices(sizes)] == [0, 128, 128, 256, 384]
  values = np.asarray(jax.jit(lambda t: t.dequantize())(col))
  for (start, extent), n in zip(col.layout.group_slices(sizes), sizes):
    assert np.all(values[:, start + n:start + extent] == 0), "padding holds zeros"
  tokens = np.asarray(jax.jit(lambda t: t.tokens())(col))
  np.testing.assert_allclose(tokens, np.asarray(x), rtol=2**-4, atol=2**-10)  # E4M3 half-ulp


def test_rows_past_the_last_group_belong_to_no_group(rng):
  sizes = jnp.asarray([10, 20, 0], jnp.int32)  # 30 of 64 rows
  x = jnp.asarray(oracle.random_matrix(rng, (64, 32))) + 1000.0
  qt = _grouped(x, sizes, FP8, None, None)
  tokens = jax.jit(lambda q: (q.rowwise.tokens(), q.columnwise.tokens()))(qt)
  assert all(np.all(np.asarray(t)[30:] == 0) for t in tokens)
  np.testing.assert_array_equal(np.asarray(qt.rowwise.amax),
                                [np.abs(np.asarray(x[:10])).max(),
                                 np.abs(np.asarray(x[10:30])).max(), 0.0])


def test_delayed_scaling_keeps_one_state_per_group(rng):
  quantizer = QUANTIZERS["fp8-delayed-e5m2"]
  sizes = np.array([30, 0, 66], np.int32)
  x = jnp.asarray(oracle.random_matrix(rng, (96, 16)))
  state = _random_state(rng, quantizer, 3)
  new = jax.jit(lambda x, s, st: jg.update_state(quantizer, st, jg.quantize(
      x, s, quantizer, state=st)))(x, jnp.asarray(sizes), state)
  for g, rows in ((0, slice(0, 30)), (1, slice(30, 30)), (2, slice(30, 96))):
    amax = jnp.max(jnp.abs(x[rows])) if sizes[g] else jnp.float32(0.0)
    one = jax.tree_util.tree_map(lambda a: a[g], state)
    expected = jq.delayed_scaling_update(one, amax, quantizer)
    assert_same_leaves(jax.tree_util.tree_map(lambda a: a[g], new), expected, f"group {g}")


def test_expert_weights_are_quantized_one_expert_at_a_time(rng, prng_key):
  quantizer = jq.HybridQuantizer(jq.NVFP4Quantizer(block_2d=True), jq.NVFP4Quantizer(
      rht=True, stochastic_rounding=True))
  w = jnp.asarray(oracle.random_matrix(rng, (3, 32, 48)))
  keys = _group_keys(prng_key, 3)

  @jax.jit
  def both(w, keys):
    return (jg.quantize_experts(w, quantizer, keys=keys),
            [jq.ops.quantize(w[g], quantizer, key=keys[g]) for g in range(3)])

  qt, alone = both(w, keys)
  for g in range(3):
    assert_same_leaves(jax.tree_util.tree_map(lambda a: a[g], qt), alone[g], f"expert {g}")


# -------------------------------------------- GEMMs -------------------------------------------

def _assert_close(actual, expected, msg=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, msg
  scale = max(np.abs(expected).max(initial=0.0), 1e-30)
  assert np.abs(actual - expected).max(initial=0.0) <= 1e-5 * scale, msg


GEMM_PAIRS = {
    "nvfp4-row-scaled x nvfp4": (jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer()),
    "fp8 x nvfp4-row-scaled": (FP8, jq.NVFP4Quantizer(row_scaled=True)),
    "mxfp8 x fp8-block-2d": (jq.MXFP8Quantizer(), jq.Float8BlockQuantizer((128, 128))),
    "identity x identity": (jq.IdentityQuantizer(), jq.IdentityQuantizer()),
}
GEMM_SIZES = (23, 0, 41, 12)  # 76 of 80 rows


@pytest.mark.parametrize("pair", list(GEMM_PAIRS))
def test_ragged_gemm_equals_per_group_gemm(rng, pair):
  """Forward/dgrad mode: `out[rows of g] = ops.gemm(a_g, b[g])` (+ bias[g]), zero elsewhere."""
  qa, qb = GEMM_PAIRS[pair]
  x = jnp.asarray(oracle.random_matrix(rng, (80, 64)))
  w = jnp.asarray(oracle.random_matrix(rng, (4, 40, 64)))
  bias = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
  starts = _starts(GEMM_SIZES)

  @jax.jit
  def both(x, w, bias, sizes):
    a = jg.quantize(x, sizes, qa, columnwise=False).rowwise
    b = jg.quantize_experts(w, qb, columnwise=False).rowwise
    out = jg.to_tokens(jg.gemm(a, b, bias=bias, out_dtype=jnp.float32), a)
    # Every group alone (zero-padded to the longest, under one vmap: one compilation).
    xs = jnp.stack([_padded_rows(x, s, n, max(GEMM_SIZES)) for s, n in zip(starts, GEMM_SIZES)])
    alone = jax.vmap(lambda xg, wg, bg: jq.ops.gemm(
        jq.ops.quantize(xg, qa, columnwise=False).rowwise,
        jq.ops.quantize(wg, qb, columnwise=False).rowwise, bias=bg, out_dtype=jnp.float32))(
            xs, w, bias)
    return out, alone

  out, alone = both(x, w, bias, jnp.asarray(GEMM_SIZES, jnp.int32))
  out = np.asarray(out)
  for g, (start, n) in enumerate(zip(starts, GEMM_SIZES)):
    _assert_close(out[start:start + n], alone[g, :n], f"{pair} group {g}")
  assert np.all(out[76:] == 0)


WGRAD_PAIRS = {
    "nvfp4-rht": (jq.NVFP4Quantizer(rht=True), jq.NVFP4Quantizer(rht=True)),
    "nvfp4-row-scaled x fp8": (jq.NVFP4Quantizer(row_scaled=True), FP8),
    "identity": (jq.IdentityQuantizer(), jq.IdentityQuantizer()),
}
WGRAD_SIZES = (16, 0, 32, 48)


@pytest.mark.parametrize("pair", list(WGRAD_PAIRS))
def test_per_group_gemm_equals_per_group_wgrad(rng, pair):
  """Wgrad mode: `out[g] = ops.gemm(x_col_g, dy_col_g)` over group g's tokens; 0 when empty."""
  qa, qb = WGRAD_PAIRS[pair]
  x = jnp.asarray(oracle.random_matrix(rng, (96, 32)))
  dy = jnp.asarray(oracle.random_matrix(rng, (96, 24)))
  block = max(jg.token_block(qa, "columnwise"), jg.token_block(qb, "columnwise"))
  starts = _starts(WGRAD_SIZES)

  @jax.jit
  def both(x, dy, sizes):
    a = jg.quantize(x, sizes, qa, rowwise=False, col_block=block).columnwise
    b = jg.quantize(dy, sizes, qb, rowwise=False, col_block=block).columnwise
    # Every group alone (zero-padded to the longest, under one vmap: one compilation).
    pad = lambda m: jnp.stack([_padded_rows(m, s, n, max(WGRAD_SIZES))
                               for s, n in zip(starts, WGRAD_SIZES)])
    alone = jax.vmap(lambda xg, dyg: jq.ops.gemm(
        jq.ops.quantize(xg, qa, rowwise=False).columnwise,
        jq.ops.quantize(dyg, qb, rowwise=False).columnwise, out_dtype=jnp.float32))(
            pad(x), pad(dy))
    return jg.gemm(a, b, out_dtype=jnp.float32), alone

  out, alone = both(x, dy, jnp.asarray(WGRAD_SIZES, jnp.int32))
  out = np.asarray(out)
  assert out.shape == (4, 32, 24) and np.all(out[1] == 0)
  for g in range(4):
    _assert_close(out[g], alone[g], f"{pair} group {g}")


# ----------------------------------------- contract -------------------------------------------

def test_group_sizes_are_traced_and_shapes_static(rng):
  traces = []

  @jax.jit
  def f(x, sizes):
    traces.append(1)
    return jg.quantize(x, sizes, jq.NVFP4Quantizer(rht=True)).columnwise.data

  x = jnp.asarray(oracle.random_matrix(rng, (64, 32)))
  shapes = {f(x, jnp.asarray(s, jnp.int32)).shape for s in ([64, 0], [1, 63], [0, 0], [33, 31])}
  assert len(traces) == 1 and shapes == {(32, 16 * ((64 + 2 * 15) // 16))}


X_SPEC = jax.ShapeDtypeStruct((64, 32), jnp.float32)


@pytest.mark.parametrize("sizes, error, match", [
    (np.array([1.0, 2.0]), TypeError, "not an integer dtype"),
    (np.zeros((2, 2), np.int32), ValueError, "1-D"),
    (np.zeros((0,), np.int32), ValueError, "1-D"),
    (np.array([3, -1], np.int32), ValueError, "negative"),
    (np.array([30, 40], np.int32), ValueError, "more than the 64 rows"),
    ("[2, 3]", TypeError, "integer array"),
])
def test_bad_group_sizes_are_rejected(sizes, error, match):
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda x: jg.quantize(x, sizes, FP8), X_SPEC)


def _raises(error, match, fn, *specs):
  with pytest.raises(error, match=match):
    jax.eval_shape(fn, *specs)


def test_bad_operands_are_rejected():
  sizes = np.array([32, 32], np.int32)
  q = lambda x, quantizer, **kw: jg.quantize(x, sizes, quantizer, **kw)
  _raises(ValueError, "2-D tokens", lambda x: q(x.reshape(4, 16, 32), FP8), X_SPEC)
  _raises(ValueError, "multiple of 32", lambda x: q(x, jq.MXFP8Quantizer(), col_block=16),
          X_SPEC)
  _raises(ValueError, "one PRNG key per group",
          lambda x: q(x, jq.NVFP4Quantizer(stochastic_rounding=True)), X_SPEC)
  rht = jq.NVFP4Quantizer(rht=True)
  _raises(ValueError, "random Hadamard", lambda x: jg.gemm(
      q(x, rht, rowwise=False).columnwise, q(x, FP8, rowwise=False).columnwise), X_SPEC)
  _raises(ValueError, r"expected \[G=2, N, K=32\]", lambda x: jg.gemm(
      q(x, rht, columnwise=False).rowwise, jnp.ones((3, 8, 32))), X_SPEC)
  _raises(ValueError, "token layouts differ", lambda x: jg.gemm(
      q(x, FP8, rowwise=False).columnwise, q(x, jq.MXFP8Quantizer(), rowwise=False).columnwise),
          X_SPEC)
  _raises(ValueError, "one DelayedScalingState per group", lambda x: q(
      x, jq.Float8DelayedScalingQuantizer(), state=jq.init_state(
          jq.Float8DelayedScalingQuantizer())), X_SPEC)
  out = jax.eval_shape(lambda x: jg.gemm(q(x, rht, columnwise=False).rowwise, jg.quantize_experts(
      jnp.ones((2, 8, 32)), jq.NVFP4Quantizer(), columnwise=False).rowwise), X_SPEC)
  assert out.shape == (64, 8)


def test_explain_says_the_reference_path_was_taken_and_why(monkeypatch):
  # This test is about the reference path; the kernels' decisions: test_grouped_ffi.py.
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  role = jq.QuantizerRole("grouped_linear", "input", "experts")

  def f(x, sizes):
    a = jg.quantize(x, sizes, jq.MXFP8Quantizer(), columnwise=False, role=role).rowwise
    b = jg.quantize_experts(jnp.ones((2, 8, 32)), jq.MXFP8Quantizer(), columnwise=False)
    return jg.gemm(a, b.rowwise, role="grouped_linear/experts/fprop")

  report = jq.explain(f, X_SPEC, jax.ShapeDtypeStruct((2,), jnp.int32))
  assert [d.op for d in report] == ["grouped_quantize", "grouped_quantize", "grouped_gemm"], \
      str(report)
  assert report.paths() == {"reference"}
  assert all(d.reason for d in report), str(report)  # never a silent fallback
  assert report[0].role == role and "2 groups" in report[0].detail
  assert "2 experts" in report[1].detail and "2 groups" in report[2].detail


def test_forcing_the_ffi_backend_on_a_case_without_a_grouped_kernel_is_an_error(monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "ffi")
  _raises(RuntimeError, "grouped quantize", lambda x: jg.quantize(
      x, np.array([30, 34]), jq.NVFP4Quantizer(row_scaled=True)), X_SPEC)
