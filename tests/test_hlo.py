"""`jaxquant.hlo`: collectives parsed from compiled-HLO text (synthetic lines of the forms XLA
prints on CPU and GPU; the multi-device tests use it on real compiled programs)."""

from jaxquant import hlo

TEXT = """
  %all-reduce.1 = f32[8,1024]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}
  %all-reduce.2 = (u32[], f32[4,4]{1,0}, u32[], u32[], u32[], /*index=5*/bf16[2,3]{1,0}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), channel_id=2
  %all-gather-start.3 = (f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,128]{1,0}) all-gather-start(%w), dimensions={0}
  %all-gather-done.3 = f8e4m3fn[128,128]{1,0} all-gather-done(%all-gather-start.3)
  %all-reduce-start.4 = bf16[16,256]{1,0} all-reduce-start(%y), channel_id=4
  %reduce-scatter.5 = f32[32]{0} reduce-scatter(%g), dimensions={0}
  %add.6 = f32[8,1024]{1,0} add(%all-reduce.1, %all-reduce.1)
  %ragged-all-to-all.7 = bf16[64,128]{1,0} ragged-all-to-all(%rows, %out, %a, %b, %c, %d), channel_id=7
"""


def test_collectives_counts_each_once_with_result_bytes():
  found = hlo.collectives(TEXT)
  assert [c.op for c in found] == ["all-reduce", "all-reduce", "all-gather", "all-reduce",
                                   "reduce-scatter", "ragged-all-to-all"]
  assert found[0].bytes == 8 * 1024 * 4
  # a tuple all-reduce whose type holds XLA's /*index=5*/ comments: all six results
  assert found[1].arrays == (("u32", ()), ("f32", (4, 4)), ("u32", ()), ("u32", ()),
                             ("u32", ()), ("bf16", (2, 3)))
  assert found[1].bytes == 4 + 64 + 12 + 12
  # an async all-gather is typed (operand, result): only the gathered result counts
  assert found[2].arrays == (("f8e4m3fn", (128, 128)),) and found[2].bytes == 128 * 128
  assert found[3].bytes == 16 * 256 * 2 and found[4].elements == 32
  # a ragged all-to-all is its own op (not an all-to-all), sized by its receive buffer
  assert found[5].arrays == (("bf16", (64, 128)),)


def test_summarize_totals_per_op():
  summary = hlo.summarize(hlo.collectives(TEXT))
  assert summary["all-reduce"]["count"] == 3
  assert summary["all-reduce"]["bytes"] == 8 * 1024 * 4 + 92 + 16 * 256 * 2
  assert summary["all-gather"] == {"count": 1, "bytes": 128 * 128}
  assert "all-to-all" not in summary


# XLA:GPU's forms: a combiner pass merges reduce-scatters (and all-reduces) into one collective
# of several arrays, and async collectives other than all-reduce are typed (operands, results).
GPU_TEXT = """
  %reduce-scatter.1 = (f32[128,256]{1,0}, f32[64]{0}) reduce-scatter(%dw, %db), channel_id=1, dimensions={0}
  %reduce-scatter-start.2 = ((f32[256,256]{1,0}, f32[128]{0}), (f32[128,256]{1,0}, f32[64]{0})) reduce-scatter-start(%dw, %db), channel_id=2, dimensions={0}
  %reduce-scatter-done.2 = (f32[128,256]{1,0}, f32[64]{0}) reduce-scatter-done(%reduce-scatter-start.2)
  %reduce-scatter-start.3 = ((f32[20]{0}), f32[10]{0}) reduce-scatter-start(%g), dimensions={0}
  %collective-permute-start.4 = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %all-to-all-start.5 = ((s32[4,2]{1,0}), s32[4,2]{1,0}) all-to-all-start(%i), dimensions={0}
  %all-gather-start.6 = ((u8[64,256]{1,0}, u8[2,256]{1,0}), (u8[128,256]{1,0}, u8[4,256]{1,0})) all-gather-start(%w, %s), dimensions={0}
"""


def test_combined_and_async_collectives_count_their_results_only():
  found = hlo.collectives(GPU_TEXT)
  assert [c.op for c in found] == ["reduce-scatter", "reduce-scatter", "reduce-scatter",
                                   "collective-permute", "all-to-all", "all-gather"]
  # a combined reduce-scatter moves both arrays, synchronous or async (results, not operands)
  assert found[0].arrays == (("f32", (128, 256)), ("f32", (64,)))
  assert found[1].arrays == found[0].arrays and found[1].bytes == 4 * (128 * 256 + 64)
  assert found[2].arrays == (("f32", (10,)),)
  assert found[3].arrays == (("bf16", (8, 16)),)  # not its operand or its u32 context
  assert found[4].arrays == (("s32", (4, 2)),)
  assert found[5].arrays == (("u8", (128, 256)), ("u8", (4, 256)))
  assert hlo.summarize(found)["reduce-scatter"] == {"count": 3,
                                                    "bytes": 8 * (128 * 256 + 64) + 40}
