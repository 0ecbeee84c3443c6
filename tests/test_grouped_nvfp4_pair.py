"""Both NVFP4 copies of tokens from one `jaxquant_grouped_quantize_nvfp4` call (design decision
55): with `row_packed` the rowwise copy is written in the packed layout (x's own rows, the rows
of no group a zero row's codes and scales) beside the columnwise copy in its padded layout, and
the amax launch reads x once for both copies' amaxes (the RHT'd one and the plain one).

The contract: the pair call's outputs are bit for bit the two one-direction calls' (the packed
rowwise call and the padded columnwise call), for codes and raw copies, with and without
stochastic rounding and RHT; `jaxquant.grouped.quantize` takes the pair where it serves
(explain names one grouped_quantize for both copies) and stays bit for bit the reference. CPU
tests run the CPU handler; `-m gpu` runs the CUDA kernels (whose outputs start uninitialized,
so every byte the pair writes is checked, the zero rows included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import test_grouped_bf16 as tgb
import test_grouped_ffi as tgf
import test_grouped_raw_copies as trc
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi.grouped import quantize as grouped_quantize
from jaxquant.backends.ffi.grouped import support
from jaxquant.grouping.layout import TokenLayout

on_kernel = tgb.on_kernel
TARGET = support.QUANTIZE_NVFP4_TARGET
QUANTIZERS = {"1x16": jq.NVFP4Quantizer(), "1x16-sr": jq.NVFP4Quantizer(stochastic_rounding=True),
              "rht": jq.NVFP4Quantizer(rht=True),
              "rht-sr": jq.NVFP4Quantizer(rht=True, stochastic_rounding=True)}

needs_target = pytest.mark.skipif(TARGET not in registry.registered_targets("cpu"),
                                  reason=f"jaxquant FFI extension without {TARGET}")


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def check_pair(rng, name, tokens, cols, dtype, groups, raw, block=16):
  """x of `tokens` rows in `groups` ragged groups (one empty, the last 21 rows in none):
  the pair call against the packed rowwise call and the padded columnwise call."""
  q = QUANTIZERS[name]
  x = trc._tokens(rng, tokens, cols, dtype)
  sizes = tgf._sizes(rng, tokens, groups, empty=(1,), spare=21)
  starts = trc._offsets(sizes)
  layout = TokenLayout(tokens, groups, block)
  pstarts = trc._offsets(np.asarray(layout.extents(jnp.asarray(sizes))))
  words = {d: jnp.asarray(rng.integers(0, 2**32, (groups, 2), dtype=np.uint64), jnp.uint32)
           if q.stochastic_rounding else None for d in ("rowwise", "columnwise")}

  def pair(x):
    return grouped_quantize._nvfp4_call(x, starts, pstarts, q, groups, layout.length, True, True,
                                        words["rowwise"], words["columnwise"], raw=raw,
                                        row_packed=True)

  def apart(x):
    (row,) = grouped_quantize._nvfp4_call(x, starts, starts, q, groups, tokens, True, False,
                                          row_words=words["rowwise"], raw=raw).values()
    (col,) = grouped_quantize._nvfp4_call(x, starts, pstarts, q, groups, layout.length, False,
                                          True, col_words=words["columnwise"], raw=raw).values()
    return {"rowwise": row, "columnwise": col}

  got, want = jax.jit(pair)(x), jax.jit(apart)(x)
  for direction in ("rowwise", "columnwise"):
    for what, u, v in zip(("data", "scales", "amax"), got[direction], want[direction]):
      assert u.shape == v.shape and u.dtype == v.dtype, (direction, what, u.shape, v.shape)
      np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=f"{name} {direction} {what}")
  row_data = np.asarray(got["rowwise"][0])
  assert row_data.shape[0] == tokens  # packed: x's rows
  tail = _bits(row_data[int(starts[-1]):])
  assert not tail.any(), "rows of no group must be zero rows"
  assert _bits(row_data[:int(starts[-1])]).any()
  amax = np.asarray(got["rowwise"][2])
  assert amax[1] == 0.0 and (amax[sizes > 0] > 0).all()


@needs_target
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("cols,dtype", [(96, jnp.bfloat16), (72, jnp.float32)])
def test_cpu_nvfp4_pair_is_the_two_calls(rng, name, raw, cols, dtype):
  check_pair(rng, name, 160, cols, dtype, groups=5, raw=raw)


@needs_target
def test_the_handler_names_a_bad_row_packed(rng):
  """row_packed takes a rowwise copy of tokens in 1x16 blocks beside a layout as long as x."""
  x = jnp.ones((64, 32), jnp.bfloat16)
  starts = jnp.asarray([0, 64], jnp.int32)
  key = jnp.zeros((1, 2), jnp.uint32)
  f4, e4m3 = jnp.float4_e2m1fn, jnp.float8_e4m3fn
  sds, amax = jax.ShapeDtypeStruct, jax.ShapeDtypeStruct((1,), jnp.float32)
  cases = {  # flags -> results
      "columnwise only": (dict(rowwise=False, columnwise=True, block_2d=False, expert_rows=0),
                          [sds((32, 64), f4), sds((32, 4), e4m3), amax]),
      "16x16 blocks": (dict(rowwise=True, columnwise=False, block_2d=True, expert_rows=0),
                       [sds((64, 32), f4), sds((4, 2), e4m3), amax]),
      "expert weights": (dict(rowwise=True, columnwise=False, block_2d=False, expert_rows=64),
                         [sds((64, 32), f4), sds((64, 2), e4m3), amax]),
  }
  for what, (flags, results) in cases.items():
    with pytest.raises(Exception, match="row_packed needs a rowwise copy of tokens"):
      jax.block_until_ready(jax.jit(lambda x: calls.call(
          TARGET, results, x, starts, starts, key, key, rht=False, stochastic=False,
          length=np.int64(64), raw=False, row_packed=True,
          **{k: np.int64(v) if k == "expert_rows" else v for k, v in flags.items()}))(x))


@needs_target
@pytest.mark.parametrize("name", ["1x16", "rht-sr"])
def test_grouped_quantize_takes_the_pair_bit_for_bit(rng, name, monkeypatch):
  """`jaxquant.grouped.quantize` of both NVFP4 directions is one FFI call (one explain record
  for both copies) and bit for bit the reference; 16x16 blocks share one layout and pair too;
  a shape the kernel cannot take (odd features) falls back to one record a copy."""
  q = QUANTIZERS[name]
  groups, tokens, cols = 4, 96, 64
  x = trc._tokens(rng, tokens, cols, jnp.bfloat16)
  sizes = jnp.asarray(tgf._sizes(rng, tokens, groups, spare=5))
  keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), groups)
  fn = lambda x, s: jq.grouped.quantize(x, s, q, keys=keys if q.stochastic_rounding else None,
                                        row_block=1, col_block=16)
  got, want = tgf._on("auto", fn, x, sizes), tgf._on("reference", fn, x, sizes)
  for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(_bits(u), _bits(v))
  records = [d for d in jq.explain(fn, x, sizes) if d.op == "grouped_quantize"]
  assert len(records) == 1 and "rowwise+columnwise" in records[0].detail, records
  assert grouped_quantize.pair_served(jq.NVFP4Quantizer(block_2d=True), TokenLayout(96, 4, 16),
                                      TokenLayout(96, 4, 16))
  assert not grouped_quantize.pair_served(jq.NVFP4Quantizer(block_2d=True),
                                          TokenLayout(96, 4, 1), TokenLayout(96, 4, 16))
  assert not grouped_quantize.pair_served(q, TokenLayout(96, 4, 1), TokenLayout(96, 4, 16),
                                          (96, 63))
  assert not grouped_quantize.pair_served(jq.NVFP4Quantizer(row_scaled=True),
                                          TokenLayout(96, 4, 1), TokenLayout(96, 4, 16))
  monkeypatch.setenv(support.NVFP4_PAIR_ENV, "off")  # one call a copy, as before
  records = [d for d in jq.explain(fn, x, sizes) if d.op == "grouped_quantize"]
  assert [d.detail.split(":")[0] for d in records] == ["rowwise", "columnwise"], records
  for u, v in zip(jax.tree_util.tree_leaves(tgf._on("auto", fn, x, sizes)),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(_bits(u), _bits(v))
  monkeypatch.setenv(support.NVFP4_PAIR_ENV, "of")
  with pytest.raises(ValueError, match="JAXQUANT_GROUPED_NVFP4_PAIR='of'; expected one of"):
    grouped_quantize.pair_served(q, TokenLayout(96, 4, 1), TokenLayout(96, 4, 16))


# -------------------------------------------- GPU ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_gpu_nvfp4_pair_is_the_two_calls(on_kernel, rng, name, raw):
  """Rowwise 16-byte stores (96, 1408 features) and element stores (36), more than one wave of
  tiles, the fused amax launch for every input type."""
  for cols, dtype in ((96, jnp.bfloat16), (72, jnp.float32), (36, jnp.float16),
                      (1408, jnp.bfloat16)):
    check_pair(rng, name, 2048, cols, dtype, groups=9, raw=raw)
