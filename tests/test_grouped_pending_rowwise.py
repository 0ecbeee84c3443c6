"""The experts' dgrad copy written over their forward copy (design decision 56).

Raw MXFP8 copies of bfloat16 expert weights hold the same values in both directions wherever a
value's row and column blocks keep it a normal FP8 value. So `jaxquant_grouped_quantize_mxfp8`
with `row_flags` writes the forward (columnwise, weights' own layout) copy and a flag per 32-value
row block instead of the rowwise copy, and `jaxquant_grouped_patch_mxfp8_rows` rewrites the
flagged row blocks of the forward copy, in place, once the forward GEMM has read it.

The contract: the forward copy, the scales and the amax are those of the call without
`row_flags`, and the patched copy is bit for bit the rowwise copy that call writes. Both
handlers flag exactly the blocks whose two copies differ. `-m gpu` runs the CUDA kernels.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import test_grouped_ffi as tgf
import test_grouped_raw_copies as trc
from jaxquant.backends.ffi import calls, registry
from jaxquant.backends.ffi import quantize as single
from jaxquant.backends.ffi.grouped import quantize as grouped_quantize
from jaxquant.backends.ffi.grouped import support
from jaxquant.grouping.tensors import PendingRowwise
from jaxquant.ops import grouped as grouped_ops

bf16_device = trc.bf16_device
on_kernel = trc.on_kernel
PATCH = "jaxquant_grouped_patch_mxfp8_rows"
PAYLOADS = trc.PAYLOADS
U16 = np.uint16

needs_target = pytest.mark.skipif(PATCH not in registry.registered_targets("cpu"),
                                  reason=f"jaxquant FFI extension without {PATCH}")


# A value this far below its blocks' largest is a subnormal of the payload format (E4M3: 2^-9
# .. 2^-6 of the block's scale, which puts the largest near 2^8; E5M2: 2^-16 .. 2^-14, largest
# near 2^15).
SUBNORMAL = {"e4m3": 2.0**-15, "e5m2": 2.0**-29}


def _weights(rng, groups, rows, cols, kind, name="e4m3"):
  """bfloat16 weights: "binades" (rows 2^-20 .. 2^20 apart: most blocks take the general
  path), "normal" (standard normal with 1% zeros, as initialized: almost none do), "edges"
  (NaN, infinities, a zero block), "mixed" (normal, with a few values that are subnormals of
  the payload `name` in both directions, their row blocks raised by a neighbour of 8: the two
  copies round them on different grids, so some blocks differ and most do not)."""
  if kind in ("binades", "edges"):
    w = (trc._tokens(rng, groups * rows, cols, jnp.float32) if kind == "binades"
         else trc._edge_weights(rng, groups, rows, cols, jnp.float32))
    return jnp.asarray(w, jnp.bfloat16)
  w = rng.standard_normal((groups * rows, cols)).astype(np.float32)
  w = np.where(rng.random(w.shape) < 0.01, 0.0, w)
  if kind == "mixed":
    for _ in range(6):
      r, c = rng.integers(groups * rows), rng.integers(cols)
      w[r, c] = np.float32(SUBNORMAL[name] * rng.uniform(1.0, 2.0))
      w[r, c ^ 1 if (c ^ 1) < cols else c - 1] = 8.0
  return jnp.asarray(w, jnp.bfloat16)


def _copies(w, groups, rows, quantizer, row_flags, x_layout=True):
  starts = jnp.arange(groups + 1, dtype=jnp.int32) * rows
  fn = lambda w: single.quantize_gathered(
      w, starts, starts, groups * rows, quantizer, rowwise=True, columnwise=True,
      orig_dtype=np.dtype(w.dtype), expert_rows=rows, raw=True, col_in_x_layout=x_layout,
      row_flags=row_flags)
  return jax.jit(fn)(w)


def _differing_blocks(row, col, rows_total, cols):
  """The flag bits (`x_layout_flag_count`'s layout, as booleans: 64 a 32 x 64 block, blocks 8 a
  128 x 128 tile in row-major tile order, bit 32 h + i for row i of row block h) of the row
  blocks whose rowwise and columnwise values differ in some bit."""
  differ = np.asarray(row).reshape(rows_total, cols).view(U16) != np.asarray(col).reshape(
      rows_total, cols).view(U16)
  tiles_r, tiles_c = -(-rows_total // 128), -(-cols // 128)
  padded = np.zeros((tiles_r * 128, tiles_c * 128), bool)
  padded[:rows_total, :cols] = differ
  # [tile row, warp row (4), row (32), tile col, warp col (2), h (2), 32 values]
  blocks = padded.reshape(tiles_r, 4, 32, tiles_c, 2, 2, 32).any(axis=6)
  bits = blocks.transpose(0, 3, 1, 4, 5, 2)  # tile row, tile col, w // 2, w % 2, h, row
  return bits.reshape(-1)


def _flag_bits(flags):
  return np.unpackbits(np.asarray(flags), bitorder="little").astype(bool)


def check_pending(rng, name, groups, rows, cols, kind):
  """The flags call's copies against the call without flags, and the patch of its forward copy
  against that call's rowwise copy, bit for bit; the flags are the blocks whose copies differ."""
  w = _weights(rng, groups, rows, cols, kind, name)
  quantizer = PAYLOADS[name]
  row, col = _copies(w, groups, rows, quantizer, False)
  flags, fcol = _copies(w, groups, rows, quantizer, True)
  transposed_row, _ = _copies(w, groups, rows, quantizer, False, x_layout=False)  # another kernel
  for t in (row, flags):
    np.testing.assert_array_equal(np.asarray(t.scale_inv).view(np.uint8),
                                  np.asarray(transposed_row.scale_inv).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(row.data).view(U16),
                                np.asarray(transposed_row.data).view(U16))
  assert flags.data.shape == (single.x_layout_flag_count(groups * rows, cols),)
  assert flags.data.dtype == np.uint8
  np.testing.assert_array_equal(np.asarray(fcol.data).view(U16), np.asarray(col.data).view(U16))
  np.testing.assert_array_equal(np.asarray(fcol.scale_inv).view(np.uint8),
                                np.asarray(col.scale_inv).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(flags.scale_inv).view(np.uint8),
                                np.asarray(row.scale_inv).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(flags.amax), np.asarray(row.amax))  # NaN == NaN
  differ = _differing_blocks(row.data, col.data, groups * rows, cols)
  given = _flag_bits(flags.data)
  np.testing.assert_array_equal(given, differ)
  after = jnp.zeros((3,), jnp.float32)
  patched = jax.jit(lambda w, f, c: single.patch_mxfp8_rows(
      w, f, c, after, e5m2=name == "e5m2"))(w, flags.data, fcol.data)
  np.testing.assert_array_equal(np.asarray(patched).reshape(groups * rows, cols).view(U16),
                                np.asarray(row.data).view(U16))
  return differ, given


@needs_target
@pytest.mark.parametrize("name", sorted(PAYLOADS))
@pytest.mark.parametrize("kind", ["binades", "mixed", "edges"])
def test_cpu_patched_rowwise_copy_is_the_written_one(rng, name, kind):
  """Partial tiles (200 columns, 96-row experts), blocks flagged and not."""
  differ, _ = check_pending(rng, name, 3, 96, 200, kind)
  assert differ.any()
  if kind == "mixed":
    assert not differ.all()


@needs_target
def test_the_handlers_and_wrappers_name_bad_arguments(rng):
  w = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
  starts = jnp.asarray([0, 32, 64], jnp.int32)
  with pytest.raises(ValueError, match="row_flags: needs col_in_x_layout and a rowwise copy"):
    single.quantize_gathered(w, starts, starts, 64, jq.MXFP8Quantizer(), rowwise=True,
                             columnwise=True, orig_dtype=np.dtype(w.dtype), expert_rows=32,
                             raw=True, row_flags=True)
  results = [jax.ShapeDtypeStruct((8,), np.uint8),
             jax.ShapeDtypeStruct((64, 3), jnp.float8_e8m0fnu),
             jax.ShapeDtypeStruct((), jnp.float32)]
  with pytest.raises(Exception, match="row_flags needs col_in_x_layout and a rowwise copy"):
    jax.block_until_ready(jax.jit(lambda w: calls.call(
        trc.TARGET, results, w, starts, starts, rowwise=True, columnwise=False,
        length=np.int64(64), expert_rows=np.int64(32), row_packed=False, raw=True,
        raw_e5m2=False, col_in_x_layout=False, row_flags=True))(w))
  copy = jnp.zeros((2, 32, 96), jnp.bfloat16)
  flags = jnp.zeros((single.x_layout_flag_count(64, 96),), jnp.uint8)  # one tile: 64 bytes
  after = jnp.zeros((1,), jnp.float32)
  with pytest.raises(ValueError, match=r"copy: expected bfloat16 \[G, rows, cols\]"):
    single.patch_mxfp8_rows(w, flags, copy[:, :16], after, e5m2=False)
  with pytest.raises(ValueError, match=r"flags: expected \[64\]"):
    single.patch_mxfp8_rows(w, flags[:4], copy, after, e5m2=False)
  with pytest.raises(ValueError, match="w2d: expected bfloat16"):
    single.patch_mxfp8_rows(w.astype(jnp.float32), flags, copy, after, e5m2=False)
  out = [jax.ShapeDtypeStruct((2, 32, 96), jnp.bfloat16)]
  for bad, match in (((w, flags[:4], copy), "flags"), ((w, flags, copy.reshape(4, 16, 96)),
                                                        "E a multiple of 32")):
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(jax.jit(lambda *a: calls.call(PATCH, out, *a, after,
                                                          raw_e5m2=False))(*bad))
  with pytest.raises(ValueError, match="rowwise_pending: .* needs rowwise and columnwise_along_n"):
    grouped_quantize.quantize_experts(w.reshape(2, 32, 96), jq.MXFP8Quantizer(), rowwise=True,
                                      columnwise=True, state=None,
                                      orig_dtype=np.dtype(jnp.bfloat16), decoded=True,
                                      rowwise_pending=True)
  pending = PendingRowwise(w, flags, None, None, jq.MXFP8Quantizer())
  with pytest.raises(TypeError, match="forward: a PendingRowwise is written over a "
                                      "TransposedExperts"):
    grouped_ops.write_pending(jq.QuantizedTensor(None, pending, jq.MXFP8Quantizer()), copy,
                              after)


# ------------------------------------------ the layer -----------------------------------------

def _step_outputs(step, args):
  return [np.asarray(a) for a in jax.tree_util.tree_leaves(tgf._on("auto", step, *args))]


def check_layer(rng, monkeypatch, **shape):
  """A GroupedDense MXFP8 step (no bias: the forward copy in the weights' layout) with the
  dgrad copy patched is bit for bit the step that writes it; explain says so; the compiled
  step patches the forward copy in place (no copy of it made)."""
  step, args = tgf._grouped_step(jq.recipes.MXFP8BlockScaling(), use_bias=False, rng=rng,
                                 **shape)
  monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
  monkeypatch.delenv(support.DGRAD_COPY_ENV, raising=False)
  report = jq.explain(step, *args)
  rowwise = [d for d in report if d.op == "grouped_quantize" and d.detail.startswith("rowwise")
             and "experts" in d.detail]
  assert len(rowwise) == 1 and grouped_ops.PENDING_NOTE in rowwise[0].detail, str(report)
  compiled = jax.jit(step).lower(*args).compile().as_text()
  calls_ = [line for line in compiled.splitlines() if f'custom_call_target="{PATCH}"' in line]
  assert len(calls_) == 1, calls_
  copy_operand = re.search(r"custom-call\(([^)]*)\)", calls_[0]).group(1).split(", ")[2]
  producer = [line for line in compiled.splitlines()
              if re.match(rf"\s*(ROOT )?{re.escape(copy_operand.split(' ')[-1])} = ", line)]
  assert producer and " copy(" not in producer[0], producer  # updated in place
  patched = _step_outputs(step, args)
  monkeypatch.setenv(support.DGRAD_COPY_ENV, "written")
  written_text = jax.jit(lambda *a: step(*a)).lower(*args).as_text()
  assert PATCH not in written_text and "row_flags = true" not in written_text
  report = jq.explain(step, *args)
  assert any(f"{support.DGRAD_COPY_ENV}=written" in d.detail for d in report), str(report)
  written = _step_outputs(step, args)
  for u, v in zip(patched, written):
    np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


@needs_target
def test_grouped_dense_with_the_dgrad_copy_patched_is_the_written_step(bf16_device, rng,
                                                                       monkeypatch):
  check_layer(rng, monkeypatch, groups=4, tokens=96, k=64, n=64)


@needs_target
def test_the_dgrad_copy_knob_names_its_choices(monkeypatch):
  monkeypatch.setenv(support.DGRAD_COPY_ENV, "sometimes")
  with pytest.raises(ValueError, match="JAXQUANT_EXPERTS_DGRAD_COPY"):
    support.dgrad_copy_choice()


# -------------------------------------------- GPU ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_gpu_patched_rowwise_copy_is_the_written_one(on_kernel, rng, name):
  """The CUDA kernels: 8 experts of 256 x 1408 (more than one wave), partial tiles, the
  exponents' edges. Normal weights flag few row blocks (E4M3: those holding a value below
  2^-14 of its blocks' largest, rounded apart by their two exponents; E5M2's bound is 2^-29),
  which is what makes the patch pay."""
  for kind in ("binades", "mixed", "edges"):
    check_pending(rng, name, 3, 96, 200, kind)  # partial tiles in both directions
    check_pending(rng, name, 3, 96, 256, kind)  # whole tile columns, 288 rows
  _, given = check_pending(rng, name, 8, 256, 1408, "normal")
  assert given.mean() < (0.01 if name == "e4m3" else 0.001), given.mean()
  check_pending(rng, name, 8, 256, 1408, "mixed")


@pytest.mark.gpu
def test_gpu_grouped_dense_with_the_dgrad_copy_patched_is_the_written_step(on_kernel, rng,
                                                                           monkeypatch):
  check_layer(rng, monkeypatch, groups=8, tokens=1024, k=256, n=192)
